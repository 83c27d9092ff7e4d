"""FlashAttention-4 over a paged KV cache, for decode plans that are exactly causal or a causal
sliding window, bottom-right aligned (:meth:`compilemask.DecodePlan.native_window`).

``flash_attn.cute.flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=, page_table=,
causal=, window_size=, return_lse=True)`` (4.0.0b36) takes our cache layout as it is: q
``[B, Nq, Hq, D]`` (a transpose view of ours), caches ``[num_pages, page_size, Hkv, D]``,
``page_table`` int32 ``[B, P]`` and ``seqused_k`` int32 ``[B]``; its causal mask is aligned to
the bottom right of each row's ``seqused_k`` keys, which is the plan's. It checks no page id:
the call passes the page table clamped to the cache and the lengths clamped to the plan's key
axis, and gives a batch row with a bad page id (among those its keys use) or length NaN in out
and lse, as the Triton decode kernel does, with no host read. Rows that see no key (a cache
shorter than the new rows) get out 0 and lse -inf from the plan's row counts.

Measured on an H200 (``docs/perf-notes.md``, "Decoding"): faster than our split-KV kernel
for 4, 16 and 64 new tokens (x 4 query heads per kv head), slower for 1 new token;
``backend="auto"`` picks it above :data:`AUTO_MIN_ROWS` query rows per kv head.
"""

from __future__ import annotations

import torch

from ..interface import DecodeCall

#: packed query rows per kv head (query heads per kv head x new tokens) above which
#: ``backend="auto"`` runs FlashAttention-4 on native decode plans (H200 measurement)
AUTO_MIN_ROWS = 4
_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (64, 96, 128)


def decode_reason(call: DecodeCall) -> str:
    """Why FlashAttention-4 does not run this cache call ("" when it does)."""
    a = call.attention
    if call.native_window is None:
        return (
            "its paged path runs decode plans of causal() or sliding_window(w) built by "
            "step_plan with q_offset=None only"
        )
    if a.device.type != "cuda":
        return f"fa4 runs on CUDA tensors, not {a.device.type}"
    if a.dtype not in _DTYPES:
        return f"fa4 runs float16 / bfloat16, not {a.dtype}"
    if a.head_dim not in _HEAD_DIMS:
        return f"fa4's paged path runs head_dim {_HEAD_DIMS} here, not {a.head_dim}"
    return ""


def many_rows(call: DecodeCall) -> bool:
    """Whether ``backend="auto"`` prefers FlashAttention-4 for this cache call."""
    a = call.attention
    return (a.heads_q // a.heads_kv) * a.q_len > AUTO_MIN_ROWS


def decode(q, k_cache, v_cache, call: DecodeCall, scale: float):
    """``(out [B, Hq, Nq, D], lse fp32 [B, Hq, Nq])`` of ``q [B, Hq, Nq, D]`` over the paged
    caches ``[num_pages, page_size, Hkv, D]`` (see the module docstring)."""
    from flash_attn.cute import flash_attn_varlen_func

    table, lens, page = call.block_table, call.cache_seqlens, call.page_size
    num_pages = k_cache.shape[0]
    limit = call.kv_len if call.len_limit is None else call.len_limit
    bad = (lens < 0) | (lens > limit)
    if call.plan_seqlens is not None:
        bad = bad | (call.plan_seqlens != lens)
    pages_used = (lens.clamp(min=0) + (page - 1)) // page
    used = torch.arange(table.shape[1], device=table.device) < pages_used[:, None]
    bad = bad | (used & ((table < 0) | (table >= num_pages))).any(1)
    window = call.native_window
    mask = {"causal": True} if window == 0 else {"causal": False, "window_size": (window - 1, 0)}
    out, lse = flash_attn_varlen_func(
        q.transpose(1, 2), k_cache, v_cache, seqused_k=lens.clamp(0, limit),
        page_table=table.clamp(0, num_pages - 1), softmax_scale=scale, return_lse=True, **mask,
    )  # fmt: skip
    out = out.transpose(1, 2)
    empty = (call.row_count == 0)[:, None]  # [Mb, 1, Nq]
    nan = bad[:, None, None]
    lse = torch.where(nan, float("nan"), torch.where(empty, float("-inf"), lse))
    out = torch.where(nan[..., None], float("nan"), torch.where(empty[..., None], 0.0, out))
    return out.to(q.dtype), lse.float()
