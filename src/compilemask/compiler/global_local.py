"""``global_local`` (a bidirectional band with global tokens) lowered to canonical rows: as
piecewise-affine rows (``_Ctx.pieces``) while their host table is small, else every row's
slots built from the runs of global keys on the device."""

from __future__ import annotations

import bisect

import numpy as np
import torch

I32 = torch.int32
#: Largest host table (pieces x slots) of ``global_local`` lowered as pieces; above it the rows
#: are built from the runs of global keys on the device (:func:`_from_runs`).
GLOBAL_LOCAL_TABLE = 4096


def _runs(global_tokens, nk: int) -> tuple[list, list]:
    """The starts and stops of the maximal runs ``[a, b)`` of consecutive global keys
    (``global_tokens`` sorted; tokens at or past ``nk`` are query rows only)."""
    starts, stops = [], []
    for g in global_tokens:
        if g < nk and stops and stops[-1] == g:
            stops[-1] = g + 1
        elif g < nk:
            starts.append(g)
            stops.append(g + 1)
    return starts, stops


def global_local_rows(ctx, window: int, global_tokens) -> tuple:
    """Canonical rows ``(lo, hi, count)`` ``[Nq, K]`` of ``global_local(window,
    global_tokens)`` in the lowering context ``ctx`` (``compiler.lower._Ctx``): piecewise
    affine rows from a host table of at most :data:`GLOBAL_LOCAL_TABLE` entries, else
    :func:`_from_runs`."""
    # a global row sees [0, Nk); another row q the band [L, H) = [q - W, q + W + 1) clipped,
    # merged with the runs of consecutive global keys that touch it, and the other runs.
    # Piecewise affine: which runs touch the band, and which ends are constant, change only
    # at the rows cut below (each comparison of q -/+ W with a constant flips once)
    nq, nk, w = ctx.q_len, ctx.kv_len, min(window, ctx._axis())
    k, glob = 1 + len(global_tokens), set(global_tokens)
    starts, stops = _runs(global_tokens, nk)  # the maximal runs [a, b) of global keys
    cuts = {w + 1, nk + w, nk - w - 1} | glob | {g + 1 for g in global_tokens}
    for c in starts + stops:
        cuts |= {c + w + 1, c - w - 1}
    ends = sorted(c for c in cuts if 0 < c < nq) + [nq]
    if len(ends) * k > GLOBAL_LOCAL_TABLE:  # a large host table: the device's slots
        return _from_runs(ctx, window, global_tokens)
    pieces, q = [], 0
    for end in ends:
        if q in glob:
            pieces.append((end, (0,), (0,), (0,), (nk,)))
            q = end
            continue
        lo_v, hi_v = min(max(q - w, 0), nk), min(q + w + 1, nk)
        lo = (0, lo_v) if lo_v in (0, nk) else (1, -w)
        hi = (0, nk) if hi_v == nk else (1, w + 1)
        i = bisect.bisect_left(stops, lo_v)  # runs [0, i) end before the band
        j = bisect.bisect_right(starts, hi_v)  # runs [j, m) start after it
        if i < j and starts[i] < lo_v:  # runs [i, j) touch it
            lo = (0, starts[i])
        if i < j and stops[j - 1] > hi_v:
            hi = (0, stops[j - 1])
        band = 1 if i < j or lo_v < hi_v else 0
        zeros = (0,) * (i + band + len(starts) - j)
        lo_b = (*starts[:i], lo[1], *starts[j:]) if band else (*starts[:i], *starts[j:])
        hi_b = (*stops[:i], hi[1], *stops[j:]) if band else (*stops[:i], *stops[j:])
        lo_a = zeros[:i] + (lo[0],) * band + zeros[i + band :]
        hi_a = zeros[:i] + (hi[0],) * band + zeros[i + band :]
        pieces.append((end, lo_a, lo_b, hi_a, hi_b))
        q = end
    return ctx.pieces(pieces, k)


