"""2-D grid relations (``disc``, ``box``, ``natten``) as row intervals, for :mod:`.lower`.

:func:`grid_window` gives one interval per key grid row a window touches, vectorised over query
rows; :func:`clear_table` works out on the host, with numpy, the intervals of every row of the
``clear`` mask as clamps of ``x + a`` that :meth:`.lower._Ctx._clear_rows` evaluates on the
device in a few operations.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from ..errors import LayoutError

I32 = torch.int32
I32_NP = np.int32
I32_MIN, I32_MAX = -(2**31), 2**31 - 1


def grid_window(q, q_start, key_start, grid, kind, params, t, skip=None):
    """Intervals of a 2-D window for query rows ``q`` of a grid (h x w, row-major) that starts at
    token ``q_start`` over a key grid of the same shape starting at token ``key_start``: one
    interval per key row the window touches, already compact (used slots first, ascending;
    unused slots ``[0, 0)``). Rows where ``skip`` holds get no interval; rows outside the query
    grid get some window (callers mask them).
    """
    h, w = grid
    local = (q - q_start).clamp(0, h * w - 1)
    y, x = local // w, local % w
    dev = local.device
    if kind == "natten":
        kh, kw = params
        if kh > h or kw > w:
            raise LayoutError(f"natten({kh}, {kw}) is larger than the {h}x{w} grid")
        y0 = y.clamp(kh // 2, h - 1 - kh // 2) - kh // 2
        cx = x.clamp(kw // 2, w - 1 - kw // 2)
        slots = torch.arange(kh, device=dev, dtype=I32) * w
        lo = (key_start + y0 * w + cx - kw // 2)[:, None] + slots[None, :]
        return lo, lo + kw
    if kind == "disc":
        r = params[0]
        reach = min(r - 1, h - 1)
        halves = [min(w, math.isqrt(r * r - d * d - 1)) for d in range(-reach, reach + 1)]
    else:  # box
        bh, bw = params
        reach = min(bh // 2, h - 1)
        halves = [min(w, bw // 2)] * (2 * reach + 1)
    slots = torch.arange(2 * reach + 1, device=dev, dtype=I32)
    y0 = (y - reach).clamp(min=0)
    rows_used = (y + reach).clamp(max=h - 1) - y0 + 1
    if skip is not None:
        rows_used = torch.where(skip, 0, rows_used)
    ok = slots[None, :] < rows_used[:, None]
    # the half-width of slot s is halves[s + shift] with shift = y0 - y + reach, which is 0
    # except for query rows in the first `reach` grid rows: look up only those
    table = t(halves + [0] * (2 * reach + 1))
    half = table[: 2 * reach + 1][None, :].expand(y.shape[0], -1)
    top = int(min(y.shape[0], max(0, q_start + reach * w))) if kind == "disc" else 0
    if top:  # rows q < top hold every cell with y < reach (local is monotone in q)
        half = half.clone()
        half[:top] = table[(y0 - y + reach)[:top, None] + slots[None, :]]
    base = (key_start + y0 * w)[:, None] + (slots * w)[None, :]
    lo = (x[:, None] - half).clamp_(min=0).add_(base)
    hi = (x[:, None] + 1 + half).clamp_(max=w).add_(base)
    return lo.masked_fill_(~ok, 0), hi.masked_fill_(~ok, 0)


def grid_may_touch(grid, kind, params) -> bool:
    """Whether a window row can span the whole grid width (then rows touch and must merge)."""
    h, w = grid
    if kind == "natten":
        return params[1] >= w
    if kind == "box":
        return params[1] >= w
    r = params[0]
    return 2 * math.isqrt(r * r - 1) + 1 >= w


class ClearTable(NamedTuple):
    """The host table of :meth:`.lower._Ctx._clear_rows` (int32): ``[f (6 * rows * k) | x (w) |
    thr, c0, c1 (view_rows each) | a text row (2 * k)]``.

    The query rows after the first ``prefix`` (text) ones are ``view_rows`` rows of ``w`` tokens:
    ``text_rows`` of text, then the ``h`` grid rows; ``rows`` adds, after them, view rows
    ``text_rows .. top - 1`` (the first grid rows) a second time, in the variant where the text
    and the first disc row merge. In row ``i`` at column ``x`` (``x = 0 .. w - 1``), slot ``j``
    holds ``lo = max(x + a_lo, lb_lo)`` and ``hi = min(x + a_hi, ub_hi)``; ``f`` holds
    ``[ub_lo, a_lo, a_hi, lb_lo, ub_hi, lb_hi]`` (``[rows, k]`` each, ``ub_lo`` and ``lb_hi``
    the int32 bounds), so that ``f[1:3]`` (a), ``f[3::2]`` (lb) and ``f[0::4]`` (ub) clamp
    ``x + a`` in one operation. The merged variant holds where ``x <= thr[i]``; the count is
    ``c1[i]`` there, ``c0[i]`` elsewhere.
    """

    table: np.ndarray
    k: int
    prefix: int
    text_rows: int
    view_rows: int
    top: int
    rows: int


def clear_table(h: int, w: int, r: int, text_len: int, trim: bool) -> ClearTable:
    """:class:`ClearTable` of ``clear((h, w), r, text_len)`` when no two disc rows touch
    (``2 * isqrt(r^2 - 1) + 1 < w``), with numpy on the host (~20 small operations).

    A grid token (y, x) sees the text ``[0, T)`` and, for each grid row ``y + dy`` with
    ``|dy| <= reach = min(r - 1, h - 1)``, the columns ``|x' - x| <= half[|dy|]`` with
    ``half[d] = isqrt(r^2 - d^2 - 1)`` (``dy^2 + dx^2 < r^2``), clipped to the grid: with
    ``base = T + (y + dy) * w``, ``lo = max(x + base - half, base)`` and
    ``hi = min(x + base + half + 1, base + w)``. Its slots are compact: slot ``text + j`` holds
    ``dy = j - min(y, reach)``. So every field is the start of the query's grid row,
    ``T + y * w``, plus ``e[dy]`` (``dy * w`` plus the offsets of ``dy``); a ``dy`` past the
    reach, or a grid row past the grid, gives a field at or past ``Nk``, and capping the fields
    (at ``Nk - w``, ``Nk + w``, ``Nk``, ``Nk``) makes such slots empty (``[Nk, Nk)``).

    The text interval touches the first disc row exactly when that row is grid row 0 and
    reaches column 0 (``y <= reach`` and ``x <= half[y]``): then the two merge in slot 0 and
    the later slots shift down by one (slot ``j`` holds ``dy = j - y``).
    """
    n = text_len + h * w
    reach = min(r - 1, h - 1)  # the farthest grid row a window touches
    half = np.array([min(w, math.isqrt(r * r - d * d - 1)) for d in range(reach + 1)], I32_NP)
    text = int(text_len > 0)
    nt, o = divmod(text_len, w)
    ptop = reach + 1 if text else 0  # the grid rows whose window holds grid row 0
    hp = nt + h
    rows = hp + ptop
    y = np.arange(h, dtype=I32_NP)
    used = np.minimum(y, reach) + np.minimum(y[::-1], reach) + 1  # grid rows seen
    if trim:  # the largest count (rows y < ptop merge at x = 0, and everywhere if half >= w - 1)
        plain = np.concatenate([used[:ptop][half[:ptop] < w - 1], used[ptop:]])
        k = max(1, text, int(used[:ptop].max(initial=0)), text + int(plain.max(initial=0)))
    else:
        k = 2 * reach + 2
    table = np.empty(6 * rows * k + w + 3 * hp + 2 * k, I32_NP)
    f = table[: 6 * rows * k].reshape(6, rows, k)
    table[6 * rows * k : 6 * rows * k + w] = np.arange(w)
    thr, c0, c1 = table[6 * rows * k + w : -2 * k].reshape(3, hp)
    thr.fill(-1)
    thr[nt : nt + ptop] = half[:ptop]
    c0[:nt] = 1
    np.add(used, text, out=c0[nt:])
    np.subtract(c0, 1, out=c1)
    f[0], f[5] = I32_MAX, I32_MIN  # ub of lo, lb of hi: none
    # e[:, i] for dy = i - reach - text, up to 2 * reach + 1: (a_lo, a_hi, lb_lo, ub_hi) - base
    dy = np.arange(-reach - text, 2 * reach + 2, dtype=I32_NP)
    hw = half[np.minimum(np.abs(dy), reach)]
    e = np.empty((4, dy.shape[0]), I32_NP)
    np.multiply(dy, w, out=e[2])
    np.subtract(e[2], hw, out=e[0])
    np.add(e[2], hw + 1, out=e[1])
    np.add(e[2], w, out=e[3])
    e[:, :text] = e[:, text + 2 * reach + 1 :] = h * w  # past the reach: at or past Nk
    s = y * w + text_len  # the start of each grid row
    grid, merged = f[1:5, nt:hp], f[1:5, hp:]
    np.add(e[:, None, :k], s[:, None], out=grid)  # rows with reach rows above: e from dy = -reach
    np.add(_windows(e, reach, reach, k), s[:reach, None], out=grid[:, :reach])  # rows with fewer
    np.add(_windows(e, reach + text, ptop, k), s[:ptop, None], out=merged)  # from dy = -y
    cap = np.array([n - w, n + w, n, n], I32_NP)[:, None, None]
    np.minimum(f[1:5, nt:], cap, out=f[1:5, nt:])
    f[1:5, :nt] = cap  # text rows: [0, Nk), then empty slots
    f[1:5, :nt, 0] = np.array([-w, n, 0, n], I32_NP)[:, None]
    if text:
        f[1:5, nt:hp, 0] = np.array([-w, text_len, 0, text_len], I32_NP)[:, None]  # [0, T)
        f[1, hp:, 0], f[3, hp:, 0] = -w, 0  # merged: [0, end of grid row 0)
    table[-2 * k :] = n
    table[-2 * k] = 0  # a text row
    return ClearTable(table, k, o, nt, hp, nt + ptop, rows)


def _windows(e: np.ndarray, start: int, rows: int, k: int) -> np.ndarray:
    """The view ``[:, i, :] = e[:, start - i : start - i + k]`` for ``i < rows`` of a contiguous
    ``e`` (numpy checks that it stays inside ``e``)."""
    step = e.itemsize
    return np.ndarray(
        (e.shape[0], rows, k), e.dtype, e, start * step, (e.shape[1] * step, -step, step)
    )
