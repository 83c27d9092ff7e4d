"""More mask_mod forms for ``recognise.py``: bidirectional windows with global tokens and NATTEN.

* ``|kv - q + c| <= t`` (``abs`` of a ``kv - q`` form, ``<`` or ``<=`` a constant): the band
  ``-t - c <= kv - q <= t - c`` (``(q - kv).abs() <= w``: ``-w <= kv - q <= w``);
* a union of one symmetric band ``|q - kv| <= w`` (``w >= 0``) with global tokens
  ``g[q] | g[kv]`` (``g`` one captured 1-D ``torch.bool`` table of at least ``max(q_len,
  kv_len)`` entries): ``global_local(w, G)`` with ``G`` the positions ``i < max(q_len,
  kv_len)`` where ``g[i]`` (one host read of ``g``), attention-gym's ``global_sliding_window``.
  Exact: on ``q < q_len``, ``kv < kv_len`` the atoms are ``q in G`` and ``kv in G``. (The
  Sparse VideoGen spatial union ``(q < P) | (kv < P) | band`` is left to the lifting: as
  ``global_local`` or as rules its ``compile`` costs more operations than its lifting);
* NATTEN on a row-major grid of width ``W``: ``|clamp(q // W, a, b) - kv // W| <= r`` and
  ``|clamp(q % W, a', b') - kv % W| <= r'`` in one conjunction (either sign order, ``<`` for
  ``<= r - 1``) with ``a == r``, ``b == H - 1 - r``, ``a' == r'``, ``b' == W - 1 - r'``,
  ``H = q_len / W`` an int, ``2r + 1 <= H``, ``2r' + 1 <= W``, ``q_len == kv_len``:
  ``natten2d((H, W), (2r + 1, 2r' + 1))``, whose window is that clamp of the query's cell
  (``semantics._natten_axis``). Any other clamp bound, width or length falls back.

Anything else raises :class:`packed.NoForm` (recognise's fallback to the lifting).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ... import masks
from ...language.ast import Mask
from . import packed
from . import recognise as r

_No = packed.NoForm


@dataclass(frozen=True)
class Abs:  # |a * q + b * kv + c|, a == -b != 0
    lin: object


@dataclass(frozen=True)
class Clamp:  # clamp(q // c or q % c, lo, hi)
    op: str
    c: int
    lo: int
    hi: int


@dataclass(frozen=True)
class CDiff:  # +-(clamp(q op c, lo, hi) - kv op c)
    op: str
    c: int
    lo: int
    hi: int


@dataclass(frozen=True)
class CAbs:  # |clamp(q op c, lo, hi) - kv op c|
    d: CDiff


@dataclass(eq=False)
class Flag:  # t[var] of a bool table, as a boolean
    t: torch.Tensor
    var: str


@dataclass
class NattenAxis:  # |clamp(q op c, lo, hi) - kv op c| <= rad
    op: str
    c: int
    lo: int
    hi: int
    rad: int


ATOMS = (Flag, NattenAxis)
VALUES = (Abs, Clamp, CDiff, CAbs)


def _grid_of_q(x):
    """``("div" | "mod", c)`` of ``q // c`` / ``q % c`` (offset 0), else None."""
    if isinstance(x, (r._Div, r._Mod)) and x.var == "q" and x.off == 0:
        return ("div" if isinstance(x, r._Div) else "mod", x.c)
    return None


def _same_kv(cl: Clamp, y) -> bool:
    return (
        isinstance(y, (r._Div, r._Mod))
        and y.var == "kv"
        and y.off == 0
        and ("div" if isinstance(y, r._Div) else "mod") == cl.op
        and y.c == cl.c
    )


def op(name: str, target, args):
    """The value of operation ``name`` on recognise's values when it is one of this module's
    forms, else None (recognise's own rules apply)."""
    if any(isinstance(a, VALUES) for a in args):
        return _value_op(name, args)
    if name in r._AND | r._OR and len(args) == 2:
        if any(isinstance(a, r._Gather) and a.t.dtype == torch.bool for a in args):
            return r._op(name, target, [_flag(a) for a in args])
        return None
    if name == "abs" and len(args) == 1 and isinstance(args[0], r._Lin):
        x = args[0]
        if x.a != -x.b or x.b == 0:
            raise _No("abs of other than kv - q + c")
        return Abs(x)
    if name == "clamp" and len(args) == 3 and _grid_of_q(args[0]) is not None:
        o, c = _grid_of_q(args[0])
        return Clamp(o, c, r._int(args[1]), r._int(args[2]))
    return None