def _from_runs(ctx, window: int, global_tokens) -> tuple:
    """``global_local`` with a host table too large for ``ctx.pieces``: every row's slots
    built directly on the device from the runs of global keys (about 40 operations,
    whatever the number of tokens). A non-global row ``q`` has the runs that end before
    its band ``[L, H) = [q - W, q + W + 1)`` (clipped), the band merged with the runs
    that touch it (``searchsorted`` of ``L`` in the runs' stops and of ``H`` in their
    starts), then the runs after it; a global row has ``[0, Nk)``."""
    nq, nk, w = ctx.q_len, ctx.kv_len, min(window, ctx._axis())
    starts, stops = _runs(global_tokens, nk)  # the maximal runs [a, b) of global keys
    m, rows = len(starts), [g for g in global_tokens if g < nq]
    k = _largest_count(ctx, w, starts, stops, rows) if ctx.trim else 1 + len(global_tokens)
    # one copy: the runs' starts and stops (an unused run at m for the gathers), the
    # global rows, the slots 0 .. K-1
    tab = ctx.t([*starts, 0, *stops, 0, *rows, *range(k)])
    s_run, e_run = tab[: m + 1], tab[m + 1 : 2 * m + 2]
    g_rows, slot = tab[2 * m + 2 : 2 * m + 2 + len(rows)], tab[2 * m + 2 + len(rows) :]
    q = ctx.q
    lo_q = (q - w).clamp_(0, nk)
    hi_q = (q + (w + 1)).clamp_(max=nk)
    band = lo_q < hi_q  # (empty past Nk + W)
    i = torch.where(band, torch.searchsorted(e_run[:m], lo_q, out_int32=True), m)
    j = torch.where(band, torch.searchsorted(s_run[:m], hi_q, right=True, out_int32=True), m)
    touch = i < j  # runs [i, j) touch the band: merged into it
    lo_b = torch.where(touch, torch.minimum(lo_q, s_run[i]), lo_q)
    hi_b = torch.where(touch, torch.maximum(hi_q, e_run[(j - 1).clamp_(min=0)]), hi_q)
    i2, band2 = i[:, None], band[:, None]
    run = torch.where(slot < i2, slot, slot - i2 - band2.int() + j[:, None])  # [Nq, K]
    used = run < m
    run.clamp_(0, m)  # an unused slot (or the band's) reads the spare run, then is replaced
    pad = torch.full((), nk, dtype=I32, device=q.device)
    lo = torch.where(used, s_run[run], pad)
    hi = torch.where(used, e_run[run], pad)
    at_band = (slot == i2) & band2
    lo = torch.where(at_band, lo_b[:, None], lo)
    hi = torch.where(at_band, hi_b[:, None], hi)
    count = i + band.int() + (m - j)
    if rows:  # a global row sees [0, Nk): one interval
        pos = torch.searchsorted(g_rows, q, out_int32=True).clamp_(max=len(rows) - 1)
        glob = g_rows[pos] == q
        first = slot == 0
        lo = torch.where(glob[:, None], torch.where(first, 0, pad), lo)
        hi = torch.where(glob[:, None], pad, hi)
        count = torch.where(glob, 1, count)
    return lo, hi, count.to(I32)


def _largest_count(ctx, w: int, starts, stops, rows) -> int:
    """The largest count of :func:`_from_runs`' rows, on the host: a row's
    count changes only where ``q - W`` or ``q + W + 1`` crosses a run's end, so the rows
    just after each such crossing (and row 0) hold every count."""
    nq, nk = ctx.q_len, ctx.kv_len
    cuts = {0}
    for c in starts + stops:
        cuts |= {c + w, c + w + 1, c - w - 1, c - w}
    cuts |= {nk + w, nk - w - 1} | {r + 1 for r in rows}
    rows_set = set(rows)
    q = np.array(sorted(c for c in cuts if 0 <= c < nq and c not in rows_set), dtype=np.int64)
    k = 1 if rows else 0
    if q.size:
        lo, hi = np.clip(q - w, 0, nk), np.minimum(q + w + 1, nk)
        band = lo < hi
        m = len(starts)
        i = np.where(band, np.searchsorted(np.array(stops), lo, side="left"), m)
        j = np.where(band, np.searchsorted(np.array(starts), hi, side="right"), m)
        k = max(k, int((i + band + (m - j)).max()))
    return max(1, k)
