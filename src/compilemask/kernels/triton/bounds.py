"""Row bounds from the compact descriptor's segments (``compiler/segments.py``).

When a plan's compact form keeps its intervals as affine *segments* (``plan.compact().rows ==
"segments"``), the kernels compute the bounds of a PARTIAL tile's rows from the segments
instead of loading them from the per-row tensors ``row_lo`` / ``row_hi`` ``[M, Nq, K]``. Three
int32 tables, built once per plan (and per q-tiling for the last), on the plan's device:

- ``SegRow`` ``[S, 4]``: per segment ``(r0, t0, count, 0)``: its first row, the first entry of
  its template in ``SlotTab`` and its interval count (the template indirection resolved);
- ``SlotTab`` ``[T, 4]``: per template interval ``(a, b, c, d)``: row ``q`` of a segment
  starting at ``r0`` sees ``[a*(q - r0) + b + r0, c*(q - r0) + d + r0)``, a slope of -128
  marking a bound stored as the key position itself; clipped to ``[0, Nk]``;
- ``TileSeg`` ``[M * Tq, 2]``: per q-tile ``(first, n)``: the segment of its first row and the
  number of segments its rows meet (a tile may straddle several: document edges).

A q-tile finds the segment of each of its rows by a branch-free binary search over ``r0`` of
its ``n`` segments (:func:`segment_of_rows`: ``SEG_STEPS = ceil(log2(max n))`` steps, a
constexpr; none for causal or a sliding window, whose tiles meet one segment), one gather per
step from a table of a few KB (L1/L2 resident); a slot's bounds then cost one gather of a
16-byte ``SlotTab`` entry and an integer multiply-add per bound (:func:`row_bounds`). FULL
tiles read nothing.

Schedules carry the tables after their fixed fields (:func:`split_fwd`, :func:`split_bwd`);
plans whose compact form keeps rows (``from_dense``, bitmask plans, rows of many tiny runs)
carry none and the kernels read the rows as before.
"""

from __future__ import annotations

import math
import weakref

import torch
import triton
import triton.language as tl


@triton.jit
def clamp(x, hi):
    """``x`` clamped to [0, hi] (``common.clamp``; ``common`` imports this module)."""
    return tl.minimum(tl.maximum(x, 0), hi)


#: the slope that marks an absolute bound (``compiler.segments.ABSOLUTE``)
_ABSOLUTE = tl.constexpr(-128)


@triton.jit
def segment_of_rows(SegRow, TileSeg, tile, offs_m, n_seg, SEG_STEPS: tl.constexpr):
    """int32 ``[BLOCK_M]``: the segment of each row ``offs_m`` of the q-tile at entry ``tile``
    of ``TileSeg`` (the last of the tile's segments starting at or before the row; the
    indices clamped to ``[0, n_seg)``)."""
    first = clamp(tl.load(TileSeg + tile * 2), n_seg - 1)
    end = tl.minimum(first + tl.load(TileSeg + tile * 2 + 1), n_seg)
    sid = tl.zeros(offs_m.shape, dtype=tl.int32) + first
    for step in tl.static_range(SEG_STEPS):
        cand = sid + (1 << (SEG_STEPS - 1 - step))
        ok = cand < end
        r0 = tl.load(SegRow + cand * 4, mask=ok, other=0)
        sid = tl.where(ok & (r0 <= offs_m), cand, sid)
    return sid


@triton.jit
def segment_rows(SegRow, sid):
    """``(r0, t0, count)`` ``[BLOCK_M]`` of the segments ``sid``."""
    seg = SegRow + sid * 4
    return tl.load(seg), tl.load(seg + 1), tl.load(seg + 2)


@triton.jit
def row_bounds(SlotTab, r0, t0, cnt, offs_m, slot, Nq, Nk, n_tab):
    """``(lo, hi)`` int32 ``[BLOCK_M]``: interval ``slot`` of rows ``offs_m`` whose segments
    are ``(r0, t0, cnt)`` (:func:`segment_rows`), clipped to ``[0, Nk]``; empty (``0, 0``)
    where the row is past ``Nq`` or has no such slot. Template entries are clamped to
    ``[0, n_tab)``."""
    ok = (offs_m < Nq) & (slot < cnt)
    tab = SlotTab + tl.minimum(tl.maximum(t0 + slot, 0), n_tab - 1) * 4
    a = tl.load(tab, mask=ok, other=0)
    b = tl.load(tab + 1, mask=ok, other=0)
    c = tl.load(tab + 2, mask=ok, other=0)
    d = tl.load(tab + 3, mask=ok, other=0)
    rel = offs_m - r0
    lo = tl.where(a == _ABSOLUTE, b, a * rel + b + r0)
    hi = tl.where(c == _ABSOLUTE, d, c * rel + d + r0)
    lo = tl.where(ok, clamp(lo, Nk), 0)
    hi = tl.where(ok, clamp(hi, Nk), 0)
    return lo, hi