def _flag(a):
    if not isinstance(a, r._Gather) or a.t.dtype != torch.bool:
        return a
    if a.c or a.t.dim() != 1:
        raise _No("a boolean gather other than g[q] or g[kv] of a 1-D table")
    return Flag(a.t, a.var)


def _value_op(name: str, args):
    x, y = (list(args) + [None])[:2]
    if name == "sub" and len(args) == 2:
        if isinstance(x, Clamp) and _same_kv(x, y):
            return CDiff(x.op, x.c, x.lo, x.hi)
        if isinstance(y, Clamp) and _same_kv(y, x):
            return CDiff(y.op, y.c, y.lo, y.hi)
    if name == "abs" and len(args) == 1 and isinstance(x, CDiff):
        return CAbs(x)
    if name in r._CMPS and len(args) == 2:
        return compare(x, y, name)
    raise _No(f"{name} of |.| or clamp values other than NATTEN's window")


def compare(x, y, op: str):
    """``x op y`` for an :class:`Abs` / :class:`CAbs` against a constant, else None."""
    if isinstance(y, (Abs, CAbs)) and not isinstance(x, VALUES):
        x, y, op = y, x, r._FLIP[op]
    if not isinstance(x, (Abs, CAbs)):
        if isinstance(y, VALUES):
            raise _No("a clamp or a difference of it outside |.| against a constant")
        return None
    if op not in ("le", "lt") or isinstance(y, VALUES):
        raise _No("|.| other than <= or < a constant")
    t = r._int(y) - (op == "lt")
    if t < 0:
        raise _No("|.| bounded below 0 (empty)")
    if isinstance(x, CAbs):
        d = x.d
        return NattenAxis(d.op, d.c, d.lo, d.hi, t)
    lin = x.lin  # |d| <= t with d = +-(kv - q) + c: kv - q in [-t - c, t - c] (b == 1)
    c = lin.c if lin.b == 1 else -lin.c
    return r._Band(-t - c, t - c)


def natten(axes: list, nq: int, nk: int) -> list[Mask]:
    """``[natten2d(...)]`` of the two window axes of a conjunction (``[]`` when none)."""
    if not axes:
        return []
    rows = [a for a in axes if a.op == "div"]
    cols = [a for a in axes if a.op == "mod"]
    if len(rows) != 1 or len(cols) != 1 or rows[0].c != cols[0].c:
        raise _No("NATTEN windows other than one row and one column axis of one width")
    (row,), (col,), w = rows, cols, cols[0].c
    if nq != nk or nq % w:
        raise _No("a NATTEN grid whose width does not divide q_len == kv_len")
    h = nq // w
    for a, extent in ((row, h), (col, w)):
        if 2 * a.rad + 1 > extent or (a.lo, a.hi) != (a.rad, extent - 1 - a.rad):
            raise _No("a NATTEN clamp other than the window shifted inward at the borders")
    return [masks.natten2d((h, w), (2 * row.rad + 1, 2 * col.rad + 1))]


def global_local(parts: list, nq: int, nk: int) -> Mask | None:
    """``global_local`` of a union's parts (a symmetric band and global flags ``g[q] | g[kv]``),
    or None when the union holds no flag."""
    flags = [p for p in parts if isinstance(p, Flag)]
    if not flags:
        return None
    bands = [p for p in parts if isinstance(p, r._Band)]
    if len(bands) != 1 or len(flags) + 1 != len(parts):
        raise _No("global tokens in a union other than with one band |q - kv| <= w")
    band, t, m = bands[0], flags[0].t, max(nq, nk)
    if band.lo is None or band.hi is None or band.lo != -band.hi or band.hi < 0:
        raise _No("global tokens with a band other than |q - kv| <= w")
    if any(f.t is not t for f in flags) or {f.var for f in flags} != {"q", "kv"}:
        raise _No("global flags other than g[q] | g[kv] of one table")
    if t.shape[0] < m:
        raise _No("a global-token table shorter than the axis")
    g = t[:m].to("cpu").numpy()  # the one host read
    return masks.global_local(band.hi, np.flatnonzero(g).tolist())
