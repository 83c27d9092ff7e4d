"""Documents that share a prefix document (attention-gym's ``shared_prefix``) recognised in the
trace and written as ``shared_prompt``.

The form, with ``doc`` the token's document id, ``off`` the documents' offsets and ``pd`` each
document's prefix document (captured 1-D integer tensors)::

    (kv >= off[doc[q]]) & (kv <= q)                                       # own document, causal
    | (doc[q] != pd[doc[q]]) & (kv >= off[pd[doc[q]]]) & (kv < off[pd[doc[q]] + 1])  # its prefix

(the parts of each ``&`` in any order, ``q >= kv`` for ``kv <= q``). Recognised when
``q_len == kv_len == N`` and, read once on the host (``doc[:N]``, ``off``, ``pd``): the ids
``doc[:N]`` are non-decreasing runs (documents) with every id in range of ``pd`` and ``off``
(``0 <= id``, ``id + 1 < len(off)``), ``off[d]`` is the first token of each document ``d``
present and ``off[d + 1]`` the token past its last where ``d`` is a prefix, and the documents
form groups of consecutive runs: a head ``h`` with ``pd[h] == h`` followed by the documents
with ``pd[d] == h``. Then row ``q`` of document ``d`` sees ``[off[d], q]`` and, when
``d != pd[d]``, the whole head document ``[off[h], off[h + 1])``, which lies before ``d``: the
group is ``shared_prompt``'s prompt (the head) and responses (the others). A head alone (no
response) of ``L`` tokens is written as a prompt of ``L - 1`` and one response of 1 (the same
causal rows). Anything else of these values raises (recognise's fallback to the lifting).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ... import masks
from ...language.ast import Mask
from . import packed
from . import recognise as r


@dataclass(frozen=True)
class Nested:  # off[pd[doc[q]] + c]
    off: torch.Tensor = field(compare=False)
    pd: torch.Tensor = field(compare=False)
    doc: torch.Tensor = field(compare=False)
    c: int


@dataclass
class NotHead:  # doc[q] != pd[doc[q]]
    pd: torch.Tensor
    doc: torch.Tensor


@dataclass
class PrefixLo:  # kv >= off[pd[doc[q]]]
    off: torch.Tensor
    pd: torch.Tensor
    doc: torch.Tensor


@dataclass
class PrefixHi:  # kv < off[pd[doc[q]] + 1]
    off: torch.Tensor
    pd: torch.Tensor
    doc: torch.Tensor


ATOMS = (NotHead, PrefixLo, PrefixHi)


def _pd_of_doc(v):
    """``(pd, doc, c)`` of ``pd[doc[q]] + c`` (a ``recognise._DocLin``), else None."""
    if not isinstance(v, r._DocLin) or len(v.terms) != 1 or (v.lin.a, v.lin.b) != (0, 0):
        return None
    coef, pd, doc, var = v.terms[0]
    return (pd, doc, v.lin.c) if coef == 1 and var == "q" else None


def op(name: str, target, args):
    """The value of operation ``name`` when it makes or uses this module's values, else None."""
    x, y = (list(args) + [None])[:2]
    if name == "getitem" and len(args) == 2 and isinstance(x, torch.Tensor):
        inner = _pd_of_doc(y)
        if inner is None:
            return None
        if x.dim() != 1:
            raise r._No("off[pd[doc[q]] + c] of a table other than 1-D")
        return Nested(x, *inner)
    if name == "ne" and len(args) == 2:
        g, v = (x, y) if isinstance(x, r._Gather) else (y, x)
        inner = _pd_of_doc(v)
        if isinstance(g, r._Gather) and inner is not None:
            pd, doc, c = inner
            if g.var == "q" and g.c == 0 and c == 0 and g.t is doc:
                return NotHead(pd, doc)
    if not any(isinstance(a, Nested) for a in args):
        return None
    if name in r._CMPS and len(args) == 2:
        k, n, op_ = (x, y, name) if isinstance(y, Nested) else (y, x, r._FLIP[name])
        if isinstance(n, Nested) and isinstance(k, r._Lin) and (k.a, k.b, k.c) == (0, 1, 0):
            if op_ == "ge" and n.c == 0:
                return PrefixLo(n.off, n.pd, n.doc)
            if op_ == "lt" and n.c == 1:
                return PrefixHi(n.off, n.pd, n.doc)
    raise r._No(f"{name} of off[pd[doc[q]] + c] other than a shared prefix's key bounds")


