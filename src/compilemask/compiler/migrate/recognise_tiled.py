"""NATTEN over tokens stored in tiles (attention-gym's ``tiled_natten``) recognised in the trace as
``tile_grid(natten2d(...), (th, tw))`` in its tiled order.

The mask_mod maps a token index ``i`` to its cell on a ``H x W`` grid stored tile by tile
(``T = th * tw`` tokens a tile, ``A = W / tw`` tiles a tile row, row-major over tiles and
inside each tile)::

    x = ((i // T) % A) * tw + (i % T) % tw
    y = ((i // T) // A) * th + (i % T) // tw

and compares the clamped query cell with the key cell per axis,
``|clamp(x_q, a, b) - x_k| <= r`` (``<`` for ``<= r - 1``, either sign order, either side of
the comparison). Recognised when the two axes (one ``x``, one ``y``, one ``(T, A, tw)``) are
the whole conjunction, ``T`` is a multiple of ``tw`` (``th = T / tw``), ``q_len == kv_len == N``
with ``N`` a multiple of ``T * A`` (``H = N / W``), and each clamp is NATTEN's window shifted
inward at the borders (``a == r``, ``b == extent - 1 - r``, ``2r + 1 <= extent``): the mask is
``tile_grid(natten2d((H, W), (2 r_y + 1, 2 r_x + 1)), (th, tw))``, whose plan without its
permutation (``plan.in_permuted_order()``) is the mask on the tiled positions, i.e. on the
mask_mod's own indices. Exact: for ``i < N`` the two formulas are the row and column of token
``i`` in ``tile_grid``'s order (row-major over the ``H / th x A`` tiles and inside each), and
``natten2d``'s window is that clamp of the query's cell (``semantics._natten_axis``).
Anything else of these values raises (recognise's fallback to the lifting).
"""

from __future__ import annotations

from dataclasses import dataclass

from ... import masks
from ...language.ast import Mask
from . import recognise as r


@dataclass(frozen=True)
class Tile:  # (var // T) % A ("tx") or (var // T) // A ("ty")
    var: str
    t: int
    a: int
    part: str


@dataclass(frozen=True)
class Off:  # (var % T) % tw ("ox") or (var % T) // tw ("oy")
    var: str
    t: int
    tw: int
    part: str


@dataclass(frozen=True)
class Scaled:  # Tile * s
    tile: Tile
    s: int


@dataclass(frozen=True)
class Coord:  # the cell's x or y of var
    var: str
    axis: str
    t: int
    a: int
    tw: int


@dataclass(frozen=True)
class Clamped:  # clamp(Coord of q, lo, hi)
    c: Coord
    lo: int
    hi: int


@dataclass(frozen=True)
class Diff:  # +-(Clamped - Coord of kv on the same axis)
    c: Clamped


@dataclass(frozen=True)
class AbsDiff:
    d: Diff


@dataclass
class TiledAxis:  # |clamp(coord(q), lo, hi) - coord(kv)| <= rad
    c: Coord
    lo: int
    hi: int
    rad: int


ATOMS = (TiledAxis,)
VALUES = (Tile, Off, Scaled, Coord, Clamped, Diff, AbsDiff)
_DIV = ("floordiv", "floor_divide")
_MOD = ("mod", "remainder")


