"""Common mask_mod forms recognised in their ``torch.fx`` trace and written in the region language.

A recognised mask_mod is built by ``compile``'s own path (``pipeline.build_plan``: analytic
lowering of the catalogue masks, no per-row interval arithmetic and no probe). Recognised:

* comparisons of ``q_idx`` and ``kv_idx`` plus Python int constants, ``kv - q`` against a
  constant (``kv <= q``, ``kv < q``, ``kv >= q``, ``kv == q``, ``q - kv < w``, ...): a band
  ``lo <= kv - q <= hi`` -- ``causal()``, ``sliding_window(w)``, else a ``band(lo, hi)`` rule;
* ``kv < p`` (``kv <= c``) only in a union with ``kv <= q``: ``prefix_lm(p)``;
* ``q // c == kv // c`` (a ``chunk(c)`` rule; with ``kv <= q``: ``chunked(c)``) and
  ``kv // c <= q // c`` (``block_causal(c)``), ``c`` a positive int;
* ``doc[q] == doc[kv]`` with ``doc`` a captured 1-D integer tensor on the plan's device whose
  first ``N`` ids are non-decreasing (``q_len == kv_len == N``): ``document(lengths, causal)``
  with the run lengths (one host read of ``doc[:N]``);
* ``&`` / ``|`` of those (``~`` of a one-sided comparison), as ``&`` / ``|`` of masks.

Anything else -- ``b`` or ``h`` used, a float or tensor constant, another operation, an
unsorted ``doc``, a band that is empty or always true -- gives None and the general lifting
(``lift.py``) runs. Exactness: every form here has the same integer semantics on FlexAttention's
top-left indices as the mask it maps to (``tests/test_recognise.py`` checks against
``create_mask``).
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field

import torch

from ... import masks
from ...language.ast import Mask
from ...language.parser import parse

log = logging.getLogger("compilemask.migrate")

_LIMIT = 2**30  # constants and bounds kept far from int32 overflow of the indices
_CMPS = {"lt", "le", "gt", "ge", "eq"}
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}
_AND = {"and", "logical_and", "bitwise_and"}
_OR = {"or", "logical_or", "bitwise_or"}
_NOT = {"invert", "logical_not", "bitwise_not"}
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class _No(Exception):
    """Not a recognised form (the message says why)."""


@dataclass(frozen=True)
class _Lin:  # a * q + b * kv + c, a and b in {-1, 0, 1}
    a: int
    b: int
    c: int


@dataclass(frozen=True)
class _Div:  # var // c
    var: str
    c: int


@dataclass(frozen=True)
class _Gather:  # t[var]
    t: torch.Tensor = field(compare=False)
    var: str


@dataclass
class _Band:  # lo <= kv - q <= hi (None: unbounded)
    lo: int | None
    hi: int | None


@dataclass
class _KvBound:  # lo <= kv <= hi
    lo: int | None
    hi: int | None


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
class _And:
    parts: list


@dataclass
class _Or:
    parts: list


_ATOMS = (_Band, _KvBound, _Chunk, _BlockCausal, _Doc)
_BOOL = (*_ATOMS, _And, _Or)


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


def _compare(x, y, op: str):
    if isinstance(x, _Div) and isinstance(y, _Div) and x.c == y.c and x.var != y.var:
        if op == "eq":
            return _Chunk(x.c)
        if (x.var, op) in (("kv", "le"), ("q", "ge")):
            return _BlockCausal(x.c)
        raise _No(f"{op} of q // c and kv // c")
    if isinstance(x, _Gather) and isinstance(y, _Gather):
        if op == "eq" and x.t is y.t and x.var != y.var:
            return _Doc(x.t)
        raise _No("a comparison of gathers other than doc[q] == doc[kv]")
    if isinstance(x, (_Div, _Gather)) or isinstance(y, (_Div, _Gather)):
        raise _No("a gather or floor division compared with another kind of value")
    d = _combine(_lin(x), _lin(y), -1)  # d op 0
    if d.a == -d.b and d.b != 0:  # +-(kv - q) + c op 0
        if d.b < 0:
            d, op = _Lin(-d.a, -d.b, -d.c), _FLIP[op]
        return _Band(*_bounds(op, -d.c))
    if d.a == 0 and d.b != 0:
        if d.b < 0:
            d, op = _Lin(0, 1, -d.c), _FLIP[op]
        return _KvBound(*_bounds(op, -d.c))
    raise _No("a comparison other than kv - q or kv against a constant")


def _negate(v):
    if isinstance(v, (_Band, _KvBound)) and (v.lo is None) != (v.hi is None):
        return type(v)(None, v.lo - 1) if v.hi is None else type(v)(v.hi + 1, None)
    raise _No("~ of a value other than a one-sided comparison")


def _attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def formula(gm):
    """The boolean formula of a traced mask_mod (``_Band`` ... ``_Or``).

    Raises:
        _No: not built from the recognised forms only.
    """
    env: dict = {}
    places = []
    out = None
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            places.append(node)
            env[node] = ("placeholder", len(places) - 1)
            continue
        if node.op == "output":
            out = env.get(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
            break
        if node.op == "get_attr":
            env[node] = _attr(gm, node.target)
            continue
        if node.kwargs:
            raise _No(f"keyword arguments to {node.target}")
        args = [env[a] if isinstance(a, torch.fx.Node) else a for a in node.args]
        for a in args:
            if isinstance(a, tuple) and a[0] == "placeholder":
                if a[1] < 2:
                    raise _No("the mask_mod uses b or h")
        args = [_idx(a) for a in args]
        env[node] = _op(_name(node), node.target, args)
    if len(places) != 4:
        raise _No("not a mask_mod(b, h, q_idx, kv_idx)")
    if not isinstance(out, _BOOL):
        raise _No("the output is not a recognised boolean")
    return out


def _idx(a):
    if isinstance(a, tuple) and len(a) == 2 and a[0] == "placeholder":
        return _Lin(1, 0, 0) if a[1] == 2 else _Lin(0, 1, 0)
    return a


def _op(name: str, target, args):
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
    if name in ("floordiv", "floor_divide") and len(args) == 2:
        x, c = args
        c = _int(c)
        if not isinstance(x, _Lin) or c < 1 or (x.a, x.b, x.c) not in ((1, 0, 0), (0, 1, 0)):
            raise _No("a floor division other than q // c or kv // c, c >= 1")
        return _Div("q" if x.a else "kv", c)
    if name == "getitem" and target in (operator.getitem, "__getitem__") and len(args) == 2:
        t, x = args
        if not isinstance(t, torch.Tensor) or not isinstance(x, _Lin):
            raise _No("indexing other than a captured tensor by q or kv")
        if (x.a, x.b, x.c) not in ((1, 0, 0), (0, 1, 0)):
            raise _No("a gather at an index other than q or kv")
        return _Gather(t, "q" if x.a else "kv")
    if name in _CMPS and len(args) == 2:
        return _compare(args[0], args[1], name)
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


def _doc_lengths(t: torch.Tensor, n: int, device) -> list[int]:
    if t.dim() != 1 or t.dtype not in _INT_DTYPES or t.device != device or t.numel() < n:
        raise _No("doc is not a 1-D integer tensor on the plan's device covering the length")
    d = t[:n].to("cpu", torch.int64)  # the one host read
    step = d[1:] - d[:-1]
    if bool((step < 0).any()):
        raise _No("doc ids are not non-decreasing")
    cuts = torch.nonzero(step).flatten() + 1
    ends = torch.cat([cuts, torch.tensor([n])])
    return torch.diff(ends, prepend=torch.tensor([0])).tolist()


def _is_causal(b: _Band) -> bool:
    return b.lo is None and b.hi == 0


def _conj(parts: list, nq: int, nk: int, device) -> Mask:
    band = _Band(None, None)
    chunks, blocks, docs, ors = set(), set(), [], []
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
        else:
            raise _No("kv against a constant outside a union with kv <= q")
    out: list[Mask] = []
    causal_left = _is_causal(band)
    if docs:
        if nq != nk:
            raise _No("doc[q] == doc[kv] with q_len != kv_len")
        out.append(masks.document(_doc_lengths(docs[0].t, nq, device), causal=causal_left))
        if causal_left:
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
    out += [_disj(o.parts, nq, nk, device) for o in ors]
    if not out:
        raise _No("a mask that is always true")
    m = out[0]
    for x in out[1:]:
        m = m & x
    return m


def _disj(parts: list, nq: int, nk: int, device) -> Mask:
    bounds = [p for p in parts if isinstance(p, _KvBound)]
    rest = [p for p in parts if not isinstance(p, _KvBound)]
    causal = [p for p in rest if isinstance(p, _Band) and _is_causal(p)]
    if bounds:
        if len(bounds) != 1 or not causal or bounds[0].lo not in (None, 0) or bounds[0].hi is None:
            raise _No("kv against a constant outside a union with kv <= q")
        rest.remove(causal[0])
        out = [masks.prefix_lm(min(max(0, bounds[0].hi + 1), _LIMIT))]
    else:
        out = []
    out += [_mask(p, nq, nk, device) for p in rest]
    m = out[0]
    for x in out[1:]:
        m = m | x
    return m


def _mask(f, nq: int, nk: int, device) -> Mask:
    if isinstance(f, _Or):
        return _disj(f.parts, nq, nk, device)
    return _conj(f.parts if isinstance(f, _And) else [f], nq, nk, device)


def recognise(gm, q_len: int, kv_len: int, device) -> Mask | None:
    """The region-language mask equal to the traced mask_mod ``gm`` (a ``torch.fx``
    GraphModule) at ``(q_len, kv_len)``, or None (the reason is logged at DEBUG on
    ``compilemask.migrate``)."""
    try:
        return _mask(formula(gm), q_len, kv_len, torch.device(device))
    except _No as exc:
        log.debug("mask_mod not a recognised form: %s", exc)
    except Exception as exc:  # noqa: BLE001 - the lifted / evaluated paths report errors
        log.debug("mask_mod not a recognised form: %s: %s", type(exc).__name__, exc)
    return None
