"""``compilemask.attention`` over KV caches: paged (``block_table``) or contiguous, with ragged
cache lengths (``cache_seqlens``), for decode and speculative-decoding steps.

The api checks the call, lays a contiguous cache out as one page per batch row, and hands a
:class:`~compilemask.kernels.interface.DecodeCall` to the backend's ``decode`` method
(``reference``: gather the pages, then the definition; ``triton``: the split-KV kernel of
``kernels/triton/decode.py``). Forward only.

Legend: B batch, Hq / Hkv query / kv heads, Nq new query rows, D head_dim, P pages per batch
row.
"""

from __future__ import annotations

import torch

from ..compiler.decode import DecodePlan
from ..compiler.plan import MaskPlan
from ..errors import InputError
from ..kernels import registry
from ..kernels.interface import SUPPORTED_HEAD_DIMS, AttentionCall, DecodeCall


def _shape(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{list(t.shape)} {t.dtype} on {t.device}"


def _int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as int32, int64 values past int32 clamped to -1 / 2**31 - 1 (still bad values
    for the checks, never wrapped onto a real page id or length)."""
    if t.dtype == torch.int64:
        t = t.clamp(-1, 2**31 - 1)
    return t.to(torch.int32)


def attend_cache(
    q, k_cache, v_cache, plan, block_table, cache_seqlens, scale, return_lse, backend,
    check_values=False,
):  # fmt: skip
    """``(out, lse)`` (or out) of ``compilemask.attention`` called with caches.

    Page ids and cache lengths are checked with one host read (an InputError naming the
    entry) on the CPU, with ``check_values`` (``attention(check_plan=True)``), and for backends
    whose decode does not check them; the Triton decode kernel on CUDA checks what it reads
    and gives a bad batch row NaN instead, without synchronising."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InputError(f"{name} must be a 4-D tensor, got {_shape(t)}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise InputError(
            "attention over a KV cache (block_table / cache_seqlens, or a DecodePlan) is forward "
            "only: run it under torch.no_grad() or torch.inference_mode(), or pass k and v "
            "[B, Hkv, Nk, D] with a MaskPlan for a differentiable call"
        )
    B, Hq, Nq, D = q.shape
    if k_cache.shape != v_cache.shape:
        same_but_dv = k_cache.shape[:-1] == v_cache.shape[:-1]
        raise InputError(
            f"k_cache {_shape(k_cache)} and v_cache {_shape(v_cache)} differ"
            + (
                " in head_dim: attention over a KV cache needs v's head_dim equal to k's (a "
                "value head_dim of its own runs without a cache)"
                if same_but_dv
                else ""
            )
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype or t.device != q.device:
            raise InputError(
                f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got {t.dtype} "
                f"on {t.device}"
            )
    if D not in SUPPORTED_HEAD_DIMS:
        raise InputError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {D}")
    if block_table is None:  # contiguous: k [B, Hkv, Nk, D], one page per batch row
        if k_cache.shape[0] != B or k_cache.shape[3] != D:
            raise InputError(
                f"without block_table, k_cache and v_cache are [B, Hkv, Nk, D] = [{B}, Hkv, Nk, "
                f"{D}], got {_shape(k_cache)}"
            )
        k_pages, v_pages = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # [B, Nk, Hkv, D]
        block_table = torch.arange(B, device=q.device, dtype=torch.int32)[:, None]
        given_table = block_table
    else:
        if k_cache.shape[3] != D:
            raise InputError(
                f"k_cache must be [num_pages, page_size, Hkv, {D}], got {_shape(k_cache)}"
            )
        if (
            not isinstance(block_table, torch.Tensor)
            or block_table.dim() != 2
            or block_table.shape[0] != B
            or block_table.dtype not in (torch.int32, torch.int64)
            or block_table.device != q.device
        ):
            raise InputError(
                f"block_table must be an int [B, P] = [{B}, P] tensor on {q.device}, got "
                f"{_shape(block_table)}"
            )
        k_pages, v_pages = k_cache, v_cache
        given_table = block_table  # checked on the host with its own values
        block_table = _int32(block_table)
    Hkv, page = k_pages.shape[2], k_pages.shape[1]
    if Hq % Hkv:
        raise InputError(f"query heads {Hq} must be a multiple of kv heads {Hkv}")
    capacity = block_table.shape[1] * page
    lo, hi, kv_len, seqlens = _intervals(plan, B, Nq, capacity, cache_seqlens, q.device)
    if seqlens is None:
        seqlens = torch.full((B,), capacity, dtype=torch.int32, device=q.device)
    plan_lens = plan.cache_seqlens if isinstance(plan, DecodePlan) else None
    if plan_lens is not None:  # a DecodePlan clips its rows at its key axis
        capacity_checked = min(capacity, plan.kv_len)
    else:
        capacity_checked = capacity
    native = plan.native_window() if isinstance(plan, DecodePlan) else None
    call = DecodeCall(
        lo, hi, block_table, _int32(seqlens), page, capacity,
        AttentionCall(B, Hq, Hkv, Nq, capacity, D, q.dtype, q.device, False, return_lse),
        None if plan_lens is None else plan_lens.to(torch.int32), capacity_checked,
        plan.row_count.view(-1, Nq), native,
    )  # fmt: skip
    impl = _resolve(backend, call)
    if check_values or not (q.is_cuda and getattr(impl, "checks_cache_values", False)):
        _check_cache_values(
            given_table, seqlens, page, k_pages.shape[0], capacity_checked, plan_lens
        )
    scale = 1.0 / D**0.5 if scale is None else float(scale)
    out, lse = impl.decode(q, k_pages, v_pages, call, scale)
    return (out, lse) if return_lse else out


def _check_cache_values(
    block_table, seqlens, page: int, num_pages: int, capacity: int, plan_lens=None
) -> None:
    """Every cache length in ``[0, capacity]`` (and equal to a DecodePlan's own
    ``cache_seqlens``, ``plan_lens``) and every page a row reads (the first
    ``ceil(cache_seqlens[b] / page_size)`` entries of its ``block_table`` row) in
    ``[0, num_pages)``: one host read per call (the kernels would clamp a bad page id and read
    another sequence's keys). Skipped while a CUDA graph is captured or torch.compile traces."""
    if torch.compiler.is_compiling():
        return
    if seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    lens = seqlens.to(torch.int64)
    bad_len = (lens < 0) | (lens > capacity)
    used = (
        torch.arange(block_table.shape[1], device=lens.device)
        < ((lens + page - 1) // page)[:, None]
    )
    bad_page = used & ((block_table < 0) | (block_table >= num_pages))
    if plan_lens is not None:
        bad_len = bad_len | (plan_lens.to(torch.int64) != lens)
    if bool(bad_len.any() | bad_page.any()):
        if bool(bad_len.any()):
            b = int(bad_len.nonzero()[0, 0])
            if plan_lens is not None and int(plan_lens[b]) != int(lens[b]):
                raise InputError(
                    f"cache_seqlens[{b}] = {int(lens[b])}, but the DecodePlan was built for "
                    f"{int(plan_lens[b])} keys in that row: build the step's plan from the same "
                    f"lengths (step_plan / plan.next)"
                )
            raise InputError(
                f"cache_seqlens[{b}] = {int(lens[b])} is outside [0, {capacity}] (block_table "
                f"pages per row x page_size)"
            )
        b, j = (int(x) for x in bad_page.nonzero()[0])
        raise InputError(
            f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of the cache "
            f"(num_pages {num_pages}); row {b} reads it for its first {int(lens[b])} keys"
        )


def _intervals(plan, B, Nq, capacity, cache_seqlens, device):
    if isinstance(plan, DecodePlan):
        if plan.batch != B or plan.q_len != Nq:
            raise InputError(
                f"the DecodePlan was built for B={plan.batch}, q_len={plan.q_len}; q has "
                f"B={B}, Nq={Nq}"
            )
        seqlens = plan.cache_seqlens if cache_seqlens is None else cache_seqlens
        lo, hi = plan.row_lo, plan.row_hi
    elif isinstance(plan, MaskPlan):
        if plan.heads is not None or plan.permutation is not None:
            raise InputError(
                "attention over a KV cache takes plans shared by every head, without a "
                "permutation (not per_head or tile_grid masks)"
            )
        if plan.batch is not None and plan.batch != B:
            raise InputError(f"the plan was compiled for batch={plan.batch}, q has B={B}")
        if plan.q_len != Nq:
            raise InputError(f"the plan was compiled for q_len={plan.q_len}, q has Nq={Nq}")
        plan.check_unchanged()
        if plan.encoding == "bits":
            raise InputError(
                "attention over a KV cache reads row intervals; this plan stores bitmasks "
                "(from_dense / from_mask_mod with many intervals per row): compile the mask, or "
                "call without a cache"
            )
        m = plan.row_lo.shape[0]
        lo, hi = plan.row_lo.view(m, Nq, -1), plan.row_hi.view(m, Nq, -1)
        seqlens = cache_seqlens
    else:
        raise InputError(f"plan must be a MaskPlan or a DecodePlan, got {type(plan).__name__}")
    if plan.kv_len > capacity:
        raise InputError(
            f"the plan's key axis ({plan.kv_len} keys) is longer than the cache holds "
            f"({capacity} keys per batch row)"
        )
    if plan.device != device:
        raise InputError(
            f"the plan is on {plan.device} but q is on {device}: use a plan built there"
        )
    if seqlens is not None and (
        not isinstance(seqlens, torch.Tensor)
        or seqlens.shape != (B,)
        or seqlens.dtype not in (torch.int32, torch.int64)
        or seqlens.device != device
    ):
        raise InputError(
            f"cache_seqlens must be an int [B] = [{B}] tensor on {device}, got {_shape(seqlens)}"
        )
    return lo, hi, plan.kv_len, seqlens


def _resolve(name, call: DecodeCall):
    order = registry.DECODE_AUTO_ORDER if name == "auto" else ((name, None),)
    reasons = []
    for n, takes in order:
        if not isinstance(n, str):
            raise InputError(f"backend must be a str, got {type(n).__name__}")
        impl = registry.get(n)
        ok, why = impl.available()
        if ok and not hasattr(impl, "decode"):
            ok, why = False, "it has no KV-cache (decode) path"
        if ok:
            check = getattr(impl, "decode_supports", None)
            ok, why = check(call) if check is not None else impl.supports(None, call.attention)
        if ok and takes is not None and not takes(call):
            ok, why = False, "slower than the next backend for calls of this size"
        if ok:
            return impl
        reasons.append(f"{n}: {why}")
    raise InputError(f"no backend runs this KV-cache call ({'; '.join(reasons)})")