@triton.jit
def preload_seg_slot(
    SlotTab, r0, t0, cnt, offs_m, Nq, Nk, n_tab, slot: tl.constexpr, SLOTS: tl.constexpr
):  # fmt: skip
    """``common.preload_row_slot`` from the segments: ``(lo, hi)`` of slot ``slot`` of the
    rows, empty when ``slot >= SLOTS``."""
    if slot < SLOTS:
        lo, hi = row_bounds(SlotTab, r0, t0, cnt, offs_m, slot, Nq, Nk, n_tab)
    else:
        lo = tl.zeros(offs_m.shape, dtype=tl.int32)
        hi = lo
    return lo, hi


@triton.jit
def seg_tile_mask(
    SegRow, SlotTab, TileSeg, tile, offs_m, offs_n, Nq, Nk, n_seg, n_tab, jlo, jhi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPAN: tl.constexpr,
    SEG_STEPS: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):  # fmt: skip
    """``common.interval_tile_mask`` (``TRANSPOSED``: ``interval_tile_mask_t``, ``[BLOCK_N,
    BLOCK_M]``) with the bounds of slots ``[jlo, jhi)`` computed from the segments of the
    q-tile at entry ``tile`` of ``TileSeg``."""
    sid = segment_of_rows(SegRow, TileSeg, tile, offs_m, n_seg, SEG_STEPS)
    r0, t0, cnt = segment_rows(SegRow, sid)
    if TRANSPOSED:
        visible = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int1)
    else:
        visible = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int1)
    if MAX_SPAN >= 0:
        for step in tl.static_range(MAX_SPAN):
            # slots past jhi are masked off: the fixed trip count keeps the kv loop pipelined
            lo, hi = row_bounds(SlotTab, r0, t0, cnt, offs_m, jlo + step, Nq, Nk, n_tab)
            hi = tl.where(jlo + step < jhi, hi, 0)
            if TRANSPOSED:
                visible = visible | (
                    (offs_n[:, None] >= lo[None, :]) & (offs_n[:, None] < hi[None, :])
                )
            else:
                visible = visible | (
                    (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
                )
    else:
        for j in range(jlo, jhi):
            lo, hi = row_bounds(SlotTab, r0, t0, cnt, offs_m, j, Nq, Nk, n_tab)
            if TRANSPOSED:
                visible = visible | (
                    (offs_n[:, None] >= lo[None, :]) & (offs_n[:, None] < hi[None, :])
                )
            else:
                visible = visible | (
                    (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
                )
    return visible


# ------------------------------------------------------------------------------------ host side
#: tensors per schedule that carry the segments: ``SegRow, SlotTab, TileSeg`` (forward, dQ)
SEG_FWD = 3
#: ``SegRow, SlotTab, TileSeg`` of the dK/dV tiling, ``TileSeg`` of the dQ tiling
SEG_BWD = 4
_STEPS: dict[int, tuple[object, int]] = {}
#: Whether kernels that would compute bounds per masked tile (the dK/dV kernel; the forward and
#: dQ kernels of plans with more than ``common.MAX_PRELOAD_SLOTS`` slots per row) read the
#: segments. Off: compiled for sm_90 (``benchmarks/sass_stats.py --segments``), the chained
#: gathers inside the tile loop become extra asynchronous copies of the software pipeliner and
#: the dK/dV kernel's spills grow (causal 80 -> 160 bytes, clear 80 -> 408), so those kernels
#: read ``row_lo`` / ``row_hi``; the forward and dQ kernels compute their preloaded slots
#: from the segments once per program (their tile loops are unchanged).
PER_TILE = False


def segment_tables(plan) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(SegRow [S, 4], SlotTab [max(T, 1), 4])`` int32 on the plan's device when the plan's
    compact form chose segments, else None. Cached on the plan. Builds ``plan.compact()``
    (host reads while deriving it, once per plan)."""

    def build():
        c = plan.compact()
        if c.rows != "segments" or c.segments is None:
            return None
        seg = c.segments
        tmpl = seg.template.to(torch.int64)
        t0 = seg.slot_ptr[tmpl]
        cnt = seg.slot_ptr[tmpl + 1] - t0
        seg_row = torch.stack((seg.r0, t0, cnt, torch.zeros_like(cnt)), -1).to(torch.int32)
        slot = torch.cat((seg.slope.to(torch.int32), seg.base.to(torch.int32)), -1)
        slot = slot[:, [0, 2, 1, 3]]  # (a, b, c, d)
        if slot.shape[0] == 0:
            slot = torch.zeros((1, 4), dtype=torch.int32, device=seg.r0.device)
        return seg_row.contiguous(), slot.contiguous()

    return plan.cached("triton.segments", build)


def tile_segments(plan, block_m: int) -> torch.Tensor:
    """int32 ``[M * Tq, 2]``: ``(first segment, segments met)`` of every q-tile of
    ``block_m`` rows (:func:`segment_tables` must not be None). Cached on the plan; its
    :func:`seg_steps` is recorded when it is built (one host read)."""

    def build():
        seg = plan.compact().segments
        m, nq = seg.num_masks, seg.q_len
        dev = seg.r0.device
        tq = math.ceil(nq / block_m)
        sizes = (seg.mask_ptr[1:] - seg.mask_ptr[:-1]).to(torch.int64)
        owner = torch.repeat_interleave(torch.arange(m, device=dev), sizes)
        keys = owner * (nq + 1) + seg.r0.to(torch.int64)
        first_row = torch.arange(tq, device=dev) * block_m
        last_row = torch.clamp(first_row + block_m, max=nq) - 1
        base = torch.arange(m, device=dev)[:, None] * (nq + 1)
        first = torch.searchsorted(keys, (base + first_row).reshape(-1), right=True) - 1
        last = torch.searchsorted(keys, (base + last_row).reshape(-1), right=True) - 1
        table = torch.stack((first, last - first + 1), -1).to(torch.int32).contiguous()
        most = int(table[:, 1].max()) if table.numel() else 1
        _remember(table, max(most - 1, 0).bit_length())
        return table

    return plan.cached(("triton.tile_segments", block_m), build)


def _remember(table: torch.Tensor, steps: int) -> None:
    key = id(table)
    _STEPS[key] = (weakref.ref(table, lambda _, key=key: _STEPS.pop(key, None)), steps)


def seg_steps(table: torch.Tensor) -> int:
    """The binary-search steps ``ceil(log2(max segments per q-tile))`` of a
    :func:`tile_segments` table (recorded when it was built; else one host read)."""
    hit = _STEPS.get(id(table))
    if hit is not None and hit[0]() is table:
        return hit[1]
    most = int(table[:, 1].max()) if table.numel() else 1
    steps = max(most - 1, 0).bit_length()
    _remember(table, steps)
    return steps


def fwd_segments(plan, block_m: int) -> list[torch.Tensor]:
    """The tensors a forward (or dQ) schedule of ``block_m`` rows carries for the segment path:
    ``[SegRow, SlotTab, TileSeg]``, or ``[]`` when the plan keeps its rows (and while
    ``torch.compile`` traces: a compiled graph reads the rows)."""
    if torch.compiler.is_compiling():
        return []
    tables = segment_tables(plan)
    if tables is None:
        return []
    return [*tables, tile_segments(plan, block_m)]


def bwd_segments(plan, dkdv_block_m: int, dq_block_m: int) -> list[torch.Tensor]:
    """``[SegRow, SlotTab, TileSeg (dK/dV tiling), TileSeg (dQ tiling)]`` or ``[]``."""
    fwd = fwd_segments(plan, dkdv_block_m)
    return fwd + [tile_segments(plan, dq_block_m)] if fwd else []


def seg_args(tables, per_program: bool) -> tuple[tuple, int, bool]:
    """``((SegRow, SlotTab, TileSeg, n_seg, n_tab), SEG_STEPS, SEG)`` kernel arguments for
    ``tables`` (``[SegRow, SlotTab, TileSeg]`` or None: the row path, with dummy tensors);
    ``per_program``: the kernel reads the bounds once per program (preloaded slots), else per
    masked tile (then the segments only with :data:`PER_TILE`)."""
    if not tables or not (per_program or PER_TILE):
        return (None, None, None, 1, 1), 0, False
    seg_row, slot_tab, tile_seg = tables
    return (
        (seg_row, slot_tab, tile_seg, seg_row.shape[0], slot_tab.shape[0]),
        seg_steps(tile_seg),
        True,
    )


def split_bwd(tail: list[torch.Tensor], ds_dq: int) -> tuple[torch.Tensor | None, list]:
    """``(ds_slots or None, segments)`` from what a backward schedule carries after its dK/dV
    and dQ fields: the dS slots when ``BwdConfig.ds_dq`` (``ds_dq``), then the segment tables
    (:func:`bwd_segments`, possibly none)."""
    if ds_dq:
        return tail[0], list(tail[1:])
    return None, list(tail)
