"""Plans of piecewise-affine rows made on the host (``recognise_pieces.py``'s forms).

A form gives its rows as **raw pieces**: consecutive query ranges ``[start, end)`` covering
``[0, Nq)``, each with ``J`` intervals ``[la q + lb, ha q + hb)`` (slopes in ``{-1, 0, 1}``),
unclipped, unsorted, possibly empty, overlapping or touching. :func:`canonical` turns them
into the canonical piece table of ``compiler.lower.PieceTable`` (per row sorted, disjoint,
not touching, non-empty intervals inside ``[0, Nk]``, the unused slots ``[Nk, Nk)``), exactly:

* every piece is split where any two of its endpoint expressions (the ``2J`` endpoints, ``0``
  and ``Nk``) change their order (an affine difference changes sign at most once: at its zero
  crossing, split before and after the zero row), so inside a piece every comparison that
  clipping, emptiness, sorting and merging make has one outcome on all its rows;
* each piece is then canonicalised once, at its first row, carrying the coefficients of the
  expressions chosen: with the comparisons fixed, the same expressions are chosen on every
  row of the piece (two expressions equal on one row of a piece are equal on all of it).

The table is built into a plan by :func:`plan_of`: on a device with the registered tile
builder's ``from_table`` (CUDA) the rows and the schedule in its one launch, else the
table's rows (``lower._Ctx.expand``: a ``searchsorted``, two gathers, an ``addcmul``) and
``build_tiles``. No host read: the counts are known on the host.
"""

from __future__ import annotations

import numpy as np
import torch

from ..lower import PieceTable, _Ctx
from ..plan import MaskPlan
from ..tiles import build_tiles, device_tile_builder
from .packed import NoForm

I32_LIMIT = 2**31 - 1
#: The most pieces a table may hold (a host table of at most ~2 MB at four slots).
MAX_PIECES = 1 << 16
#: The most intervals a row may hold before canonicalisation.
MAX_RAW = 16


class Table:
    """A canonical piece table on the host: ``values`` int32 (a zero word, ``ends [P]``,
    ``ab [2, 2, P, K]``, ``counts [P]``: ``lower._TableCtx.table_of``'s layout), ``pieces``
    P, ``k`` K. Read only (kept by ``recognise_pieces.py`` per form and lengths), its pinned
    copy for CUDA builds made once."""

    __slots__ = ("values", "pieces", "k", "_pinned")

    def __init__(self, values: np.ndarray, pieces: int, k: int):
        self.values, self.pieces, self.k, self._pinned = values, pieces, k, None

    def host(self, device: torch.device) -> torch.Tensor:
        """The values as a CPU tensor, pinned for a CUDA ``device`` (its copy does not
        block)."""
        if device.type != "cuda":
            return torch.from_numpy(self.values)
        if self._pinned is None:
            self._pinned = torch.from_numpy(self.values).pin_memory()
        return self._pinned


def canonical(starts, ends, la, lb, ha, hb, nq: int, nk: int) -> Table:
    """The host values of the canonical piece table of raw pieces (see the module).

    Args:
        starts, ends: int ``[P]``, consecutive (``starts[0] == 0``, ``starts[i + 1] ==
            ends[i]``, ``ends[-1] == nq``); pieces without rows are allowed and dropped.
        la, lb, ha, hb: int ``[P, J]``, the raw intervals of each piece (``1 <= J <=``
            :data:`MAX_RAW`; slopes ``la``, ``ha`` in ``{-1, 0, 1}``).
        nq, nk: the lengths.

    Returns:
        :class:`Table`: ``P'`` pieces (the pieces with rows, split), ``K`` the most intervals
        a row holds (at least 1).

    Raises:
        NoForm: pieces that do not tile ``[0, nq)``, too many pieces or intervals, slopes
            outside ``{-1, 0, 1}``, values beyond int32.
    """
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    la, lb, ha, hb = (np.asarray(x, np.int64) for x in (la, lb, ha, hb))
    if starts.ndim != 1 or la.ndim != 2 or la.shape[0] != starts.shape[0]:
        raise NoForm("raw pieces of inconsistent shapes")
    if not 1 <= la.shape[1] <= MAX_RAW or not len(starts):
        raise NoForm("raw pieces with no or too many intervals")
    if starts[0] != 0 or ends[-1] != nq or (starts[1:] != ends[:-1]).any():
        raise NoForm("raw pieces that do not tile the query rows")
    if (np.abs(la) > 1).any() or (np.abs(ha) > 1).any():
        raise NoForm("a slope outside {-1, 0, 1}")
    if max(np.abs(lb).max(), np.abs(hb).max()) > 2**40:
        raise NoForm("raw interval bounds too large")
    keep = ends > starts
    starts, ends, la, lb, ha, hb = (x[keep] for x in (starts, ends, la, lb, ha, hb))
    starts, la, lb, ha, hb = _split(starts, ends, la, lb, ha, hb, nk)
    ends = np.append(starts[1:], nq)
    if len(starts) > MAX_PIECES:
        raise NoForm("too many pieces")
    return _values(starts, ends, la, lb, ha, hb, nk)


