"""Packed-sequence mask_mods with per-row tables, recognised as ``hstu`` and ``shared_prompt``.

``recognise.py`` reads a comparison of ``kv_idx`` or ``q_idx`` with a captured 1-D integer
table gathered by ``q_idx`` as a row atom: ``kv op t[q]`` (:class:`KvRow`, a per-row key bound)
or ``q op t[q]`` (:class:`QRow`, a row predicate). Two formulas built from them are recognised
(``&`` and ``|`` in any order and nesting that flattens to these parts, comparisons in either
orientation, ``<`` or ``<=``):

* ``u[q] == u[kv] & ((kv < e[q] & ((kv <= q) | (q < c[q]) | (q >= e2[q]))) | (kv == q))``:
  ``hstu(lengths, num_targets, contextual)``. ``u`` non-decreasing gives the users
  ``[s, e)``; ``e`` and ``e2`` must equal one value ``h`` per user with ``s < h <= e`` (the
  history's end: ``num_targets = e - h``); ``c`` one value per user with ``min(max(c - s, 0),
  h - s) == min(C, h - s)`` for one ``C >= 0`` (``contextual``).
* ``(kv <= q) & g[q] == g[kv] & ((kv < p[q]) | (r[q] == r[kv]))``: ``shared_prompt(prompts,
  responses)``. ``g`` non-decreasing gives the groups ``[s, e)``; ``p`` must be one value
  ``pe`` per group with ``s <= pe < e`` (the prompt's end); the response ids ``r`` on
  ``[pe, e)`` split it into runs (the responses) whose ids are distinct within the group (ids
  on the prompt do not matter: every prompt key is seen by the whole group).

Exactness: under these conditions each row's keys are, by the formula, what the catalogue
mask gives (``hstu``: the first ``min(C, h - s)`` rows see ``[s, h)``, later history rows and
the first target ``[s, q + 1)``, later targets ``[s, h)`` and ``q``; ``shared_prompt``: prompt
rows ``[s, q + 1)``, a response row ``[s, pe)`` and ``[its response's start, q + 1)``);
``tests/test_recognise.py`` checks against ``create_mask``. Every table is read in one
device-to-host copy, on whatever one device the tables live (the catalogue mask holds their
values, built on the plan's device: ``"cuda"`` and ``"cuda:0"`` are never told apart); a table
that is not 1-D integer covering ``N``, tables on two devices, or values that break a
condition give no form and the general lifting runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ... import masks
from ...language.ast import Mask

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class NoForm(Exception):
    """Not a packed form (the message says why)."""


@dataclass(frozen=True)
class KvRow:  # kv op t[q] + add, op one of lt / le / gt / ge / eq
    t: torch.Tensor = field(compare=False)
    op: str
    add: int = 0


@dataclass(frozen=True)
class QRow:  # q op t[q] + add
    t: torch.Tensor = field(compare=False)
    op: str
    add: int = 0


ROW_ATOMS = (KvRow, QRow)


def has_rows(f) -> bool:
    """Whether formula ``f`` holds a row atom anywhere."""
    if isinstance(f, ROW_ATOMS):
        return True
    return any(has_rows(p) for p in getattr(f, "parts", ()))


def packed_mask(f, nq: int, nk: int, kinds) -> Mask:
    """The catalogue mask of formula ``f`` (``kinds``: recognise's ``(And, Or, Band, Doc)``).

    Raises:
        NoForm: not one of the two forms, or its tables break a condition.
    """
    if nq != nk:
        raise NoForm("a packed form with q_len != kv_len")
    for match in (_hstu, _shared_prompt):
        got = match(f, kinds)
        if got is not None:
            return got[0](_read(got[1], nq))
    raise NoForm("row tables outside the hstu and shared_prompt forms")


# ------------------------------------------------------------------ matching


def _split(parts, want: dict):
    """``parts`` sorted into the slots of ``want`` (name -> predicate), one part each, or
    None when they do not fill them exactly."""
    out, rest = {}, list(parts)
    for name, ok in want.items():
        hit = [p for p in rest if ok(p)]
        if len(hit) != 1:
            return None
        out[name] = hit[0]
        rest.remove(hit[0])
    return out if not rest else None


def _band(kinds, lo, hi):
    band = kinds[2]
    return lambda p: isinstance(p, band) and (p.lo, p.hi) == (lo, hi)


def _is(cls, *ops):
    return lambda p: isinstance(p, cls) and p.op in ops


def _hstu(f, kinds):
    and_, or_, _, doc = kinds
    if not isinstance(f, and_):
        return None
    top = _split(f.parts, {"u": lambda p: isinstance(p, doc), "o": lambda p: isinstance(p, or_)})
    if top is None:
        return None
    outer = _split(top["o"].parts, {"diag": _band(kinds, 0, 0), "a": lambda p: isinstance(p, and_)})
    if outer is None:
        return None
    inner = _split(
        outer["a"].parts, {"key": _is(KvRow, "lt", "le"), "o": lambda p: isinstance(p, or_)}
    )
    if inner is None:
        return None
    rows = _split(
        inner["o"].parts,
        {"causal": _band(kinds, None, 0), "ctx": _is(QRow, "lt", "le"),
         "tgt": _is(QRow, "ge", "gt")},
    )  # fmt: skip
    if rows is None:
        return None
    key, ctx, tgt = inner["key"], rows["ctx"], rows["tgt"]
    tables = [top["u"].t, key.t, ctx.t, tgt.t]

    def build(vals):
        u, he, ce, he2 = vals
        he = he + key.add + (key.op == "le")  # kv < he
        ce = ce + ctx.add + (ctx.op == "le")  # q < ce
        he2 = he2 + tgt.add + (tgt.op == "gt")  # q >= he2
        s, e, new = runs(u)
        h = _per_run(he, s, new, "the history end")
        if not np.array_equal(he, he2):
            raise NoForm("the key bound and the target rows' bound differ")
        if not ((s < h) & (h <= e)).all():
            raise NoForm("a history end outside (start, end] of its user")
        c = np.minimum(np.maximum(_per_run(ce, s, new, "the contextual end") - s, 0), h - s)
        ctx_len = int(c.max())
        if not np.array_equal(c, np.minimum(ctx_len, h - s)):
            raise NoForm("contextual rows not min(C, history) for one C")
        return masks.hstu((e - s).tolist(), (e - h).tolist(), contextual=ctx_len)

    return build, tables


def _shared_prompt(f, kinds):
    and_, or_, _, doc = kinds
    if not isinstance(f, and_):
        return None
    top = _split(
        f.parts,
        {"causal": _band(kinds, None, 0), "g": lambda p: isinstance(p, doc),
         "o": lambda p: isinstance(p, or_)},
    )  # fmt: skip
    if top is None:
        return None
    o = _split(top["o"].parts, {"key": _is(KvRow, "lt", "le"), "r": lambda p: isinstance(p, doc)})
    if o is None:
        return None
    key = o["key"]

    def build(vals):
        g, p, r = vals
        p = p + key.add + (key.op == "le")  # kv < p
        s, e, new = runs(g)
        pe = _per_run(p, s, new, "the prompt end")
        if not ((s <= pe) & (pe < e)).all():
            raise NoForm("a prompt end outside [start, end) of its group")
        pos = np.arange(len(g))
        pe_tok = np.repeat(pe, e - s)
        prev = np.concatenate([[True], r[1:] != r[:-1]])
        starts = np.flatnonzero((pos >= pe_tok) & (prev | (pos == pe_tok)))
        grp = np.searchsorted(s, starts, side="right") - 1
        ends = np.minimum(np.append(starts[1:], len(g)), e[grp])
        order = np.lexsort((r[starts], grp))
        dup = (grp[order][1:] == grp[order][:-1]) & (r[starts][order][1:] == r[starts][order][:-1])
        if dup.any():
            raise NoForm("a response id used by two runs of one group")
        cuts = np.cumsum(np.bincount(grp, minlength=len(s)))[:-1]
        responses = [x.tolist() for x in np.split(ends - starts, cuts)]
        return masks.shared_prompt((pe - s).tolist(), responses)

    return build, [top["g"].t, key.t, o["r"].t]


# ------------------------------------------------------------------ tables


def readable(t: torch.Tensor, n: int) -> bool:
    """Whether ``t`` is a table whose first ``n`` values can be read: a 1-D integer tensor
    holding data (not ``meta``) of at least ``n`` values. Its device does not matter: the
    values are read to the host and the plan is built from them on its own device."""
    return t.dim() == 1 and t.dtype in _INT_DTYPES and t.device.type != "meta" and t.numel() >= n


def _read(tables: list, n: int) -> list:
    """The first ``n`` values of each table as int64 numpy arrays: one device-to-host copy
    (the tables on one device, any)."""
    uniq = list({id(t): t for t in tables}.values())
    if not all(readable(t, n) for t in uniq):
        raise NoForm("a table not 1-D integer covering the length")
    if len({t.device for t in uniq}) != 1:
        raise NoForm("tables on two devices")
    host = torch.cat([t[:n].to(torch.int64) for t in uniq]).cpu().numpy()  # the one host read
    by_id = {id(t): host[i * n : (i + 1) * n] for i, t in enumerate(uniq)}
    return [by_id[id(t)] for t in tables]


def runs(ids: np.ndarray):
    """Starts and ends of the runs of non-decreasing ``ids``, and where a run starts (bool
    per token)."""
    if (ids[1:] < ids[:-1]).any():
        raise NoForm("ids are not non-decreasing")
    new = np.concatenate([[True], ids[1:] != ids[:-1]])
    s = np.flatnonzero(new)
    return s, np.append(s[1:], len(ids)), new


def _per_run(t: np.ndarray, s: np.ndarray, new: np.ndarray, what: str) -> np.ndarray:
    """The one value of ``t`` on each run (raises when a run holds two)."""
    if ((t[1:] != t[:-1]) & ~new[1:]).any():
        raise NoForm(f"{what} is not one value per run")
    return t[s]
