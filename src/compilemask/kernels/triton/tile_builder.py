"""Tile schedules built by two Triton kernels instead of ~130 small tensor operations.

On a GPU the tensor-op builder (``compiler/tiles.py``) is launch-bound: every one of its
operations is a kernel launch (``benchmarks/build_op_counts.py``). The schedule does not depend
on the mask, only on the row intervals, so it fits in two kernels:

1. ``_classify_tiles``, grid (Tq, M): one program per q-tile loads its rows' intervals once and
   walks the kv-tiles, writing each tile's visible pairs, kind and slot range ``[jlo, jhi)``
   (the definitions of ``compiler/tiles.py``: pairs by clipping every interval to the tile,
   ``jlo = #{j : H[j] <= a}``, ``jhi = max(#{j : L[j] < b}, jlo)``).
2. ``_tile_lists``, grid (rows, M), launched for the q-tiles and, through transposed strides,
   for the kv-tiles: the touched tiles of a row in ascending order (-1 padded), their count,
   and the same list FULL tiles first (0 padded) with the number of FULL tiles (what
   ``schedule.split_full_first`` computes for the kernels).

No bitmask tiles (they need a host synchronisation to size): used where the tensor builder
would not make them either (``use_bits=False``, or at most ``BITS_MIN_SLOTS`` slots per row).

The default for plans built on a CUDA device (``api/device_builder.py``; the environment
variable ``COMPILEMASK_TILE_BUILDER=tensor`` turns it off); :func:`enable` / :func:`using`
switch it for every device Triton serves. ``tests/test_tile_builder.py`` checks it against the
tensor builder through Triton's interpreter, ``tests/test_gpu.py`` on a GPU.
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from ...compiler import tiles as tiles_mod
from ...compiler.tiles import TileSchedule

_LIST_CHUNK = 128
_ORDER_BLOCK = 64
_ORDER_CHUNK = 64
_ORDER_KERNEL_MAX_TILES = 8192  # heaviest_first: one launch of O(T^2) compares up to here
# FULL-first lists made while building a schedule, for the kernels' schedules to reuse
# (``full_first_lists``): id(kind) -> (weakref to kind, q lists, kv lists).
_FULL_FIRST: dict[int, tuple] = {}


@triton.jit
def _classify_tiles(
    Lo, Hi, Kind, Pairs, Jlo, Jhi, BitsIndex,
    q_len, kv_len, n_slots, Tq, Tk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_PAD: tl.constexpr,
):  # fmt: skip
    qt = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.arange(0, K_PAD)
    row_ok = rows < q_len
    ok = row_ok[:, None] & (slots < n_slots)[None, :]
    offs = m * q_len * n_slots + rows.to(tl.int64)[:, None] * n_slots + slots[None, :]
    # padding (rows past q_len, slots past n_slots) reads as an empty interval at kv_len
    lo = tl.load(Lo + offs, mask=ok, other=kv_len)
    hi = tl.load(Hi + offs, mask=ok, other=kv_len)
    # per slot, over the q-tile's real rows: the largest end and the smallest start
    h_max = tl.max(tl.where(row_ok[:, None], hi, -1), axis=0)
    l_min = tl.min(tl.where(row_ok[:, None], lo, 2147483647), axis=0)
    rows_in = tl.minimum(q_len - qt * BLOCK_M, BLOCK_M)
    out = (m * Tq + qt) * Tk
    for t in range(0, Tk):
        t0 = t * BLOCK_N
        t1 = tl.minimum(t0 + BLOCK_N, kv_len)
        overlap = tl.minimum(hi, t1) - tl.maximum(lo, t0)
        pairs = tl.sum(tl.maximum(overlap, 0))
        jlo = tl.sum((h_max <= t0).to(tl.int32))
        jhi = tl.maximum(tl.sum((l_min < t1).to(tl.int32)), jlo)
        full = (pairs == BLOCK_M * BLOCK_N) & (rows_in == BLOCK_M) & (t1 - t0 == BLOCK_N)
        kind = tl.where(full, 1, tl.where(pairs > 0, 2, 0))
        tl.store(Kind + out + t, kind)
        tl.store(Pairs + out + t, pairs)
        tl.store(Jlo + out + t, jlo)
        tl.store(Jhi + out + t, jhi)
        tl.store(BitsIndex + out + t, -1)


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
    c = tl.load(count + t, mask=t_ok, other=0)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for u0 in range(0, n, CHUNK):
        u = u0 + tl.arange(0, CHUNK)
        cu = tl.load(count + u, mask=u < n, other=-1)
        heavier = cu[None, :] > c[:, None]
        tie_before = (cu[None, :] == c[:, None]) & (u[None, :] < t[:, None])
        rank += tl.sum((heavier | tie_before).to(tl.int32), axis=1)
    tl.store(order + rank, t, mask=t_ok)
    if WORK:
        full = tl.load(tl.where(which == 0, FullCountQ, FullCountK) + m * n + t, mask=t_ok)
        lists = tl.where(which == 0, FullFirstQ, FullFirstK) + (m * n + t) * length
        first = tl.load(lists, mask=t_ok & (c > 0), other=0)
        part = tl.load(lists + full, mask=t_ok & (full < c), other=0)
        work = tl.where(which == 0, WorkQ, WorkK) + (m * n + rank) * 8
        tl.store(work, t, mask=t_ok)
        tl.store(work + 1, c, mask=t_ok)
        tl.store(work + 2, full, mask=t_ok)
        tl.store(work + 3, first, mask=t_ok)
        tl.store(work + 4, part, mask=t_ok)
        for f in tl.static_range(5, 8):
            tl.store(work + f, tl.zeros([BLOCK], dtype=tl.int32), mask=t_ok)


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


def tile_lists_both(kind: torch.Tensor, out=None):
    """:func:`tile_lists` of the q-tiles and of the kv-tiles in one launch:
    ``(q lists, kv lists)``, each a 4-tuple as there (written into ``out``, two such 4-tuples
    of empty tensors, when given)."""
    m, tq, tk = kind.shape
    if out is None:
        out = _list_buffers(m, tq, tk, kind.device), _list_buffers(m, tk, tq, kind.device)
    q_out, kv_out = out
    if m * tq * tk:
        _tile_lists[(max(tq, tk), m, 2)](
            kind, *q_out, *kv_out, tq, tk, CHUNK=_LIST_CHUNK, BOTH=True, TRANSPOSED=False
        )
        return tuple(q_out), tuple(kv_out)
    return tile_lists(kind), tile_lists(kind, transposed=True)


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
    use_bits=False)``."""
    m, n, k = lo.shape
    tq, tk = -(-q_len // block_m), -(-kv_len // block_n)
    # every output in one allocation (on a GPU host each one costs about as much as a launch)
    per_q, per_kv, tiles, tiles_t = (m, tq), (m, tk), (m, tq, tk), (m, tk, tq)
    shapes = [tiles] * 5 + [per_q, tiles, tiles, per_q, per_kv, tiles_t, tiles_t, per_kv]
    shapes += [per_q, per_kv, (0, block_m, -(-block_n // 32)), (m, tq, 8), (m, tk, 8)]
    sizes = [math.prod(shape) for shape in shapes]
    flat = torch.empty(sum(sizes), dtype=torch.int32, device=lo.device)
    out = [part.view(shape) for part, shape in zip(flat.split(sizes), shapes)]
    kind, pairs, jlo, jhi, bits_index = out[:5]
    if m * tq * tk:
        _classify_tiles[(tq, m)](
            lo, hi, kind, pairs, jlo, jhi, bits_index, q_len, kv_len, k, tq, tk,
            BLOCK_M=block_m, BLOCK_N=block_n, K_PAD=max(1 << (max(k, 1) - 1).bit_length(), 2),
        )  # fmt: skip
    q_lists, kv_lists = tile_lists_both(kind, out=(out[5:9], out[9:13]))
    q_count, q_list, q_full_first, q_full_count = q_lists
    kv_count, kv_list, kv_full_first, kv_full_count = kv_lists
    q_work, kv_work = out[16:18]  # the kernels' work lists (schedule.work_list), same launch
    q_order, kv_order, made = heaviest_first(
        q_count, kv_count, out=out[13:15],
        work=((q_full_first, q_full_count, q_work), (kv_full_first, kv_full_count, kv_work)),
    )  # fmt: skip
    if not made or not m * tq * tk:
        q_work = kv_work = None
    bits = out[15]
    key = id(kind)
    ref = weakref.ref(kind, lambda _, key=key: _FULL_FIRST.pop(key, None))
    _FULL_FIRST[key] = (
        ref, (q_full_first, q_full_count, q_work), (kv_full_first, kv_full_count, kv_work)
    )  # fmt: skip
    return TileSchedule(
        block_m, block_n, q_len, kv_len, kind, pairs, jlo, jhi, bits_index, bits,
        q_count, q_list, kv_count, kv_list, q_order, kv_order,
    )  # fmt: skip


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


#: ``_classify_tiles`` holds a [BLOCK_M, next_pow2(K)] tile of a q-tile's intervals in
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


_device_builder.serves = serves  # type: ignore[attr-defined]


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
