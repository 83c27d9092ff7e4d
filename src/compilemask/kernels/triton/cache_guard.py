"""Checks of a paged KV cache's page ids and lengths on the device, for decode kernels that read
pages without checking them (FlashAttention-4's paged path, ``kernels/fa4/paged.py``): one launch
before the kernel clamps what it will read, one after it marks the rows.

No host read: a batch row whose cache length lies outside ``[0, limit]`` (or differs from its
plan's), or whose keys use a page id outside ``[0, num_pages)``, gets NaN in out and lse, as the
split-KV kernel of :mod:`.decode` gives it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _guard_kernel(
    Table, Lens, PlanLens, SafeTable, SafeLens, Bad, P, sbt_b, page, num_pages, limit,
    HAS_PLAN_LENS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Batch row ``b``: its page ids clamped to the cache and its length to ``[0, limit]``;
    ``Bad[b]`` 1 when the length lies outside, differs from the plan's, or a page id its keys
    use lies outside ``[0, num_pages)``."""
    b = tl.program_id(0)
    n = tl.load(Lens + b)
    bad = (n < 0) | (n > limit)
    if HAS_PLAN_LENS:
        bad = bad | (tl.load(PlanLens + b) != n)
    used = tl.cdiv(tl.maximum(n, 0), page)
    for p0 in range(0, P, BLOCK):
        j = p0 + tl.arange(0, BLOCK)
        ids = tl.load(Table + b * sbt_b + j, mask=j < P, other=0)
        bad = bad | (tl.max(((j < used) & ((ids < 0) | (ids >= num_pages))).to(tl.int32), 0) > 0)
        safe = tl.minimum(tl.maximum(ids, 0), num_pages - 1)
        tl.store(SafeTable + b * P + j, safe, mask=j < P)
    tl.store(SafeLens + b, tl.minimum(tl.maximum(n, 0), limit))
    tl.store(Bad + b, bad.to(tl.int32))


@triton.jit
def _mark_kernel(
    Out, Lse, Bad, Count, H, Nq, D, so_b, so_h, so_m, sl_b, sl_h, scm_b, BLOCK_D: tl.constexpr
):
    """Row ``(b, h, i)`` of ``out`` and ``lse`` (strided ``[B, H, Nq, D]`` / ``[B, H, Nq]``):
    NaN when batch row ``b`` is bad, 0 and -inf when the row sees no key (``Count [Mb, Nq]``)."""
    r = tl.program_id(0)
    i = r % Nq
    h = (r // Nq) % H
    b = r // (H * Nq)
    bad = tl.load(Bad + b) != 0
    empty = tl.load(Count + b * scm_b + i) == 0
    if bad | empty:
        d = tl.arange(0, BLOCK_D)
        fill = tl.where(bad, float("nan"), 0.0)
        row = Out + b.to(tl.int64) * so_b + h * so_h + i * so_m
        tl.store(row + d, tl.zeros([BLOCK_D], tl.float32) + fill, mask=d < D)
        value = tl.where(bad, float("nan"), float("-inf"))
        tl.store(Lse + b.to(tl.int64) * sl_b + h * sl_h + i, value)


def guard_pages(table, lens, plan_lens, page: int, num_pages: int, limit: int):
    """``(safe_table int32 [B, P], safe_lens int32 [B], bad int32 [B])``: the page ids clamped
    to ``[0, num_pages)``, the lengths to ``[0, limit]``, and 1 for the bad batch rows (see the
    module docstring); ``plan_lens``: int ``[B]`` lengths the plan was built for, or None."""
    B, P = table.shape
    safe_table = torch.empty((B, P), dtype=torch.int32, device=table.device)
    safe_lens = torch.empty(B, dtype=torch.int32, device=table.device)
    bad = torch.empty(B, dtype=torch.int32, device=table.device)
    _guard_kernel[(B,)](
        table, lens, lens if plan_lens is None else plan_lens, safe_table, safe_lens, bad, P,
        table.stride(0), page, num_pages, limit,
        HAS_PLAN_LENS=plan_lens is not None, BLOCK=min(1024, triton.next_power_of_2(P)),
    )  # fmt: skip
    return safe_table, safe_lens, bad


def mark_rows(out, lse, bad, count) -> None:
    """In place: NaN in ``out [B, H, Nq, D]`` and ``lse [B, H, Nq]`` (any strides, fp32 lse) for
    the batch rows with ``bad``, 0 and -inf for the rows with ``count [Mb, Nq] == 0``."""
    B, H, Nq, D = out.shape
    _mark_kernel[(B * H * Nq,)](
        out, lse, bad, count, H, Nq, D, out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), count.stride(0) if count.shape[0] > 1 else 0,
        BLOCK_D=triton.next_power_of_2(D),
    )  # fmt: skip
