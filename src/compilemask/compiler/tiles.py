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
import sys
from dataclasses import dataclass, fields, replace

import torch

EMPTY, FULL, PARTIAL, PARTIAL_BITS = 0, 1, 2, 3
_BIG_ENDIAN = sys.byteorder == "big"
#: In plans with more than BITS_MIN_SLOTS interval slots per row, a PARTIAL tile whose slot
#: range is wider than BITS_MIN_SPAN is stored as a bitmask: the kernels read a bitmask tile
#: with one load per row and word and a shift and a test per element, an interval tile with two
#: loads per row and slot and four operations per element and slot. Plans with at most
#: BITS_MIN_SLOTS slots per row keep intervals: the kernels load them once per q-tile.
BITS_MIN_SPAN = 2
BITS_MIN_SLOTS = 4
#: the most elements of one intermediate ``[rows, slots, words]`` of ``_tile_bits``
_BITS_ELEMS = 1 << 24

# An optional builder of schedules without bitmask tiles (the Triton kernels of
# ``kernels/triton/tile_builder.py``: registered for CUDA plans by ``api/device_builder.py``,
# for every device Triton serves by ``tile_builder.enable()``): called as
# ``builder(lo, hi, count, q_len, kv_len, block_m, block_n)``; it may decline with None.
_DEVICE_TILE_BUILDER = None


def register_device_tile_builder(builder) -> None:
    """Use ``builder`` for schedules that need no bitmask tile (None: the tensor builder).

    ``builder.serves(t)``, when the builder has it, says on which tensors the kernel schedules
    may also take the builder's FULL-first lists (``kernels/triton/schedule.py``);
    ``builder.tile_bits``, when it has it, computes :func:`_tile_bits` on those tensors
    (:func:`tile_bits`).
    """
    global _DEVICE_TILE_BUILDER
    _DEVICE_TILE_BUILDER = builder


def device_tile_builder():
    """The registered builder, or None (the tensor builder)."""
    return _DEVICE_TILE_BUILDER


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
        bits: ``[P, block_m, ceil(block_n / 32)]``: bit ``c % 32`` of word ``c // 32`` of row ``r``
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
            elif kind == PARTIAL:
                any(row_lo[m, q, j] <= k < row_hi[m, q, j] for j in range(jlo, jhi))
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
    """Visible pairs per (q-tile, kv-tile): ``[M, Tq, Tk]`` int32.

    Per q-tile, ``D(x) = sum over rows and intervals of clamp(x - lo, 0, hi - lo)`` is
    ``x * S0(x) - S1(x)`` with ``S0`` / ``S1`` the sums of ``+1, -1`` / ``+lo, -hi`` over the
    interval ends left of ``x``; binning the ends by kv-tile and taking cumulative sums gives
    ``D`` at every tile boundary. Empty slots (``lo == hi``) cancel out by themselves.
    """
    m, n, k = lo.shape
    dev = lo.device
    stride = tk + 1
    rows = torch.arange(n, device=dev, dtype=torch.int32)
    base = (torch.arange(m, device=dev, dtype=torch.int32) * tq).view(m, 1) + _div(rows, block_m)
    base = (base * stride + 1).view(m, n, 1)
    size = m * tq * stride
    # S1 per q-tile is at most block_m * K * kv_len: int32 when that fits, else int64
    acc = torch.int32 if block_m * k * (tq * block_n) < 2**31 else torch.int64
    s0 = torch.zeros(size, dtype=torch.int32, device=dev)
    s1 = torch.zeros(size, dtype=acc, device=dev)
    ones = torch.ones(1, dtype=torch.int32, device=dev).expand(m * n * k)
    for pos, sign in ((lo, 1), (hi, -1)):
        idx = (torch.clamp(_div(pos, block_n), max=tk - 1) + base).view(-1)
        vals = pos.reshape(-1) if sign > 0 else -pos.reshape(-1)
        s0.index_add_(0, idx, ones, alpha=sign)
        s1.index_add_(0, idx, vals.to(acc))
    s0 = torch.cumsum(s0.view(m, tq, stride), -1, dtype=torch.int64)
    s1 = torch.cumsum(s1.view(m, tq, stride), -1, dtype=torch.int64)
    x = (torch.arange(stride, device=dev, dtype=torch.int64) * block_n).view(1, 1, stride)
    d = x * s0 - s1  # D at each kv-tile boundary
    return (d[..., 1:] - d[..., :-1]).to(torch.int32)


