"""Documents per batch row and head: ``doc[b, h, q_idx] == doc[b, h, kv_idx]`` (FlashAttention-4's
``fa4_document``) recognised in the trace and written as ``per_batch`` / ``per_head`` lists of
``recognise.py``'s masks.

* ``t[b, h, q]`` / ``t[b, h, kv]`` (``t`` a captured 3-D tensor indexed by the mask_mod's own
  ``b`` and ``h``, then ``q_idx`` or ``kv_idx``) is a :class:`BHGather`; the one operation on it
  is ``==`` of the two of one table, a ``recognise._Doc`` of the 3-D table. Anything else of a
  :class:`BHGather` raises (recognise's fallback to the lifting).
* :func:`recognise_parts`: a formula holding such a table (one, of an integer dtype, at least
  ``[batch or 1, heads or 1, N]``, ``q_len == kv_len == N``) is read once (``t[:B, :H, :N]``,
  one host copy) and, per ``(b, h)`` FlexAttention calls (``b`` in ``range(batch)``, 0 when
  ``batch`` is None; ``h`` alike), the formula with the table's row ``t[b, h]`` in its place is
  written by ``recognise.py`` (so ``document(lengths, causal)`` with the row's runs, and
  whatever else the conjunction holds). The masks are then ``per_batch([per_head([...])])``
  (``per_batch`` only with ``batch``, ``per_head`` only with ``heads``). Exact: on every
  ``(b, h)`` FlexAttention evaluates, ``t[b, h, i]`` is the row's value at ``i``.

A formula without a 3-D table goes to ``recognise.recognise`` (only when neither ``batch`` nor
``heads`` is given: a plan that depends on them is left to the lifting).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from ... import masks
from ...language.ast import Mask
from . import packed
from . import recognise as r

log = logging.getLogger("compilemask.migrate")

_INT = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclasses.dataclass(frozen=True)
class BHGather:  # t[b, h, var]
    t: torch.Tensor = dataclasses.field(compare=False)
    var: str


@dataclasses.dataclass
class BHDoc(r._Doc):  # t[b, h, q] == t[b, h, kv]: a document atom per (b, h)
    pass


def _bh_index(x) -> str | None:
    """``"q"`` / ``"kv"`` when ``x`` is the index tuple ``(b, h, q_idx | kv_idx)`` (the
    placeholders themselves, as ``recognise._formula`` resolves them), else None."""
    if not isinstance(x, tuple) or len(x) != 3:
        return None
    if not all(isinstance(a, tuple) and len(a) == 2 and a[0] == "placeholder" for a in x):
        return None
    if (x[0][1], x[1][1]) != (0, 1) or x[2][1] not in (2, 3):
        return None
    return "q" if x[2][1] == 2 else "kv"


def op(name: str, target, args):
    """The value of operation ``name`` when it makes or uses a :class:`BHGather`, else None."""
    if name == "getitem" and len(args) == 2 and isinstance(args[0], torch.Tensor):
        var = _bh_index(args[1])
        if var is not None:
            if args[0].dim() != 3:
                raise r._No("t[b, h, idx] of a table other than 3-D")
            return BHGather(args[0], var)
    if not any(isinstance(a, BHGather) for a in args):
        return None
    x, y = (list(args) + [None])[:2]
    if name == "eq" and len(args) == 2 and isinstance(x, BHGather) and isinstance(y, BHGather):
        if x.t is y.t and x.var != y.var:
            return BHDoc(x.t)
    raise r._No(f"{name} of t[b, h, idx] other than t[b, h, q] == t[b, h, kv]")


def _tables(f, bh: dict, other: dict) -> None:
    """The tables of :class:`BHDoc` atoms of the formula ``f`` into ``bh``, every other
    tensor it holds into ``other`` (``{id: t}``)."""
    if isinstance(f, BHDoc):
        bh[id(f.t)] = f.t
    elif isinstance(f, torch.Tensor):
        other[id(f)] = f
    elif isinstance(f, (list, tuple)):
        for x in f:
            _tables(x, bh, other)
    elif dataclasses.is_dataclass(f) and not isinstance(f, type):
        for fld in dataclasses.fields(f):
            _tables(getattr(f, fld.name), bh, other)


def recognise_parts(gm, q_len: int, kv_len: int, batch, heads) -> Mask | None:
    """The region-language mask of the traced mask_mod ``gm`` for the ``(b, h)`` FlexAttention
    evaluates (a ``per_batch`` / ``per_head`` list when ``batch`` / ``heads`` is given), or
    None (the reason logged at DEBUG)."""
    try:
        f = r.formula(gm)
    except r._No as exc:
        log.debug("mask_mod not a recognised form: %s", exc)
        return None
    found, other = {}, {}
    _tables(f, found, other)
    if not found:
        return r.recognise(gm, q_len, kv_len) if batch is None and heads is None else None
    try:
        if any(k in other for k in found):  # t[q] of the same 3-D table elsewhere
            raise r._No("a t[b, h, idx] table also used otherwise")
        return _parts(f, list(found.values()), q_len, kv_len, batch, heads)
    except (r._No, packed.NoForm) as exc:
        log.debug("mask_mod not a recognised form: %s", exc)
    except Exception as exc:  # noqa: BLE001 - the lifted / evaluated paths report errors
        log.debug("mask_mod not a recognised form: %s: %s", type(exc).__name__, exc)
    return None


def _parts(f, tables: list, nq: int, nk: int, batch, heads) -> Mask:
    nb, nh = batch or 1, heads or 1
    if len(tables) != 1 or packed.has_rows(f) or isinstance(f, r._Const):
        raise r._No("t[b, h, idx] other than one document table")
    (t,) = tables
    if t.dtype not in _INT or t.device.type == "meta" or nq != nk:
        raise r._No("t[b, h, idx] of a non-integer table, or q_len != kv_len")
    if t.shape[0] < nb or t.shape[1] < nh or t.shape[2] < nq:
        raise r._No("t[b, h, idx] of a table smaller than (batch, heads, length)")
    host = t[:nb, :nh, :nq].to("cpu", torch.int64).numpy()  # the one host read
    rows = [[_part(f, t, np.ascontiguousarray(host[b, h]), nq, nk) for h in range(nh)]
            for b in range(nb)]  # fmt: skip
    per = [masks.per_head(row) if heads is not None else row[0] for row in rows]
    return masks.per_batch(per) if batch is not None else per[0]


def _part(f, t: torch.Tensor, row: np.ndarray, nq: int, nk: int) -> Mask:
    """``recognise.py``'s mask of ``f`` with the table ``t`` replaced by its row ``row``."""
    return r._mask(r._rebind(f, {id(t): row}), nq, nk)
