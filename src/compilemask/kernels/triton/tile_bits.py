"""Bitmask tiles in one Triton launch: ``compiler.tiles._tile_bits`` without its tensor
operations.

On a GPU the tensor version is launch-bound: two binary searches of one step per slot-index
bit (about thirteen operations a step) and the words in chunks, about 250 launches for a plan
with 65 intervals per row, each of them a few microseconds of host time. Here one program per
listed tile ``(m, qt, kt)`` holds its ``block_m`` rows: per row, a binary search of the tile's
slot range ``[jlo, jhi)`` for the first interval ending after the tile's first key and the first
starting at or after its end, then a scan of the intervals between them that adds each one's
bit runs to the row's words (disjoint intervals: the sum is their union). Equal to
``_tile_bits`` bit for bit (``tests/test_tile_bits.py``: through Triton's interpreter on the
CPU, compiled on a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .build_host import launch


@triton.jit
def _first_at_least(vals, base, a, b, target, k, steps):
    """Per row, the first slot ``j`` in ``[a, b)`` with ``vals[base + j] >= target`` (``b``
    when none): ``steps`` halvings, enough for ranges up to ``2**steps - 1`` slots."""
    for _ in range(steps):
        mid = (a + b) >> 1
        go_left = tl.load(vals + base + tl.minimum(tl.maximum(mid, 0), k - 1)) >= target
        open_ = a < b
        a, b = tl.where(open_ & ~go_left, mid + 1, a), tl.where(open_ & go_left, mid, b)
    return a


@triton.jit
def _tile_bits_kernel(
    lo, hi, tiles, jlo, jhi, out, n_rows, k, q_len, steps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
    M_PAD: tl.constexpr, W_PAD: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0).to(tl.int64)
    mi = tl.load(tiles + 3 * p)
    qt = tl.load(tiles + 3 * p + 1)
    kt = tl.load(tiles + 3 * p + 2)
    r = tl.arange(0, M_PAD)
    rows = qt * BLOCK_M + r
    row_ok = (r < BLOCK_M) & (rows < q_len)
    base = (mi * n_rows + tl.minimum(rows, q_len - 1)) * k  # int64 [M_PAD]
    t0 = (kt * BLOCK_N).to(tl.int32)
    a = tl.zeros([M_PAD], tl.int32) + tl.load(jlo + p)
    b = tl.zeros([M_PAD], tl.int32) + tl.load(jhi + p)
    j0 = _first_at_least(hi, base, a, b, t0 + 1, k, steps)  # hi > tile start
    j1 = _first_at_least(lo, base, j0, b, t0 + BLOCK_N, k, steps)  # lo >= tile end
    span = tl.max(tl.where(row_ok, j1 - j0, 0), 0)
    w32 = (tl.arange(0, W_PAD) * 32)[None, :]
    one = tl.full([M_PAD, W_PAD], 1, tl.int64)
    acc = tl.zeros([M_PAD, W_PAD], tl.int64)
    for s in range(span):
        j = j0 + s
        live = row_ok & (j < j1)
        at = base + tl.minimum(tl.maximum(j, 0), k - 1)  # in the row whatever the ranges
        x0 = tl.minimum(tl.maximum(tl.load(lo + at, mask=live, other=0) - t0, 0), BLOCK_N)
        x1 = tl.minimum(tl.maximum(tl.load(hi + at, mask=live, other=0) - t0, 0), BLOCK_N)
        live = live & (x0 < x1)
        aw = tl.minimum(tl.maximum(x0[:, None] - w32, 0), 32).to(tl.int64)
        bw = tl.minimum(tl.maximum(x1[:, None] - w32, 0), 32).to(tl.int64)
        acc += tl.where(live[:, None], (one << bw) - (one << aw), 0)
    acc = tl.where(acc >= 2147483648, acc - 4294967296, acc).to(tl.int32)
    w = tl.arange(0, W_PAD)[None, :]
    dst = out + p * (BLOCK_M * WORDS) + r[:, None] * WORDS + w
    tl.store(dst, acc, mask=(r[:, None] < BLOCK_M) & (w < WORDS))


def tile_bits_triton(
    lo: torch.Tensor,
    hi: torch.Tensor,
    tiles: torch.Tensor,
    jlo: torch.Tensor,
    jhi: torch.Tensor,
    block_m: int,
    block_n: int,
    q_len: int,
) -> torch.Tensor:
    """``compiler.tiles._tile_bits`` in one launch: int32 ``[P, block_m, ceil(block_n / 32)]``
    bitmasks of the listed tiles ``tiles`` (int ``[P, 3]``: mask, q-tile, kv-tile) of the
    canonical row intervals ``lo, hi`` (int32 ``[M, Nq, K]``), ``jlo, jhi`` (``[P]``) each
    tile's slot range. No host synchronisation."""
    count = tiles.shape[0]
    words = -(-block_n // 32)
    out = torch.empty((count, block_m, words), dtype=torch.int32, device=lo.device)
    if count == 0:
        return out
    _, n_rows, k = lo.shape
    values = (
        lo.contiguous(), hi.contiguous(), tiles.to(torch.int64).contiguous(),
        jlo.to(torch.int32).contiguous(), jhi.to(torch.int32).contiguous(), out,
        n_rows, k, q_len, max(k, 1).bit_length(),
    )  # fmt: skip
    consts = (
        ("BLOCK_M", block_m), ("BLOCK_N", block_n), ("WORDS", words),
        ("M_PAD", triton.next_power_of_2(block_m)), ("W_PAD", triton.next_power_of_2(words)),
    )  # fmt: skip
    launch(_tile_bits_kernel, (count,), lo.device, values, consts)
    return out
