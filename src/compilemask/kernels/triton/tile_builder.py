"""Tile schedules built by one Triton launch instead of ~130 small tensor operations.

On a GPU the tensor-op builder (``compiler/tiles.py``) is launch-bound: every one of its
operations is a kernel launch (``compilemask.tools.op_counts``), and so is the host side of a
Triton launch. The schedule does not depend on the mask, only on the row intervals, so it fits
in one kernel, ``_build_schedule``, grid (Tq + Tk, M):

1. q-tile programs load their rows' intervals once and walk the kv-tiles, writing each tile's
   visible pairs, kind and slot range ``[jlo, jhi)`` (the definitions of ``compiler/tiles.py``:
   pairs by clipping every interval to the tile, ``jlo = #{j : H[j] <= a}``,
   ``jhi = max(#{j : L[j] < b}, jlo)``), then their row's lists: the touched kv-tiles in
   ascending order (-1 padded), their count, and the same list FULL tiles first (0 padded)
   with the number of FULL tiles (what ``schedule.split_full_first`` computes for the kernels);
2. kv-tile programs classify their column of tiles themselves (no program waits for
   another: the intervals are read again, from L2) and write the kv-tiles' lists the same
   way; they need only the tiles' kinds, not their pairs;
3. the last program of each mask to finish (a ticket counter) orders the q- and kv-tiles
   heaviest first and writes the kernels' work entries (``schedule.work_list``).

For a mask with a piece table (``compiler.lower.piece_table``: causal, document,
shared_prompt, hstu) the same launch also makes the rows (:func:`build_from_table`): the
q-tile programs evaluate their rows from the table and write them into the plan's ``row_lo``
/ ``row_hi`` / ``row_count``, regions of the schedule's allocation; the kv-tile programs
evaluate no row: their column's kinds follow from the ranges of each piece's rows that touch
or cover the kv-tile (``table_tiles.py``), two binary searches and a few piece evaluations per
q-tile instead of ``BLOCK_M`` of each. The host table is copied into the allocation's last
region, its first word the ordering's ticket: the copy is the one operation before the
launch. On a GPU the launch goes through the compiled
kernel's launcher after the first (``build_host.launch``: Triton's ``JITFunction.run`` costs
the host about 11 us more per launch).

``_tile_lists`` (the lists of a schedule built elsewhere) and ``_heaviest_first_kernel`` (the
orders of axes longer than ``_FUSED_ORDER_MAX_TILES``) are launched on their own.

No bitmask tiles (they need a host synchronisation to size): ``compiler.tiles.build_tiles``
adds them to a schedule built here where a plan takes them (more than ``BITS_MIN_SLOTS`` slots
per row), with ``tile_bits.tile_bits_triton`` (this builder's ``tile_bits``).

The default for plans built on a CUDA device (``api/device_builder.py``; the environment
variable ``COMPILEMASK_TILE_BUILDER=tensor`` turns it off); :func:`enable` / :func:`using`
switch it for every device Triton serves. ``tests/test_tile_builder.py`` checks it against the
tensor builder through Triton's interpreter, ``tests/test_gpu.py`` on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import weakref
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from ...compiler import tiles as tiles_mod
from ...compiler.tiles import TileSchedule
from .build_host import launch
from .table_tiles import column_kinds_from_table, piece_of, table_bounds
from .tile_bits import tile_bits_triton

_LIST_CHUNK = 128
_ORDER_BLOCK = 64
_ORDER_CHUNK = 64
_ORDER_KERNEL_MAX_TILES = 8192  # heaviest_first: one launch of O(T^2) compares up to here
# _build_schedule's last program orders both axes alone (O(T^2) compares in one program) up to
# this many tiles per axis; beyond, heaviest_first's launch spreads them over programs
_FUSED_ORDER_MAX_TILES = 512
# q-tiles a kv-tile program classifies at a time from a piece table (``[chunk, K_PAD]``
# tensors: at most 512 lanes, so fewer q-tiles for rows of more than two slots)
_TABLE_CHUNK = 256


def _table_chunk(k_pad: int) -> int:
    """The q-tiles per step of a kv-tile program classifying from a piece table."""
    return max(1, min(_TABLE_CHUNK, 512 // k_pad))


# FULL-first lists made while building a schedule, for the kernels' schedules to reuse
# (``full_first_lists``): id(kind) -> (weakref to kind, q lists, kv lists).
_FULL_FIRST: dict[int, tuple] = {}


@triton.jit
def _row_lists(src, list_out, full_first_out, length, CHUNK: tl.constexpr):
    """The lists of one row of kinds at ``src`` (contiguous, ``length`` entries): the touched
    tiles ascending (-1 padded) into ``list_out`` and the same FULL first (0 padded) into
    ``full_first_out``; returns ``(touched, full)`` counts."""
    n_touched = 0
    n_full = 0
    for c0 in range(0, length, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        kind = tl.load(src + idx, mask=idx < length, other=0)
        touched = (kind > 0).to(tl.int32)
        pos = n_touched + tl.cumsum(touched, 0) - 1
        tl.store(list_out + pos, idx, mask=touched > 0)
        n_touched += tl.sum(touched)
        n_full += tl.sum((kind == 1).to(tl.int32))
    n_partial = 0
    n_full_seen = 0
    for c0 in range(0, length, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        inside = idx < length
        kind = tl.load(src + idx, mask=inside, other=0)
        full = (kind == 1).to(tl.int32)
        part = (kind > 1).to(tl.int32)
        pos_full = n_full_seen + tl.cumsum(full, 0) - 1
        pos_part = n_full + n_partial + tl.cumsum(part, 0) - 1
        pos = tl.where(full > 0, pos_full, pos_part)
        tl.store(full_first_out + pos, idx, mask=(full + part) > 0)
        n_full_seen += tl.sum(full)
        n_partial += tl.sum(part)
        tail = inside & (idx >= n_touched)
        tl.store(list_out + idx, tl.full([CHUNK], -1, tl.int32), mask=tail)
        tl.store(full_first_out + idx, tl.zeros([CHUNK], tl.int32), mask=tail)
    return n_touched, n_full


@triton.jit
def _rank(count, t, t_ok, n, CHUNK: tl.constexpr, CACHE: tl.constexpr):
    """``(c, rank)`` of the tiles ``t``: their counts and ``rank(t) = #{u: c[u] > c[t]} +
    #{u < t: c[u] == c[t]}`` over the ``n`` counts at ``count`` (a stable argsort of -count);
    CACHE: the loads' cache modifier."""
    c = tl.load(count + t, mask=t_ok, other=0, cache_modifier=CACHE)
    rank = tl.zeros_like(t)
    for u0 in range(0, n, CHUNK):
        u = u0 + tl.arange(0, CHUNK)
        cu = tl.load(count + u, mask=u < n, other=-1, cache_modifier=CACHE)
        heavier = cu[None, :] > c[:, None]
        tie_before = (cu[None, :] == c[:, None]) & (u[None, :] < t[:, None])
        rank += tl.sum((heavier | tie_before).to(tl.int32), axis=1)
    return c, rank


