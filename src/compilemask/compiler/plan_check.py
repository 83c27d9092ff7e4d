"""Validation of a :class:`~compilemask.compiler.plan.MaskPlan`: every invariant the kernels rely
on, checked where a plan enters (constructor, copy, unpickling, :meth:`MaskPlan.load`).

Two parts:

* :func:`check_structure`: types, dtypes, devices, contiguity, shapes and the plain fields
  (host-only: reads no tensor value);
* :func:`value_checks`: the values (sorted, disjoint, in-bounds intervals; tile kinds, pair
  counts, slot ranges, bitmasks and work lists consistent with them; a true permutation), as
  one boolean tensor per check, computed on the plan's device. The caller reads them back
  together (:func:`raise_failed`): one host synchronisation. Plans whose schedule holds
  bitmask tiles, and ``encoding="bits"`` plans, synchronise while computing them (their
  builders do too).

A failed check raises :class:`~compilemask.errors.PlanError` naming the field.
"""

from __future__ import annotations

import math

import torch

from ..errors import PlanError
from .tiles import (
    EMPTY,
    FULL,
    PARTIAL,
    PARTIAL_BITS,
    TileSchedule,
    _lists,
    _pairs_per_tile,
    _slot_ranges,
    _tile_bits,
    build_tiles_from_dense,
    dense_from_tiles,
)

_INT32_MAX = 2**31 - 1
#: schedule tensors of shape [M, Tq, Tk]
_TILE_FIELDS = ("kind", "pairs", "jlo", "jhi", "bits_index")


def fail(field: str, what: str) -> None:
    raise PlanError(f"invalid MaskPlan: {field}: {what}")


