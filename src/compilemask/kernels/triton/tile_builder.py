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
would not make them either (``use_bits=False``, or at most ``BITS_MIN_SPAN`` slots per row).

The default for plans built on a CUDA device (``api/device_builder.py``; the environment
variable ``COMPILEMASK_TILE_BUILDER=tensor`` turns it off); :func:`enable` / :func:`using`
switch it for every device Triton serves. ``tests/test_tile_builder.py`` checks it against the
tensor builder through Triton's interpreter, ``tests/test_gpu.py`` on a GPU.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from ...compiler import tiles as tiles_mod
from ...compiler.tiles import TileSchedule

_LIST_CHUNK = 128


@triton.jit
def _classify_tiles(
    Lo, Hi, Kind, Pairs, Jlo, Jhi,
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


@triton.jit
def _tile_lists(
    Kind, Count, List, FullFirst, FullCount,
    n_rows, length, stride_m, stride_row, stride_col,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """Lists of one row of the [M, rows, length] view of ``Kind`` given by the strides."""
    r = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    src = Kind + m * stride_m + r.to(tl.int64) * stride_row
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
        tl.store(List + dst + pos, idx, mask=touched > 0)
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
        tl.store(FullFirst + dst + pos, idx, mask=(full + part) > 0)
        n_full_seen += tl.sum(full)
        n_partial += tl.sum(part)
        # padding past the count: -1 in the ascending list, 0 in the FULL-first list
        tail = inside & (idx >= n_touched)
        tl.store(List + dst + idx, tl.full([CHUNK], -1, tl.int32), mask=tail)
        tl.store(FullFirst + dst + idx, tl.zeros([CHUNK], tl.int32), mask=tail)
    tl.store(Count + m * n_rows + r, n_touched)
    tl.store(FullCount + m * n_rows + r, n_full)


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
    stride_row, stride_col = (1, tk) if transposed else (tk, 1)
    dev = kind.device
    count = torch.empty((m, rows), dtype=torch.int32, device=dev)
    full_count = torch.empty((m, rows), dtype=torch.int32, device=dev)
    lists = torch.empty((m, rows, length), dtype=torch.int32, device=dev)
    full_first = torch.empty((m, rows, length), dtype=torch.int32, device=dev)
    if m * rows and length:
        _tile_lists[(rows, m)](
            kind, count, lists, full_first, full_count,
            rows, length, tq * tk, stride_row, stride_col,
            CHUNK=_LIST_CHUNK,
        )  # fmt: skip
    elif m * rows:
        count.zero_()
        full_count.zero_()
    return count, lists, full_first, full_count


def _heaviest_first(count: torch.Tensor) -> torch.Tensor:
    return torch.argsort(-count, dim=-1, stable=True).to(torch.int32)


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
    tq, tk = math.ceil(q_len / block_m), math.ceil(kv_len / block_n)
    dev = lo.device
    shape = (m, tq, tk)
    kind, pairs, jlo, jhi = (torch.empty(shape, dtype=torch.int32, device=dev) for _ in range(4))
    if m * tq * tk:
        _classify_tiles[(tq, m)](
            lo, hi, kind, pairs, jlo, jhi, q_len, kv_len, k, tq, tk,
            BLOCK_M=block_m, BLOCK_N=block_n, K_PAD=max(triton.next_power_of_2(max(k, 1)), 2),
        )  # fmt: skip
    q_count, q_list, _, _ = tile_lists(kind)
    kv_count, kv_list, _, _ = tile_lists(kind, transposed=True)
    bits_index = torch.full_like(kind, -1)
    bits = torch.zeros((0, block_m, -(-block_n // 32)), dtype=torch.int32, device=dev)
    return TileSchedule(
        block_m, block_n, q_len, kv_len, kind, pairs, jlo, jhi, bits_index, bits,
        q_count, q_list, kv_count, kv_list, _heaviest_first(q_count), _heaviest_first(kv_count),
    )  # fmt: skip


def serves(t: torch.Tensor) -> bool:
    """Whether the kernels can run on ``t``'s device (a GPU, or the CPU through Triton's
    interpreter)."""
    return t.device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1"


def _device_builder(lo, hi, count, q_len, kv_len, block_m, block_n):
    """The hook ``compiler.tiles.build_tiles`` calls; None declines (the CPU without Triton's
    interpreter, or shapes the kernels do not take)."""
    if not serves(lo):
        return None
    if block_m & (block_m - 1) or block_m < 16:
        return None
    return build_tiles_triton(lo.contiguous(), hi.contiguous(), q_len, kv_len, block_m, block_n)


_device_builder.serves = serves  # type: ignore[attr-defined]


def enable(on: bool = True) -> None:
    """Build tile schedules with the Triton kernels on every device they serve, the CPU
    through Triton's interpreter included (``on=False``: the tensor builder everywhere).

    Applies where no bitmask tile is needed: GPU plan builds (``compile(..., device="cuda")``)
    and plans with at most ``BITS_MIN_SPAN`` slots per row. CUDA plans use these kernels by
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