def is_form(f) -> bool:
    """Whether the formula holds this module's atoms (then only :func:`shared_prefix` may
    write it)."""
    parts = f.parts if isinstance(f, (r._And, r._Or)) else [f]
    return any(
        isinstance(p, ATOMS)
        or (isinstance(p, r._And) and any(isinstance(a, ATOMS) for a in p.parts))
        for p in parts
    )


def _split(f):
    """``(off, pd, doc)`` of the exact two-part union, else raise."""
    if not isinstance(f, r._Or) or len(f.parts) != 2:
        raise r._No("a shared prefix other than a union of the own and the prefix part")
    own = [p for p in f.parts if isinstance(p, r._And) and len(p.parts) == 2]
    pre = [p for p in f.parts if isinstance(p, r._And) and len(p.parts) == 3]
    if len(own) != 1 or len(pre) != 1:
        raise r._No("a shared prefix other than (own & causal) | (not head & lo & hi)")
    starts = [p for p in own[0].parts if isinstance(p, r._RowStart) and not p.strict]
    bands = [p for p in own[0].parts if isinstance(p, r._Band) and r._is_causal(p)]
    if len(starts) != 1 or len(bands) != 1:
        raise r._No("a shared prefix whose own part is not kv >= off[doc[q]] with kv <= q")
    off, doc = starts[0].t, starts[0].doc
    kinds = {type(p): p for p in pre[0].parts}
    if set(kinds) != {NotHead, PrefixLo, PrefixHi}:
        raise r._No("a shared prefix whose prefix part is not its three terms")
    pd = kinds[NotHead].pd
    for p in pre[0].parts:
        if p.doc is not doc or p.pd is not pd or getattr(p, "off", off) is not off:
            raise r._No("a shared prefix over two different doc, pd or off tables")
    return off, pd, doc


def shared_prefix(f, nq: int, nk: int) -> Mask:
    """``shared_prompt(...)`` of the formula ``f`` at ``q_len == kv_len == nq`` (raises
    ``recognise._No`` / ``packed.NoForm`` when a condition of the module docstring fails)."""
    off, pd, doc = _split(f)
    if nq != nk or not packed.readable(doc, nq):
        raise r._No("a shared prefix with q_len != kv_len or doc not covering the length")
    tables = (off, pd)
    if any(t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) for t in tables):
        raise r._No("off or pd not a 1-D int32 / int64 table")
    if len({doc.device, off.device, pd.device}) != 1:
        raise r._No("shared prefix tables on two devices")
    parts = [doc[:nq].to(torch.int64), off.to(torch.int64), pd.to(torch.int64)]
    host = torch.cat(parts).cpu().numpy()  # the one host read
    d, o, p = host[:nq], host[nq : nq + off.shape[0]], host[nq + off.shape[0] :]
    s, e, _ = packed.runs(d)
    ids = d[s]
    if ids.min() < 0 or ids.max() >= len(p) or ids.max() + 1 >= len(o):
        raise r._No("document ids outside pd or off")
    if (o[ids] != s).any():
        raise r._No("off[d] is not the first token of document d")
    heads = p[ids]
    where = {int(v): j for j, v in enumerate(ids)}
    prompts, responses, group = [], [], None
    for j, v in enumerate(ids):
        h = int(heads[j])
        if h == v:
            if o[v + 1] != e[j]:
                raise r._No("off[h + 1] is not the end of prefix document h")
            prompts.append(int(e[j] - s[j]))
            responses.append([])
            group = v
        elif group is None or h != group or where.get(h) is None:
            raise r._No("documents not in groups led by their prefix document")
        else:
            responses[-1].append(int(e[j] - s[j]))
    for g, resp in enumerate(responses):
        if not resp:  # a prefix alone: its causal rows as a prompt and one response
            prompts[g] -= 1
            resp.append(1)
    return masks.shared_prompt(prompts, responses)