def op(name: str, target, args):
    """The value of operation ``name`` when it makes or uses this module's values, else None."""
    x, y = (list(args) + [None])[:2]
    if name in _DIV + _MOD and len(args) == 2 and isinstance(x, (r._Div, r._Mod)):
        c = r._int(y)
        if x.off or c < 1:
            raise r._No("// or % of (i + c) // d or (i + c) % d, c != 0, or by d < 1")
        if isinstance(x, r._Div):
            return Tile(x.var, x.c, c, "tx" if name in _MOD else "ty")
        return Off(x.var, x.c, c, "ox" if name in _MOD else "oy")
    if not any(isinstance(a, VALUES) for a in args):
        return None
    if name == "mul" and len(args) == 2:
        t, s = (x, y) if isinstance(x, Tile) else (y, x)
        if isinstance(t, Tile) and not isinstance(s, VALUES) and r._int(s) >= 1:
            return Scaled(t, s)
    if name == "add" and len(args) == 2:
        s, o = (x, y) if isinstance(x, Scaled) else (y, x)
        if isinstance(s, Scaled) and isinstance(o, Off):
            return _coord(s, o)
    if name == "clamp" and len(args) == 3 and isinstance(x, Coord) and x.var == "q":
        return Clamped(x, r._int(args[1]), r._int(args[2]))
    if name == "sub" and len(args) == 2:
        c, k = (x, y) if isinstance(x, Clamped) else (y, x)
        if isinstance(c, Clamped) and isinstance(k, Coord) and k.var == "kv":
            if (k.axis, k.t, k.a, k.tw) == (c.c.axis, c.c.t, c.c.a, c.c.tw):
                return Diff(c)
    if name == "abs" and len(args) == 1 and isinstance(x, Diff):
        return AbsDiff(x)
    if name in r._CMPS and len(args) == 2:
        return _compare(x, y, name)
    raise r._No(f"{name} of tiled grid coordinates other than NATTEN's window")


def _coord(s: Scaled, o: Off) -> Coord:
    tile = s.tile
    if tile.var != o.var or tile.t != o.t:
        raise r._No("a tiled coordinate of two indices or two tile sizes")
    if tile.part == "tx" and o.part == "ox" and s.s == o.tw:
        return Coord(tile.var, "x", tile.t, tile.a, o.tw)
    if tile.part == "ty" and o.part == "oy" and s.s * o.tw == tile.t:
        return Coord(tile.var, "y", tile.t, tile.a, o.tw)
    raise r._No("a sum of tile and offset terms other than a tiled x or y")


def _compare(x, y, op: str) -> TiledAxis:
    if isinstance(y, AbsDiff) and not isinstance(x, VALUES):
        x, y, op = y, x, r._FLIP[op]
    if not isinstance(x, AbsDiff) or isinstance(y, VALUES) or op not in ("le", "lt"):
        raise r._No("a tiled coordinate compared other than |.| <= or < a constant")
    rad = r._int(y) - (op == "lt")
    if rad < 0:
        raise r._No("|.| bounded below 0 (empty)")
    c = x.d.c
    return TiledAxis(c.c, c.lo, c.hi, rad)


def natten(axes: list, nq: int, nk: int) -> Mask:
    """``tile_grid(natten2d(...), (th, tw))`` of the two window axes (the whole conjunction)."""
    xs = [a for a in axes if a.c.axis == "x"]
    ys = [a for a in axes if a.c.axis == "y"]
    if len(xs) != 1 or len(ys) != 1:
        raise r._No("tiled NATTEN windows other than one x and one y axis")
    (ax,), (ay,) = xs, ys
    t, a, tw = ax.c.t, ax.c.a, ax.c.tw
    if (ay.c.t, ay.c.a, ay.c.tw) != (t, a, tw) or t % tw:
        raise r._No("tiled NATTEN axes of two tilings, or a tile size not a multiple of tw")
    if nq != nk or nq % (t * a):
        raise r._No("a tiled grid that does not fill q_len == kv_len")
    w = a * tw
    h = nq // w
    for ax_, extent in ((ax, w), (ay, h)):
        if 2 * ax_.rad + 1 > extent or (ax_.lo, ax_.hi) != (ax_.rad, extent - 1 - ax_.rad):
            raise r._No("a NATTEN clamp other than the window shifted inward at the borders")
    window = masks.natten2d((h, w), (2 * ay.rad + 1, 2 * ax.rad + 1))
    return masks.tile_grid(window, (t // tw, tw))
