"""Interval-set algebra on per-row interval lists, vectorised over rows.

A *row interval set* is a pair ``(lo, hi)`` of int32 tensors ``[..., N, K]``: row ``r`` sees the
keys ``[lo[..., r, j], hi[..., r, j])`` for every slot ``j``. The canonical form (what every
function here returns) has, per row, the non-empty intervals first, sorted, disjoint and not
touching (``hi[j] < lo[j + 1]``), and the unused slots empty with ``lo == hi == pad``.

All operations are O(N * K) work (plus a sort of ``2 K`` events per row for the sweep) and never
look at individual (query, key) pairs.
"""

from __future__ import annotations

import torch

EMPTY_POS = torch.iinfo(torch.int32).max  # sorts after every real position


def clip(lo: torch.Tensor, hi: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip intervals to ``[0, kv_len)``; intervals left with ``hi <= lo`` become empty."""
    lo = lo.clamp(0, kv_len)
    hi = hi.clamp(0, kv_len)
    return lo, torch.maximum(hi, lo)


def _bound_k(count: torch.Tensor, k_bound: int, trim: bool) -> int:
    if trim and count.numel() and k_bound > 1:  # (one slot or none: 1, nothing to read)
        return max(1, int(count.max()))
    return max(1, k_bound)


def _scatter_compact(
    flag: torch.Tensor, values: torch.Tensor, k_out: int, pad: int
) -> torch.Tensor:
    """Per row, write ``values[..., j]`` where ``flag`` holds into consecutive slots."""
    rank = torch.cumsum(flag, dim=-1, dtype=torch.int64) - 1
    slot = torch.where(flag, rank, k_out)
    out = torch.full((*values.shape[:-1], k_out + 1), pad, dtype=torch.int32, device=values.device)
    out.scatter_(-1, slot, values.to(torch.int32))
    return out[..., :k_out]


def compact_sorted(
    lo: torch.Tensor, hi: torch.Tensor, pad: int, *, trim: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Canonicalise intervals that are already in ascending order per row and disjoint (they may
    touch, and empty intervals may sit anywhere). Returns ``(lo, hi, count)``.

    ``trim``: shrink K to the largest count (one host synchronisation); otherwise keep the bound.
    """
    if lo.shape[-1] == 1:  # one interval per row: nothing to merge (a few ops instead of ~25)
        return finish_compact(lo, hi, pad, trim=trim)
    valid = lo < hi
    neg = torch.full_like(hi, -1)
    last_hi = torch.cummax(torch.where(valid, hi, neg), dim=-1).values
    prev_hi = torch.cat([neg[..., :1], last_hi[..., :-1]], dim=-1)
    start = valid & (lo != prev_hi)
    count = start.sum(-1, dtype=torch.int32)
    k_out = _bound_k(count, lo.shape[-1], trim)
    # the valid intervals of merged run r (r = starts so far - 1) go to slot r, the others to
    # slot k_out (cut off): the run is [its smallest lo, its largest hi); slots no run reaches
    # keep the padding
    run = torch.cumsum(start, dim=-1, dtype=torch.int64) - 1
    slot = torch.where(valid, run, k_out)
    shape = (2, *lo.shape[:-1], k_out + 1)
    out = torch.full(shape, pad, dtype=torch.int32, device=lo.device)
    out[0].scatter_reduce_(-1, slot, lo.to(torch.int32), reduce="amin", include_self=False)
    out[1].scatter_reduce_(-1, slot, hi.to(torch.int32), reduce="amax", include_self=False)
    return out[0, ..., :k_out], out[1, ..., :k_out], count


def finish_compact(lo, hi, pad: int, *, trim: bool = True):
    """Canonical form of intervals that are compact already (used slots first, sorted, not
    touching): set unused slots to ``pad`` and count. Returns ``(lo, hi, count)``."""
    valid = lo < hi
    count = valid.sum(-1, dtype=torch.int32)
    k_out = _bound_k(count, lo.shape[-1], trim)
    lo, hi, valid = lo[..., :k_out], hi[..., :k_out], valid[..., :k_out]
    pad_t = torch.full((), pad, dtype=lo.dtype, device=lo.device)  # one fill for both
    return torch.where(valid, lo, pad_t), torch.where(valid, hi, pad_t), count


def sweep(
    sets: list[tuple[torch.Tensor, torch.Tensor]],
    weights: list[int],
    keep,
    pad: int,
    *,
    trim: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine interval sets by an event sweep over each row.

    Each set ``i`` adds ``weights[i]`` to a per-position state inside its intervals; the result is
    the set of positions whose state satisfies ``keep(state)`` (a function on int tensors with
    ``keep(0) == False``). Union: weights 1, ``state > 0``; intersection of two canonical sets:
    weights 1 and 2, ``state == 3``; difference ``A - B``: ``state == 1``.
    Leading dimensions broadcast. Returns canonical ``(lo, hi, count)``.
    """
    shape = torch.broadcast_shapes(*(s[0].shape[:-1] for s in sets))
    pos, delta = [], []
    for (lo, hi), w in zip(sets, weights):
        lo = lo.expand(*shape, lo.shape[-1])
        hi = hi.expand(*shape, hi.shape[-1])
        live = (lo < hi).to(torch.int32) * w
        pos += [lo, hi]
        delta += [live, -live]
    pos_all = torch.cat(pos, dim=-1)
    delta_all = torch.cat(delta, dim=-1)
    pos_s, order = torch.sort(pos_all, dim=-1, stable=True)
    delta_s = torch.gather(delta_all, -1, order)
    state = torch.cumsum(delta_s, dim=-1, dtype=torch.int32)
    nxt = torch.cat([pos_s[..., 1:], torch.full_like(pos_s[..., :1], -1)], dim=-1)
    group_last = pos_s != nxt
    first = torch.searchsorted(pos_s.contiguous(), pos_s.contiguous(), right=False)
    before = torch.gather(state, -1, (first - 1).clamp(min=0))
    before = torch.where(first == 0, torch.zeros_like(before), before)
    now_in, was_in = keep(state), keep(before)
    starts = group_last & now_in & ~was_in
    ends = group_last & ~now_in & was_in
    count = starts.sum(-1, dtype=torch.int32)
    k_bound = sum(s[0].shape[-1] for s in sets)
    k_out = _bound_k(count, k_bound, trim)
    return (
        _scatter_compact(starts, pos_s, k_out, pad),
        _scatter_compact(ends, pos_s, k_out, pad),
        count,
    )


def union(sets, pad, *, trim=True):
    return sweep(sets, [1] * len(sets), lambda s: s > 0, pad, trim=trim)


def intersection(a, b, pad, *, trim=True):
    return sweep([a, b], [1, 2], lambda s: s == 3, pad, trim=trim)


def difference(a, b, pad, *, trim=True):
    return sweep([a, b], [1, 2], lambda s: s == 1, pad, trim=trim)


def pad_k(lo: torch.Tensor, hi: torch.Tensor, k: int, pad: int):
    """Pad the slot axis to ``k`` slots with empty intervals."""
    extra = k - lo.shape[-1]
    if extra <= 0:
        return lo, hi
    fill = torch.full((*lo.shape[:-1], extra), pad, dtype=lo.dtype, device=lo.device)
    return torch.cat([lo, fill], -1), torch.cat([hi, fill], -1)


def dense_rows(lo: torch.Tensor, hi: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Boolean rows ``[..., N, kv_len]`` of an interval set: +1 at every ``lo``, -1 at every
    ``hi``, running sum > 0. O(N * (kv_len + K)); for tests, references and pictures."""
    lo, hi = lo.long(), hi.long()
    ones = torch.ones_like(lo, dtype=torch.int32)
    edges = torch.zeros((*lo.shape[:-1], kv_len + 1), dtype=torch.int32, device=lo.device)
    edges.scatter_add_(-1, lo, ones).scatter_add_(-1, hi, -ones)
    return torch.cumsum(edges, -1, dtype=torch.int32)[..., :kv_len] > 0


def from_dense_rows(rows: torch.Tensor, pad: int, *, trim: bool = True):
    """Intervals of boolean rows ``[..., N, Nk]`` (maximal runs of True). Returns canonical
    ``(lo, hi, count)``."""
    rows = rows.to(torch.bool)
    nk = rows.shape[-1]
    false_col = torch.zeros((*rows.shape[:-1], 1), dtype=torch.bool, device=rows.device)
    prev = torch.cat([false_col, rows[..., :-1]], -1)
    nxt = torch.cat([rows[..., 1:], false_col], -1)
    starts = rows & ~prev
    ends = rows & ~nxt
    count = starts.sum(-1, dtype=torch.int32)
    k_out = _bound_k(count, nk, trim)
    cols = torch.arange(nk, device=rows.device, dtype=torch.int32).expand_as(rows)
    return (
        _scatter_compact(starts, cols, k_out, pad),
        _scatter_compact(ends, cols + 1, k_out, pad),
        count,
    )