def _div(x: torch.Tensor, d: int) -> torch.Tensor:
    """``x // d`` for non-negative ``x`` (a shift when ``d`` is a power of two)."""
    if d & (d - 1) == 0:
        return x >> (d.bit_length() - 1)
    return x // d


def _slot_ranges(lo, hi, count, tq: int, tk: int, block_m: int, block_n: int, kv_len: int):
    """``jlo, jhi`` ``[M, Tq, Tk]`` (see module docstring). Unused slots hold ``kv_len``, which
    acts as +inf for both bounds since tile starts are ``< kv_len``."""
    m, n, k = lo.shape
    dev = lo.device
    whole = n // block_m
    h_max = [hi[:, : whole * block_m].view(m, whole, block_m, k).amax(2)]
    l_min = [lo[:, : whole * block_m].view(m, whole, block_m, k).amin(2)]
    if whole < tq:  # the last, partial q-tile
        h_max.append(hi[:, whole * block_m :].amax(1, keepdim=True))
        l_min.append(lo[:, whole * block_m :].amin(1, keepdim=True))
    h_max = torch.cat(h_max, 1).contiguous() if len(h_max) > 1 else h_max[0].contiguous()
    l_min = torch.cat(l_min, 1).contiguous() if len(l_min) > 1 else l_min[0].contiguous()
    starts = torch.arange(tk, device=dev, dtype=torch.int32) * block_n
    ends = torch.clamp(starts + block_n, max=kv_len)
    jlo = torch.searchsorted(h_max, starts.expand(m, tq, tk).contiguous(), right=True)
    jhi = torch.searchsorted(l_min, ends.expand(m, tq, tk).contiguous(), right=False)
    return jlo.to(torch.int32), torch.maximum(jhi, jlo).to(torch.int32)


