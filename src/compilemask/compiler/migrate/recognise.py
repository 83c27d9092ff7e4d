"""Common mask_mod forms recognised in their ``torch.fx`` trace and written in the region language.

A recognised mask_mod is built by ``compile``'s own path (``pipeline.build_plan``: analytic
lowering of the catalogue masks, no per-row interval arithmetic and no probe). Recognised:

* comparisons of ``q_idx`` and ``kv_idx`` plus Python int constants, ``kv - q`` against a
  constant (``kv <= q``, ``kv < q``, ``kv >= q``, ``kv == q``, ``q - kv < w``, ...): a band
  ``lo <= kv - q <= hi`` -- ``causal()``, ``sliding_window(w)``, else a ``band(lo, hi)`` rule;
* ``kv < p`` (``kv <= c``) only in a union with ``kv <= q``: ``prefix_lm(p)``;
* ``q // c == kv // c`` (a ``chunk(c)`` rule; with ``kv <= q``: ``chunked(c)``) and
  ``kv // c <= q // c`` (``block_causal(c)``), ``c`` a positive int;
* ``doc[q] == doc[kv]`` with ``doc`` a captured 1-D integer tensor (on any device: its values
  are read) whose first ``N`` ids are non-decreasing (``q_len == kv_len == N``):
  ``document(lengths, causal)`` with the run lengths (one host read of ``doc[:N]``);
* a 2-D local disc with text (CLEAR): ``(q < T) | (k < T) | (dy * dy + dx * dx < r * r)``
  with ``qi, ki = q - T, k - T``, ``dy = qi // w - ki // w``, ``dx = qi % w - ki % w`` (either
  sign order, ``dy ** 2`` for ``dy * dy``, ``<= r * r - 1`` for ``< r * r``; ``r >= 1`` and
  ``T >= 0`` ints, the text terms ``q < T`` / ``k < T`` may be absent only when ``T == 0``):
  ``clear((h, w), r, T)`` when ``q_len == kv_len == N`` and ``N - T`` is a positive multiple
  ``h * w`` of ``w``. Exact: ``clear`` is true on the text rows and columns, as the text terms;
  for ``q, k >= T`` the offsets ``qi, ki`` lie in ``[0, h * w)``, so ``// w`` and ``% w`` are
  the grid row and column of q and k in the row-major image, ``dy^2 + dx^2`` (of either sign)
  is ``clear``'s squared distance, and on integers ``< r * r`` is ``<= r * r - 1``. One offset
  ``T`` on both sides, one ``w`` for ``//`` and ``%``, a square ``r * r`` and both text terms
  are required (anything else is another mask);
* ``&`` / ``|`` of those (``~`` of a one-sided comparison), as ``&`` / ``|`` of masks;
* packed users or groups with per-row tables gathered by ``q``: ``kv op t[q]`` and
  ``q op t[q]`` (row atoms) in the hstu and shared_prompt forms of ``packed.py``, as
  ``hstu(...)`` / ``shared_prompt(...)`` (one host read of the tables); a row atom anywhere
  else is not recognised.

Anything else -- ``b`` or ``h`` used, a float or tensor constant, another operation, an
unsorted ``doc``, a band that is empty or always true, a bound on ``q`` outside a CLEAR union
-- gives None and the general lifting (``lift.py``) runs. Exactness: every form here has the
same integer semantics on FlexAttention's top-left indices as the mask it maps to
(``tests/test_recognise.py`` checks against ``create_mask``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from ... import masks
from ...language.ast import Mask, TiledGrid
from ...language.parser import parse
from . import packed, trace
from . import recognise_bh as bh
from . import recognise_gym as gym
from . import recognise_prefix as prefix
from . import recognise_tiled as tiled

log = logging.getLogger("compilemask.migrate")

_LIMIT = 2**30  # constants and bounds kept far from int32 overflow of the indices
_CMPS = {"lt", "le", "gt", "ge", "eq"}
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}
_AND = {"and", "logical_and", "bitwise_and"}
_OR = {"or", "logical_or", "bitwise_or"}
_NOT = {"invert", "logical_not", "bitwise_not"}


class _No(Exception):
    """Not a recognised form (the message says why)."""


@dataclass(frozen=True)
class _Lin:  # a * q + b * kv + c, a and b in {-1, 0, 1}
    a: int
    b: int
    c: int


@dataclass(frozen=True)
class _Div:  # (var + off) // c
    var: str
    c: int
    off: int = 0


@dataclass(frozen=True)
class _Mod:  # (var + off) % c
    var: str
    c: int
    off: int


@dataclass(frozen=True)
class _Diff:  # +-((q + off) op c - (kv + off) op c), op "div" (grid row) or "mod" (column)
    op: str
    c: int
    off: int


@dataclass(frozen=True)
class _Sq:  # d * d
    d: _Diff


@dataclass(frozen=True)
class _SumSq:  # dy * dy + dx * dx: the squared distance on a grid of width c at token -off
    c: int
    off: int


@dataclass(frozen=True)
class _Gather:  # t[var] + c
    t: torch.Tensor = field(compare=False)
    var: str
    c: int = 0


@dataclass(frozen=True, eq=False)
class _DocLin:  # lin + sum of coef * t[doc[var]]: offsets of documents gathered by q or kv
    lin: _Lin
    terms: tuple  # ((coef, t, doc, var), ...)


@dataclass
class _Band:  # lo <= kv - q <= hi (None: unbounded)
    lo: int | None
    hi: int | None


@dataclass
class _KvBound:  # lo <= kv <= hi
    lo: int | None
    hi: int | None


@dataclass
class _QBound:  # lo <= q <= hi
    lo: int | None
    hi: int | None


@dataclass
class _Disc:  # dy^2 + dx^2 < r^2 on the image of width w after `text` text tokens
    text: int
    w: int
    r: int


@dataclass
class _Chunk:  # q // c == kv // c
    c: int


@dataclass
class _BlockCausal:  # kv // c <= q // c
    c: int


@dataclass
class _Doc:  # t[q] == t[kv]
    t: torch.Tensor


@dataclass
class _InDoc:  # an atom that holds as written only where doc[q] == doc[kv]
    doc: torch.Tensor
    atom: _Band
    tables: tuple  # the tensors gathered by doc ids (their lengths are checked)


@dataclass
class _RowStart:  # kv >= t[doc[q]] + strict: with kv <= q, a document's causal rows if the
    t: torch.Tensor  # bound is each row's run start (checked on the values)
    doc: torch.Tensor
    strict: bool


@dataclass
class _And:
    parts: list


@dataclass
class _Or:
    parts: list


@dataclass(frozen=True)
class _Const:  # b.new_ones((), dtype=torch.bool) / new_zeros: attention-gym's and_masks / or_masks
    value: bool


@dataclass(frozen=True)
class _ModBand:  # (q % c) op (kv % c) as lo <= kv % c - q % c <= hi: kv - q inside a chunk(c)
    c: int
    lo: int | None
    hi: int | None


_DEVICE = ("placeholder-device",)
_DOC_LIN = (_DocLin,)  # ``b.device`` (``noop_mask``'s new_ones reads it)


_ATOMS = (_Band, _KvBound, _QBound, _Disc, _Chunk, _BlockCausal, _Doc, _ModBand, _InDoc, _RowStart,
          *packed.ROW_ATOMS, *gym.ATOMS, *tiled.ATOMS,
          *prefix.ATOMS)  # fmt: skip
_BOOL = (*_ATOMS, _And, _Or)
_GRID = (_Div, _Mod, _Diff, _Sq, _SumSq)


def _name(node) -> str:
    t = node.target
    name = (t if isinstance(t, str) else getattr(t, "__name__", str(t))).strip("_")
    return {"rand": "and", "ror": "or"}.get(name, name)


def _int(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or abs(v) >= _LIMIT:
        raise _No(f"constant {v!r} is not a small Python int")
    return v


def _lin(v) -> _Lin:
    if isinstance(v, _Lin):
        return v
    return _Lin(0, 0, _int(v))


def _combine(x: _Lin, y: _Lin, s: int) -> _Lin:
    out = _Lin(x.a + s * y.a, x.b + s * y.b, x.c + s * y.c)
    if abs(out.a) > 1 or abs(out.b) > 1 or abs(out.c) >= _LIMIT:
        raise _No("a linear form beyond kv - q + c")
    return out


def _bounds(op: str, t: int) -> tuple[int | None, int | None]:
    """``X op t`` for an integer X as ``lo <= X <= hi``."""
    return {"lt": (None, t - 1), "le": (None, t), "gt": (t + 1, None), "ge": (t, None),
            "eq": (t, t)}[op]  # fmt: skip


def _disc(s: _SumSq, t, op: str) -> _Disc:
    """``s op t`` as a disc: ``< r * r`` or ``<= r * r - 1``, ``r >= 1``."""
    t = _int(t) + (op == "le")
    if op not in ("lt", "le") or t < 1 or math.isqrt(t) ** 2 != t:
        raise _No(f"dy^2 + dx^2 {op} a constant other than < r * r or <= r * r - 1")
    if s.off > 0:
        raise _No("a grid offset q + c, c > 0 (an image before token 0)")
    return _Disc(-s.off, s.c, math.isqrt(t))


def _doc_lin(v) -> _DocLin:
    return v if isinstance(v, _DocLin) else _DocLin(_lin(v), ())


def _in_doc(x, y, op: str) -> _InDoc:
    """``x op y`` with document terms ``t[doc[q]]``, ``t[doc[kv]]`` that cancel where
    ``doc[q] == doc[kv]`` (there ``t[doc[q]] == t[doc[kv]]``): a band inside the document
    (attention-gym's ``document(causal, offsets)``: ``q - off[doc[q]] >= kv - off[doc[kv]]``)."""
    x, y = _doc_lin(x), _doc_lin(y)
    terms = x.terms + tuple((-c, t, d, v) for c, t, d, v in y.terms)
    docs = {id(d): d for _, _, d, _ in terms}
    total: dict = {}
    for c, t, d, _ in terms:
        total[(id(t), id(d))] = total.get((id(t), id(d)), 0) + c
    if len(terms) == 1 and terms[0][3] == "q" and abs(terms[0][0]) == 1:  # kv op t[doc[q]]
        (c, t, doc, _), d = terms[0], _combine(x.lin, y.lin, -1)
        if d.b < 0:
            c, d, op = -c, _Lin(-d.a, -d.b, -d.c), _FLIP[op]
        if (d.a, d.b, d.c, c) == (0, 1, 0, -1) and op in ("ge", "gt"):
            return _RowStart(t, doc, op == "gt")
    if len(docs) != 1 or any(total.values()):
        raise _No("document terms t[doc[q]], t[doc[kv]] that do not cancel inside a document")
    atom = _compare(x.lin, y.lin, op)
    if not isinstance(atom, _Band):
        raise _No("a comparison with document terms other than of kv - q")
    return _InDoc(next(iter(docs.values())), atom, tuple(t for _, t, _, _ in terms))


def _compare(x, y, op: str):
    v = gym.compare(x, y, op)
    if v is not None:
        return v
    if isinstance(x, _DocLin) or isinstance(y, _DocLin):
        return _in_doc(x, y, op)
    if isinstance(y, _SumSq) and not isinstance(x, _SumSq):
        x, y, op = y, x, _FLIP[op]
    if isinstance(x, _SumSq):
        return _disc(x, y, op)
    if isinstance(x, _Div) and isinstance(y, _Div) and x.c == y.c and x.var != y.var:
        if x.off or y.off:
            raise _No("a comparison of (q + c) // d and (kv + c) // d, c != 0")
        if op == "eq":
            return _Chunk(x.c)
        if (x.var, op) in (("kv", "le"), ("q", "ge")):
            return _BlockCausal(x.c)
        raise _No(f"{op} of q // c and kv // c")
    if isinstance(x, _Mod) and isinstance(y, _Mod) and x.c == y.c and x.var != y.var:
        if x.off or y.off:
            raise _No("a comparison of (q + c) % d and (kv + c) % d, c != 0")
        if x.var == "kv":
            x, y, op = y, x, _FLIP[op]
        return _ModBand(x.c, *_bounds(_FLIP[op], 0))  # q%c op kv%c: kv%c - q%c flip(op) 0
    row = None
    if isinstance(x, _Gather):
        row = _row(x, y, op)
    elif isinstance(y, _Gather):
        row = _row(y, x, _FLIP[op])
    if row is not None:
        return row
    if isinstance(x, _Gather) and isinstance(y, _Gather):
        if op == "eq" and x.t is y.t and x.var != y.var and x.c == y.c == 0:
            return _Doc(x.t)
        raise _No("a comparison of gathers other than doc[q] == doc[kv]")
    if isinstance(x, (*_GRID, _Gather)) or isinstance(y, (*_GRID, _Gather)):
        raise _No("a gather, floor division or remainder compared with another kind of value")
    d = _combine(_lin(x), _lin(y), -1)  # d op 0
    if d.a == -d.b and d.b != 0:  # +-(kv - q) + c op 0
        if d.b < 0:
            d, op = _Lin(-d.a, -d.b, -d.c), _FLIP[op]
        return _Band(*_bounds(op, -d.c))
    if d.a == 0 and d.b != 0:
        if d.b < 0:
            d, op = _Lin(0, 1, -d.c), _FLIP[op]
        return _KvBound(*_bounds(op, -d.c))
    if d.b == 0 and d.a != 0:
        if d.a < 0:
            d, op = _Lin(1, 0, -d.c), _FLIP[op]
        return _QBound(*_bounds(op, -d.c))
    raise _No("a comparison other than kv - q, kv or q against a constant")


def _row(t: _Gather, x, op: str):
    """``t[q] op x`` for ``x`` = ``kv`` or ``q`` as a row atom (``kv flip(op) t[q]``), else
    None."""
    if t.var != "q" or not isinstance(x, _Lin) or x.c or op == "ne":
        return None
    if (x.a, x.b) == (0, 1):
        return packed.KvRow(t.t, _FLIP[op], t.c)
    if (x.a, x.b) == (1, 0):
        return packed.QRow(t.t, _FLIP[op], t.c)
    return None


def _negate(v):
    if isinstance(v, _Const):
        return _Const(not v.value)
    if isinstance(v, (_Band, _KvBound, _QBound)) and (v.lo is None) != (v.hi is None):
        return type(v)(None, v.lo - 1) if v.hi is None else type(v)(v.hi + 1, None)
    raise _No("~ of a value other than a one-sided comparison")


def _attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


#: formulas per trace: a formula depends on the graph and its captured tensor objects alone
#: (no tensor value is read here); a cached trace bound to other tensors (``trace.Bound``)
#: takes its template's formula with those tensors swapped in
_FORMULAS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _rebind(f, swap: dict):
    """``f`` (a formula) with each tensor ``t`` replaced by ``swap[id(t)]``."""
    if isinstance(f, torch.Tensor):
        return swap.get(id(f), f)
    if isinstance(f, list):
        return [_rebind(x, swap) for x in f]
    if isinstance(f, tuple):
        return tuple(_rebind(x, swap) for x in f)
    if dataclasses.is_dataclass(f) and not isinstance(f, type):
        new = {x.name: _rebind(getattr(f, x.name), swap) for x in dataclasses.fields(f)}
        return dataclasses.replace(f, **new)
    return f


def formula(gm):
    """The boolean formula of a traced mask_mod (``_Band`` ... ``_Or``), kept per ``gm`` (per
    template of a ``trace.Bound``).

    Raises:
        _No: not built from the recognised forms only.
    """
    swap = getattr(gm, "swap", None) if isinstance(gm, trace.Bound) else None
    if swap is not None:
        gm = gm.template
    with _LOCK:
        hit = _FORMULAS.get(gm)
    if hit is None:
        try:
            hit = (_formula(gm), None)
        except _No as exc:
            hit = (None, str(exc))
        with _LOCK:
            _FORMULAS[gm] = hit
    if hit[1] is not None:
        raise _No(hit[1])
    return hit[0] if swap is None else _rebind(hit[0], swap)


def _live(graph) -> set:
    """The nodes the output depends on (a value computed and never used, as ``q_logical`` of
    attention-gym's ``document`` over ``noop_mask``, is not part of the formula)."""
    todo = [n for n in graph.nodes if n.op == "output"]
    live = set(todo)
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in live:
                live.add(a)
                todo.append(a)
    return live


#: operations whose unused results may be skipped (no in-place update among them)
_DEAD_OK = frozenset({"getitem", "getattr", "add", "sub", "mul", "neg", "floordiv",
                      "floor_divide", "mod", "remainder", "abs", "ne", *_CMPS, *_AND, *_OR,
                      *_NOT})  # fmt: skip


def _check_dead(node) -> None:
    """Raise :class:`_No` unless skipping unused ``node`` changes nothing: an out-of-place
    operation of :data:`_DEAD_OK` (``x.add_(1)`` is unused as a value but writes ``x``)."""
    t = node.target
    raw = t if isinstance(t, str) else getattr(t, "__name__", "")
    in_place = node.op == "call_method" and raw.endswith("_") and not raw.endswith("__")
    if in_place or node.op not in ("call_function", "call_method", "get_attr"):
        raise _No(f"an unused {node.op} {raw}")
    if node.op != "get_attr" and _name(node) not in _DEAD_OK:
        raise _No(f"an unused operation {raw}")


def _formula(gm):
    env: dict = {}
    places = []
    out = None
    live = _live(gm.graph)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            places.append(node)
            env[node] = ("placeholder", len(places) - 1)
            continue
        if node not in live:
            _check_dead(node)
            continue
        if node.op == "output":
            out = env.get(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
            break
        if node.op == "get_attr":
            env[node] = _attr(gm, node.target)
            continue
        const = _constant(node, env)
        if const is not None:
            env[node] = const
            continue
        if node.kwargs:
            raise _No(f"keyword arguments to {node.target}")
        t = node.target
        if node.op == "call_method" and t.endswith("_") and not t.endswith("__"):
            raise _No(f"an in-place operation {t}")  # its input is changed for later uses
        args = [_resolve(a, env) for a in node.args]
        for a in args:
            if isinstance(a, tuple) and a[0] == "placeholder":
                if a[1] < 2:
                    raise _No("the mask_mod uses b or h")
        args = [_idx(a) for a in args]
        env[node] = _op(_name(node), node.target, args)
    if len(places) != 4:
        raise _No("not a mask_mod(b, h, q_idx, kv_idx)")
    if not isinstance(out, (*_BOOL, _Const)):
        raise _No("the output is not a recognised boolean")
    return out


def _resolve(a, env):
    """A node's argument: a node's value, a tuple of them (an index ``t[b, h, q]``), or
    itself."""
    if isinstance(a, torch.fx.Node):
        return env[a]
    if isinstance(a, tuple) and any(isinstance(x, torch.fx.Node) for x in a):
        return tuple(env[x] if isinstance(x, torch.fx.Node) else x for x in a)
    return a


def _is_index(v) -> bool:
    return isinstance(v, tuple) and len(v) == 2 and v[0] == "placeholder"


def _constant(node, env):
    """``x.device`` of an index argument (:data:`_DEVICE`), or ``x.new_ones(())`` /
    ``x.new_zeros(())`` of one with ``dtype=torch.bool`` (a :class:`_Const`: what
    attention-gym's ``and_masks`` / ``or_masks`` start from, and ``noop_mask``), else None."""
    args = [env[a] if isinstance(a, torch.fx.Node) else a for a in node.args]
    if node.op == "call_function" and node.target is getattr:
        if len(args) == 2 and _is_index(args[0]) and args[1] == "device" and not node.kwargs:
            return _DEVICE
        return None
    if node.op != "call_method" or node.target not in ("new_ones", "new_zeros"):
        return None
    kw = dict(node.kwargs)
    kw = {k: env[v] if isinstance(v, torch.fx.Node) else v for k, v in kw.items()}
    size = args[1] if len(args) == 2 else kw.pop("size", None)
    empty = isinstance(size, (tuple, list)) and len(size) == 0
    if not args or not _is_index(args[0]) or len(args) > 2 or not empty:
        raise _No(f"{node.target} other than x.{node.target}((), dtype=torch.bool)")
    if kw.pop("dtype", None) is not torch.bool or kw.pop("device", _DEVICE) is not _DEVICE or kw:
        raise _No(f"{node.target} other than x.{node.target}((), dtype=torch.bool)")
    return _Const(node.target == "new_ones")


def _idx(a):
    if isinstance(a, tuple) and len(a) == 2 and a[0] == "placeholder":
        return _Lin(1, 0, 0) if a[1] == 2 else _Lin(0, 1, 0)
    return a


def _grid_op(name: str, args):
    """``// c``, ``% c`` of ``q + off`` / ``kv + off``, their q-minus-kv differences, squares
    and the sum ``dy^2 + dx^2``; anything else of those values raises."""
    if name in ("floordiv", "floor_divide", "mod", "remainder") and len(args) == 2:
        x, c = args
        c = _int(c)
        if not isinstance(x, _Lin) or c < 1 or (x.a, x.b) not in ((1, 0), (0, 1)):
            raise _No(f"{name} other than (q + c) // d or (kv + c) // d (also %), d >= 1")
        cls = _Div if name in ("floordiv", "floor_divide") else _Mod
        return cls("q" if x.a else "kv", c, x.c)
    x, y = (args + [None])[:2]
    if name == "sub" and len(args) == 2 and isinstance(x, (_Div, _Mod)) and type(x) is type(y):
        if x.var == y.var or x.c != y.c or x.off != y.off:
            raise _No("a difference other than of q and kv with one divisor and one offset")
        return _Diff("div" if isinstance(x, _Div) else "mod", x.c, x.off)
    if isinstance(x, _Diff) and (
        (name == "mul" and len(args) == 2 and x == y)
        or (name == "pow" and len(args) == 2 and _int(y) == 2)
        or (name == "square" and len(args) == 1)
    ):
        return _Sq(x)
    if name == "add" and len(args) == 2 and isinstance(x, _Sq) and isinstance(y, _Sq):
        if {x.d.op, y.d.op} == {"div", "mod"} and (x.d.c, x.d.off) == (y.d.c, y.d.off):
            return _SumSq(x.d.c, x.d.off)
    raise _No(f"{name} of grid values other than dy * dy + dx * dx")


def _op(name: str, target, args):
    for forms in (bh, tiled, prefix, gym):  # the form modules' own operations first
        v = forms.op(name, target, args)
        if v is not None:
            return v
    if name in ("floordiv", "floor_divide", "mod", "remainder") or (
        name not in _CMPS and any(isinstance(a, _GRID) for a in args)
    ):
        return _grid_op(name, args)
    if name in ("add", "sub") and len(args) == 2 and any(isinstance(a, _DOC_LIN) for a in args):
        x, y = (_doc_lin(a) for a in args)
        s = 1 if name == "add" else -1
        terms = x.terms + tuple((s * c, t, d, v) for c, t, d, v in y.terms)
        return _DocLin(_combine(x.lin, y.lin, s), terms)
    if name in ("add", "sub") and len(args) == 2 and any(isinstance(a, _Gather) for a in args):
        x, k = args if isinstance(args[0], _Gather) else (args[1], args[0])
        if name == "sub" and x is not args[0]:
            raise _No("a constant minus a gather")
        if x.t.dtype not in (torch.int32, torch.int64):  # t[q] + c wraps in a narrow dtype
            raise _No("a constant added to a gather from a table narrower than int32")
        k = _int(k) * (1 if name == "add" else -1)
        if abs(x.c + k) >= _LIMIT:
            raise _No("a gather plus a constant beyond the limit")
        return _Gather(x.t, x.var, x.c + k)  # t[q] + c: a row bound shifted by c
    if name in ("add", "sub") and len(args) == 2:
        return _combine(_lin(args[0]), _lin(args[1]), 1 if name == "add" else -1)
    if name == "neg" and len(args) == 1:
        return _combine(_Lin(0, 0, 0), _lin(args[0]), -1)
    if name == "mul" and len(args) == 2:
        x, k = (args[0], args[1]) if not isinstance(args[0], int) else (args[1], args[0])
        k = _int(k)
        if k not in (-1, 1):
            raise _No("a product other than by +-1")
        return _combine(_Lin(0, 0, 0), _lin(x), k)
    if name == "getitem" and target in (operator.getitem, "__getitem__") and len(args) == 2:
        t, x = args
        if isinstance(t, torch.Tensor) and isinstance(x, _Gather):  # offsets[doc[q]]
            if x.c or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
                raise _No("a gather by a gathered value from other than a 1-D integer table")
            return _DocLin(_Lin(0, 0, 0), ((1, t, x.t, x.var),))
        if not isinstance(t, torch.Tensor) or not isinstance(x, _Lin):
            raise _No("indexing other than a captured tensor by q or kv")
        if (x.a, x.b, x.c) not in ((1, 0, 0), (0, 1, 0)):
            raise _No("a gather at an index other than q or kv")
        return _Gather(t, "q" if x.a else "kv")
    if name in _CMPS and len(args) == 2:
        return _compare(args[0], args[1], name)
    if name in _AND | _OR and len(args) == 2 and any(isinstance(a, _Const) for a in args):
        c, other = (args[0], args[1]) if isinstance(args[0], _Const) else (args[1], args[0])
        if not isinstance(other, (*_BOOL, _Const)):
            raise _No(f"{name} of non-boolean values")
        # True & x = x, False | x = x; False & x = False, True | x = True
        return other if c.value == (name in _AND) else c
    if name in _AND | _OR and len(args) == 2:
        if not all(isinstance(a, _BOOL) for a in args):
            raise _No(f"{name} of non-boolean values")
        cls = _And if name in _AND else _Or
        parts = []
        for a in args:
            parts += a.parts if isinstance(a, cls) else [a]
        return cls(parts)
    if name in _NOT and len(args) == 1:
        return _negate(args[0])
    raise _No(f"operation {name}")


# ------------------------------------------------------------------ formula -> region mask


def _rule(relation: str) -> Mask:
    return parse(f"{{ layout all:* ; * -> * : {relation} }}")


def _doc_lengths(t: torch.Tensor, n: int, tables=()) -> list[int]:
    """The run lengths of the ids ``t[:n]`` (one host read); ``tables``: 1-D tensors
    gathered by these ids (``offsets[doc[q]]``), each long enough for every id. ``t`` may be
    an int64 numpy row already read (``recognise_bh.py``)."""
    if isinstance(t, np.ndarray):
        if t.ndim != 1 or t.dtype != np.int64 or len(t) < n:
            raise _No("doc is not a 1-D integer row covering the length")
        d = t[:n]
    elif not packed.readable(t, n):
        raise _No("doc is not a 1-D integer tensor covering the length")
    else:
        d = t[:n].to("cpu", torch.int64).numpy()  # the one host read
    if (
        tables
        and len(d)
        and any(not -x.shape[0] <= d.min() <= d.max() < x.shape[0] for x in tables)
    ):
        raise _No("a table gathered by document ids is shorter than the ids")
    try:
        s, e, _ = packed.runs(d)
    except packed.NoForm:
        raise _No("doc ids are not non-decreasing") from None
    return (e - s).tolist()


def _start_lengths(p: _RowStart, n: int) -> list[int]:
    """The documents of rows whose keys are ``[t[doc[q]] + strict, q]``: the bound must be 0
    on row 0 and, on every later row, the previous row's bound or the row itself (where a
    document starts). One host read of ``doc[:n]`` and ``t``."""
    doc, t = p.doc, p.t
    if not packed.readable(doc, n) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise _No("kv >= t[doc[q]] with tables other than 1-D integer ones")
    if doc.device != t.device:
        raise _No("kv >= t[doc[q]] with tables on two devices")
    host = torch.cat([doc[:n].to(torch.int64), t.to(torch.int64)]).to("cpu").numpy()  # one read
    d, tv = host[:n], host[n:]
    if not (-len(tv) <= d.min() and d.max() < len(tv)):
        raise _No("document ids past the end of the table gathered by them")
    s = tv[d] + p.strict
    prev = np.concatenate([[0], s[:-1]])
    if s[0] != 0 or not ((s == prev) | (s == np.arange(n))).all():
        raise _No("kv >= t[doc[q]] whose bound is not each row's document start")
    new = np.flatnonzero(np.concatenate([[True], s[1:] != s[:-1]]))
    return np.diff(np.append(new, n)).tolist()


def _is_causal(b: _Band) -> bool:
    return b.lo is None and b.hi == 0


def _conj(parts: list, nq: int, nk: int) -> Mask:
    if any(isinstance(p, tiled.TiledAxis) for p in parts):
        if not all(isinstance(p, tiled.TiledAxis) for p in parts):
            raise _No("tiled NATTEN windows with other terms (tile_grid is outermost)")
        return tiled.natten(parts, nq, nk)
    band = _Band(None, None)
    chunks, blocks, docs, ors, discs, mods, nattens = set(), set(), [], [], [], [], []
    for p in parts:
        if isinstance(p, _Band):
            lo = [v for v in (band.lo, p.lo) if v is not None]
            hi = [v for v in (band.hi, p.hi) if v is not None]
            band = _Band(max(lo) if lo else None, min(hi) if hi else None)
        elif isinstance(p, _Chunk):
            chunks.add(p.c)
        elif isinstance(p, _BlockCausal):
            blocks.add(p.c)
        elif isinstance(p, _Doc):
            if docs and docs[0].t is not p.t:
                raise _No("two different doc tensors")
            docs = [p]
        elif isinstance(p, _Or):
            ors.append(p)
        elif isinstance(p, _Disc):
            discs.append(p)
        elif isinstance(p, (_ModBand, _InDoc, _RowStart)):
            mods.append(p)
        elif isinstance(p, gym.NattenAxis):
            nattens.append(p)
        elif isinstance(p, _QBound):
            raise _No("q against a constant outside a union with a disc")
        else:
            raise _No("kv against a constant outside a union with kv <= q")
    starts = [p for p in mods if isinstance(p, _RowStart)]
    mods = [p for p in mods if not isinstance(p, _RowStart)]
    for p in mods:  # inside one chunk of c keys, kv % c - q % c == kv - q (one doc: alike)
        if isinstance(p, _InDoc):
            if not docs or docs[0].t is not p.doc:
                raise _No("document terms outside a conjunction with doc[q] == doc[kv]")
            p = p.atom
        elif p.c not in chunks:
            raise _No("(q % c) op (kv % c) outside a conjunction with q // c == kv // c")
        lo = [v for v in (band.lo, p.lo) if v is not None]
        hi = [v for v in (band.hi, p.hi) if v is not None]
        band = _Band(max(lo) if lo else None, min(hi) if hi else None)
    out: list[Mask] = [_clear(d, [], [], nq, nk) for d in discs] + gym.natten(nattens, nq, nk)
    causal_left = _is_causal(band)
    if docs:
        if nq != nk:
            raise _No("doc[q] == doc[kv] with q_len != kv_len")
        tables = [t for p in mods if isinstance(p, _InDoc) for t in p.tables]
        out.append(masks.document(_doc_lengths(docs[0].t, nq, tables), causal=causal_left))
        if causal_left:
            band = _Band(None, None)
    if starts:
        if len(starts) > 1 or docs or not causal_left or nq != nk:
            raise _No("kv >= t[doc[q]] other than with kv <= q alone (q_len == kv_len)")
        out.append(masks.document(_start_lengths(starts[0], nq), causal=True))
        band = _Band(None, None)
    if len(chunks) == 1 and causal_left and not docs:
        out.append(masks.chunked(chunks.pop()))
        band = _Band(None, None)
    out += [_rule(f"chunk({c})") for c in sorted(chunks)]
    out += [masks.block_causal(c) for c in sorted(blocks)]
    if _is_causal(band):
        out.append(masks.causal())
    elif band.hi == 0 and band.lo is not None and band.lo <= 0:
        out.append(masks.sliding_window(1 - band.lo))
    elif band.lo is not None or band.hi is not None:
        lo = -nq if band.lo is None else max(band.lo, -nq)
        hi = nk if band.hi is None else min(band.hi, nk)
        if lo > hi:
            raise _No("an empty band")
        out.append(_rule(f"band({lo}, {hi})"))
    out += [_disj(o.parts, nq, nk) for o in ors]
    if not out:
        raise _No("a mask that is always true")
    m = out[0]
    for x in out[1:]:
        m = m & x
    return m


def _clear(d: _Disc, qs: list, kvs: list, nq: int, nk: int) -> Mask:
    """``clear`` of disc ``d`` and its text terms ``q < T`` (``qs``), ``kv < T`` (``kvs``)."""
    if len(qs) > 1 or len(kvs) > 1 or (d.text > 0 and not (qs and kvs)):
        raise _No("a disc without exactly its two text terms q < T and kv < T")
    if any((b.lo, b.hi) != (None, d.text - 1) for b in qs + kvs):
        raise _No("a text term other than q < T or kv < T, T the grid's offset")
    if nq != nk or nq - d.text <= 0 or (nq - d.text) % d.w:
        raise _No("a disc whose grid is not (q_len - T) / w rows of w tokens, q_len == kv_len")
    return masks.clear(((nq - d.text) // d.w, d.w), d.r, d.text)


def _disj(parts: list, nq: int, nk: int) -> Mask:
    out = []
    discs = [p for p in parts if isinstance(p, _Disc)]
    glob = None if discs else gym.global_local(parts, nq, nk)
    if glob is not None:
        return glob
    if discs or any(isinstance(p, _QBound) for p in parts):
        if len(discs) != 1:
            raise _No("q against a constant outside a union with one disc")
        qs = [p for p in parts if isinstance(p, _QBound)]
        kvs = [p for p in parts if isinstance(p, _KvBound)]
        out.append(_clear(discs[0], qs, kvs, nq, nk))
        parts = [p for p in parts if not isinstance(p, (_Disc, _QBound, _KvBound))]
    if any(isinstance(p, _Band) and _is_causal(p) for p in parts):
        parts = [_prefix_box(p) for p in parts]
    bounds = [p for p in parts if isinstance(p, _KvBound)]
    rest = [p for p in parts if not isinstance(p, _KvBound)]
    causal = [p for p in rest if isinstance(p, _Band) and _is_causal(p)]
    if bounds:
        if len(bounds) != 1 or not causal or bounds[0].lo not in (None, 0) or bounds[0].hi is None:
            raise _No("kv against a constant outside a union with kv <= q")
        rest.remove(causal[0])
        out.append(masks.prefix_lm(min(max(0, bounds[0].hi + 1), _LIMIT)))
    out += [_mask(p, nq, nk) for p in rest]
    if any(isinstance(x, TiledGrid) for x in out):
        raise _No("tiled NATTEN windows in a union (tile_grid is outermost)")
    m = out[0]
    for x in out[1:]:
        m = m | x
    return m


def _prefix_box(p):
    """``(q <= a) & (kv <= b)`` with ``a >= b - 1`` as ``kv <= b`` (FlashAttention-4's
    prefix-LM), for a part of a union with ``kv <= q``: the pairs it adds, ``q > a``,
    ``kv <= b``, have ``kv <= b <= a + 1 <= q``, so the causal part holds them already.
    Other parts unchanged."""
    if not isinstance(p, _And) or len(p.parts) != 2:
        return p
    qs = [x for x in p.parts if isinstance(x, _QBound)]
    kvs = [x for x in p.parts if isinstance(x, _KvBound)]
    if len(qs) != 1 or len(kvs) != 1 or qs[0].lo is not None or qs[0].hi is None:
        return p
    if kvs[0].lo is not None or kvs[0].hi is None or qs[0].hi < kvs[0].hi - 1:
        return p
    return kvs[0]


def _mask(f, nq: int, nk: int) -> Mask:
    if isinstance(f, _Or):
        return _disj(f.parts, nq, nk)
    return _conj(f.parts if isinstance(f, _And) else [f], nq, nk)


def recognise(gm, q_len: int, kv_len: int) -> Mask | None:
    """The region-language mask equal to the traced mask_mod ``gm`` (a ``torch.fx``
    GraphModule) at ``(q_len, kv_len)``, or None (the reason is logged at DEBUG on
    ``compilemask.migrate``). Captured tables are read on whatever device they live (one
    host copy); the mask holds their values, not the tensors."""
    try:
        f = formula(gm)
        if isinstance(f, _Const):  # every pair (an empty mask is left to the lifting)
            if not f.value:
                raise _No("a mask that is always false")
            return _rule(f"band({-q_len}, {kv_len})")
        if prefix.is_form(f):
            return prefix.shared_prefix(f, q_len, kv_len)
        if packed.has_rows(f):
            return packed.packed_mask(f, q_len, kv_len, (_And, _Or, _Band, _Doc))
        return _mask(f, q_len, kv_len)
    except (_No, packed.NoForm) as exc:
        log.debug("mask_mod not a recognised form: %s", exc)
    except Exception as exc:  # noqa: BLE001 - the lifted / evaluated paths report errors
        log.debug("mask_mod not a recognised form: %s: %s", type(exc).__name__, exc)
    return None
