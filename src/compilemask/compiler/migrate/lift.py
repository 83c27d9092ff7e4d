"""Analytic lifting: a FlexAttention ``mask_mod`` to row intervals without evaluating N x N pairs.

The mask_mod is traced with ``torch.fx`` and its graph is run once per (b, h) on abstract values:

* ``Const``: does not depend on q or kv (a Python value or a tensor);
* ``QV`` / ``KV``: depends on ``q_idx`` only / ``kv_idx`` only: its value at every query
  ``[Nq, ...]`` (every key ``[Nk, ...]``), computed with FlexAttention's scalar semantics (the
  node's operation under ``torch.vmap``, tensor indexing as ``aten.index``) -- gathers from
  document ids, offsets or lengths land here, O(N);
* ``Sep``: an integer ``f(q) + g(kv)`` (sums and differences of QV and KV, times constants);
  ``AbsSep``: ``|f(q) + g(kv)|``;
* ``Iv``: a boolean of (q, kv) as canonical row intervals ``[Nq or 1, K]``;
* ``Pending``: an intersection of an ``Iv`` and comparisons ``g(kv) op t(q)`` not yet lowered;
  ``Disj``: a union of such values, kept apart until it is used so that an ``&`` that follows
  is taken into each part (``same_group & ((k < p[q]) | (r[k] == r[q]))`` lowers ``r[k] ==
  r[q]`` inside the group's keys, not over whole rows).

A comparison ``f(q) + g(kv) op 0`` becomes ``g(kv) op -f(q)``. Split the keys into the maximal
runs on which ``g`` is non-decreasing (or, if fewer, non-increasing: then negate): inside one
run the keys that satisfy it form one interval, found by a binary search on a sorted key
``run * span + g``. A row's comparison is lowered inside the intervals it is intersected with
(``same_doc & (q_logical >= kv_logical)``: the document's keys lie in one run of ``kv_logical``),
as long as those intervals cross few runs. ``&``, ``|``, ``~`` are interval-set algebra.
Anything else -- a Python branch on an index, ``%`` or ``//`` of a mixed term, a 2-D table
indexed by both q and kv -- raises :class:`Unsupported` and the mask_mod is evaluated instead.

Cheap forms, taken before the general ones: a key term ``+-kv_idx + c`` (``Sep.ga``, tracked
through ``+ - *`` by Python ints, ``QV``/``KV.aff``) is never built as a tensor and is compared
by clamping each interval of a row; a key term monotone over all keys is compared by one
``searchsorted`` per row; ``&`` and ``|`` of one-interval rows, and ``|`` with whole rows, need
no sort. Element-by-element operators on values of q alone or kv alone run directly (what
vmap gives, without its host cost). The values and those operations are in ``values.py``.
"""

from __future__ import annotations

import logging

import torch
from torch.utils import _pytree as pytree

from .. import intervals as iv
from ..plan import MaskPlan, built_plans
from ..tiles import build_tiles
from . import modeval, trace
from .catalogue import recognised_plan
from .values import (
    _ELEMENTWISE,
    KV,
    QV,
    AbsSep,
    Disj,
    Iv,
    Pending,
    Sep,
    SumSq,
    Unsupported,
    _affine_step,
    _callable,
    _check_bool,
    _elementwise,
    _gather,
    _is_bool,
    _is_bool_scalar,
    _is_int_scalar,
    _vmapped,
)

log = logging.getLogger("compilemask.migrate")

#: the most key runs one row's intervals may cross when a comparison is lowered inside them
MAX_RUNS_PER_ROW = 128
#: a comparison inside ``K`` slots per row over a key term of ``R`` runs takes all ``R`` runs
#: per slot (no host read of how many it crosses) when ``R * K`` is at most this
_RUNS_UNREAD = 16
#: intermediate interval sets of at most this many slots per row are not trimmed to the
#: most any row holds (a host read each); the result is trimmed once at the end
_UNTRIMMED_SLOTS = 8
#: the most parts of a union kept apart (``Disj``)
_MAX_DISJ = 4
#: row-dependent interval sets above this many bytes whose rows hold more intervals than
#: their bits take (more than ``Nk / 64`` slots) are not built: such a mask_mod (a key mask
#: under causality, say) is evaluated into a bitmask plan, chunk by chunk, instead of an
#: ``[Nq, K]`` interval table that grows with ``Nq * Nk``
MAX_LIFTED_BYTES = 1 << 24