def _tile_bits(lo, hi, tiles, jlo, jhi, block_m: int, block_n: int, q_len: int) -> torch.Tensor:
    """Bitmasks ``[P, block_m, ceil(block_n / 32)]`` for the listed tiles ``(m, qt, kt)``
    (``lo``, ``hi``: canonical intervals, each row sorted and disjoint).

    Per row of a tile only the slots meeting the tile's keys are read: the first with
    ``hi > start`` and the first with ``lo >= end``, by a binary search inside the tile's slot
    range ``[jlo, jhi)`` (a whole row, or a few wide rows, widen that range for every row of
    the tile). Each 32-bit word is the sum of the bit runs of those intervals (disjoint, so
    the sum is their union), or, when rows hold many slots in a tile, read off a dense row of
    ``block_n`` bits; for the rows with a slot in their tile only: ``O(P * block_m * log span
    + rows * min(slots * words, block_n))``; three host reads."""
    dev = lo.device
    k = lo.shape[-1]
    mi, qt, kt = tiles.unbind(1)
    rows = qt[:, None] * block_m + torch.arange(block_m, device=dev)[None, :]  # [P, BM]
    row_ok = rows < q_len
    flat = (mi[:, None] * lo.shape[1] + rows.clamp(max=q_len - 1)) * k  # [P, BM]
    lo_f, hi_f = lo.reshape(-1), hi.reshape(-1)
    t0 = (kt * block_n)[:, None]
    span = int((jhi - jlo).max())

    def first(vals, target, a):  # the first slot j in [a, jhi) with vals[j] >= target
        b = jhi[:, None].expand_as(a)
        for _ in range(max(1, span).bit_length()):
            mid = (a + b) >> 1
            go_left = vals[flat + mid.clamp(max=k - 1)] >= target
            open_ = a < b
            a, b = torch.where(open_ & ~go_left, mid + 1, a), torch.where(open_ & go_left, mid, b)
        return a

    j0 = first(hi_f, t0 + 1, jlo[:, None].expand(-1, block_m))  # hi > start
    j1 = first(lo_f, t0 + block_n, j0)  # lo >= end
    words = -(-block_n // 32)
    out = torch.zeros((tiles.shape[0] * block_m, words), dtype=torch.int32, device=dev)
    s = int((j1 - j0).max()) if j0.numel() else 0
    live = ((j1 > j0) & row_ok).view(-1).nonzero().squeeze(1) if s else None
    if live is None or not live.numel():
        return out.view(tiles.shape[0], block_m, words)
    # only the rows with a slot in their tile (a whole row in a tile of empty rows: one), in
    # chunks of at most _BITS_ELEMS elements of [rows, S, W] (or [rows, block_n + 1])
    j0, j1 = j0.reshape(-1)[live], j1.reshape(-1)[live]
    flat, t0 = flat.reshape(-1)[live], t0.expand(-1, block_m).reshape(-1)[live]
    base = torch.arange(words, device=dev, dtype=torch.int64) * 32
    one = torch.ones((), dtype=torch.int64, device=dev)
    by_runs = 2 * s * words <= block_n  # else a dense row per live row is the less work
    step = max(1, _BITS_ELEMS // (s * words if by_runs else block_n + 1))
    for c in range(0, live.numel(), step):
        c_j0, c_j1, c_t0 = j0[c : c + step], j1[c : c + step], t0[c : c + step, None]
        j = c_j0[:, None] + torch.arange(s, device=dev)  # [L, S]
        at = flat[c : c + step, None] + j.clamp(max=k - 1)
        a = (lo_f[at] - c_t0).clamp(0, block_n)
        b = (hi_f[at] - c_t0).clamp(0, block_n)
        ok = (j < c_j1[:, None]) & (a < b)
        out[live[c : c + step]] = (_runs_to_words if by_runs else _dense_to_words)(
            a, b, ok, base, one, block_n
        )
    return out.view(tiles.shape[0], block_m, words)


def _runs_to_words(a, b, ok, base, one, block_n: int) -> torch.Tensor:
    """int32 ``[L, W]`` words of the disjoint runs ``[a, b)`` where ``ok`` (``[L, S]``): each
    word the sum of the runs' bits in it (their union)."""
    aw = (a[..., None].to(torch.int64) - base).clamp(0, 32)  # [L, S, W]
    bw = (b[..., None].to(torch.int64) - base).clamp(0, 32)
    run = torch.bitwise_left_shift(one, bw) - torch.bitwise_left_shift(one, aw)
    w = (run * ok[..., None]).sum(1)  # below 2**32
    return torch.where(w >= 2**31, w - 2**32, w).to(torch.int32)


def _dense_to_words(a, b, ok, base, one, block_n: int) -> torch.Tensor:
    """:func:`_runs_to_words` through a dense row of ``block_n`` bits per row."""
    live = ok.to(torch.int32)
    diff = torch.zeros((a.shape[0], block_n + 1), dtype=torch.int32, device=a.device)
    diff.scatter_add_(1, a.to(torch.int64), live)
    diff.scatter_add_(1, b.to(torch.int64), -live)
    return pack_bits(torch.cumsum(diff[:, :block_n], -1) > 0)


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
    synchronisation to size them; builds that must not synchronise pass False). Ignored while
    ``torch.compile`` traces (the number of bitmasks is data-dependent): the schedule then
    keeps interval tiles, which the kernels also read; tracing also skips the registered
    device builder (the tensor operations trace).
    """
    tracing = torch.compiler.is_compiling()
    if use_bits and tracing:
        use_bits = False
    # while tracing, the tensor builder (Dynamo does not trace a Triton launch made from a
    # Python helper with a weakref cache)
    device_ok = _DEVICE_TILE_BUILDER is not None and not tracing
    with_bits = use_bits and lo.shape[-1] > BITS_MIN_SLOTS
    if device_ok:
        built = _DEVICE_TILE_BUILDER(lo, hi, count, q_len, kv_len, block_m, block_n)
        if built is not None:
            return _add_bits(built, lo, hi) if with_bits else built
    tq, tk = math.ceil(q_len / block_m), math.ceil(kv_len / block_n)
    pairs = _pairs_per_tile(lo, hi, tq, tk, block_m, block_n)
    dev = lo.device
    rows = (q_len - torch.arange(tq, device=dev) * block_m).clamp(max=block_m).view(1, tq, 1)
    cols = (kv_len - torch.arange(tk, device=dev) * block_n).clamp(max=block_n).view(1, 1, tk)
    full = (pairs == block_m * block_n) & (rows == block_m) & (cols == block_n)
    kind = torch.where(full, FULL, torch.where(pairs > 0, PARTIAL, EMPTY)).to(torch.int32)
    jlo, jhi = _slot_ranges(lo, hi, count, tq, tk, block_m, block_n, kv_len)
    bits_index = torch.full_like(kind, -1)
    bits = torch.zeros((0, block_m, -(-block_n // 32)), dtype=torch.int32, device=dev)
    built = _schedule(block_m, block_n, q_len, kv_len, kind, pairs, jlo, jhi, bits_index, bits)
    return _add_bits(built, lo, hi) if with_bits else built


def _add_bits(s: TileSchedule, lo, hi) -> TileSchedule:
    """``s`` (a schedule without bitmask tiles, its tensors its own) with its wide PARTIAL
    tiles (slot ranges wider than ``BITS_MIN_SPAN``) made PARTIAL_BITS: kinds and bits
    indices rewritten in place (the lists and orders do not tell the two encodings apart),
    the bitmasks by :func:`tile_bits`. One host read (the number of tiles)."""
    wide = (s.kind == PARTIAL) & (s.jhi - s.jlo > BITS_MIN_SPAN)
    tiles = wide.nonzero()
    if not tiles.shape[0]:
        return s
    s.kind.masked_fill_(wide, PARTIAL_BITS)
    s.bits_index[wide] = torch.arange(tiles.shape[0], device=lo.device, dtype=torch.int32)
    sel = tiles.unbind(1)
    bits = tile_bits(lo, hi, tiles, s.jlo[sel], s.jhi[sel], s.block_m, s.block_n, s.q_len)
    return replace(s, bits=bits)


def tile_bits(lo, hi, tiles, jlo, jhi, block_m: int, block_n: int, q_len: int) -> torch.Tensor:
    """:func:`_tile_bits` by the registered device builder's kernel where it serves ``lo``
    (``builder.tile_bits``: one launch, no host read), else by tensor operations."""
    builder = _DEVICE_TILE_BUILDER
    kernel = getattr(builder, "tile_bits", None)
    if kernel is not None and getattr(builder, "serves", None) is not None:
        if builder.serves(lo) and lo.dtype == torch.int32 and not torch.compiler.is_compiling():
            return kernel(lo, hi, tiles, jlo, jhi, block_m, block_n, q_len)
    return _tile_bits(lo, hi, tiles, jlo, jhi, block_m, block_n, q_len)


def _schedule(block_m, block_n, q_len, kv_len, kind, pairs, jlo, jhi, bits_index, bits):
    touched = kind > EMPTY
    q_count, q_list, q_order = _lists(touched)
    kv_count, kv_list, kv_order = _lists(touched.transpose(1, 2))
    return TileSchedule(
        block_m,
        block_n,
        q_len,
        kv_len,
        kind.contiguous(),
        pairs,
        jlo,
        jhi,
        bits_index,
        bits,
        q_count,
        q_list,
        kv_count,
        kv_list,
        q_order,
        kv_order,
    )


def pack_bits(vis: torch.Tensor) -> torch.Tensor:
    """Pack bool ``[..., block_n]`` into int32 words ``[..., ceil(block_n / 32)]`` (bit
    ``c % 32`` of word ``c // 32``; a last partial word is padded with zeros). A byte at a
    time: each 8 keys become one uint8 (one byte of scratch per key), 4 bytes one word,
    little-endian, so the temporaries are the size of ``vis``. A ``vis`` of another dtype is
    read as ``vis != 0``."""
    if vis.dtype != torch.bool:
        vis = vis != 0
    pad = -vis.shape[-1] % 32
    if pad:
        vis = torch.nn.functional.pad(vis, (0, pad))
    keys = vis.contiguous().view(torch.uint8).reshape(*vis.shape[:-1], vis.shape[-1] // 8, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=vis.device)
    packed = (keys * weights).sum(-1, dtype=torch.uint8)  # [..., block_n / 8], < 256
    if _BIG_ENDIAN:  # the four bytes of a word in the host's order
        packed = packed.reshape(*packed.shape[:-1], -1, 4).flip(-1)
    return packed.contiguous().view(torch.int32).reshape(*vis.shape[:-1], vis.shape[-1] // 32)


def unpack_bits(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: int32 ``[..., W]`` -> bool ``[..., 32 * W]``."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words[..., None] >> shifts) & 1).bool().flatten(-2)


def distinct_pages(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(distinct, index)``: the distinct pages of ``pages`` (slices along dim 0) and, per
    page, the index of its copy in ``distinct`` (int64 ``[P]``). Pages are told apart by a
    64-bit hash of their words (one sort of ``P`` keys), then compared in full: if two
    different pages ever share a hash, the pages are sorted whole instead (exact either way).
    Two host reads."""
    count = pages.shape[0]
    if count == 0:
        return pages, torch.zeros(0, dtype=torch.int64, device=pages.device)
    flat = pages.reshape(count, -1).to(torch.int64)
    gen = torch.Generator().manual_seed(0x5EED)
    mult = torch.randint(1, 2**62, (flat.shape[1],), generator=gen, dtype=torch.int64) * 2 + 1
    keys = (flat * mult.to(flat.device)).sum(-1)  # wraps modulo 2**64
    _, index = torch.unique(keys, return_inverse=True)
    order = torch.arange(count, device=pages.device)
    first = torch.full((int(index.max()) + 1,), count, device=pages.device)
    first = first.scatter_reduce(0, index, order, "amin")
    distinct = pages[first]
    if not torch.equal(distinct[index], pages):  # a hash shared by different pages
        distinct, index = torch.unique(pages, dim=0, return_inverse=True)
    return distinct, index


def build_tiles_from_dense(chunks, m: int, q_len: int, kv_len: int, block_m: int, block_n: int):
    """A :class:`TileSchedule` whose PARTIAL tiles are all bitmasks, from dense boolean row
    chunks ``[M, rows, Nk]`` covering the ``q_len`` rows in order (each chunk's rows a
    multiple of ``block_m`` but the last), for plans whose rows hold too many intervals to
    store them. Tiles with the same bits share one page (:func:`distinct_pages`): a mask whose
    rows repeat (a key mask, a block pattern) keeps a page per distinct tile, not per tile.

    Memory: the outputs are allocated once (the pages' store grows by doubling) and the
    chunk's buffers are kept from chunk to chunk, so nothing of a new size is allocated and
    kept per chunk: interleaving such allocations with a chunk's temporaries fragments the
    host allocator's heap (resident memory in gigabytes at 32K keys). While ``torch.compile``
    traces, the sizes are data-dependent and never branched on: the pages are concatenated
    and not made distinct."""
    tq, tk = math.ceil(q_len / block_m), math.ceil(kv_len / block_n)
    words = -(-block_n // 32)
    tracing = torch.compiler.is_compiling()
    kind = pairs = bits_index = store = pad = tiles = None
    pieces = []
    n_bits = row = 0
    for rows in chunks:
        dev = rows.device
        if kind is None:
            kind = torch.zeros((m, tq, tk), dtype=torch.int32, device=dev)
            pairs, bits_index = torch.zeros_like(kind), torch.full_like(kind, -1)
            store = torch.empty((max(tq * tk // 8, 1), block_m, words), dtype=torch.int32,
                                device=dev)  # fmt: skip
        r = rows.shape[1]
        tq_c, q0 = math.ceil(r / block_m), row // block_m
        row += r
        shape = (m, tq_c * block_m, tk * block_n)
        if pad is None or pad.shape != shape:
            pad = torch.empty(shape, dtype=torch.bool, device=dev)
            tiles = torch.empty((m, tq_c, tk, block_m, block_n), dtype=torch.bool, device=dev)
        if r < shape[1] or kv_len < shape[2]:
            pad.zero_()
        pad[:, :r, :kv_len] = rows
        tiles.copy_(pad.view(m, tq_c, block_m, tk, block_n).permute(0, 1, 3, 2, 4))
        cnt = tiles.view(m, tq_c, tk, -1).sum(-1, dtype=torch.int32)
        full = cnt == block_m * block_n
        part = (cnt > 0) & ~full
        kind[:, q0 : q0 + tq_c] = torch.where(full, FULL, torch.where(part, PARTIAL_BITS, EMPTY))
        pairs[:, q0 : q0 + tq_c] = cnt
        at = part.view(-1).nonzero().squeeze(1)
        n_part = at.numel()  # data-dependent: never branched on while tracing
        # every tile of the chunk packed (a temporary of one size), the PARTIAL ones kept
        packed = pack_bits(tiles.view(-1, block_m, block_n))
        if tracing:
            pieces.append(packed[at])
        else:
            if n_bits + n_part > store.shape[0]:  # grow by doubling: few reallocations
                grown = torch.empty((max(2 * store.shape[0], n_bits + n_part), *store.shape[1:]),
                                    dtype=store.dtype, device=dev)  # fmt: skip
                grown[:n_bits] = store[:n_bits]
                store = grown
            torch.index_select(packed, 0, at, out=store[n_bits : n_bits + n_part])
        chunk_index = torch.full((m, tq_c, tk), -1, dtype=torch.int32, device=dev)
        chunk_index.view(-1)[at] = torch.arange(n_part, dtype=torch.int32, device=dev) + n_bits
        bits_index[:, q0 : q0 + tq_c] = chunk_index
        n_bits += n_part
    if kind is None:
        raise ValueError("build_tiles_from_dense: no row chunks")
    if tracing:  # a page per PARTIAL tile: finding the distinct ones reads the host
        bits = torch.cat(pieces)
    else:
        bits, page = distinct_pages(store[:n_bits])
        if page.numel():
            bits_index = torch.where(bits_index >= 0, page[bits_index.long().clamp(min=0)], -1)
    bits_index = bits_index.to(torch.int32)
    zero = torch.zeros_like(kind)
    return _schedule(
        block_m, block_n, q_len, kv_len, kind, pairs, zero, zero.clone(), bits_index,
        bits.contiguous(),
    )  # fmt: skip


def build_tiles_from_key_rows(keys: torch.Tensor, q_len: int, kv_len: int, block_m: int,
                              block_n: int) -> TileSchedule:  # fmt: skip
    """:func:`build_tiles_from_dense` of masks whose rows are all alike: mask ``m`` shows
    every query the keys ``keys[m]`` (bool ``[M, Nk]``; a key-only mask_mod). A q-tile's
    tiles are then those of one tile of ``block_m`` such rows (the last q-tile's of its
    remaining rows), built once and repeated along the q axis, so the work is O(M Nk), not
    O(M Nq Nk), and every q-tile shares the pages of its PARTIAL tiles."""
    m = keys.shape[0]
    whole, rest = divmod(q_len, block_m)
    parts = [
        (
            build_tiles_from_dense(
                [keys[:, None].expand(m, r, kv_len)], m, r, kv_len, block_m, block_n
            ),
            n,
        )  # fmt: skip
        for r, n in ((block_m, whole), (rest, 1))
        if r and n
    ]
    pages = 0
    kind, pairs, index, bits = [], [], [], []
    for one, n in parts:
        kind.append(one.kind.expand(m, n, -1))
        pairs.append(one.pairs.expand(m, n, -1))
        index.append(torch.where(one.bits_index >= 0, one.bits_index + pages, -1).expand(m, n, -1))
        bits.append(one.bits)
        pages += one.bits.shape[0]
    kind, pairs = torch.cat(kind, 1).contiguous(), torch.cat(pairs, 1).contiguous()
    index = torch.cat(index, 1).to(torch.int32).contiguous()
    zero = torch.zeros_like(kind)
    return _schedule(
        block_m, block_n, q_len, kv_len, kind, pairs, zero, zero.clone(), index,
        torch.cat(bits).contiguous(),
    )  # fmt: skip


def dense_from_tiles(s: TileSchedule, start: int, end: int) -> torch.Tensor:
    """Boolean rows ``[M, end - start, Nk]`` rebuilt from a schedule without PARTIAL (interval)
    tiles: FULL tiles and bitmask tiles."""
    t0, t1 = start // s.block_m, math.ceil(end / s.block_m)
    kind = s.kind[:, t0:t1]
    m, tq, tk = kind.shape
    tiles = torch.zeros((m, tq, tk, s.block_m, s.block_n), dtype=torch.bool, device=kind.device)
    tiles[kind == FULL] = True
    sel = kind == PARTIAL_BITS
    tiles[sel] = unpack_bits(s.bits[s.bits_index[:, t0:t1][sel].long()])[..., : s.block_n]
    dense = tiles.permute(0, 1, 3, 2, 4).reshape(m, tq * s.block_m, tk * s.block_n)
    off = start - t0 * s.block_m
    return dense[:, off : off + end - start, : s.kv_len]
