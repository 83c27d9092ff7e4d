"""The tile schedule: classify every (q-tile, kv-tile) and list the touched ones.

For tile sizes ``BLOCK_M x BLOCK_N`` a (q-tile, kv-tile) is

* FULL (1): the whole box lies inside ``[0, Nq) x [0, Nk)`` and every pair in it is visible;
* PARTIAL (2): some pair is visible (or it is an edge tile with a visible pair); the kernel masks
  it with the row intervals whose slot index lies in ``[jlo, jhi)``;
* PARTIAL_BITS (3): a PARTIAL tile whose rows hold many intervals inside it; it is masked with a
  packed bitmask instead;
* EMPTY (0): no visible pair; never listed.

Everything is computed from the row intervals in O(N*K + Tq*Tk) work (Tq, Tk: number of q- and
kv-tiles), without looking at individual pairs:

* visible pairs per tile: per q-tile the function ``D(x) = sum_rows |S_r & [0, x)|`` is
  piecewise linear with slope changes at the interval ends, so ``D`` at every kv-tile boundary
  is a cumulative sum of binned events;
* ``[jlo, jhi)``: with ``H[j]`` the largest ``hi`` of slot ``j`` over the q-tile's rows (an
  unused slot counts as +inf) and ``L[j]`` the smallest ``lo``, the slots that can meet kv-tile
  ``[a, b)`` are ``#{j : H[j] <= a} <= j < #{j : L[j] < b}`` (both ``H`` and ``L`` are
  non-decreasing in ``j``, so these are two ``searchsorted`` calls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

EMPTY, FULL, PARTIAL, PARTIAL_BITS = 0, 1, 2, 3
BITS_MIN_SPAN = 9  # a PARTIAL tile whose slot range is wider than this is stored as bits
_BIG = torch.iinfo(torch.int32).max


@dataclass(frozen=True)
class TileSchedule:
    """Tile classes and work lists of one tiling. All tensors int32, contiguous, on the plan's
    device; ``M`` = number of masks (batch x head variants), ``Tq = ceil(Nq / block_m)``,
    ``Tk = ceil(Nk / block_n)``.

    Attributes:
        block_m, block_n: tile sizes in tokens (BLOCK_M query rows x BLOCK_N keys).
        kind: ``[M, Tq, Tk]`` EMPTY 0 / FULL 1 / PARTIAL 2 / PARTIAL_BITS 3.
        pairs: ``[M, Tq, Tk]`` visible (query, key) pairs in each tile.
        jlo, jhi: ``[M, Tq, Tk]`` for a PARTIAL tile, every row's intervals that meet the kv-tile
            have slot indices in ``[jlo, jhi)`` (``plan.row_lo[m, r, j]`` ...).
        bits_index: ``[M, Tq, Tk]`` row of ``bits`` for a PARTIAL_BITS tile, else -1.
        bits: ``[P, block_m, block_n // 32]``: bit ``c % 32`` of word ``c // 32`` of row ``r``
            says key ``kt * block_n + c`` is visible to query ``qt * block_m + r``.
        q_count: ``[M, Tq]`` touched kv-tiles per q-tile; q_list: ``[M, Tq, Tk]`` their indices,
            ascending, padded with -1 (forward and dQ).
        kv_count: ``[M, Tk]``; kv_list: ``[M, Tk, Tq]`` touched q-tiles per kv-tile, ascending
            (dK/dV).
        q_order: ``[M, Tq]`` q-tiles heaviest first (weight = q_count, ties: lower index first);
        kv_order: ``[M, Tk]`` likewise for kv-tiles.

    The dense mask of tile (qt, kt) is rebuilt as::

        for r in range(block_m), c in range(block_n):
            q, k = qt * block_m + r, kt * block_n + c
            if kind == FULL: visible
            elif kind == PARTIAL: any(row_lo[m, q, j] <= k < row_hi[m, q, j] for j in range(jlo, jhi))
            elif kind == PARTIAL_BITS: bits[bits_index, r, c // 32] >> (c % 32) & 1
            else: not visible
    """

    block_m: int
    block_n: int
    q_len: int
    kv_len: int
    kind: torch.Tensor
    pairs: torch.Tensor
    jlo: torch.Tensor
    jhi: torch.Tensor
    bits_index: torch.Tensor
    bits: torch.Tensor
    q_count: torch.Tensor
    q_list: torch.Tensor
    kv_count: torch.Tensor
    kv_list: torch.Tensor
    q_order: torch.Tensor
    kv_order: torch.Tensor

    @property
    def num_q_tiles(self) -> int:
        return self.kind.shape[1]

    @property
    def num_kv_tiles(self) -> int:
        return self.kind.shape[2]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _INTS}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device) -> TileSchedule:
        moved = {k: v.to(device) for k, v in self.tensors().items()}
        return TileSchedule(self.block_m, self.block_n, self.q_len, self.kv_len, **moved)

    def counts(self) -> dict[str, int]:
        """Numbers of FULL, PARTIAL (both encodings) and EMPTY tiles over all masks."""
        kind = self.kind
        return {
            "full": int((kind == FULL).sum()),
            "partial": int(((kind == PARTIAL) | (kind == PARTIAL_BITS)).sum()),
            "partial_bits": int((kind == PARTIAL_BITS).sum()),
            "empty": int((kind == EMPTY).sum()),
        }


_INTS = ("block_m", "block_n", "q_len", "kv_len")


def _pairs_per_tile(lo, hi, tq: int, tk: int, block_m: int, block_n: int) -> torch.Tensor:
    """Visible pairs per (q-tile, kv-tile): ``[M, Tq, Tk]`` int32."""
    m, n, k = lo.shape
    dev = lo.device
    row_tile = (torch.arange(n, device=dev) // block_m).view(1, n, 1)
    mask_base = (torch.arange(m, device=dev) * tq).view(m, 1, 1)
    stride = tk + 1
    flat = []
    vals0 = []
    vals1 = []
    for pos, sign in ((lo, 1), (hi, -1)):
        pos64 = pos.to(torch.int64)
        live = (lo < hi).to(torch.int64) * sign
        bin_ = torch.clamp(pos64 // block_n + 1, max=tk)
        flat.append(((mask_base + row_tile) * stride + bin_).reshape(-1))
        vals0.append(live.reshape(-1))
        vals1.append((live * pos64).reshape(-1))
    idx = torch.cat(flat)
    s0 = torch.zeros(m * tq * stride, dtype=torch.int64, device=dev)
    s1 = torch.zeros_like(s0)
    s0.index_add_(0, idx, torch.cat(vals0))
    s1.index_add_(0, idx, torch.cat(vals1))
    s0 = torch.cumsum(s0.view(m, tq, stride), -1)
    s1 = torch.cumsum(s1.view(m, tq, stride), -1)
    x = (torch.arange(stride, device=dev, dtype=torch.int64) * block_n).view(1, 1, stride)
    d = x * s0 - s1  # D at each kv-tile boundary
    return (d[..., 1:] - d[..., :-1]).to(torch.int32)


def _slot_ranges(lo, hi, count, tq: int, tk: int, block_m: int, block_n: int):
    """``jlo, jhi`` ``[M, Tq, Tk]`` (see module docstring)."""
    m, n, k = lo.shape
    dev = lo.device
    n_pad = tq * block_m
    slot = torch.arange(k, device=dev).view(1, 1, k)
    used = slot < count[..., None]
    big = torch.full_like(lo, _BIG)
    h = torch.where(used, hi, big)
    low = torch.where(used, lo, big)
    if n_pad > n:  # rows past the end constrain nothing
        h = torch.cat([h, torch.full((m, n_pad - n, k), -1, dtype=h.dtype, device=dev)], 1)
        low = torch.cat([low, torch.full((m, n_pad - n, k), _BIG, dtype=h.dtype, device=dev)], 1)
    h_max = h.view(m, tq, block_m, k).amax(2).contiguous()
    l_min = low.view(m, tq, block_m, k).amin(2).contiguous()
    starts = (torch.arange(tk, device=dev, dtype=torch.int32) * block_n).expand(m, tq, tk)
    jlo = torch.searchsorted(h_max, starts.contiguous(), right=True)
    jhi = torch.searchsorted(l_min, (starts + block_n).contiguous(), right=False)
    return jlo.to(torch.int32), torch.maximum(jhi, jlo).to(torch.int32)


def _tile_bits(lo, hi, tiles, jlo, jhi, block_m: int, block_n: int, q_len: int) -> torch.Tensor:
    """Bitmasks ``[P, block_m, block_n // 32]`` for the listed tiles ``(m, qt, kt)``."""
    dev = lo.device
    mi, qt, kt = tiles.unbind(1)
    span = int((jhi - jlo).max())
    rows = qt[:, None] * block_m + torch.arange(block_m, device=dev)[None, :]  # [P, BM]
    row_ok = rows < q_len
    rows_c = rows.clamp(max=q_len - 1)
    j = jlo[:, None] + torch.arange(span, device=dev)[None, :]  # [P, S]
    j_ok = j < jhi[:, None]
    j_c = j.clamp(max=lo.shape[-1] - 1)
    sel = (mi[:, None, None], rows_c[:, :, None], j_c[:, None, :])
    t0 = (kt * block_n)[:, None, None]
    a = (lo[sel] - t0).clamp(0, block_n)
    b = (hi[sel] - t0).clamp(0, block_n)
    live = (row_ok[:, :, None] & j_ok[:, None, :] & (a < b)).to(torch.int32)
    diff = torch.zeros((tiles.shape[0], block_m, block_n + 1), dtype=torch.int32, device=dev)
    diff.scatter_add_(2, a.to(torch.int64), live)
    diff.scatter_add_(2, b.to(torch.int64), -live)
    vis = torch.cumsum(diff[..., :block_n], -1) > 0
    words = vis.view(tiles.shape[0], block_m, block_n // 32, 32).to(torch.int64)
    shifts = torch.arange(32, device=dev, dtype=torch.int64)
    packed = (words << shifts).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def _lists(touched: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per leading row: count, ascending indices of touched entries (-1 padded), heaviest order."""
    count = touched.sum(-1, dtype=torch.int32)
    order = torch.argsort((~touched).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    idx = torch.arange(touched.shape[-1], device=touched.device)
    lists = torch.where(idx < count[..., None], order, torch.full_like(order, -1))
    heavy = torch.argsort(-count, dim=-1, stable=True).to(torch.int32)
    return count, lists.contiguous(), heavy.contiguous()


def build_tiles(
    lo: torch.Tensor,
    hi: torch.Tensor,
    count: torch.Tensor,
    q_len: int,
    kv_len: int,
    block_m: int,
    block_n: int,
    *,
    use_bits: bool = True,
) -> TileSchedule:
    """Build the :class:`TileSchedule` of canonical row intervals ``[M, Nq, K]``.

    ``use_bits``: store PARTIAL tiles whose slot range is wide as bitmasks (needs one host
    synchronisation to size them; builds that must not synchronise pass False). Bitmasks need
    ``block_n % 32 == 0``; other tilings always use intervals.
    """
    tq, tk = math.ceil(q_len / block_m), math.ceil(kv_len / block_n)
    pairs = _pairs_per_tile(lo, hi, tq, tk, block_m, block_n)
    dev = lo.device
    rows = (q_len - torch.arange(tq, device=dev) * block_m).clamp(max=block_m).view(1, tq, 1)
    cols = (kv_len - torch.arange(tk, device=dev) * block_n).clamp(max=block_n).view(1, 1, tk)
    full = (pairs == block_m * block_n) & (rows == block_m) & (cols == block_n)
    kind = torch.where(
        full, FULL, torch.where(pairs > 0, PARTIAL, EMPTY)
    ).to(torch.int32)
    jlo, jhi = _slot_ranges(lo, hi, count, tq, tk, block_m, block_n)
    bits_index = torch.full_like(kind, -1)
    bits = torch.zeros((0, block_m, block_n // 32), dtype=torch.int32, device=dev)
    if use_bits and block_n % 32 == 0 and lo.shape[-1] > BITS_MIN_SPAN:
        wide = (kind == PARTIAL) & (jhi - jlo > BITS_MIN_SPAN)
        tiles = wide.nonzero()
        if tiles.shape[0]:
            kind = torch.where(wide, PARTIAL_BITS, kind).to(torch.int32)
            bits_index[wide] = torch.arange(tiles.shape[0], device=dev, dtype=torch.int32)
            sel = tiles.unbind(1)
            bits = _tile_bits(lo, hi, tiles, jlo[sel], jhi[sel], block_m, block_n, q_len)
    touched = kind > EMPTY
    q_count, q_list, q_order = _lists(touched)
    kv_count, kv_list, kv_order = _lists(touched.transpose(1, 2))
    return TileSchedule(
        block_m, block_n, q_len, kv_len, kind.contiguous(), pairs, jlo, jhi, bits_index,
        bits, q_count, q_list, kv_count, kv_list, q_order, kv_order,
    )
