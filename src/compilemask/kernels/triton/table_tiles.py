"""A piece table's rows and tile kinds inside the tile builder's launch
(``tile_builder._build_schedule``).

A piece table (``compiler.lower.PieceTable``) holds the rows of a piecewise-affine mask: the
pieces' ascending ``ends`` (runs of rows, none empty, the last one ``Nq``) and per piece and
slot ``j`` the interval ``[lo_a q + lo_b, hi_a q + hi_b)`` of every row ``q`` of the piece,
``a`` 0 or 1, canonical in every row (sorted, disjoint, not touching; unused slots ``[Nk,
Nk)``). A q-tile program evaluates its rows from it (:func:`piece_of`, :func:`table_bounds`):
it needs every row's intervals to count its tiles' pairs and write the plan's rows.

A kv-tile program needs only the kinds of its column of tiles (empty, FULL, partial), and
those follow from the pieces without evaluating a row (:func:`column_kinds_from_table`): in
one piece every condition on a row's slot, such as ``lo <= t0``, is affine in ``q`` with a
slope of -1, 0 or 1, so the rows meeting it are a range of ``q``, and so are the rows meeting
several (:func:`_touching_and_covering`). A q-tile of ``BLOCK_M`` rows crossing ``s`` pieces
costs two binary searches and ``s`` evaluations per slot instead of ``BLOCK_M`` searches and
evaluations (a q-tile crosses few pieces: pieces are runs of rows).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def piece_of(Table, rows, n_pieces, steps):
    """The piece of each of ``rows`` (any shape): ``#{i : ends[i] <= row}`` over the ascending
    ``ends`` at ``Table`` (``n_pieces`` of them, the last one ``Nq``), what ``searchsorted(ends,
    rows, right=True)`` gives, by ``steps`` halvings (``2**steps > n_pieces``)."""
    pos = tl.zeros_like(rows)
    step = 1 << steps
    for _ in range(steps):
        step = step // 2
        cand = pos + step
        take = cand <= n_pieces
        end = tl.load(Table + cand - 1, mask=take, other=0)
        pos = tl.where(take & (end <= rows), cand, pos)
    return pos


@triton.jit
def table_bounds(Table, piece, q, slot, ok, n_pieces, n_slots, kv_len):
    """``(lo, hi)`` of slot ``slot`` of row ``q`` in piece ``piece`` (broadcast shapes) from a
    piece table (``lower.PieceTable``): ``[lo_a q + lo_b, hi_a q + hi_b)``, ``kv_len`` where
    not ``ok`` (rows past ``q_len``, slots past ``n_slots``: the padding of the loads)."""
    size = n_pieces * n_slots
    at = Table + n_pieces + piece * n_slots + slot
    lo_a = tl.load(at, mask=ok, other=0)
    hi_a = tl.load(at + size, mask=ok, other=0)
    lo_b = tl.load(at + 2 * size, mask=ok, other=kv_len)
    hi_b = tl.load(at + 3 * size, mask=ok, other=kv_len)
    return lo_b + lo_a * q, hi_b + hi_a * q


@triton.jit
def _touching_and_covering(a, b, lo_a, hi_a, lo_b, hi_b, t0, t1):
    """``(touching, covering)``: how many rows ``q`` of ``[a, b)`` have an interval ``[lo_a q
    + lo_b, hi_a q + hi_b)`` (``a`` 0 or 1) that touches the keys ``[t0, t1)`` (``lo < t1``,
    ``hi > t0``, ``lo < hi``), and how many one that covers them (``lo <= t0``, ``hi >= t1``).

    Each condition is ``c q + d > 0`` with ``c`` -1, 0 or 1: the rows ``q >= 1 - d`` (``c =
    1``), ``q < d`` (``c = -1``), all or none (``c = 0``); those meeting all of them in ``[a,
    b)`` are a range ``[first, end)``."""
    first = tl.maximum(a, tl.where(hi_a == 1, t0 + 1 - hi_b, a))  # hi > t0
    first = tl.maximum(first, tl.where(hi_a > lo_a, lo_b + 1 - hi_b, a))  # lo < hi
    end = tl.minimum(b, tl.where(lo_a == 1, t1 - lo_b, b))  # lo < t1
    end = tl.minimum(end, tl.where(hi_a < lo_a, hi_b - lo_b, b))  # lo < hi
    never = ((lo_a == 0) & (lo_b >= t1)) | ((hi_a == 0) & (hi_b <= t0))
    never |= (hi_a == lo_a) & (hi_b <= lo_b)
    touching = tl.where(never, 0, tl.maximum(end - first, 0))
    first = tl.maximum(a, tl.where(hi_a == 1, t1 - hi_b, a))  # hi >= t1
    end = tl.minimum(b, tl.where(lo_a == 1, t0 + 1 - lo_b, b))  # lo <= t0
    never = ((lo_a == 0) & (lo_b > t0)) | ((hi_a == 0) & (hi_b < t1))
    return touching, tl.where(never, 0, tl.maximum(end - first, 0))


@triton.jit
def column_kinds_from_table(Table, dst, t0, t1, q_len, Tq, n_pieces, n_slots, steps,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            K_PAD: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """The kinds of the tiles ``(qt, [t0, t1))`` of every q-tile ``qt < Tq`` into ``dst[qt]``
    (int32: 0 empty, 1 FULL, 2 partial; what ``compiler/tiles.py`` classifies from the pairs:
    FULL is ``BLOCK_M`` rows of ``BLOCK_N`` keys each), from the piece table at ``Table``
    (``n_pieces`` ends, then the coefficients of ``n_slots`` slots), ``CHUNK`` q-tiles at a
    time.

    Per q-tile, its first and last pieces (:func:`piece_of` of its first and last rows), then
    for each piece ``p`` it crosses and each slot, the range of its rows ``[a, b)`` that touch
    ``[t0, t1)`` (``lo < t1``, ``hi > t0``, ``lo < hi``) and the range that covers it (``lo
    <= t0``, ``hi >= t1``). A tile is touched where some range is non-empty; FULL where
    ``BLOCK_M`` rows cover ``[t0, t1)``, ``t1 - t0 == BLOCK_N``: in a canonical row (disjoint,
    not touching intervals) ``BLOCK_N`` pairs means one interval holding all the keys, and no
    row is covered by two slots, so the covering ranges' lengths add up to the covered rows."""
    slots = tl.arange(0, K_PAD)
    slot_ok = (slots < n_slots)[None, :]
    size = n_pieces * n_slots
    for c0 in range(0, Tq, CHUNK):
        qts = c0 + tl.arange(0, CHUNK)
        qt_ok = qts < Tq
        r0 = qts * BLOCK_M
        r1 = tl.minimum(r0 + BLOCK_M, q_len)
        first = piece_of(Table, r0, n_pieces, steps)
        last = piece_of(Table, r1 - 1, n_pieces, steps)
        span = tl.max(tl.where(qt_ok, last - first, 0))
        touched = tl.zeros([CHUNK], tl.int32)
        covered = tl.zeros([CHUNK], tl.int32)
        for i in range(0, span + 1):
            p = first + i
            p_ok = qt_ok & (p <= last)
            start = tl.load(Table + p - 1, mask=p_ok & (p > 0), other=0)
            end = tl.load(Table + p, mask=p_ok, other=0)
            a = tl.maximum(r0, start)[:, None]
            b = tl.where(p_ok, tl.minimum(r1, end), 0)[:, None]  # the piece's rows in the tile
            ok = p_ok[:, None] & slot_ok
            at = Table + n_pieces + p[:, None] * n_slots + slots[None, :]
            # padding slots read as [0, 0): touching and covering nothing
            lo_a = tl.load(at, mask=ok, other=0)
            hi_a = tl.load(at + size, mask=ok, other=0)
            lo_b = tl.load(at + 2 * size, mask=ok, other=0)
            hi_b = tl.load(at + 3 * size, mask=ok, other=0)
            touching, covering = _touching_and_covering(a, b, lo_a, hi_a, lo_b, hi_b, t0, t1)
            touched += tl.sum(touching, axis=1)
            covered += tl.sum(covering, axis=1)
        full = (covered == BLOCK_M) & (t1 - t0 == BLOCK_N)
        kind = tl.where(full, 1, tl.where(touched > 0, 2, 0))
        tl.store(dst + qts, kind, mask=qt_ok)
