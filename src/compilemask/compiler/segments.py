"""The compact descriptor: row intervals as piecewise-affine *segments*, tile lists as *runs*.

A plan's row intervals ``[M, Nq, K]`` (``compiler/intervals.py``) are, for the rules of the
catalogue, affine in the query row over long spans: causal is ``[0, q + 1)`` on every row, a
window ``[q - w + 1, q + 1)`` past its first ``w`` rows, a document ``[start, q + 1)`` inside
each document. A **segment** is a run of query rows ``[r0, r1)`` of one mask index with a
constant number of intervals, each ``[a*q + b, c*q + d)`` with small integer slopes ``a, c``
(int8). Expanding the segments gives the row intervals back exactly (:func:`expand_rows`).

Segments are found in the row intervals themselves (:func:`segments_from_rows`), vectorised in
O(M * Nq * K) work with no loop over rows: row ``q`` starts a new segment when its interval
count differs from row ``q - 1``'s, when a bound jumps by more than an int8 slope, or when
``q - 1``, ``q`` are not on the line of the segment's first two rows. That greedy rule reads
``start[q] = hard[q] | (bend[q] & ~start[q - 1])``; within a chain of consecutive candidate
rows the starts alternate, so the chain's parity gives every start at once.

A **tile run** is a run ``[t0, t1)`` of touched tiles of one kind (FULL or PARTIAL; PARTIAL
covers the bitmask tiles, whose encoding the row intervals decide) along a q-tile's kv-tiles
(forward view) or a kv-tile's q-tiles (backward view): causal needs one FULL run and one
PARTIAL run per tile. Where runs do not pay, the view keeps the touched tiles as a compressed
row (one int32 ``index * 4 + kind`` each). :func:`expand_kind` and :func:`expand_lists` give
back the schedule's kinds and its lists (``q_count, q_list, q_order`` / ``kv_*``) exactly.

:func:`compact_plan` picks, per plan, the smaller of segments and rows (plans of
``from_dense``, random bitmasks, or rows with many tiny runs keep their rows);
:func:`compact_from_mask` builds the compact form from the language without building the
``[M, Tq, Tk]`` tables (q-tiles a chunk at a time), for lengths where those do not fit.
Nothing here is read by the kernels yet: they read the plan's rows and schedule as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import CompileMaskError
from .tiles import EMPTY, FULL, PARTIAL, _lists, _pairs_per_tile

I32 = torch.int32
#: largest |slope| a segment stores (int8)
MAX_SLOPE = 127
#: the slope byte of a constant bound stored as an absolute key position
ABSOLUTE = -128
#: tiles of ``[M, chunk, Tk]`` kind tables made at once by :func:`tile_runs_from_rows`
CHUNK_TILES = 1 << 22


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ---------------------------------------------------------------------------- segments
@dataclass(frozen=True)
class Segments:
    """Row intervals as affine segments. ``S`` segments, ``U`` templates, ``T`` intervals over all
    templates.

    Attributes:
        q_len, kv_len: ``Nq``, ``Nk`` (tokens).
        mask_ptr: int32 ``[M + 1]``: the segments of mask index ``m`` are
            ``mask_ptr[m] .. mask_ptr[m + 1] - 1``, by ascending first row.
        r0: int32 ``[S]``: first row of each segment; a segment ends where the next one of its
            mask starts (the last at ``Nq``). The first segment of a mask starts at row 0.
        template: int32 ``[S]``: the template of each segment (segments that are equal up to a
            shift along the diagonal, like the documents of a document mask or the inner rows
            of a disc on a grid, share one).
        slot_ptr: int32 ``[U + 1]``: the intervals of template ``u`` are
            ``slot_ptr[u] .. slot_ptr[u + 1] - 1`` (sorted, disjoint, not touching on every row).
        slope: int8 ``[T, 2]``: ``(a, c)``; base: int32 ``[T, 2]``: ``(b, d)``; row ``q`` of a
            segment starting at ``r0`` sees ``[a*(q - r0) + b + r0, c*(q - r0) + d + r0)``
            (clipped to ``[0, Nk]``); a slope of :data:`ABSOLUTE` (-128) marks a constant
            bound stored as the key position itself.
    """

    q_len: int
    kv_len: int
    mask_ptr: torch.Tensor
    r0: torch.Tensor
    template: torch.Tensor
    slot_ptr: torch.Tensor
    slope: torch.Tensor
    base: torch.Tensor

    @property
    def num_masks(self) -> int:
        return self.mask_ptr.shape[0] - 1

    @property
    def num_segments(self) -> int:
        return self.r0.shape[0]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.mask_ptr, self.r0, self.template, self.slot_ptr, self.slope, self.base)


def segments_from_rows(
    lo: torch.Tensor, hi: torch.Tensor, count: torch.Tensor, kv_len: int
) -> Segments:
    """The maximal affine segments (greedy, see the module docstring) of canonical row
    intervals ``lo, hi`` int32 ``[M, Nq, K]``, ``count`` int32 ``[M, Nq]`` whose bounds lie in
    ``[0, kv_len]``. O(M * Nq * K) tensor work."""
    if lo.dim() != 3 or hi.shape != lo.shape or count.shape != lo.shape[:2]:
        raise CompileMaskError(
            f"segments_from_rows needs lo, hi [M, Nq, K] and count [M, Nq], got "
            f"{tuple(lo.shape)}, {tuple(hi.shape)}, {tuple(count.shape)}"
        )
    m, n, k = lo.shape
    dev = lo.device
    lo, hi = lo.to(I32), hi.to(I32)
    hard = torch.ones((m, n), dtype=torch.bool, device=dev)
    bend = torch.zeros((m, n), dtype=torch.bool, device=dev)
    if n > 1:
        dlo, dhi = lo[:, 1:] - lo[:, :-1], hi[:, 1:] - hi[:, :-1]  # d[q] at rows 1 .. n-1
        big = ((dlo.abs() > MAX_SLOPE) | (dhi.abs() > MAX_SLOPE)).any(-1)
        hard[:, 1:] = (count[:, 1:] != count[:, :-1]) | big
        if n > 2:
            bend[:, 2:] = ((dlo[:, 1:] != dlo[:, :-1]) | (dhi[:, 1:] != dhi[:, :-1])).any(-1)
    cand = hard | bend
    prev = torch.zeros_like(cand)
    prev[:, 1:] = cand[:, :-1]
    reset = hard | (cand & ~prev)
    idx = torch.arange(n, device=dev).expand(m, n)
    last = torch.cummax(torch.where(reset, idx, -1), dim=1).values
    start = cand & ((idx - last) % 2 == 0)
    ms, rs = start.nonzero(as_tuple=True)  # row-major: by mask, then row
    seg_count = count[ms, rs].to(torch.int64)
    nxt = torch.clamp(rs + 1, max=max(n - 1, 0))
    # a one-row segment (next row starts another, or the last row) stores slope 0
    single = (rs + 1 >= n) | start[ms, nxt]
    a = torch.where(single[:, None], 0, lo[ms, nxt] - lo[ms, rs])
    c = torch.where(single[:, None], 0, hi[ms, nxt] - hi[ms, rs])
    used = torch.arange(k, device=dev) < seg_count[:, None]
    a, b = _anchor(a, lo[ms, rs], rs, used)
    c, d = _anchor(c, hi[ms, rs], rs, used)
    zero = torch.zeros((), dtype=I32, device=dev)
    table = torch.cat(
        [seg_count[:, None].to(I32)] + [torch.where(used, x.to(I32), zero) for x in (a, c, b, d)],
        -1,
    )
    # segments equal up to a shift along the diagonal share one template
    if table.shape[0]:
        uniq, tmpl = torch.unique(table, dim=0, return_inverse=True)
    else:
        uniq, tmpl = table, torch.zeros(0, dtype=torch.int64, device=dev)
    t_count = uniq[:, 0].to(torch.int64)
    t_used = torch.arange(k, device=dev) < t_count[:, None]
    ua, uc, ub, ud = uniq[:, 1:].view(-1, 4, k).unbind(1)
    slope = torch.stack((ua[t_used], uc[t_used]), -1).to(torch.int8)
    base = torch.stack((ub[t_used], ud[t_used]), -1).to(I32)
    mask_ptr = torch.zeros(m + 1, dtype=torch.int64, device=dev)
    mask_ptr[1:] = torch.cumsum(torch.bincount(ms, minlength=m), 0)
    slot_ptr = torch.zeros(uniq.shape[0] + 1, dtype=torch.int64, device=dev)
    slot_ptr[1:] = torch.cumsum(t_count, 0)
    return Segments(
        n,
        kv_len,
        mask_ptr.to(I32),
        rs.to(I32),
        tmpl.to(I32),
        slot_ptr.to(I32),
        slope.contiguous(),
        base.contiguous(),
    )


def _anchor(slope, value, r0, used):
    """``(slope, base)`` of one bound of every segment slot: relative to the segment's first
    row (``base = value - r0``: documents, windows and grid rows repeat along the diagonal),
    or, for a constant bound whose absolute value is shared by more segments than its relative
    one (a text prefix ``[0, text)`` on every row), absolute (slope :data:`ABSOLUTE`)."""
    r = r0[:, None].to(torch.int64)
    rel = value.to(torch.int64) - r
    flat = value.to(torch.int64)
    const = used & (slope == 0)
    j = torch.arange(slope.shape[1], device=slope.device).expand_as(slope)
    keys = torch.cat(((j << 34) + rel + 2**32, (1 << 40) + (j << 34) + flat + 2**32))[
        torch.cat((const, const))
    ]
    base = rel.to(I32)
    if keys.numel():
        _, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
        n = int(const.sum())
        freq = counts[inverse]
        absolute = torch.zeros_like(const)
        absolute[const] = freq[n:] > freq[:n]
        slope = torch.where(absolute, ABSOLUTE, slope)
        base = torch.where(absolute, value.to(I32), base)
    return slope, base


def expand_rows(seg: Segments, start: int = 0, end: int | None = None, k: int | None = None):
    """Canonical ``(lo, hi, count)`` of rows ``[start, end)``: int32 ``[M, rows, K]`` and
    ``[M, rows]``, unused slots ``lo == hi == Nk``. ``k``: the slot count (default: the
    largest count of those rows, at least 1). O(M * rows * K) work."""
    end = seg.q_len if end is None else end
    m, dev = seg.num_masks, seg.r0.device
    rows = torch.arange(start, end, device=dev, dtype=I32)
    # segment of every (mask, row): the last segment of the mask starting at or before it
    seg_keys = _segment_mask(seg) * (seg.q_len + 1) + seg.r0
    sid = torch.searchsorted(seg_keys, _row_keys(seg, rows), right=True) - 1
    sid = sid.view(m, end - start)
    u = seg.template[sid].to(torch.int64)
    first = seg.slot_ptr[u].to(torch.int64)
    count = (seg.slot_ptr[u + 1].to(torch.int64) - first).to(I32)
    if k is None:
        k = max(1, int(count.max())) if count.numel() else 1
    j = torch.arange(k, device=dev)
    used = j < count[..., None]
    pad = torch.full((), seg.kv_len, dtype=I32, device=dev)
    if seg.slope.shape[0] == 0:
        nk = pad.expand(used.shape).clone()
        return nk, nk.clone(), count
    t = torch.where(used, first[..., None] + j, 0)
    r0 = seg.r0[sid][..., None]
    q = rows.view(1, -1, 1) - r0
    slope, base = seg.slope[t].to(I32), seg.base[t]
    rel = slope != ABSOLUTE
    bound = torch.where(rel, slope * q[..., None] + base + r0[..., None], base)
    lo, hi = bound.clamp(0, seg.kv_len).unbind(-1)
    return torch.where(used, lo, pad), torch.where(used, hi, pad), count


def _segment_mask(seg: Segments) -> torch.Tensor:
    """int64 ``[S]``: the mask index of every segment."""
    sizes = (seg.mask_ptr[1:] - seg.mask_ptr[:-1]).to(torch.int64)
    return torch.repeat_interleave(torch.arange(seg.num_masks, device=seg.r0.device), sizes)


def _row_keys(seg: Segments, rows: torch.Tensor) -> torch.Tensor:
    m = torch.arange(seg.num_masks, device=rows.device, dtype=torch.int64)
    return (m[:, None] * (seg.q_len + 1) + rows[None, :]).reshape(-1)


# ---------------------------------------------------------------------------- tile runs
@dataclass(frozen=True)
class TileRuns:
    """Touched tiles of one view (``owner`` tiles x ``other`` tiles per mask) as runs.

    Attributes:
        owners, others: tiles along the owning axis (q-tiles for the forward view, kv-tiles for
            the backward view) and the other axis.
        encoding: ``"runs"`` (entries ``(t0 * 4 + kind, t1)``, the tiles ``[t0, t1)`` of one
            kind) or ``"tiles"`` (entries ``t * 4 + kind``, one per touched tile).
        ptr: int32 ``[M * owners + 1]``: the entries of owner ``(m, t)`` are
            ``ptr[m * owners + t] .. ptr[m * owners + t + 1] - 1``, ascending.
        entries: int32 ``[E, 2]`` (runs) or ``[E]`` (tiles). ``kind``: FULL 1 or PARTIAL 2.
    """

    owners: int
    others: int
    encoding: str
    ptr: torch.Tensor
    entries: torch.Tensor

    @property
    def nbytes(self) -> int:
        return _nbytes(self.ptr, self.entries)


def _runs_from_events(starts, ends, kinds, m: int, owners: int, others: int) -> TileRuns:
    """Runs from start events ``(m, owner, t0)`` with ``kinds`` and end events
    ``(m, owner, t1)``, both int64 ``[R, 3]`` in any order; the cheaper encoding."""
    dev = kinds.device

    def order(ev):
        return torch.argsort((ev[:, 0] * owners + ev[:, 1]) * (others + 1) + ev[:, 2])

    so, eo = order(starts), order(ends)
    starts, kinds, ends = starts[so], kinds[so], ends[eo]
    owner = starts[:, 0] * owners + starts[:, 1]
    t0, t1 = starts[:, 2], ends[:, 2]
    n_tiles = int((t1 - t0).sum())
    if 2 * starts.shape[0] <= n_tiles:
        entries = torch.stack((t0 * 4 + kinds, t1), -1).to(I32)
        sizes, enc = torch.bincount(owner, minlength=m * owners), "runs"
    else:
        length = t1 - t0
        own = torch.repeat_interleave(owner, length)
        first = torch.repeat_interleave(torch.cumsum(length, 0) - length, length)
        tile = torch.repeat_interleave(t0, length) + torch.arange(n_tiles, device=dev) - first
        entries = (tile * 4 + torch.repeat_interleave(kinds, length)).to(I32)
        sizes, enc = torch.bincount(own, minlength=m * owners), "tiles"
    ptr = torch.zeros(m * owners + 1, dtype=torch.int64, device=dev)
    ptr[1:] = torch.cumsum(sizes, 0)
    return TileRuns(owners, others, enc, ptr.to(I32), entries.contiguous())


def _edges(kind: torch.Tensor, prev: torch.Tensor | None, dim: int, close: bool):
    """Start and end events of runs of equal non-zero kind along ``dim`` (1 or 2) of ``kind``
    ``[M, A, B]``, continuing ``prev`` (the slice before it along ``dim``, or None) and, with
    ``close``, ending the runs still open at the end of the axis. Returns ``(starts [R, 3],
    start kinds [R], ends [E, 3])`` as int64 indices into ``kind`` (an end is exclusive)."""
    zero = torch.zeros_like(kind.narrow(dim, 0, 1))
    parts = [zero if prev is None else prev, kind] + ([zero] if close else [])
    ext = torch.cat(parts, dim)
    n = ext.shape[dim]
    now, before = ext.narrow(dim, 1, n - 1), ext.narrow(dim, 0, n - 1)
    change = now != before
    s = (change & (now > EMPTY)).nonzero()
    e = (change & (before > EMPTY)).nonzero()
    return s, now[tuple(s.unbind(1))].to(torch.int64), e


def tile_kinds(lo, hi, q_len: int, kv_len: int, block_m: int, block_n: int, q0: int = 0):
    """Kinds EMPTY / FULL / PARTIAL ``[M, tiles, Tk]`` of the q-tiles covering rows
    ``[q0, q0 + rows)`` (``q0`` a multiple of ``block_m``) from their intervals ``lo, hi``
    ``[M, rows, K]``; the rule of ``compiler.tiles.build_tiles`` (PARTIAL_BITS is PARTIAL)."""
    m, rows, _ = lo.shape
    tq, tk = math.ceil(rows / block_m), math.ceil(kv_len / block_n)
    pairs = _pairs_per_tile(lo, hi, tq, tk, block_m, block_n)
    dev = lo.device
    height = (q_len - q0 - torch.arange(tq, device=dev) * block_m).clamp(max=block_m)
    width = (kv_len - torch.arange(tk, device=dev) * block_n).clamp(max=block_n)
    full = (pairs == block_m * block_n) & (height.view(1, tq, 1) == block_m)
    full &= width.view(1, 1, tk) == block_n
    return torch.where(full, FULL, torch.where(pairs > 0, PARTIAL, EMPTY)).to(I32)


def runs_from_kind(kind: torch.Tensor) -> tuple[TileRuns, TileRuns]:
    """The forward (per q-tile) and backward (per kv-tile) views of kinds ``[M, Tq, Tk]``
    (PARTIAL_BITS counts as PARTIAL)."""
    kind = kind.clamp(max=PARTIAL)
    m, tq, tk = kind.shape
    return _views([kind], m, tq, tk)


def _views(chunks, m: int, tq: int, tk: int) -> tuple[TileRuns, TileRuns]:
    """Both views from an iterable of kind chunks ``[M, c, Tk]`` (consecutive q-tiles)."""
    fs, fk, fe, bs, bk, be = [], [], [], [], [], []
    prev, q0 = None, 0
    for kind in chunks:
        last = q0 + kind.shape[1] == tq
        s, k, e = _edges(kind, None, 2, True)  # along kv-tiles, within each q-tile
        fs.append(_shift(s, q0)), fk.append(k), fe.append(_shift(e, q0))
        s, k, e = _edges(kind, prev, 1, last)  # along q-tiles, across chunks
        bs.append(_shift(s, q0)), bk.append(k), be.append(_shift(e, q0))
        prev, q0 = kind[:, -1:], q0 + kind.shape[1]

    def cat(xs):
        xs = [x for x in xs if x.numel()]
        return torch.cat(xs, 0) if xs else torch.zeros((0, 3), dtype=torch.int64)

    fwd = _runs_from_events(cat(fs), cat(fe), cat(fk).reshape(-1), m, tq, tk)
    swap = [0, 2, 1]  # backward view: owner = kv-tile, position = q-tile
    bwd = _runs_from_events(cat(bs)[:, swap], cat(be)[:, swap], cat(bk).reshape(-1), m, tk, tq)
    return fwd, bwd


def _shift(ev: torch.Tensor, by: int) -> torch.Tensor:
    """Events with their q-tile index (column 1) moved by ``by``."""
    if by and ev.numel():
        ev = ev.clone()
        ev[:, 1] += by
    return ev


def expand_kind(runs: TileRuns, num_masks: int) -> torch.Tensor:
    """int32 ``[M, owners, others]``: FULL 1 / PARTIAL 2 / EMPTY 0 of every tile of the view
    (the forward view gives ``schedule.kind`` with PARTIAL_BITS as PARTIAL; the backward view
    its transpose)."""
    dev = runs.ptr.device
    size = num_masks * runs.owners
    sizes = (runs.ptr[1:] - runs.ptr[:-1]).to(torch.int64)
    owner = torch.repeat_interleave(torch.arange(size, device=dev), sizes)
    if runs.encoding == "runs":
        t0, kinds, t1 = runs.entries[:, 0] // 4, runs.entries[:, 0] % 4, runs.entries[:, 1]
        length = (t1 - t0).to(torch.int64)
        owner = torch.repeat_interleave(owner, length)
        first = torch.repeat_interleave(torch.cumsum(length, 0) - length, length)
        tile = torch.repeat_interleave(t0.to(torch.int64), length)
        tile = tile + torch.arange(int(length.sum()), device=dev) - first
        kinds = torch.repeat_interleave(kinds, length)
    else:
        tile, kinds = (runs.entries // 4).to(torch.int64), runs.entries % 4
    out = torch.zeros(size * runs.others, dtype=I32, device=dev)
    out[owner * runs.others + tile] = kinds.to(I32)
    return out.view(num_masks, runs.owners, runs.others)


def expand_lists(runs: TileRuns, num_masks: int):
    """``(count, list, order)`` of the view, exactly the schedule's ``q_count, q_list,
    q_order`` (forward view) or ``kv_count, kv_list, kv_order`` (backward view)."""
    return _lists(expand_kind(runs, num_masks) > EMPTY)


# ---------------------------------------------------------------------------- the descriptor
@dataclass(frozen=True)
class CompactPlan:
    """The compact descriptor of a plan at one tiling.

    Attributes:
        q_len, kv_len, num_masks, block_m, block_n: the plan's sizes and tiling.
        rows: ``"segments"`` (:attr:`segments` holds the intervals), ``"rows"`` (the plan's
            row intervals are smaller: they are kept) or ``"bits"`` (a bitmask plan: its rows
            and bitmask tiles are kept).
        segments: the :class:`Segments`, or None when the rows are kept.
        forward, backward: :class:`TileRuns` per q-tile and per kv-tile.
        row_bytes: bytes of the intervals part (the segments, or the kept rows and bitmasks).
    """

    q_len: int
    kv_len: int
    num_masks: int
    block_m: int
    block_n: int
    rows: str
    segments: Segments | None
    forward: TileRuns
    backward: TileRuns
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return self.row_bytes + self.forward.nbytes + self.backward.nbytes

    def parts(self) -> dict:
        """Bytes by part, and the encodings chosen."""
        return {
            "rows": self.rows,
            "segments": self.segments.num_segments if self.segments is not None else None,
            "row_bytes": self.row_bytes,
            "forward": self.forward.encoding,
            "forward_bytes": self.forward.nbytes,
            "backward": self.backward.encoding,
            "backward_bytes": self.backward.nbytes,
            "bytes": self.nbytes,
        }


def rows_nbytes(num_masks: int, q_len: int, slots: int) -> int:
    """Bytes of per-row intervals: int32 ``row_lo``, ``row_hi`` ``[M, Nq, K]``, ``row_count``."""
    return 4 * num_masks * q_len * (2 * slots + 1)


def compact_plan(plan) -> CompactPlan:
    """The compact form of ``plan`` at its default tiling: segments when they are smaller than
    the rows (else the rows), and both tile views as runs or compressed rows. Exact:
    ``expand_rows(c.segments, k=plan.max_intervals)`` is ``(plan.row_lo, plan.row_hi,
    plan.row_count)`` and :func:`expand_kind` / :func:`expand_lists` give the schedule's kinds
    and lists. Also ``plan.compact()`` (cached)."""
    s = plan.schedule
    m = plan.num_masks
    fwd, bwd = runs_from_kind(s.kind)
    if plan.encoding == "bits":
        row_bytes = _nbytes(plan.row_lo, plan.row_hi, plan.row_count, plan.row_runs, s.bits)
        row_bytes += _nbytes(s.bits_index)
        kept, seg = "bits", None
    else:
        seg = segments_from_rows(plan.row_lo, plan.row_hi, plan.row_count, plan.kv_len)
        row_bytes = _nbytes(plan.row_lo, plan.row_hi, plan.row_count)
        kept = "rows"
        if seg.nbytes < row_bytes:
            kept, row_bytes = "segments", seg.nbytes
        else:
            seg = None
    return CompactPlan(
        plan.q_len, plan.kv_len, m, s.block_m, s.block_n, kept, seg, fwd, bwd, row_bytes
    )


def tile_runs_from_rows(rows_fn, m: int, q_len: int, kv_len: int, block_m: int, block_n: int,
                        *, chunk_tiles: int = CHUNK_TILES):  # fmt: skip
    """Both tile views from row intervals read a chunk of q-tiles at a time: ``rows_fn(r0,
    r1)`` gives ``(lo, hi)`` ``[M, r1 - r0, K]``. Memory O(chunk_tiles + M * rows * K), never
    ``[M, Tq, Tk]``."""
    tq, tk = math.ceil(q_len / block_m), math.ceil(kv_len / block_n)
    step = max(1, chunk_tiles // max(1, m * tk))

    def chunks():
        for t in range(0, tq, step):
            r0, r1 = t * block_m, min(q_len, (t + step) * block_m)
            lo, hi = rows_fn(r0, r1)
            yield tile_kinds(lo, hi, q_len, kv_len, block_m, block_n, r0)

    return _views(chunks(), m, tq, tk)


def compact_from_mask(
    mask,
    q_len: int,
    kv_len: int | None = None,
    *,
    block_m: int = 128,
    block_n: int = 128,
    chunk_tiles: int = CHUNK_TILES,
) -> CompactPlan:
    """The compact form of ``mask`` (the language) at ``q_len x kv_len`` on the CPU, built from
    the lowered rows without the ``[M, Tq, Tk]`` tables of a plan: for lengths where a plan
    does not fit in memory. The same as ``compact_plan(compile(mask, ...))`` where both fit.

    Raises:
        CompileMaskError: a ``tile_grid`` mask (its rows need the plan's permutation) or a
            mask the lowering refuses.
    """
    from .lower import lower
    from .pipeline import positive_int

    q_len = positive_int(q_len, "q_len")
    kv_len = q_len if kv_len is None else positive_int(kv_len, "kv_len")
    lo, hi, count = lower(mask, q_len, kv_len, "cpu")
    lo = lo.reshape(-1, q_len, lo.shape[-1])
    hi = hi.reshape(lo.shape)
    count = count.reshape(lo.shape[:2])
    m = lo.shape[0]
    seg = segments_from_rows(lo, hi, count, kv_len)
    row_bytes = rows_nbytes(m, q_len, lo.shape[-1])
    if seg.nbytes < row_bytes:
        kept, row_bytes = "segments", seg.nbytes
    else:
        kept = "rows"
    del count
    fwd, bwd = tile_runs_from_rows(
        lambda r0, r1: (lo[:, r0:r1], hi[:, r0:r1]), m, q_len, kv_len, block_m, block_n,
        chunk_tiles=chunk_tiles,
    )  # fmt: skip
    return CompactPlan(q_len, kv_len, m, block_m, block_n, kept,
                       seg if kept == "segments" else None, fwd, bwd, row_bytes)  # fmt: skip