_SEP_DTYPES = (torch.int64, torch.int32, torch.bool)
_MIXED = (Sep, AbsSep, SumSq, Iv, Pending, Disj)
_CMP = {"ge": "ge", "gt": "gt", "le": "le", "lt": "lt", "eq": "eq", "ne": "ne"}
_FLIP = {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt", "eq": "eq", "ne": "ne"}


_REFLECTED = {"rand": "and", "ror": "or", "radd": "add", "rmul": "mul"}  # commutative only


def _name(node) -> str:
    t = node.target
    name = (t if isinstance(t, str) else getattr(t, "__name__", str(t))).strip("_")
    return _REFLECTED.get(name, name) if isinstance(t, str) else name


class Lifter:
    def __init__(self, q_len: int, kv_len: int, device):
        self.nq, self.nk, self.device = q_len, kv_len, device
        self._runs = {}  # id(g) -> (g, its runs): one key term is compared many times
        self._profiles = {}  # id(g) -> (g, (descents, ascents, min, max))
        self._consts = None
        self._zero64 = None
        self._arange = None
        self._tables = {}  # id(key) -> (key, top, its searchsorted table): see ``_search``
        self._kv_spans = {}  # id(t) -> (t, lo, hi): a KV bool ``t`` true on [lo, hi) alone
        self._arange32 = None
        self._ints = []  # (tensor, int, version) of the b and h of the current run

    def profile_of(self, g: torch.Tensor) -> tuple[int, int, int, int]:
        """``(descents, ascents, min, max)`` of a key term ``g`` (int64 ``[Nk]``): how many
        neighbours step down / up, and its range, in one host read."""
        hit = self._profiles.get(id(g))
        if hit is None or hit[0] is not g:
            lo, hi = torch.aminmax(g)
            d = torch.stack([(g[1:] < g[:-1]).sum(), (g[1:] > g[:-1]).sum(), lo, hi])
            hit = self._profiles[id(g)] = (g, tuple(d.tolist()))
        return hit[1]

    def prefetch(self, terms) -> None:
        """The profiles of the key terms ``terms`` (int64 ``[Nk]`` tensors; others skipped)
        not known yet, all in one host read."""
        todo = list({id(g): g for g in terms if g.dim() == 1}.values())
        todo = [g for g in todo if self._profiles.get(id(g), (None,))[0] is not g]
        if len(todo) < 2:
            return
        if len({(g.shape, g.dtype) for g in todo}) == 1:  # all at once: 7 operations
            gs = torch.stack(todo)  # [T, Nk]
            lo, hi = torch.aminmax(gs, dim=-1)
            down, up = (gs[:, 1:] < gs[:, :-1]).sum(-1), (gs[:, 1:] > gs[:, :-1]).sum(-1)
            table = torch.stack([down, up, lo, hi], -1)
        else:
            rows = []
            for g in todo:
                lo, hi = torch.aminmax(g)
                rows.append(torch.stack([(g[1:] < g[:-1]).sum(), (g[1:] > g[:-1]).sum(), lo, hi]))
            table = torch.stack(rows)
        for g, d in zip(todo, table.tolist()):
            self._profiles[id(g)] = (g, tuple(d))

    def runs_of(self, g: torch.Tensor):
        hit = self._runs.get(id(g))
        if hit is None or hit[0] is not g:
            hit = self._runs[id(g)] = (g, _runs(g, self.profile_of(g)))
        return hit[1]

    def sorted_of(self, g: torch.Tensor):
        """``(sign * g, sign)`` when ``g`` [Nk] is non-decreasing (sign 1) or non-increasing
        (sign -1), else None."""
        if g.dim() != 1:
            return None
        down, up, _, _ = self.profile_of(g)
        if not down:
            return g, 1
        if up:
            return None
        hit = self._runs.get(("neg", id(g)))
        if hit is None or hit[0] is not g:
            hit = self._runs[("neg", id(g))] = (g, -g)
        return hit[1], -1

    # ------------------------------------------------------------------ interval sets
    def consts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """0 and ``nk``: int32 0-d tensors, made once (never written to; one kernel, no copy
        from the host)."""
        if self._consts is None:
            both = torch.arange(2, dtype=torch.int32, device=self.device) * self.nk
            self._consts = both[0], both[1]
        return self._consts

    def full(self) -> Iv:
        zero, nk = self.consts()
        return Iv(zero.view(1, 1), nk.view(1, 1))

    def row_full(self, k: int):
        """``([0, nk, ...], [nk, nk, ...])``: int32 ``[k]``, the whole row in ``k`` slots."""
        hi = torch.full((k,), self.nk, dtype=torch.int32, device=self.device)
        return torch.cat([torch.zeros_like(hi[:1]), hi[1:]]), hi

    def canon(self, lo, hi) -> Iv:
        lo, hi = iv.clip(lo, hi, self.nk)
        lo, hi, _ = iv.compact_sorted(
            lo.to(torch.int32), hi.to(torch.int32), self.nk, trim=_trim(lo.shape[-1])
        )
        return Iv(lo, hi)

    def to_iv(self, v) -> Iv:
        if isinstance(v, Iv):
            return v
        if isinstance(v, Pending):
            return self.resolve(v)
        if isinstance(v, Disj):
            parts = [self.to_iv(part) for part in v.parts]
            if len(parts) > 2:  # one sweep over every part instead of one per pair
                self.bounded(*parts)
                sets = [(p.lo, p.hi) for p in parts]
                trim = _trim(sum(p.lo.shape[-1] for p in parts))
                return Iv(*iv.union(sets, self.nk, trim=trim)[:2])
            out = parts[0]
            for part in parts[1:]:
                out = self.lor(out, part)
            return out
        if isinstance(v, QV) and v.t.dtype == torch.bool and v.t.dim() == 1:
            zero, nk = self.consts()
            lo = torch.where(v.t[:, None], zero, nk)
            return Iv(lo, nk.expand(lo.shape))
        if isinstance(v, KV) and v.t.dtype == torch.bool and v.t.dim() == 1:
            span = self._kv_spans.get(id(v.t))
            if span is not None and span[0] is v.t:  # one interval: views, no operation
                ar = self.arange32()
                return Iv(ar[span[1]].view(1, 1), ar[span[2]].view(1, 1))
            lo, hi, _ = iv.from_dense_rows(v.t[None], self.nk)
            return Iv(lo, hi)
        if isinstance(v, bool):
            f = self.full()
            return f if v else Iv(f.hi, f.hi.clone())
        if isinstance(v, torch.Tensor) and _is_bool_scalar(v):  # [0, nk) or [nk, nk): no read
            zero, nk = self.consts()
            return Iv(torch.where(v.to(zero.device), zero, nk).view(1, 1), nk.view(1, 1))
        raise Unsupported(f"a {type(v).__name__} value used as a boolean mask")

    def bounded(self, *sets: Iv) -> None:
        """Refuse (``Unsupported``) an operation on ``sets`` whose result could hold more
        intervals than its bits, in more than :data:`MAX_LIFTED_BYTES` (the result's slots
        are at most the operands' together, its rows theirs broadcast)."""
        rows = max(x.lo.shape[-2] if x.lo.dim() > 1 else 1 for x in sets)
        self.bounded_shape(rows, sum(x.lo.shape[-1] for x in sets))

    def bounded_shape(self, rows: int, slots: int) -> None:
        """:meth:`bounded` for a result of ``rows`` rows and ``slots`` slots."""
        if rows > 1 and 64 * slots > self.nk and 8 * rows * slots > MAX_LIFTED_BYTES:
            raise Unsupported(
                f"an interval table of {rows} rows of up to {slots} slots "
                f"({8 * rows * slots} bytes) would hold more than their bits; the mask_mod is "
                f"evaluated instead (as bitmask tiles where its rows hold that many intervals)"
            )

    def land(self, a: Iv, b: Iv) -> Iv:
        self.bounded(a, b)
        if a.lo.shape[-1] == 1 and b.lo.shape[-1] == 1:  # one interval each: one interval
            return self.kept(torch.maximum(a.lo, b.lo), torch.minimum(a.hi, b.hi))
        trim = _trim(a.lo.shape[-1] + b.lo.shape[-1])
        return Iv(*iv.intersection((a.lo, a.hi), (b.lo, b.hi), self.nk, trim=trim)[:2])

    def lor(self, a: Iv, b: Iv) -> Iv:
        self.bounded(a, b)
        if a.lo.shape[-1] == 1 and b.lo.shape[-1] == 1:
            # [x0, x1) the one starting first (an empty one starts at nk): the two merge when
            # [y0, y1) starts by x1 (an empty y then merges into x, as y0 == nk only if x1 == nk)
            first = a.lo <= b.lo
            x0, x1 = torch.where(first, a.lo, b.lo), torch.where(first, a.hi, b.hi)
            y0, y1 = torch.where(first, b.lo, a.lo), torch.where(first, b.hi, a.hi)
            merge = y0 <= x1
            pad = self.consts()[1]
            lo = torch.cat([x0, torch.where(merge, pad, y0)], -1)
            hi = torch.cat(
                [torch.where(merge, torch.maximum(x1, y1), x1), torch.where(merge, pad, y1)], -1
            )
            return Iv(lo, hi)
        trim = _trim(a.lo.shape[-1] + b.lo.shape[-1])
        return Iv(*iv.union([(a.lo, a.hi), (b.lo, b.hi)], self.nk, trim=trim)[:2])

    def kept(self, x, y) -> Iv:
        """``[x, y)`` per slot, the empty ones set to ``[nk, nk)``, compacted when there are
        several slots (``x``, ``y`` sorted and disjoint per row). ``x``: an integer tensor
        ``>= 0`` or the int 0; ``y``: an integer tensor ``<= nk`` or the int ``nk``. An empty
        slot has ``x' = nk``, and ``y' = max(y, x')`` is then ``nk`` (as ``y <= nk``) and
        ``y`` otherwise: one ``where`` for both bounds."""
        zero, pad = self.consts()
        if isinstance(x, int) and isinstance(y, int):
            return self.full()
        dims = [v.shape for v in (x, y) if not isinstance(v, int)]  # [..., rows, slots]
        rows = max(d[-2] if len(d) > 1 else 1 for d in dims)
        self.bounded_shape(rows, max(d[-1] if len(d) else 1 for d in dims))
        if isinstance(y, int):  # [x, nk): empty only when x >= nk
            x = x.clamp(max=self.nk).to(torch.int32)
            y = pad.expand(x.shape)
        elif isinstance(x, int):  # [0, y): empty when y <= 0
            x = torch.where(y > 0, zero, pad)
            y = torch.maximum(y, x).to(torch.int32)
        else:
            x = torch.where(x < y, x, pad)
            x, y = x.to(torch.int32), torch.maximum(y, x).to(torch.int32)
        if x.shape[-1] == 1:
            return Iv(x, y)
        return Iv(*iv.compact_sorted(x, y, self.nk, trim=_trim(x.shape[-1]))[:2])

    def lnot(self, a: Iv) -> Iv:
        f = self.full()
        trim = _trim(1 + a.lo.shape[-1])
        return Iv(*iv.difference((f.lo, f.hi), (a.lo, a.hi), self.nk, trim=trim)[:2])

    # ------------------------------------------------------------------ comparisons
    def zero64(self) -> torch.Tensor:
        """0: an int64 0-d tensor, made once (never written to)."""
        if self._zero64 is None:
            self._zero64 = torch.zeros((), dtype=torch.int64, device=self.device)
        return self._zero64

    def to_sep(self, v) -> Sep:
        if isinstance(v, Sep):
            return v
        zero = self.zero64()
        if isinstance(v, (QV, KV)):
            if v.t.dim() != 1 or v.t.dtype not in _SEP_DTYPES:
                raise Unsupported(
                    f"a {v.t.dtype} or non-scalar index value in a q/kv comparison (only "
                    "int64, int32 and bool values, whose arithmetic does not wrap here, lift)"
                )
            t = v.t.to(torch.int64)
            if isinstance(v, QV):
                return Sep(t, zero, (0, 0))
            return Sep(zero, t, v.aff if v.t.dtype == torch.int64 else None)
        if isinstance(v, (int, bool)) or (isinstance(v, torch.Tensor) and v.dim() == 0):
            # a Python scalar by a fill (a launch, no copy from the host's pageable memory)
            c = (
                v.to(self.device)
                if isinstance(v, torch.Tensor)
                else torch.full((), v, device=self.device)
            )
            if c.dtype not in _SEP_DTYPES:
                raise Unsupported(f"a {c.dtype} constant in a q/kv comparison")
            return Sep(c.to(torch.int64), zero, (0, 0))
        raise Unsupported(f"a {type(v).__name__} value in integer arithmetic")

    def g_of(self, s: Sep) -> torch.Tensor:
        """The key term of ``s`` as a tensor (built from ``s.ga`` when it was not kept)."""
        if s.g is not None:
            return s.g
        a, c = s.ga
        if a == 0:
            return torch.full((), c, dtype=torch.int64, device=self.device)
        return torch.arange(c, c + a * self.nk, a, device=self.device)[: self.nk]

    def lin(self, x: Sep, y: Sep | None, cy: int, cx: int = 1) -> Sep:
        """``cx * x + cy * y`` (``y`` None: ``cx * x``), keeping an affine key term symbolic."""

        def comb(u, v):
            u = u if cx == 1 else u * cx
            if y is None:
                return u
            return u + v if cy == 1 else u - v if cy == -1 else u + v * cy

        f = comb(x.f, None if y is None else y.f)
        ys = (0, 0) if y is None else y.ga
        if x.ga is not None and ys is not None:
            ga = (cx * x.ga[0] + cy * ys[0], cx * x.ga[1] + cy * ys[1])
            return Sep(f, None, ga)
        return Sep(f, comb(self.g_of(x), None if y is None else self.g_of(y)))

    def compare(self, op: str, a, b):
        if isinstance(b, (AbsSep, SumSq)) and not isinstance(a, (AbsSep, SumSq)):
            a, b, op = b, a, _FLIP[op]
        if isinstance(a, SumSq):
            return self.disc(op, a, b)
        if isinstance(a, AbsSep):
            s, r = a.s, self.to_sep(b)
            neg_r = self.lin(r, None, 0, -1)
            if op in ("le", "lt"):
                lower = "ge" if op == "le" else "gt"
                return self.conj(self.compare(lower, s, neg_r), self.compare(op, s, r))
            if op in ("ge", "gt"):  # |s| >= r is not |s| < r; |s| > r is not |s| <= r
                return self.lnot(self.to_iv(self.compare("lt" if op == "ge" else "le", a, b)))
            raise Unsupported(f"abs(...) {op} ...")
        sa, sb = self.to_sep(a), self.to_sep(b)
        d = self.lin(sa, sb, -1)  # g(kv) op t(q)
        t = -d.f
        if d.ga is not None and d.ga[0] == 0:
            return QV(
                getattr(torch, op)(
                    torch.full((), d.ga[1], dtype=torch.int64, device=self.device), t
                ).expand(self.nq)
            )
        if d.ga is not None and abs(d.ga[0]) == 1:
            key = d.ga  # +-kv + c: compared by clamping (``within_affine``)
        else:
            key = self.g_of(d)
            if key.dim() == 0:
                return QV(getattr(torch, op)(key, t).expand(self.nq))
        if op == "ne":
            return self.lnot(self.to_iv(Pending(None, [(key, "eq", t)])))
        return Pending(None, [(key, op, t)])

    def disc(self, op: str, a: SumSq, b) -> Iv:
        """``s1 * s1 + s2 * s2 op c`` (``c`` an int): per level ``d`` of the term whose key
        part is monotone, ``s_outer == d`` and ``|s_inner| <= m(d)``; the union of the levels."""
        if op in ("gt", "ge"):
            return self.lnot(self.disc("le" if op == "gt" else "lt", a, b))
        if op not in ("lt", "le") or len(a.terms) != 2 or not _is_int_scalar(b):
            raise Unsupported("a sum of squares other than s1*s1 + s2*s2 < c")
        c = int(b) if op == "le" else int(b) - 1  # s1^2 + s2^2 <= c
        if c < 0:
            return self.to_iv(False)
        outer, inner = (Sep(s.f, self.g_of(s)) for s in a.terms)
        if outer.g.dim() == 0 or self.sorted_of(outer.g) is None:
            outer, inner = inner, outer
        r = _isqrt(c)
        if r > 1024:
            raise Unsupported("a disc of radius above 1024")
        d = torch.arange(-r, r + 1, device=self.device)
        m = modeval.to_device([_isqrt(c - x * x) for x in range(-r, r + 1)], self.device)
        lv = (d.numel(), 1)  # every level at once: t of shape [L, Nq] (or [L, 1])
        p = Pending(
            None,
            [
                (outer.g, "eq", d.view(lv) - outer.f),
                (inner.g, "ge", -m.view(lv) - inner.f),
                (inner.g, "le", m.view(lv) - inner.f),
            ],
        )
        got = self.resolve(p)  # [L, Nq or 1, K]: disjoint across levels
        lo = got.lo.expand(d.numel(), self.nq, -1).permute(1, 0, 2).reshape(self.nq, -1)
        hi = got.hi.expand(d.numel(), self.nq, -1).permute(1, 0, 2).reshape(self.nq, -1)
        lo, order = torch.sort(lo, -1)
        return self.canon(lo, torch.gather(hi, -1, order))

    def conj(self, a, b):
        if isinstance(a, Disj) and isinstance(b, Disj):
            a = self.to_iv(a)
        if isinstance(a, Disj) or isinstance(b, Disj):  # (x | y) & z = (x & z) | (y & z)
            d, other = (a, b) if isinstance(a, Disj) else (b, a)
            return Disj([self.conj(part, other) for part in d.parts])
        pa = a if isinstance(a, Pending) else Pending(self.to_iv(a), [])
        pb = b if isinstance(b, Pending) else Pending(self.to_iv(b), [])
        if pa.base is None or pb.base is None:
            base = pa.base if pb.base is None else pb.base
        else:
            base = self.land(pa.base, pb.base)
        return Pending(base, pa.cmps + pb.cmps)

    def resolve(self, p: Pending) -> Iv:
        cur = p.base
        for ga, op, t in (c for c in p.cmps if isinstance(c[0], tuple)):  # kv +- c: no search
            cur = self.within_affine(cur, ga, op, t)
        rest = [c for c in p.cmps if not isinstance(c[0], tuple)]
        self.prefetch(g for g, _, _ in rest)
        for g, op, t in rest:  # monotone key terms: one binary search
            mono = self.sorted_of(g)
            if mono is not None:
                cur = self.within_sorted(cur, *mono, op, t)
        rest = [c for c in rest if self.sorted_of(c[0]) is None]
        cmps = [(self.runs_of(g), op, t) for g, op, t in rest]
        for runs, op, t in sorted(cmps, key=lambda c: c[0][2]):  # fewest key runs first
            cur = self.within(cur if cur is not None else self.full(), runs, op, t)
        return cur if cur is not None else self.full()

    def within_affine(self, cur: Iv | None, ga, op: str, t) -> Iv:
        """The keys of ``cur`` (None: all) with ``a * kv + c op t(q)``, ``a`` = +-1: one
        interval per interval of ``cur``, by clamping (no key search)."""
        a, c = ga
        if a < 0:  # -kv + c op t  <=>  kv flip(op) c - t
            op, t = _FLIP[op], c - t
        elif c:
            t = t - c
        t = t.reshape(-1, 1)
        one = t + 1 if op in ("gt", "le", "eq") else None
        x = {"ge": t, "gt": one, "le": 0, "lt": 0, "eq": t}[op]
        y = {"ge": self.nk, "gt": self.nk, "le": one, "lt": t, "eq": one}[op]
        return self.clip_to(cur, x, y)

    def within_sorted(self, cur: Iv | None, x: torch.Tensor, sign: int, op: str, t) -> Iv:
        """The keys of ``cur`` (None: all) with ``g(kv) op t(q)`` for a monotone ``g``
        (``x = sign * g`` non-decreasing): one interval per interval of ``cur``, from a
        binary search of ``t`` in ``x``."""
        if sign < 0:
            op, t = _FLIP[op], -t
        t = t.reshape(*t.shape, 1) if t.dim() else t.reshape(1, 1)
        left = torch.searchsorted(x, t) if op in ("ge", "lt", "eq") else None
        right = torch.searchsorted(x, t, right=True) if op in ("gt", "le", "eq") else None
        lo = {"ge": left, "gt": right, "le": 0, "lt": 0, "eq": left}[op]
        hi = {"ge": self.nk, "gt": self.nk, "le": right, "lt": left, "eq": right}[op]
        return self.clip_to(cur, lo, hi)

    def clip_to(self, cur: Iv | None, x, y) -> Iv:
        """``[x, y)`` (int64 tensors ``[..., rows, 1]``, or ints: 0 for x, nk for y) within
        each interval of ``cur`` (None: ``[0, nk)``), canonical."""
        if cur is None:
            x = x if isinstance(x, int) else x.clamp(min=0)
            y = y if isinstance(y, int) else y.clamp(max=self.nk)
        else:
            x = cur.lo if isinstance(x, int) else torch.maximum(cur.lo, x)
            y = cur.hi if isinstance(y, int) else torch.minimum(cur.hi, y)
        return self.kept(x, y)

    def within(self, cur: Iv, runs, op: str, t) -> Iv:
        """The keys of ``cur`` with ``g(kv) op t(q)``: per interval of a row, per run of
        ``g`` it crosses, one interval."""
        key, run, n_runs, bounds, gmin, span, sign = runs
        if sign < 0:
            op, t = _FLIP[op], -t
        lo, hi = cur.lo, cur.hi  # int32: indexes and compares as int64 would
        live = lo < hi
        first = run[lo.clamp(max=self.nk - 1)]
        last = run[(hi - 1).clamp(min=0, max=self.nk - 1)]
        if n_runs * lo.shape[-1] <= _RUNS_UNREAD:  # every run in every slot: no host read
            s_max = n_runs
        elif lo.shape[-1] == 1:
            width = torch.where(live, last - first + 1, 0)
            s_max = int(width.max()) if width.numel() else 0
            if s_max == 0:
                return cur
        else:  # with the most slots in use (the set may be untrimmed), in the same read
            width = torch.where(live, last - first + 1, 0)
            s_max, used = torch.stack([width.amax(), live.sum(-1).amax()]).tolist()
            if s_max == 0:
                return cur
            if used < lo.shape[-1]:  # the slots past ``used`` are empty in every row
                k = max(1, used)
                cur = Iv(cur.lo[..., :k], cur.hi[..., :k])
                lo, hi, live = lo[..., :k], hi[..., :k], live[..., :k]
                first, last = first[..., :k], last[..., :k]
        if s_max * lo.shape[-1] > MAX_RUNS_PER_ROW:
            raise Unsupported(
                f"a comparison crosses {s_max} monotone runs of its key term in one row"
            )
        r = first[..., None] + self.indices(s_max)[:s_max]  # [rows, K, S]
        ok = live[..., None] & (r <= last[..., None])
        r = r.clamp(max=n_runs - 1)
        ends = bounds[r]  # [rows, K, S, 2]: each run's first key and the key past its last
        a = torch.maximum(lo[..., None], ends[..., 0])
        b = torch.minimum(hi[..., None], ends[..., 1])
        tq = t if t.dim() == 0 else t.reshape(*t.shape, 1, 1)
        tt = (tq - (gmin - 1)).clamp(0, span - 1)
        target = r * span + tt
        left, right = self.search(key, target, n_runs * span)
        if op == "ge":
            x, y = left, b
        elif op == "gt":
            x, y = right, b
        elif op == "le":
            x, y = a, right
        elif op == "lt":
            x, y = a, left
        else:  # eq
            x, y = left, right
        x, y = torch.maximum(x, a), torch.minimum(y, b)
        # a kept slot has x < y <= nk (y <= b <= nk); the others become [nk, nk)
        keep = ok & (x < y)
        pad = self.consts()[1]
        x, y = torch.where(keep, x, pad), torch.where(keep, y, pad)
        # within [0, nk], sorted and disjoint by construction (runs ordered inside each sorted
        # slot, empties at nk): compacted without clipping
        x, y = x.flatten(-2), y.flatten(-2)
        lo, hi, _ = iv.compact_sorted(x, y, self.nk, trim=_trim(x.shape[-1]))
        return Iv(lo.to(torch.int32), hi.to(torch.int32))

    def search(self, key: torch.Tensor, target: torch.Tensor, top_bound: int):
        """:func:`_search` with the table of ``key`` made once per key (one key term is
        compared many times)."""
        hit = self._tables.get(id(key))
        if hit is None or hit[0] is not key or hit[1] != top_bound:
            hit = self._tables[id(key)] = (key, top_bound, _search_table(key, top_bound))
        return _search(key, target, top_bound, hit[2])

    # ------------------------------------------------------------------ graph
    def arange32(self) -> torch.Tensor:
        """``arange(nk + 1)`` (int32), made once: its elements are the 0-d bounds of one-interval
        key sets (views, never written to)."""
        if self._arange32 is None:
            self._arange32 = torch.arange(self.nk + 1, dtype=torch.int32, device=self.device)
        return self._arange32

    def note_span(self, name: str, args, out) -> None:
        """Records the keys ``[lo, hi)`` of a KV bool ``out`` that is one interval by its form:
        ``a * kv_idx + c op n`` (``a`` = +-1, ``n`` a Python int, either side; ``op`` not
        ``ne``) or ``~`` of such a value whose interval touches an end of the keys."""
        if not isinstance(out, KV) or out.t.dtype != torch.bool or out.t.dim() != 1:
            return
        nk = self.nk
        if name == "invert":
            span = self._kv_spans.get(id(args[0].t)) if isinstance(args[0], KV) else None
            if span is None or span[0] is not args[0].t:
                return
            lo, hi = span[1], span[2]
            if lo >= hi:
                lo, hi = 0, nk
            elif lo == 0:
                lo, hi = hi, nk
            elif hi == nk:
                lo, hi = 0, lo
            else:
                return
        elif name in ("lt", "le", "gt", "ge", "eq") and len(args) == 2:
            v, n, op = args[0], args[1], name
            if not isinstance(v, KV):
                v, n, op = n, v, _FLIP[op]
            if not isinstance(v, KV) or v.aff is None or type(n) is not int:
                return
            a, c = v.aff
            if v.t.dtype != torch.int64 or abs(a) != 1:
                return
            if a < 0:  # -kv + c op n  <=>  kv flip(op) c - n
                op, x = _FLIP[op], c - n
            else:
                x = n - c
            lo, hi = {"ge": (x, nk), "gt": (x + 1, nk), "le": (0, x + 1), "lt": (0, x),
                      "eq": (x, x + 1)}[op]  # fmt: skip
            lo, hi = max(lo, 0), min(hi, nk)
        else:
            return
        if lo >= hi:
            lo = hi = nk
        self._kv_spans[id(out.t)] = (out.t, lo, hi)

    def indices(self, n: int) -> torch.Tensor:
        """``arange(m)`` (int64, ``m >= n, nq, nk``), one for every run: ``q_idx``, ``kv_idx``,
        ``b`` and ``h`` are views of it."""
        if self._arange is None or self._arange.numel() < n:
            m = max(n, self.nq, self.nk)
            self._arange = torch.arange(m, device=self.device)
        return self._arange

    def run(self, gm, b: int, h: int, resolve: bool = True):
        """The mask_mod's value at ``(b, h)``: an :class:`Iv` (``resolve`` False: the output
        value as it stands, e.g. a :class:`Pending` not lowered yet)."""
        env = {}
        idx = self.indices(max(b, h) + 1)
        bt, ht = idx[b], idx[h]  # views: no copy from the host
        self._ints = [(bt, b, bt._version), (ht, h, ht._version)]
        args = [bt, ht, QV(idx[: self.nq], (1, 0)), KV(idx[: self.nk], (1, 0))]
        places = [node for node in gm.graph.nodes if node.op == "placeholder"]
        if len(places) != len(args):
            raise Unsupported(
                f"the traced mask_mod takes {len(places)} arguments, not the four of "
                "mask_mod(b, h, q_idx, kv_idx)"
            )
        env.update(zip(places, args))
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                continue
            elif node.op == "get_attr":
                env[node] = getattr(gm, node.target)
            elif node.op == "output":
                out = _check_bool(pytree.tree_map(lambda n: env[n], node.args[0]))
                return self.to_iv(out) if resolve else out
            else:
                a = pytree.tree_map(lambda n: env[n] if n in env else n, node.args)
                kw = pytree.tree_map(lambda n: env[n] if n in env else n, node.kwargs)
                env[node] = self.call(node, a, kw)
        raise Unsupported("no output")

    def call(self, node, args, kwargs):
        leaves = pytree.tree_leaves((args, kwargs))
        kinds = {type(x) for x in leaves}
        name = _name(node)
        if kinds & set(_MIXED) or (QV in kinds and KV in kinds):
            return self.mixed(name, args, kwargs)
        fn = _callable(node)
        if name in ("add", "sub", "mul", "neg") and not kwargs:
            step = _affine_step(name, args)
            if step is not None:
                return step
        if node.op == "call_function" and name in _ELEMENTWISE and not kwargs:
            direct = _elementwise(fn, args)
            if direct is not None:
                self.note_span(name, args, direct)
                return direct
        if name == "getitem" and not kwargs:
            direct = _gather(*self._known(args))
            if direct is not None:
                return direct
        for cls in (QV, KV):
            if cls in kinds:
                return cls(_vmapped(fn, args, kwargs, cls))
        return fn(*args, **kwargs)

    def _known(self, args):
        """``(table, index)`` with the run's own ``b`` / ``h`` tensors in the index as the ints
        they hold (while not updated in place): indexing by them reads nothing back."""
        table, index = args
        items = index if isinstance(index, tuple) else (index,)
        out = []
        for i in items:
            hit = [v for t, v, ver in self._ints if i is t and t._version == ver]
            out.append(hit[0] if hit else i)
        return table, tuple(out) if isinstance(index, tuple) else out[0]

    def mixed(self, name: str, args, kwargs):
        if name in ("add", "sub", "neg", "mul", "abs") and any(map(_is_bool, args)):
            raise Unsupported(f"{name} of a bool (torch's own rules differ from integers)")
        if kwargs:
            raise Unsupported(f"{name} with keyword arguments on mixed q/kv values")
        if name in _CMP and len(args) == 2:
            return self.compare(name, *args)
        if name in ("and", "logical_and", "bitwise_and") and len(args) == 2:
            return self.conj(*args)
        if name in ("or", "logical_or", "bitwise_or") and len(args) == 2:
            rows = [a for a in args if isinstance(a, QV) and a.t.dtype == torch.bool]
            if rows and rows[0].t.dim() == 1:  # whole rows, or the other operand
                x = self.to_iv(args[1] if args[0] is rows[0] else args[0])
                lo = torch.where(rows[0].t[:, None], self.row_full(x.lo.shape[-1])[0], x.lo)
                hi = torch.where(rows[0].t[:, None], self.row_full(x.lo.shape[-1])[1], x.hi)
                return Iv(lo, hi)
            if any(isinstance(a, (Pending, Disj)) for a in args):  # lowered when used
                parts = [p for a in args for p in (a.parts if isinstance(a, Disj) else [a])]
                if len(parts) <= _MAX_DISJ:
                    return Disj(parts)
            return self.lor(self.to_iv(args[0]), self.to_iv(args[1]))
        if name in ("invert", "logical_not", "bitwise_not") and len(args) == 1:
            return self.lnot(self.to_iv(args[0]))
        if name == "add" and len(args) == 2 and all(isinstance(a, SumSq) for a in args):
            return SumSq(args[0].terms + args[1].terms)
        if name in ("add", "sub") and len(args) == 2:
            a, b = self.to_sep(args[0]), self.to_sep(args[1])
            return self.lin(a, b, 1 if name == "add" else -1)
        if name == "neg" and len(args) == 1:
            return self.lin(self.to_sep(args[0]), None, 0, -1)
        if name == "mul" and len(args) == 2 and args[0] is args[1] and isinstance(args[0], Sep):
            return SumSq([args[0]])
        if name == "mul" and len(args) == 2:
            a, c = (args[0], args[1]) if _is_int_scalar(args[1]) else (args[1], args[0])
            if not _is_int_scalar(c):
                raise Unsupported("a product of two index-dependent values")
            return self.lin(self.to_sep(a), None, 0, int(c))
        if name == "abs" and len(args) == 1:
            return AbsSep(self.to_sep(args[0]))
        raise Unsupported(f"{name} on values that depend on both q_idx and kv_idx")


def _runs(g: torch.Tensor, profile):
    """The sorted key of ``g`` [Nk] over its monotone runs, choosing the direction
    (non-decreasing, or non-increasing negated) with fewer runs; ``profile``:
    ``Lifter.profile_of(g)``."""
    down, up, gmin, gmax = profile
    if down <= up:
        x, n_runs, sign = g, down + 1, 1
    else:
        x, n_runs, sign, gmin, gmax = -g, up + 1, -1, -gmax, -gmin
    span = gmax - gmin + 3
    if n_runs * span >= 2**62:  # the sort key (and the search targets) would leave int64
        raise Unsupported(f"a key term spans {span} values over {n_runs} runs (int64 keys)")
    run = torch.nn.functional.pad(torch.cumsum(x[1:] < x[:-1], 0), (1, 0))
    key = run * span + (x - (gmin - 1))
    counts = torch.bincount(run, minlength=n_runs)
    run_end = torch.cumsum(counts, 0)
    bounds = torch.stack([run_end - counts, run_end], -1)  # [n_runs, 2]: [start, end)
    return key, run, n_runs, bounds, gmin, span, sign


def _trim(k: int) -> bool:
    """Whether an intermediate set of ``k`` slots per row is trimmed (one host read)."""
    return k > _UNTRIMMED_SLOTS


def _search_table(key: torch.Tensor, top_bound: int):
    """``[top_bound, 2]``: for each value ``t`` in ``[0, top_bound)`` the left and right
    ``searchsorted`` of ``t`` in the sorted ``key``, or None when that range is too large
    for a table (more than ``4 * key.numel() + 1024``)."""
    if top_bound > 4 * key.numel() + 1024:
        return None
    counts = torch.bincount(key, minlength=top_bound)
    right_of = torch.cumsum(counts, 0)
    return torch.stack([right_of - counts, right_of], -1)


def _isqrt(n: int) -> int:
    import math

    return math.isqrt(n)


def _search(key: torch.Tensor, target: torch.Tensor, top_bound: int, table=None):
    """``searchsorted(key, target)`` left and right for a sorted non-negative int64 ``key``
    and targets in ``[0, top_bound)`` (``top_bound`` above every key): through ``table``
    (:func:`_search_table`, when the range is small: O(range + targets), cheaper than a binary
    search per target on the CPU, and one gather per search), else by binary search."""
    if table is not None:
        both = table[target]  # [..., 2]: left and right
        return both[..., 0], both[..., 1]
    flat = target.reshape(-1)
    left = torch.searchsorted(key, flat).view(target.shape)
    return left, torch.searchsorted(key, flat, right=True).view(target.shape)


def traced(mask_mod, state=False):
    """The ``torch.fx`` trace of ``mask_mod`` (``trace.symbolic_trace``; ``state``: its
    ``trace.structure`` when known).

    Raises:
        Unsupported: torch.fx cannot trace it.
    """
    try:
        return trace.symbolic_trace(mask_mod, state)
    except Exception as exc:  # noqa: BLE001 - any tracing failure means: evaluate
        raise Unsupported(f"torch.fx cannot trace it ({type(exc).__name__}: {exc})") from None


def lift_intervals(mask_mod, q_len: int, kv_len: int, bh, device, gm=None):
    """``(lo, hi)``: int32 ``[len(bh), Nq, K]``, the lifted intervals of every (b, h) of ``bh``
    (per row sorted, disjoint, the empty slots ``[kv_len, kv_len)``; ``K`` not trimmed to
    the most any row holds: :func:`finished` does that, with its one host read); ``gm``: the
    mask_mod's trace when already taken.

    Raises:
        Unsupported: with the reason, when the mask_mod has no analytic form here.
    """
    gm = traced(mask_mod) if gm is None else gm
    lifter = Lifter(q_len, kv_len, device)
    if len(bh) == 1:
        parts = [lifter.run(gm, *bh[0])]
    else:  # the key-term profiles of every part's output in one host read
        outs = [lifter.run(gm, b, h, resolve=False) for b, h in bh]
        lifter.prefetch(g for o in outs for g in _pending_keys(o))
        parts = [lifter.to_iv(o) for o in outs]
    k = max(p.lo.shape[-1] for p in parts)
    lifter.bounded_shape(len(parts) * q_len, k)  # the table the plan will hold, row by row
    if len(parts) == 1:
        return parts[0].lo.expand(1, q_len, k), parts[0].hi.expand(1, q_len, k)
    padded = [iv.pad_k(p.lo, p.hi, k, kv_len) for p in parts]
    lo = torch.stack([x.expand(q_len, k) for x, _ in padded])
    hi = torch.stack([y.expand(q_len, k) for _, y in padded])
    return lo, hi


def _pending_keys(v):
    """The key-term tensors of the comparisons ``v`` (a :class:`Pending` or :class:`Disj` of
    them) will search when lowered."""
    parts = v.parts if isinstance(v, Disj) else [v]
    for p in parts:
        if isinstance(p, Pending):
            yield from (g for g, _, _ in p.cmps if isinstance(g, torch.Tensor))


def finished(lo, hi, k: int, kv_len: int):
    """Canonical ``(lo, hi)`` of :func:`lift_intervals`' output cut to ``k`` slots (``k``: the
    most non-empty slots of any row, at least 1; read by the caller)."""
    lo, hi = lo[..., :k], hi[..., :k]
    valid = lo < hi
    pad = torch.full((), kv_len, dtype=lo.dtype, device=lo.device)
    return torch.where(valid, lo, pad), torch.where(valid, hi, pad)


def try_lift(
    mask_mod, q_len, kv_len, batch, heads, bh, block_m, block_n, device, state=False, cache=False
):
    """A plan of the lifted mask_mod (``source == "from_mask_mod:lifted"``), or None (the
    reason is logged at INFO on ``compilemask.migrate``). A common form is built by
    ``compile``'s path (``catalogue.py``; kept by the mask's text with ``cache``).
    ``state``: the mask_mod's ``trace.structure`` when known."""
    try:
        gm = traced(mask_mod, state)
        plan = recognised_plan(gm, q_len, kv_len, batch, heads, block_m, block_n, device, cache)
        if plan is not None:
            return plan
        lo, hi = lift_intervals(mask_mod, q_len, kv_len, bh, device, gm)
        count = (lo < hi).sum(-1, dtype=torch.int32)  # the same once cut: the rest is empty
        # the most non-empty slots of a row, read with the probe's verdict (one host read)
        most = count.amax() if lo.shape[-1] > 1 else None
        k = modeval.probe_read(mask_mod, lo, hi, q_len, kv_len, bh, device, most)
        if k is None:
            log.warning("lifted mask_mod disagrees with its evaluation on a probe; evaluating")
            return None
        lo, hi = finished(lo, hi, max(1, k), kv_len)
    except Unsupported as exc:
        log.info("mask_mod not lifted: %s", exc)
        return None
    except Exception as exc:  # noqa: BLE001 - the evaluation path reports user errors
        log.info("mask_mod not lifted: %s: %s", type(exc).__name__, exc)
        return None
    schedule = build_tiles(lo, hi, count, q_len, kv_len, block_m, block_n, use_bits=True)
    with built_plans():  # canonical intervals and their tiles by construction, as in compile
        return MaskPlan(
            q_len, kv_len, batch, heads, lo, hi, count, schedule, source="from_mask_mod:lifted"
        )