def _int(value, field: str, low: int, high: int = _INT32_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        fail(field, f"must be an int in [{low}, {high}], got {value!r}")


def _tensor(t, field: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if (
        type(t) is torch.Tensor  # the common case in one test (a subclass: the checks below)
        and t.dtype is dtype
        and t.shape == shape
        and t.is_contiguous()
        and t.device == device
    ):
        return
    if not isinstance(t, torch.Tensor):
        fail(field, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        fail(field, f"must be {dtype}, got {t.dtype}")
    if t.device != device:
        fail(field, f"must be on the plan's device {device} (row_lo's), got {t.device}")
    if tuple(t.shape) != shape:
        fail(field, f"must have shape {list(shape)}, got {list(t.shape)}")
    if not t.is_contiguous():
        fail(field, "must be contiguous")


def plan_tensor_fields(plan) -> list[tuple[str, object]]:
    """``(name, value)`` of every tensor the plan holds (None for absent optional ones)."""
    out = [(n, getattr(plan, n)) for n in ("row_lo", "row_hi", "row_count", "row_runs")]
    out.append(("permutation", plan.permutation))
    s = plan.schedule
    if isinstance(s, TileSchedule):
        out += [(f"schedule.{n}", t) for n, t in s.tensors().items()]
    return out


def check_structure(plan) -> None:
    """Types, dtypes, devices, contiguity and shapes; the plain fields. Reads no values."""
    _int(plan.q_len, "q_len", 1)
    _int(plan.kv_len, "kv_len", 1)
    for name in ("batch", "heads"):
        v = getattr(plan, name)
        if v is not None:
            _int(v, name, 1)
    if plan.encoding not in ("intervals", "bits"):
        fail("encoding", f"must be 'intervals' or 'bits', got {plan.encoding!r}")
    if not isinstance(plan.source, str):
        fail("source", f"must be a str, got {type(plan.source).__name__}")
    if not isinstance(plan._cache, dict):
        fail("_cache", f"must be a dict, got {type(plan._cache).__name__}")
    lo = plan.row_lo
    if not isinstance(lo, torch.Tensor) or lo.dim() != 3:
        fail("row_lo", f"must be an int32 tensor [M, Nq, K], got {_describe(lo)}")
    dev = lo.device
    m, nq, k = (plan.batch or 1) * (plan.heads or 1), plan.q_len, lo.shape[2]
    if plan.encoding == "bits" and k != 1:
        fail("row_lo", f"a bits plan holds one empty slot per row, got K={k}")
    _tensor(lo, "row_lo", (m, nq, k), torch.int32, dev)
    _tensor(plan.row_hi, "row_hi", (m, nq, k), torch.int32, dev)
    _tensor(plan.row_count, "row_count", (m, nq), torch.int32, dev)
    if plan.encoding == "bits":
        _tensor(plan.row_runs, "row_runs", (m, nq), torch.int32, dev)
    elif plan.row_runs is not None:
        fail("row_runs", "must be None for encoding='intervals'")
    if plan.permutation is not None:
        _tensor(plan.permutation, "permutation", (nq,), torch.int64, dev)
    s = plan.schedule
    if not isinstance(s, TileSchedule):
        fail("schedule", f"must be a TileSchedule, got {type(s).__name__}")
    _int(s.block_m, "schedule.block_m", 1)
    _int(s.block_n, "schedule.block_n", 1)
    if s.q_len != plan.q_len or s.kv_len != plan.kv_len:
        fail(
            "schedule",
            f"built for q_len={s.q_len!r}, kv_len={s.kv_len!r}, the plan has "
            f"q_len={plan.q_len}, kv_len={plan.kv_len}",
        )
    tq, tk = math.ceil(nq / s.block_m), math.ceil(plan.kv_len / s.block_n)
    for name in _TILE_FIELDS:
        _tensor(getattr(s, name), f"schedule.{name}", (m, tq, tk), torch.int32, dev)
    bits = s.bits
    if not isinstance(bits, torch.Tensor) or bits.dim() != 3:
        fail("schedule.bits", f"must be an int32 tensor [P, block_m, W], got {_describe(bits)}")
    _tensor(
        bits, "schedule.bits", (bits.shape[0], s.block_m, -(-s.block_n // 32)), torch.int32, dev
    )
    _tensor(s.q_count, "schedule.q_count", (m, tq), torch.int32, dev)
    _tensor(s.q_list, "schedule.q_list", (m, tq, tk), torch.int32, dev)
    _tensor(s.kv_count, "schedule.kv_count", (m, tk), torch.int32, dev)
    _tensor(s.kv_list, "schedule.kv_list", (m, tk, tq), torch.int32, dev)
    _tensor(s.q_order, "schedule.q_order", (m, tq), torch.int32, dev)
    _tensor(s.kv_order, "schedule.kv_order", (m, tk), torch.int32, dev)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {list(x.shape)}"
    return type(x).__name__


def _all(x: torch.Tensor) -> torch.Tensor:
    return x.all() if x.numel() else torch.ones((), dtype=torch.bool, device=x.device)


def _is_perm(x: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` (last dim) is a permutation of ``0 .. n-1``."""
    n = x.shape[-1]
    return _all(x.sort(-1).values == torch.arange(n, device=x.device, dtype=x.dtype))


def permutation_checks(plan) -> list[tuple[str, torch.Tensor]]:
    if plan.permutation is None:
        return []
    return [("permutation: must be a permutation of 0 .. q_len-1", _is_perm(plan.permutation))]


def value_checks(plan) -> list[tuple[str, torch.Tensor]]:
    """``(what, ok)`` pairs, ``ok`` a 0-dim bool tensor on the plan's device (structure already
    checked)."""
    checks = permutation_checks(plan)
    if plan.encoding == "bits":
        return checks + _bits_checks(plan)
    return checks + _interval_checks(plan)


def _list_checks(s: TileSchedule, touched: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    q_count, q_list, _ = _lists(touched)
    kv_count, kv_list, _ = _lists(touched.transpose(1, 2))
    return [
        ("schedule.q_count: touched kv-tiles per q-tile", _all(q_count == s.q_count)),
        ("schedule.q_list: the touched kv-tiles, ascending, -1 padded", _all(q_list == s.q_list)),
        ("schedule.kv_count: touched q-tiles per kv-tile", _all(kv_count == s.kv_count)),
        ("schedule.kv_list: the touched q-tiles, ascending, -1 padded", _all(kv_list == s.kv_list)),
        ("schedule.q_order: a permutation of the q-tiles", _is_perm(s.q_order)),
        ("schedule.kv_order: a permutation of the kv-tiles", _is_perm(s.kv_order)),
    ]


def _bits_index_checks(s: TileSchedule) -> list[tuple[str, torch.Tensor]]:
    is_bits = s.kind == PARTIAL_BITS
    idx = s.bits_index
    in_range = (idx >= 0) & (idx < s.bits.shape[0])
    return [
        (
            "schedule.bits_index: a row of schedule.bits for PARTIAL_BITS tiles, -1 elsewhere",
            _all(torch.where(is_bits, in_range, idx == -1)),
        )
    ]


def _interval_checks(plan) -> list[tuple[str, torch.Tensor]]:
    lo, hi, cnt, nk = plan.row_lo, plan.row_hi, plan.row_count, plan.kv_len
    m, nq, k = lo.shape
    s = plan.schedule
    slot = torch.arange(k, device=lo.device, dtype=torch.int32)
    used = slot < cnt[..., None]
    out = [
        ("row_count: must be in [0, K]", _all((cnt >= 0) & (cnt <= k))),
        (
            "row_lo/row_hi: used slots must hold non-empty intervals inside [0, kv_len)",
            _all(torch.where(used, (lo >= 0) & (lo < hi) & (hi <= nk), True)),
        ),
        (
            "row_lo/row_hi: unused slots must hold lo == hi == kv_len",
            _all(torch.where(used, True, (lo == nk) & (hi == nk))),
        ),
    ]
    if k > 1:
        gap = used[..., 1:]
        ordered = torch.where(gap, hi[..., :-1] < lo[..., 1:], True)
        out.append(
            ("row_lo/row_hi: intervals must be sorted, disjoint, non-touching", _all(ordered))
        )
    # the schedule the intervals imply (on clamped copies: garbage in, no index errors)
    lo_c, hi_c = lo.clamp(0, nk), hi.clamp(0, nk)
    bm, bn = s.block_m, s.block_n
    tq, tk = s.kind.shape[1], s.kind.shape[2]
    pairs = _pairs_per_tile(lo_c, hi_c, tq, tk, bm, bn)
    rows = (nq - torch.arange(tq, device=lo.device) * bm).clamp(max=bm).view(1, tq, 1)
    cols = (nk - torch.arange(tk, device=lo.device) * bn).clamp(max=bn).view(1, 1, tk)
    full = (pairs == bm * bn) & (rows == bm) & (cols == bn)
    touched = pairs > 0
    kind = s.kind
    jlo, jhi = _slot_ranges(lo_c, hi_c, cnt, tq, tk, bm, bn, nk)
    out += [
        ("schedule.kind: values must be 0..3", _all((kind >= EMPTY) & (kind <= PARTIAL_BITS))),
        ("schedule.pairs: visible pairs per tile", _all(s.pairs == pairs)),
        ("schedule.kind: FULL exactly on the full tiles", _all((kind == FULL) == full)),
        (
            "schedule.kind: touched (non-EMPTY) exactly where a pair is visible",
            _all((kind > EMPTY) == touched),
        ),
        (
            "schedule.jlo/jhi: must satisfy 0 <= jlo <= jhi <= K",
            _all((s.jlo >= 0) & (s.jlo <= s.jhi) & (s.jhi <= k)),
        ),
        (
            "schedule.jlo/jhi: a PARTIAL tile's slot range must hold every interval meeting it",
            _all(torch.where(kind == PARTIAL, (s.jlo <= jlo) & (s.jhi >= jhi), True)),
        ),
    ]
    out += _bits_index_checks(s)
    out += _list_checks(s, kind > EMPTY)
    if s.bits.shape[0]:  # bitmask tiles: their bits must be the intervals' (one host read)
        is_bits = (kind == PARTIAL_BITS) & touched & ~full
        tiles = is_bits.nonzero()
        if tiles.shape[0]:
            sel = tiles.unbind(1)
            want = _tile_bits(lo_c, hi_c, tiles, jlo[sel], jhi[sel], bm, bn, nq)
            idx = s.bits_index[sel].clamp(0, s.bits.shape[0] - 1).long()
            out.append(("schedule.bits: a bitmask tile's bits", _all(s.bits[idx] == want)))
    return out


def _bits_checks(plan) -> list[tuple[str, torch.Tensor]]:
    s = plan.schedule
    nk = plan.kv_len
    out = [
        (
            "row_lo/row_hi/row_count: a bits plan holds one empty slot per row",
            _all((plan.row_lo == nk) & (plan.row_hi == nk)) & _all(plan.row_count == 0),
        ),
        (
            "schedule.kind: a bits plan has EMPTY, FULL and PARTIAL_BITS tiles only",
            _all((s.kind == EMPTY) | (s.kind == FULL) | (s.kind == PARTIAL_BITS)),
        ),
    ]
    out += _bits_index_checks(s)
    if not bool(torch.stack([ok for _, ok in out]).all()):
        return out  # the mask cannot be rebuilt from these tiles
    m, nq, bm = plan.num_masks, plan.q_len, s.block_m
    step = max(1, (1 << 22) // nk) // bm * bm or bm
    chunks = [dense_from_tiles(s, r, min(nq, r + step)) for r in range(0, nq, step)]
    fresh = build_tiles_from_dense(iter(chunks), m, nq, nk, bm, s.block_n)
    runs = torch.cat([_runs(c) for c in chunks], 1)
    out += [
        ("schedule.pairs: visible pairs per tile", _all(s.pairs == fresh.pairs)),
        ("schedule.kind: tile kinds of the bitmask tiles", _all(s.kind == fresh.kind)),
        ("row_runs: intervals per row", _all(plan.row_runs == runs)),
    ]
    if bool((s.kind == fresh.kind).all()):  # same tiles: their bits, padding bits 0
        sel = s.kind == PARTIAL_BITS
        stored = s.bits[s.bits_index[sel].long()]
        want = fresh.bits[fresh.bits_index[sel].long()]
        out.append(("schedule.bits: bits outside the lengths must be 0", _all(stored == want)))
    out += _list_checks(s, s.kind > EMPTY)
    return out


def _runs(rows: torch.Tensor) -> torch.Tensor:
    """int32 number of maximal runs of True along the last dim."""
    starts = rows.clone()
    starts[..., 1:] &= ~rows[..., :-1]
    return starts.sum(-1, dtype=torch.int32)


def segment_checks(plan) -> None:
    """Check the compact form's segments (``compiler/segments.py``) when the plan holds one that
    chose them (``plan.compact()`` was called): pointers and first rows ordered, templates and
    slots in range, every bound inside ``[0, kv_len]`` on the segment's first and last rows
    (it is affine in between), and expanding them gives ``row_lo, row_hi, row_count``.
    Two host reads (the expansion runs on checked indices only).

    Raises:
        PlanError: the first violated invariant, naming the part (``segments.r0`` ...).
    """
    compact = plan._cache.get("compact")
    seg = getattr(compact, "segments", None)
    if seg is None:
        return
    from .segments import ABSOLUTE, expand_rows

    m, nq, nk = plan.num_masks, plan.q_len, plan.kv_len
    s, u, t = seg.r0.shape[0], seg.slot_ptr.shape[0] - 1, seg.slope.shape[0]
    if (seg.mask_ptr.shape != (m + 1,) or seg.template.shape != (s,) or u < 0
            or seg.base.shape != (t, 2) or seg.slope.shape != (t, 2)):  # fmt: skip
        fail("segments", "mask_ptr, r0, template, slot_ptr, slope, base shapes disagree")
    mp, sp = seg.mask_ptr.to(torch.int64), seg.slot_ptr.to(torch.int64)
    sizes = mp[1:] - mp[:-1]
    checks = [
        ("segments.mask_ptr: from 0 to S, ascending, every mask one segment or more",
         (mp[0] == 0) & (mp[-1] == s) & _all(sizes >= 1)),
        ("segments.slot_ptr: from 0 to T, ascending",
         (sp[0] == 0) & (sp[-1] == t) & _all(sp[1:] >= sp[:-1])),
        ("segments.template: in [0, U)", _all((seg.template >= 0) & (seg.template < u))),
    ]  # fmt: skip
    raise_failed(checks)
    owner = torch.repeat_interleave(torch.arange(m, device=mp.device), sizes)
    r0 = seg.r0.to(torch.int64)
    start = torch.zeros(s, dtype=torch.bool, device=mp.device)
    start[mp[:-1]] = True
    same = owner[1:] == owner[:-1]
    end = torch.cat((torch.where(same, r0[1:], nq), r0.new_full((1,), nq)))
    checks = [
        ("segments.r0: each mask's first segment starts at row 0, the others ascending below "
         "q_len", _all(torch.where(start, r0 == 0, (r0 > 0) & (r0 < nq)))
         & _all(torch.where(same, r0[1:] > r0[:-1], True))),
    ]  # fmt: skip
    raise_failed(checks)
    # every bound on the first and last row of its segment
    tmpl = seg.template.to(torch.int64)
    first, count = sp[tmpl], sp[tmpl + 1] - sp[tmpl]
    seg_of = torch.repeat_interleave(torch.arange(s, device=mp.device), count)
    slot = torch.arange(int(count.sum()), device=mp.device) - torch.repeat_interleave(
        torch.cumsum(count, 0) - count, count
    )
    entry = first[seg_of] + slot
    slope, base = seg.slope[entry].to(torch.int64), seg.base[entry].to(torch.int64)
    rows = torch.stack((r0[seg_of], end[seg_of] - 1), -1)[:, :, None]  # [E, 2, 1]
    rel = rows - r0[seg_of][:, None, None]
    value = torch.where(slope[:, None] == ABSOLUTE, base[:, None], slope[:, None] * rel
                        + base[:, None] + r0[seg_of][:, None, None])  # fmt: skip
    lo, hi, cnt = expand_rows(seg, k=plan.row_lo.shape[-1])
    checks = [
        ("segments.base/slope: every bound inside [0, kv_len]",
         _all((value >= 0) & (value <= nk))),
        ("segments: expanding them must give row_lo, row_hi and row_count",
         _all(lo == plan.row_lo) & _all(hi == plan.row_hi) & _all(cnt == plan.row_count)),
    ]  # fmt: skip
    raise_failed(checks)


def raise_failed(checks: list[tuple[str, object]]) -> None:
    """Read the flags back (one transfer) and raise :class:`PlanError` for the first failed."""
    if not checks:
        return
    flags = torch.stack([torch.as_tensor(ok).reshape(()) for _, ok in checks]).tolist()
    for (what, _), ok in zip(checks, flags):
        if not ok:
            raise PlanError(f"invalid MaskPlan: {what}")