def _split(starts, ends, la, lb, ha, hb, nk: int):
    """The pieces split where two endpoint expressions change order: ``(starts, la, lb, ha,
    hb)`` of the finer pieces (their ends are the next starts, the last one ``nq``)."""
    p, j = la.shape
    zeros = np.zeros((p, 1), np.int64)
    a = np.concatenate([la, ha, zeros, zeros], 1)  # [P, E]: lo_j, hi_j, 0, nk
    b = np.concatenate([lb, hb, zeros, zeros + nk], 1)
    da = a[:, :, None] - a[:, None, :]  # [P, E, E]: (a_x - a_y) q + (b_x - b_y)
    db = b[:, :, None] - b[:, None, :]
    sel = da > 0  # each unordered pair once, with a positive slope
    piece = np.broadcast_to(np.arange(p)[:, None, None], da.shape)[sel]
    s, t = da[sel], -db[sel]  # zero at q = t / s
    lo_pt = -(-t // s)  # first row with a q + b >= 0
    hi_pt = t // s + 1  # first row with a q + b > 0
    pts = np.concatenate([lo_pt, hi_pt])
    owner = np.concatenate([piece, piece])
    inside = (pts > starts[owner]) & (pts < ends[owner])
    if not inside.any():
        return starts, la, lb, ha, hb
    cuts = np.unique(np.concatenate([starts, pts[inside]]))
    idx = np.searchsorted(starts, cuts, side="right") - 1
    return cuts, la[idx], lb[idx], ha[idx], hb[idx]


def _values(starts, ends, la, lb, ha, hb, nk: int) -> Table:
    p, j = la.shape
    q = starts[:, None]
    lo_v, hi_v = la * q + lb, ha * q + hb  # values at each piece's first row
    lo_a, lo_b, hi_a, hi_b = la.copy(), lb.copy(), ha.copy(), hb.copy()
    below = lo_v <= 0  # clip: max(lo, 0), min(hi, nk)
    lo_v[below], lo_a[below], lo_b[below] = 0, 0, 0
    above = hi_v >= nk
    hi_v[above], hi_a[above], hi_b[above] = nk, 0, nk
    empty = lo_v >= hi_v
    big = np.iinfo(np.int64).max
    key = np.where(empty, big, lo_v)
    order = np.argsort(key, axis=1, kind="stable")
    lo_v, hi_v, lo_a, lo_b, hi_a, hi_b, key = (
        np.take_along_axis(x, order, 1) for x in (lo_v, hi_v, lo_a, lo_b, hi_a, hi_b, key)
    )
    out = np.zeros((4, p, j), np.int64)  # lo_a, hi_a, lo_b, hi_b of the merged intervals
    out[3] = out[2] = nk
    count = np.zeros(p, np.int64)
    rows = np.arange(p)
    has = np.zeros(p, bool)
    cur = np.zeros((5, p), np.int64)  # lo_a, lo_b, hi_a, hi_b, hi value of the open interval
    for k in range(j):
        valid = key[:, k] != big
        new = valid & (~has | (lo_v[:, k] > cur[4]))  # a gap: the open interval is done
        done = new & has
        w = rows[done]
        out[0, w, count[w]], out[2, w, count[w]] = cur[0, w], cur[1, w]
        out[1, w, count[w]], out[3, w, count[w]] = cur[2, w], cur[3, w]
        count[w] += 1
        cur[0][new], cur[1][new] = lo_a[new, k], lo_b[new, k]
        cur[2][new], cur[3][new], cur[4][new] = hi_a[new, k], hi_b[new, k], hi_v[new, k]
        grow = valid & ~new & (hi_v[:, k] > cur[4])  # overlapping or touching: merged
        cur[2][grow], cur[3][grow], cur[4][grow] = hi_a[grow, k], hi_b[grow, k], hi_v[grow, k]
        has |= valid
    w = rows[has]
    out[0, w, count[w]], out[2, w, count[w]] = cur[0, w], cur[1, w]
    out[1, w, count[w]], out[3, w, count[w]] = cur[2, w], cur[3, w]
    count[w] += 1
    kk = max(1, int(count.max()))
    out = out[:, :, :kk]
    # the rows' values stay in [0, nk]: the coefficients fit int32 when the ends do
    values = np.concatenate([[0], ends, out.reshape(-1), count])
    if np.abs(values).max() > I32_LIMIT:
        raise NoForm("piece table values beyond int32")
    return Table(values.astype(np.int32), p, kk)


def plan_of(
    table: Table, q_len, kv_len, block_m, block_n, device, source, parts=(1, None, None)
) -> MaskPlan:
    """The plan of a canonical piece table (:func:`canonical`) on ``device`` (a
    ``torch.device``). ``parts``: ``(M, batch, heads)`` of a plan of ``M`` masks (``M ==
    (batch or 1) * (heads or 1)``), their rows the table's ``M * q_len`` rows in turn."""
    m, batch, heads = parts
    p, k = table.pieces, table.k
    build = getattr(device_tile_builder(), "from_table", None)
    if m == 1 and build is not None and not torch.compiler.is_compiling():
        host = table.host(device)
        built = build(lambda: PieceTable(host, p, k), q_len, kv_len, device, block_m, block_n)
        if built is not None:
            return MaskPlan._built(q_len, kv_len, batch, heads, *built, source=source)
    host_sync = device.type == "cpu"
    ctx = _Ctx(m * q_len, kv_len, device, trim=host_sync)
    flat = ctx.t(table.values[1:])  # one host-to-device copy
    ends, ab, counts = flat[:p], flat[p : p + 4 * p * k].view(2, 2, p, k), flat[-p:]
    lo, hi, count = ctx.expand(ends, ab, counts)
    lo, hi, count = lo.view(m, q_len, k), hi.view(m, q_len, k), count.view(m, q_len)
    schedule = build_tiles(lo, hi, count, q_len, kv_len, block_m, block_n, use_bits=host_sync)
    return MaskPlan._built(q_len, kv_len, batch, heads, lo, hi, count, schedule, source=source)
