"""FlashAttention-4 over a paged KV cache, for decode plans that are exactly causal or a causal
sliding window, bottom-right aligned (:meth:`compilemask.DecodePlan.native_window`).

``flash_attn.cute.flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=, page_table=,
causal=, window_size=, return_lse=True)`` (4.0.0b36) takes our cache layout as it is: q
``[B, Nq, Hq, D]`` (a transpose view of ours), caches ``[num_pages, page_size, Hkv, D]``,
``page_table`` int32 ``[B, P]`` and ``seqused_k`` int32 ``[B]``; its causal mask is aligned to
the bottom right of each row's ``seqused_k`` keys, which is the plan's. It checks no page id:
the call passes the page table clamped to the cache and the lengths clamped to the plan's key
axis, and gives a batch row with a bad page id (among those its keys use) or length NaN in out
and lse, as the Triton decode kernel does, with no host read (one small Triton kernel before
FlashAttention-4 and one after it). Rows that see no key (a cache
shorter than the new rows) get out 0 and lse -inf from the plan's row counts.

Measured on an H200 (``docs/perf-notes.md``, "Decoding"): faster than our split-KV kernel
for 16 and 64 new tokens (x 4 query heads per kv head), slower for 1 and 4;
``backend="auto"`` picks it above :data:`AUTO_MIN_ROWS` query rows per kv head.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from ..interface import DecodeCall

#: packed query rows per kv head (query heads per kv head x new tokens) above which
#: ``backend="auto"`` runs FlashAttention-4 on native decode plans (H200 measurement)
AUTO_MIN_ROWS = 16
_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (64, 96, 128)


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def decode_reason(call: DecodeCall) -> str:
    """Why FlashAttention-4 does not run this cache call ("" when it does)."""
    a = call.attention
    if not _triton_installed():
        return "fa4's paged path checks page ids with Triton kernels: install compilemask[triton]"
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
    caches ``[num_pages, page_size, Hkv, D]`` (see the module docstring). Three launches: the
    guard of page ids and lengths, FlashAttention-4, the marking of bad and empty rows
    (``kernels/triton/cache_guard.py``)."""
    from flash_attn.cute import flash_attn_varlen_func

    from ..triton.cache_guard import guard_pages, mark_rows

    limit = call.kv_len if call.len_limit is None else call.len_limit
    safe_table, safe_lens, bad = guard_pages(
        call.block_table, call.cache_seqlens, call.plan_seqlens, call.page_size,
        k_cache.shape[0], limit,
    )  # fmt: skip
    window = call.native_window
    mask = {"causal": True} if window == 0 else {"causal": True, "window_size": (window - 1, 0)}
    out, lse = flash_attn_varlen_func(
        q.transpose(1, 2), k_cache, v_cache, seqused_k=safe_lens, page_table=safe_table,
        softmax_scale=scale, return_lse=True, **mask,
    )  # fmt: skip
    out = out.transpose(1, 2)  # [B, Hq, Nq, D], a view of FlashAttention's new output
    mark_rows(out, lse, bad, call.row_count)
    return out, lse
