"""The abstract values of the lifter (``lift.py``) and the operations it runs on values of
``q_idx`` alone or ``kv_idx`` alone (directly, or under ``torch.vmap`` with FlexAttention's
scalar semantics)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree


class Unsupported(Exception):
    """The mask_mod (or one of its operations) has no analytic form here."""


@dataclass
class QV:
    t: torch.Tensor
    aff: tuple | None = None  # (a, c): ``t == a * q_idx + c`` exactly (int64)


@dataclass
class KV:
    t: torch.Tensor
    aff: tuple | None = None  # (a, c): ``t == a * kv_idx + c`` exactly (int64)


@dataclass
class Sep:
    f: torch.Tensor  # int64 [Nq] or 0-d
    g: torch.Tensor | None  # int64 [Nk] or 0-d; None when ``ga`` gives it
    ga: tuple | None = None  # (a, c): ``g == a * kv_idx + c`` exactly


@dataclass
class AbsSep:
    s: Sep


@dataclass
class SumSq:
    """``sum(s * s for s in terms)`` of separable terms (a disc: ``dy * dy + dx * dx``)."""

    terms: list


@dataclass
class Iv:
    lo: torch.Tensor
    hi: torch.Tensor


@dataclass
class Pending:
    base: Iv | None
    cmps: list  # (g [Nk] int64 or an affine (a, c) with |a| == 1, op, t [Nq] or 0-d int64)


@dataclass
class Disj:
    parts: list  # Iv, Pending or other boolean values of (q, kv): their union


#: ``operator`` functions that act element by element on integer and bool tensors
_ELEMENTWISE = frozenset({"add", "sub", "mul", "floordiv", "mod", "lt", "le", "gt", "ge", "eq",
                          "ne", "and", "or", "xor", "neg", "invert"})  # fmt: skip


def _elementwise(fn, args):
    """``fn(*args)`` applied to the values directly when every operand is a Python int or bool
    or a 1-D integer or bool value of one kind (QV or KV): element by element it is what
    vmap computes, without vmap's host cost. None for any other form."""
    kinds = {type(a) for a in args if isinstance(a, (QV, KV))}
    if len(kinds) != 1:
        return None
    vals = []
    for a in args:
        if isinstance(a, (QV, KV)):
            if a.t.dim() != 1 or a.t.dtype.is_floating_point or a.t.is_complex():
                return None
            vals.append(a.t)
        elif type(a) in (int, bool):
            vals.append(a)
        else:
            return None
    out = fn(*vals)
    return kinds.pop()(out) if isinstance(out, torch.Tensor) else None


def _affine_step(name: str, args):
    """``v + c``, ``c + v``, ``v - c``, ``c - v``, ``v * c``, ``c * v``, ``-v`` of an affine int64
    index value ``v`` (QV or KV with ``aff``) and a Python int ``c``: the value computed as
    the int64 tensor operation it is, and its affine form kept. None for any other form."""
    if name == "neg":
        (v,) = args
        if isinstance(v, (QV, KV)) and v.aff is not None and v.t.dtype == torch.int64:
            return type(v)(-v.t, (-v.aff[0], -v.aff[1]))
        return None
    if len(args) != 2:
        return None
    left = isinstance(args[0], (QV, KV))
    v, c = args if left else args[::-1]
    if not isinstance(v, (QV, KV)) or v.aff is None or v.t.dtype != torch.int64:
        return None
    if type(c) is not int:
        return None
    a, b = v.aff
    if name == "add":
        return type(v)(v.t + c, (a, b + c))
    if name == "mul":
        return type(v)(v.t * c, (a * c, b * c))
    if left:  # v - c
        return type(v)(v.t - c, (a, b - c))
    return type(v)(c - v.t, (-a, c - b))


def _gather(table, index):
    """``table[index]`` for a constant tensor indexed by ints, 0-d integer tensors and one kind
    of per-index integer values (QV or KV, 1-D): plain advanced indexing gives what vmap with
    ``aten.index`` gives, without its cost. None for any other form. (A 0-d tensor index is
    read to the host by Python's indexing, as in the mask_mod itself; the lifter passes the
    ``b`` and ``h`` it knows as ints.)"""
    items = index if isinstance(index, tuple) else (index,)
    if not isinstance(table, torch.Tensor) or len(items) > table.dim():
        return None
    kinds = {type(i) for i in items if isinstance(i, (QV, KV))}
    if len(kinds) != 1:
        return None
    cls = kinds.pop()
    idx = []
    for i in items:
        t = i.t if isinstance(i, (QV, KV)) else i
        if isinstance(t, bool) or not isinstance(t, (int, torch.Tensor)):
            return None
        if isinstance(t, int):  # a Python int stays one: bounds checked on the host, no copy
            idx.append(t)
            continue
        t = t.to(table.device)
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() > 1:
            return None
        if t.dim() == 1 and not isinstance(i, (QV, KV)):
            return None
        idx.append(t)
    return cls(table[tuple(idx)])


def _callable(node):
    if node.op == "call_method":
        return lambda self, *a, **k: getattr(self, node.target)(*a, **k)
    return node.target


def _vmapped(fn, args, kwargs, cls):
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    flat, spec = pytree.tree_flatten((args, kwargs))
    pos = [i for i, x in enumerate(flat) if isinstance(x, cls)]
    others = [i for i, x in enumerate(flat) if isinstance(x, (QV, KV)) and i not in pos]
    if others:
        raise Unsupported("q and kv values in one operation")

    def inner(*vals):
        leaves = list(flat)
        for i, v in zip(pos, vals):
            leaves[i] = v
        a, k = pytree.tree_unflatten(leaves, spec)
        return fn(*a, **k)

    with TransformGetItemToIndex():
        out = torch.vmap(inner)(*[flat[i].t for i in pos])
    if not isinstance(out, torch.Tensor):
        raise Unsupported(f"an operation returned {type(out).__name__}")
    return out


def _is_bool(v) -> bool:
    if isinstance(v, (QV, KV)):
        return v.t.dtype == torch.bool
    return isinstance(v, bool) or (isinstance(v, torch.Tensor) and v.dtype == torch.bool)


def _is_bool_scalar(v) -> bool:
    if isinstance(v, bool):
        return True
    return isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype == torch.bool


def _is_int_scalar(v) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return True
    return isinstance(v, torch.Tensor) and v.dim() == 0 and not v.dtype.is_floating_point


def _check_bool(out):
    if isinstance(out, (QV, KV)) and out.t.dtype != torch.bool:
        raise Unsupported("the mask_mod does not return a bool")
    if isinstance(out, (Sep, AbsSep)):
        raise Unsupported("the mask_mod does not return a bool")
    return out