@triton.jit
def _store_work(full_count, full_first, work, t, t_ok, c, rank, length, CACHE: tl.constexpr):
    """The work entries of ``schedule.work_list`` of the tiles ``t`` from their FULL-first
    lists (``length`` entries each): ``work[rank(t)] = (t, count, full_count, list[0],
    list[full_count], 0, 0, 0)``."""
    full = tl.load(full_count + t, mask=t_ok, other=0, cache_modifier=CACHE)
    lists = full_first + t.to(tl.int64) * length
    first = tl.load(lists, mask=t_ok & (c > 0), other=0, cache_modifier=CACHE)
    part = tl.load(lists + full, mask=t_ok & (full < c), other=0, cache_modifier=CACHE)
    entry = work + rank.to(tl.int64) * 8
    tl.store(entry, t, mask=t_ok)
    tl.store(entry + 1, c, mask=t_ok)
    tl.store(entry + 2, full, mask=t_ok)
    tl.store(entry + 3, first, mask=t_ok)
    tl.store(entry + 4, part, mask=t_ok)
    for f in tl.static_range(5, 8):
        tl.store(entry + f, tl.zeros_like(t), mask=t_ok)


@triton.jit
def _order_side(count, full_count, full_first, order, work, n, length,
                BLOCK: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """One axis of one mask in :func:`_build_schedule`'s last program: ``order[rank(t)] = t``
    (:func:`_rank`) and the work entries (:func:`_store_work`). Loads bypass L1: other
    programs wrote these values."""
    for t0 in range(0, n, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        t_ok = t < n
        c, rank = _rank(count, t, t_ok, n, CHUNK, ".cg")
        tl.store(order + rank, t, mask=t_ok)
        _store_work(full_count, full_first, work, t, t_ok, c, rank, length, ".cg")


@triton.jit
def _build_schedule(
    Lo, Hi, Out,
    q_len, kv_len, n_slots, Tq, Tk, n_pieces, steps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_PAD: tl.constexpr,
    CHUNK_Q: tl.constexpr,
    ORDER: tl.constexpr,
    FROM_TABLE: tl.constexpr,
    SPAN_CHUNK: tl.constexpr,
):  # fmt: skip
    """The whole schedule in one launch, grid (Tq + Tk, M). Programs ``[0, Tq)`` classify a
    q-tile's row of tiles (slot ranges ``SPAN_CHUNK`` tiles at a time; pairs only for the
    kv-tiles between the rows' first and last visible key) and write its lists; programs
    ``[Tq, Tq + Tk)`` classify a kv-tile's column (``CHUNK_Q`` q-tiles at a time, into the
    scratch ``KindT`` [M, Tk, Tq]) and write its lists: from the intervals, or FROM_TABLE
    from the table's pieces (``table_tiles.column_kinds_from_table``: no row evaluated).
    ORDER: every program then takes a ticket of its mask (``Tickets`` [M], zero before the
    launch); the program that takes the last one writes the mask's heaviest-first orders and
    work entries.

    ``Out``: every output in one int32 allocation, in the order of :func:`_layout` (one
    pointer argument instead of nineteen: each costs the host a specialisation and a pointer
    read per launch).

    FROM_TABLE (one mask): ``Lo`` and ``Hi`` are unused; the piece table (``lower.PieceTable``,
    ``n_pieces`` pieces, ``steps`` halvings to find a row's piece, ``table_tiles.piece_of``),
    copied into the last region of ``Out`` (its first word the ticket), takes the intervals'
    place: the q-tile programs evaluate their rows from it and write them, with their counts,
    into the plan's ``row_lo``, ``row_hi``, ``row_count`` (the regions before it); the kv-tile
    programs classify their column from the pieces."""
    n_masks = tl.num_programs(1).to(tl.int64)
    tiles = n_masks * Tq * Tk  # ten [M, Tq, Tk] / [M, Tk, Tq] regions, then the per-tile ones
    Kind, Pairs, Jlo, Jhi, BitsIndex = (
        Out,
        Out + tiles,
        Out + 2 * tiles,
        Out + 3 * tiles,
        Out + 4 * tiles,
    )
    QList, QFullFirst, KindT = Out + 5 * tiles, Out + 6 * tiles, Out + 7 * tiles
    KvList, KvFullFirst = Out + 8 * tiles, Out + 9 * tiles
    per_q, per_kv = n_masks * Tq, n_masks * Tk
    QCount = Out + 10 * tiles
    QFullCount, QOrder = QCount + per_q, QCount + 2 * per_q
    KvCount = QCount + 3 * per_q
    KvFullCount, KvOrder = KvCount + per_kv, KvCount + 2 * per_kv
    QWork = KvCount + 3 * per_kv
    KvWork = QWork + 8 * per_q
    RowLo = KvWork + 8 * per_kv  # FROM_TABLE: the rows, then the copied table
    RowHi = RowLo + n_masks * q_len * n_slots
    RowCount = RowHi + n_masks * q_len * n_slots
    if FROM_TABLE:
        Tickets = RowCount + n_masks * q_len  # the table's first word (zero)
        Lo = Tickets + 1
    else:
        Tickets = RowLo
    pid = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    slots = tl.arange(0, K_PAD)
    lo_hi_base = m * q_len * n_slots
    if pid < Tq:
        qt = pid
        rows = qt * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        ok = row_ok[:, None] & (slots < n_slots)[None, :]
        offs = lo_hi_base + rows.to(tl.int64)[:, None] * n_slots + slots[None, :]
        if FROM_TABLE:
            piece = piece_of(Lo, rows, n_pieces, steps)
            lo, hi = table_bounds(Lo, piece[:, None], rows[:, None], slots[None, :], ok,
                                  n_pieces, n_slots, kv_len)  # fmt: skip
            tl.store(RowLo + offs, lo, mask=ok)
            tl.store(RowHi + offs, hi, mask=ok)
            count = tl.load(Lo + n_pieces * (1 + 4 * n_slots) + piece, mask=row_ok, other=0)
            tl.store(RowCount + m * q_len + rows, count, mask=row_ok)
        else:
            # padding (rows past q_len, slots past n_slots) reads as an empty interval at kv_len
            lo = tl.load(Lo + offs, mask=ok, other=kv_len)
            hi = tl.load(Hi + offs, mask=ok, other=kv_len)
        h_max = tl.max(tl.where(row_ok[:, None], hi, -1), axis=0)
        l_min = tl.min(tl.where(row_ok[:, None], lo, 2147483647), axis=0)
        rows_in = tl.minimum(q_len - qt * BLOCK_M, BLOCK_M)
        out = (m * Tq + qt) * Tk
        # every tile's slot range, and no pairs, a chunk of tiles at a time; then the pairs of
        # the tiles the rows' keys span, one tile at a time
        for c0 in range(0, Tk, SPAN_CHUNK):
            t = c0 + tl.arange(0, SPAN_CHUNK)
            t_ok = t < Tk
            t0 = (t * BLOCK_N)[:, None]
            t1 = tl.minimum(t0 + BLOCK_N, kv_len)
            jlo = tl.sum((h_max[None, :] <= t0).to(tl.int32), axis=1)
            jhi = tl.maximum(tl.sum((l_min[None, :] < t1).to(tl.int32), axis=1), jlo)
            none = tl.zeros([SPAN_CHUNK], tl.int32)
            tl.store(Kind + out + t, none, mask=t_ok)
            tl.store(Pairs + out + t, none, mask=t_ok)
            tl.store(Jlo + out + t, jlo, mask=t_ok)
            tl.store(Jhi + out + t, jhi, mask=t_ok)
            tl.store(BitsIndex + out + t, none - 1, mask=t_ok)
        seen = ok & (lo < hi)
        key_lo = tl.min(tl.min(tl.where(seen, lo, kv_len), axis=1), axis=0)
        key_hi = tl.max(tl.max(tl.where(seen, hi, 0), axis=1), axis=0)
        tl.debug_barrier()  # the chunks' stores before the span's tiles overwrite some
        for t in range(key_lo // BLOCK_N, (key_hi + BLOCK_N - 1) // BLOCK_N):
            t0 = t * BLOCK_N
            t1 = tl.minimum(t0 + BLOCK_N, kv_len)
            overlap = tl.minimum(hi, t1) - tl.maximum(lo, t0)
            pairs = tl.sum(tl.maximum(overlap, 0))
            full = (pairs == BLOCK_M * BLOCK_N) & (rows_in == BLOCK_M) & (t1 - t0 == BLOCK_N)
            kind = tl.where(full, 1, tl.where(pairs > 0, 2, 0))
            tl.store(Kind + out + t, kind)
            tl.store(Pairs + out + t, pairs)
        tl.debug_barrier()  # the row's kinds, stored above, read back by every thread
        row = m * Tq + qt
        n_touched, n_full = _row_lists(
            Kind + out, QList + row * Tk, QFullFirst + row * Tk, Tk, CHUNK=128
        )
        tl.store(QCount + row, n_touched)
        tl.store(QFullCount + row, n_full)
    else:
        t = pid - Tq
        t0 = t * BLOCK_N
        t1 = tl.minimum(t0 + BLOCK_N, kv_len)
        row = m * Tk + t
        dst = KindT + row * Tq
        if FROM_TABLE:  # the kinds from the pieces, no row evaluated (table_tiles.py)
            column_kinds_from_table(Lo, dst, t0, t1, q_len, Tq, n_pieces, n_slots, steps,
                                    BLOCK_M, BLOCK_N, K_PAD, CHUNK_Q)  # fmt: skip
        else:
            r = tl.arange(0, BLOCK_M)
            for c0 in range(0, Tq, CHUNK_Q):
                qts = c0 + tl.arange(0, CHUNK_Q)
                rows = qts[:, None] * BLOCK_M + r[None, :]  # [CHUNK_Q, BLOCK_M]
                ok = (rows < q_len)[:, :, None] & (slots < n_slots)[None, None, :]
                offs = lo_hi_base + rows.to(tl.int64)[:, :, None] * n_slots
                offs += slots[None, None, :]
                lo = tl.load(Lo + offs, mask=ok, other=kv_len)
                hi = tl.load(Hi + offs, mask=ok, other=kv_len)
                overlap = tl.maximum(tl.minimum(hi, t1) - tl.maximum(lo, t0), 0)
                pairs = tl.sum(tl.sum(overlap, axis=2), axis=1)  # [CHUNK_Q]
                rows_in = tl.minimum(q_len - qts * BLOCK_M, BLOCK_M)
                full = (pairs == BLOCK_M * BLOCK_N) & (rows_in == BLOCK_M)
                full &= t1 - t0 == BLOCK_N
                kind = tl.where(full, 1, tl.where(pairs > 0, 2, 0))
                tl.store(dst + qts, kind, mask=qts < Tq)
        tl.debug_barrier()
        n_touched, n_full = _row_lists(
            dst, KvList + row * Tq, KvFullFirst + row * Tq, Tq, CHUNK=128
        )
        tl.store(KvCount + row, n_touched)
        tl.store(KvFullCount + row, n_full)
    if ORDER:
        tl.debug_barrier()  # every thread's stores before the ticket (release)
        ticket = tl.atomic_add(Tickets + m, 1, sem="acq_rel", scope="gpu")
        if ticket == Tq + Tk - 1:  # the mask's last program: every count and list is written
            tl.debug_barrier()
            _order_side(QCount + m * Tq, QFullCount + m * Tq, QFullFirst + m * Tq * Tk,
                        QOrder + m * Tq, QWork + m * Tq * 8, Tq, Tk,
                        BLOCK=64, CHUNK=64)  # fmt: skip
            _order_side(KvCount + m * Tk, KvFullCount + m * Tk, KvFullFirst + m * Tk * Tq,
                        KvOrder + m * Tk, KvWork + m * Tk * 8, Tk, Tq,
                        BLOCK=64, CHUNK=64)  # fmt: skip


@triton.jit
def _tile_lists(
    Kind, Count, List, FullFirst, FullCount, Count2, List2, FullFirst2, FullCount2,
    Tq, Tk,
    CHUNK: tl.constexpr,
    BOTH: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):  # fmt: skip
    """Lists of one row of the [M, Tq, Tk] ``Kind``: a q-tile's kv-tiles or, transposed, a
    kv-tile's q-tiles. BOTH: axis 2 of the grid picks the direction (0: q-tiles into Count,
    List, ...; 1: kv-tiles into Count2, List2, ...) so one launch writes both; else
    TRANSPOSED picks it and only the first outputs are written."""
    if BOTH:
        t = tl.program_id(2)
    else:
        t = TRANSPOSED * 1
    r = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    n_rows = tl.where(t == 0, Tq, Tk)
    length = tl.where(t == 0, Tk, Tq)
    stride_row = tl.where(t == 0, Tk, 1).to(tl.int64)
    stride_col = tl.where(t == 0, 1, Tk).to(tl.int64)
    count_out = tl.where(t == 0, Count, Count2)
    list_out = tl.where(t == 0, List, List2)
    full_first_out = tl.where(t == 0, FullFirst, FullFirst2)
    full_count_out = tl.where(t == 0, FullCount, FullCount2)
    if r < n_rows:
        src = Kind + m * Tq * Tk + r.to(tl.int64) * stride_row
        dst = (m * n_rows + r) * length
        n_touched = 0
        n_full = 0
        for c0 in range(0, length, CHUNK):
            idx = c0 + tl.arange(0, CHUNK)
            inside = idx < length
            kind = tl.load(src + idx.to(tl.int64) * stride_col, mask=inside, other=0)
            touched = (kind > 0).to(tl.int32)
            full = (kind == 1).to(tl.int32)
            pos = n_touched + tl.cumsum(touched, 0) - 1
            tl.store(list_out + dst + pos, idx, mask=touched > 0)
            n_touched += tl.sum(touched)
            n_full += tl.sum(full)
        n_partial = 0
        n_full_seen = 0
        for c0 in range(0, length, CHUNK):
            idx = c0 + tl.arange(0, CHUNK)
            inside = idx < length
            kind = tl.load(src + idx.to(tl.int64) * stride_col, mask=inside, other=0)
            full = (kind == 1).to(tl.int32)
            part = (kind > 1).to(tl.int32)
            pos_full = n_full_seen + tl.cumsum(full, 0) - 1
            pos_part = n_full + n_partial + tl.cumsum(part, 0) - 1
            pos = tl.where(full > 0, pos_full, pos_part)
            tl.store(full_first_out + dst + pos, idx, mask=(full + part) > 0)
            n_full_seen += tl.sum(full)
            n_partial += tl.sum(part)
            # padding past the count: -1 in the ascending list, 0 in the FULL-first list
            tail = inside & (idx >= n_touched)
            tl.store(list_out + dst + idx, tl.full([CHUNK], -1, tl.int32), mask=tail)
            tl.store(full_first_out + dst + idx, tl.zeros([CHUNK], tl.int32), mask=tail)
        tl.store(count_out + m * n_rows + r, n_touched)
        tl.store(full_count_out + m * n_rows + r, n_full)


@triton.jit
def _heaviest_first_kernel(
    CountQ, CountK, OrderQ, OrderK, Tq, Tk,
    FullCountQ, FullCountK, FullFirstQ, FullFirstK, WorkQ, WorkK,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    WORK: tl.constexpr,
):  # fmt: skip
    """``order[m, rank(t)] = t`` with rank(t) = #{u: c[u] > c[t]} + #{u < t: c[u] == c[t]}:
    the tiles by decreasing count, ties by index (a stable argsort of -count). Axis 2 of the
    grid picks the q-tiles (0) or the kv-tiles (1). WORK: also the work entries of
    ``schedule.work_list`` from the FULL-first lists (``work[m, rank(t)] = (t, count,
    full_count, list[0], list[full_count], 0, 0, 0)``)."""
    which = tl.program_id(2)
    m = tl.program_id(1).to(tl.int64)
    n = tl.where(which == 0, Tq, Tk)
    length = tl.where(which == 0, Tk, Tq)  # of each tile's list
    count = tl.where(which == 0, CountQ, CountK) + m * n
    order = tl.where(which == 0, OrderQ, OrderK) + m * n
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    t_ok = t < n
    c, rank = _rank(count, t, t_ok, n, CHUNK, "")
    tl.store(order + rank, t, mask=t_ok)
    if WORK:
        base = m * n
        full_count = tl.where(which == 0, FullCountQ, FullCountK) + base
        full_first = tl.where(which == 0, FullFirstQ, FullFirstK) + base * length
        work = tl.where(which == 0, WorkQ, WorkK) + base * 8
        _store_work(full_count, full_first, work, t, t_ok, c, rank, length, "")


def heaviest_first(q_count: torch.Tensor, kv_count: torch.Tensor, out=None, work=None):
    """``(q_order, kv_order)``: per mask the tiles by decreasing count, ties by lower index
    (``argsort(-count, stable=True)``) in one launch; int32 ``[M, Tq]`` and ``[M, Tk]``
    (written into ``out``, two such tensors, when given).

    ``work``: ``((q_full_first, q_full_count, q_work), (kv_full_first, kv_full_count,
    kv_work))``, the FULL-first lists and counts and two empty int32 ``[M, T, 8]`` tensors
    that the same launch fills with the work entries of ``schedule.work_list``. Returns
    ``(q_order, kv_order, made)`` then, ``made`` False where the tiles were sorted by torch
    instead (more than ``_ORDER_KERNEL_MAX_TILES``: the work tensors are not written).
    """
    m, tq = q_count.shape
    tk = kv_count.shape[1]
    if max(tq, tk) > _ORDER_KERNEL_MAX_TILES:  # O(T^2) compares: a sort beyond this
        orders = tuple(
            torch.argsort(-c, dim=-1, stable=True).to(torch.int32) for c in (q_count, kv_count)
        )
        return orders if work is None else (*orders, False)
    q_order, kv_order = out or (torch.empty_like(q_count), torch.empty_like(kv_count))
    if m and max(tq, tk):
        grid = (-(-max(tq, tk) // _ORDER_BLOCK), m, 2)
        (qff, qfc, qw), (kff, kfc, kw) = work or ((q_count,) * 3, (kv_count,) * 3)
        _heaviest_first_kernel[grid](
            q_count, kv_count, q_order, kv_order, tq, tk, qfc, kfc, qff, kff, qw, kw,
            BLOCK=_ORDER_BLOCK, CHUNK=_ORDER_CHUNK, WORK=work is not None,
        )  # fmt: skip
    return (q_order, kv_order) if work is None else (q_order, kv_order, True)


def _list_buffers(m: int, rows: int, length: int, dev) -> list[torch.Tensor]:
    """Empty ``(count, list, full_first, full_count)`` for ``rows`` lists of ``length``."""
    return [
        torch.empty(shape, dtype=torch.int32, device=dev)
        for shape in ((m, rows), (m, rows, length), (m, rows, length), (m, rows))
    ]


def tile_lists(kind: torch.Tensor, *, transposed: bool = False):
    """Lists of the q-tiles (``transposed=False``: per q-tile its kv-tiles) or of the kv-tiles.

    Args:
        kind: int32 ``[M, Tq, Tk]`` contiguous.

    Returns:
        ``(count [M, R], list [M, R, L] ascending -1 padded, full_first [M, R, L] FULL tiles
        first 0 padded, full_count [M, R])``, all int32, with ``R, L = Tq, Tk`` (or ``Tk, Tq``
        transposed).
    """
    m, tq, tk = kind.shape
    rows, length = (tk, tq) if transposed else (tq, tk)
    out = _list_buffers(m, rows, length, kind.device)
    if m * rows and length:
        _tile_lists[(rows, m)](
            kind, *out, *out, tq, tk, CHUNK=_LIST_CHUNK, BOTH=False, TRANSPOSED=transposed
        )
    elif m * rows:
        out[0].zero_()
        out[3].zero_()
    return tuple(out)


_LAYOUTS: dict[tuple, tuple] = {}


def _layout(
    m: int, tq: int, tk: int, block_m: int, block_n: int, order: bool, rows: tuple = ()
) -> tuple:
    """``(runs, where)``: the outputs of :func:`build_tiles_triton` as slices of one int32
    allocation, kept per tiling (on a GPU host every allocation costs about as much as a
    launch, and every tensor view about a microsecond). Memory order (what
    ``_build_schedule`` computes from ``M``, ``Tq``, ``Tk``): kind, pairs, jlo, jhi,
    bits_index, q_list, q full-first [M, Tq, Tk]; the scratch, kv_list, kv full-first
    [M, Tk, Tq]; q_count, q full counts, q_order [M, Tq]; the same for the kv-tiles; q_work
    [M, Tq, 8]; kv_work; the tickets [M] (none without the fused ordering); the bitmask words
    (none). With ``rows = (Nq, K, W)`` (a build from a piece table, M = 1): after kv_work the
    plan's row_lo, row_hi [M, Nq, K] and row_count [M, Nq], then the piece table's ``W``
    words in the tickets' place (its first word is the ticket). The tickets (or the table)
    are the last words of the allocation (the bitmask words are none). ``runs``: ``(size,
    count, shape, offset, size, stride)`` per run of consecutive outputs of one shape (made
    as one strided view, unbound when ``count > 1``: ``size`` and ``stride`` of that view);
    ``where[i]``: the position in memory order of the i-th output in the order
    :func:`build_tiles_triton` unpacks them."""
    key = (m, tq, tk, block_m, block_n, order, rows)
    hit = _LAYOUTS.get(key)
    if hit is None:
        per_q, per_kv, tiles, tiles_t = (m, tq), (m, tk), (m, tq, tk), (m, tk, tq)
        shapes = [tiles] * 5 + [tiles_t]  # kind, pairs, jlo, jhi, bits_index; scratch
        shapes += [per_q, tiles, tiles, per_q, per_kv, tiles_t, tiles_t, per_kv]
        tickets = (rows[2],) if rows else (m if order else 0,)
        shapes += [per_q, per_kv, (m, tq, 8), (m, tk, 8), tickets]
        shapes += [(0, block_m, -(-block_n // 32))]
        memory = [0, 1, 2, 3, 4, 7, 8, 5, 11, 12, 6, 9, 14, 10, 13, 15, 16, 17, 18, 19]
        if rows:
            shapes += [(m, *rows[:2]), (m, *rows[:2]), (m, rows[0])]
            memory[-2:-2] = [20, 21, 22]
        grouped: list[list] = []
        for i in memory:
            shape = shapes[i]
            if grouped and grouped[-1][1] == shape:
                grouped[-1][0] += 1
            else:
                grouped.append([1, shape])
        runs, offset = [], 0
        for count, shape in grouped:
            one = math.prod(shape)
            stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
            size = shape if count == 1 else (count, *shape)
            runs.append((count * one, count, shape, offset, size, stride if count == 1 else
                         (one, *stride)))  # fmt: skip
            offset += count * one
        hit = _LAYOUTS[key] = (runs, [memory.index(i) for i in range(len(shapes))])
    return hit


def _views(flat: torch.Tensor, runs: list, where: list) -> list:
    """The outputs of one :func:`_layout` as contiguous views of ``flat``: one strided view
    per run, unbound where the run has several outputs."""
    views = []
    strided = flat.as_strided
    for _, count, _, offset, size, stride in runs:
        if count == 1:
            views.append(strided(size, stride, offset))
        else:
            views += strided(size, stride, offset).unbind(0)
    return [views[i] for i in where]


def _outputs(runs: list, where: list, device: torch.device) -> tuple:
    """``(flat, outputs)``: one new int32 allocation and the outputs of one :func:`_layout`,
    contiguous views of it."""
    flat = torch.empty(runs[-1][3] + runs[-1][0], dtype=torch.int32, device=device)
    return flat, _views(flat, runs, where)


def build_tiles_triton(
    lo: torch.Tensor,
    hi: torch.Tensor,
    q_len: int,
    kv_len: int,
    block_m: int,
    block_n: int,
) -> TileSchedule:
    """The :class:`TileSchedule` of row intervals ``lo, hi`` (int32 ``[M, Nq, K]``
    contiguous), without bitmask tiles: equal to ``compiler.tiles.build_tiles(...,
    use_bits=False)``.

    One ``_build_schedule`` launch writes everything (and the FULL-first lists and work
    entries the kernels' schedules reuse, :func:`full_first_lists`) when neither axis has more
    than :data:`_FUSED_ORDER_MAX_TILES` tiles; longer axes order their tiles in a second
    launch (:func:`heaviest_first`). Outputs are views of one allocation; the tickets of the
    fused ordering are its only zeroed part (one fill)."""
    m, _, k = lo.shape
    return _build(lo, hi, None, m, k, q_len, kv_len, block_m, block_n, lo.device)[0]


def build_from_table(
    table, q_len: int, kv_len: int, block_m: int, block_n: int, device: torch.device
):
    """``(row_lo, row_hi, row_count, schedule)`` on ``device`` of one mask's piece table
    (``table``: a ``compiler.lower.PieceTable``, on the host): the rows ``lower`` makes from
    it (int32 ``[1, Nq, K]``, ``[1, Nq]``) and their :func:`build_tiles_triton` schedule, bit
    for bit, all written by the one ``_build_schedule`` launch into its one allocation, into
    which the table is copied first (the one operation before the launch: no
    ``searchsorted``, gathers or ``addcmul``, no fill). Needs ``q_len, kv_len >= 1``."""
    schedule, rows = _build(None, None, table, 1, table.k, q_len, kv_len, block_m, block_n, device)
    return (*rows, schedule)


_SCHEDULE_FIELDS = tuple(f.name for f in dataclasses.fields(TileSchedule))
# (M, K, Nq, Nk, block_m, block_n, table words, fused-order limit) -> _setup(...)
_SETUPS: dict[tuple, tuple] = {}


def _setup(m, k, q_len, kv_len, block_m, block_n, words) -> tuple:
    """What a build's launch and outputs take from its sizes alone: ``(runs, where, total
    words, order, grid, constants, Tq, Tk)``."""
    tq, tk = -(-q_len // block_m), -(-kv_len // block_n)
    order = max(tq, tk) <= _FUSED_ORDER_MAX_TILES
    runs, where = _layout(m, tq, tk, block_m, block_n, order, (q_len, k, words) if words else ())
    k_pad = max(1 << (max(k, 1) - 1).bit_length(), 2)
    consts = (
        ("BLOCK_M", block_m), ("BLOCK_N", block_n), ("K_PAD", k_pad),
        ("CHUNK_Q", _table_chunk(k_pad) if words else max(1, min(64, 4096 // (block_m * k_pad)))),
        ("ORDER", order),
        ("FROM_TABLE", words > 0),
        ("SPAN_CHUNK", max(16, min(128, 2048 // k_pad))),
    )  # fmt: skip
    return runs, where, runs[-1][3] + runs[-1][0], order, (tq + tk, m), consts, tq, tk


def _build(lo, hi, table, m, k, q_len, kv_len, block_m, block_n, device):
    """``(schedule, rows)``: :func:`build_tiles_triton` of the intervals ``lo, hi`` on
    ``device``, or of the rows a piece ``table`` evaluates (``lo``, ``hi`` None), ``rows``
    then their ``(row_lo, row_hi, row_count)`` (else empty)."""
    words = table.flat.shape[0] if table is not None else 0
    key = (m, k, q_len, kv_len, block_m, block_n, words, _FUSED_ORDER_MAX_TILES)
    setup = _SETUPS.get(key)
    if setup is None:
        if len(_SETUPS) >= 256:
            _SETUPS.clear()
        setup = _SETUPS[key] = _setup(m, k, q_len, kv_len, block_m, block_n, words)
    runs, where, total, order, grid, consts, tq, tk = setup
    flat = torch.empty(total, dtype=torch.int32, device=device)
    built = m * tq * tk
    if built:  # the launch first: the views' Python runs while the device builds
        if table is not None:  # the table and the ticket before it: the one operation
            # pinned on a GPU's host; the table (or the tickets) are the allocation's last words
            flat.as_strided((words,), (1,), total - words).copy_(table.flat, non_blocking=True)
            lo = hi = flat  # unused: the launch reads the table from its allocation
            pieces = table.pieces
        else:
            if order:
                flat.as_strided((m,), (1,), total - m).zero_()
            pieces = 1
        values = (lo, hi, flat, q_len, kv_len, k, tq, tk, pieces, pieces.bit_length())
        launch(_build_schedule, grid, device, values, consts)
    out = _views(flat, runs, where)
    kind, pairs, jlo, jhi, bits_index = out[:5]
    q_count, q_list, q_full_first, q_full_count = out[6:10]
    kv_count, kv_list, kv_full_first, kv_full_count = out[10:14]
    q_order, kv_order, q_work, kv_work, _, bits = out[14:20]
    if not built:
        for t in (q_count, q_full_count, kv_count, kv_full_count, q_order, kv_order):
            t.zero_()  # not reached by the seeds: an empty axis has no tiles to list
        q_work = kv_work = None
    elif not order:
        lists = ((q_full_first, q_full_count, q_work), (kv_full_first, kv_full_count, kv_work))
        q_order, kv_order, made = heaviest_first(
            q_count, kv_count, out=(q_order, kv_order), work=lists
        )
        if not made:
            q_work = kv_work = None
    key = id(kind)
    ref = weakref.ref(kind, lambda _, key=key: _FULL_FIRST.pop(key, None))
    _FULL_FIRST[key] = (
        ref, (q_full_first, q_full_count, q_work), (kv_full_first, kv_full_count, kv_work)
    )  # fmt: skip
    schedule = object.__new__(TileSchedule)  # the frozen dataclass's fields, set directly
    schedule.__dict__.update(zip(_SCHEDULE_FIELDS, (
        block_m, block_n, q_len, kv_len, kind, pairs, jlo, jhi, bits_index, bits,
        q_count, q_list, kv_count, kv_list, q_order, kv_order,
    )))  # fmt: skip
    return schedule, out[20:]


def full_first_lists(kind: torch.Tensor, transposed: bool):
    """``(full_first, full_count, work)`` that :func:`build_tiles_triton` made with ``kind``
    (the kv-tiles' lists when ``transposed``; ``work`` the ``schedule.work_list`` entries, or
    None when it did not make them), or None for a schedule it did not build."""
    hit = _FULL_FIRST.get(id(kind))
    if hit is None or hit[0]() is not kind:
        return None
    return hit[2] if transposed else hit[1]


def serves(t: torch.Tensor) -> bool:
    """Whether the kernels can run on ``t``'s device (a GPU, or the CPU through Triton's
    interpreter)."""
    return t.device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1"


#: ``_build_schedule`` holds a [BLOCK_M, next_pow2(K)] tile of a q-tile's intervals in
#: registers: rows with more slots than this go to the tensor builder (a dilated mask can have
#: thousands; the seeds have at most 32).
MAX_SLOTS = 64


def _device_builder(lo, hi, count, q_len, kv_len, block_m, block_n):
    """The hook ``compiler.tiles.build_tiles`` calls; None declines (the CPU without Triton's
    interpreter, or shapes the kernels do not take: block_m not a power of two >= 16, more
    than :data:`MAX_SLOTS` interval slots per row)."""
    if not serves(lo):
        return None
    if block_m & (block_m - 1) or block_m < 16 or lo.shape[-1] > MAX_SLOTS:
        return None
    return build_tiles_triton(lo.contiguous(), hi.contiguous(), q_len, kv_len, block_m, block_n)


def _device_builder_from_table(make_table, q_len, kv_len, device, block_m, block_n):
    """The pipeline's hook for masks with a piece table (``compiler.lower.piece_table``):
    ``(row_lo, row_hi, row_count, schedule)`` by :func:`build_from_table`, or None (decline,
    before ``make_table()`` is called where the device or the tiling decides it) where
    :func:`_device_builder` would decline or an axis is empty."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    if block_m & (block_m - 1) or block_m < 16 or q_len < 1 or kv_len < 1:
        return None
    table = make_table()
    if table is None or table.k > MAX_SLOTS:
        return None
    return build_from_table(table, q_len, kv_len, block_m, block_n, device)


_device_builder.serves = serves  # type: ignore[attr-defined]
_device_builder.tile_bits = tile_bits_triton  # type: ignore[attr-defined]
_device_builder.from_table = _device_builder_from_table  # type: ignore[attr-defined]


def enable(on: bool = True) -> None:
    """Build tile schedules with the Triton kernels on every device they serve, the CPU
    through Triton's interpreter included (``on=False``: the tensor builder everywhere).

    Applies where no bitmask tile is needed: GPU plan builds (``compile(..., device="cuda")``)
    and plans with at most ``BITS_MIN_SLOTS`` slots per row. CUDA plans use these kernels by
    default (``api/device_builder.py``); this switch is for tests and comparisons.
    """
    tiles_mod.register_device_tile_builder(_device_builder if on else None)


@contextlib.contextmanager
def using(on: bool) -> Iterator[None]:
    """:func:`enable` (``on``) inside the block, then the builder registered before it.

    Example::

        >>> with tile_builder.using(False):  # the tensor builder, e.g. as a reference
        ...     ref = cm.compile(mask, n, device="cuda", cache=False)
    """
    before = tiles_mod.device_tile_builder()
    enable(on)
    try:
        yield
    finally:
        tiles_mod.register_device_tile_builder(before)
