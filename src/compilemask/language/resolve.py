"""Resolve a layout at a length: where each segment and each part of a family lies.

Shared by the dense evaluator (:mod:`.semantics`) and the compiler's lowering, so both read a
layout the same way and raise the same errors.

The layout covers the token axis of length ``axis_len = max(q_len, kv_len)``. Segments follow one
another from position 0; an open-ended segment (``rest:*``, at most one) takes whatever the
fixed segments leave. A layout without an open-ended segment fixes the axis length.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LayoutError, LengthError
from .ast import GRID_RELATIONS, RELATION_ARITY, RuleMask, Segment, Span


@dataclass(frozen=True)
class ResolvedSegment:
    """A segment placed on the axis. ``starts[p]``/``lengths[p]`` (tokens) of each part."""

    name: str
    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    grid: tuple[int, int] | None

    @property
    def start(self) -> int:
        return self.starts[0]

    @property
    def end(self) -> int:
        return self.starts[-1] + self.lengths[-1]


def fixed_length(layout: tuple[Segment, ...]) -> int | None:
    """The axis length a layout fixes, or None when it has an open-ended segment."""
    if any(s.lengths is None for s in layout):
        return None
    return sum(sum(s.lengths) for s in layout)


def check_layout(layout: tuple[Segment, ...]) -> None:
    """Raise :class:`LayoutError` for duplicate names, bad lengths or two open-ended segments."""
    seen: set[str] = set()
    open_ended = 0
    for s in layout:
        if s.name in seen or s.name == "*":
            raise LayoutError(f"segment name {s.name!r} is used twice or reserved")
        seen.add(s.name)
        if s.lengths is None:
            open_ended += 1
            continue
        if not s.lengths:
            raise LayoutError(f"segment {s.name!r} has no parts")
        for i, n in enumerate(s.lengths):
            part = (
                f"segment {s.name!r}" if len(s.lengths) == 1 else f"part {i} of segment {s.name!r}"
            )
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 2**31 - 1:
                raise LayoutError(
                    f"{part} has a bad length {n!r} (need an int >= 1, below 2**31; "
                    f"leave a part out instead of giving it no tokens)"
                )
        if s.grid is not None:
            h, w = s.grid
            if h < 1 or w < 1 or s.lengths != (h * w,):
                raise LayoutError(f"grid segment {s.name!r} must be grid(h, w) with h, w >= 1")
    if open_ended > 1:
        raise LayoutError("a layout may hold at most one open-ended segment (name:*)")


def resolve(layout: tuple[Segment, ...], axis_len: int) -> dict[str, ResolvedSegment]:
    """Place every segment on an axis of ``axis_len`` tokens."""
    check_layout(layout)
    fixed = sum(sum(s.lengths) for s in layout if s.lengths is not None)
    if fixed_length(layout) is not None and fixed != axis_len:
        raise LengthError(
            f"the layout fixes the length to {fixed} tokens but the mask is compiled for "
            f"{axis_len} (max(q_len, kv_len))"
        )
    if fixed > axis_len:
        raise LengthError(f"the layout needs at least {fixed} tokens, got {axis_len}")
    out: dict[str, ResolvedSegment] = {}
    pos = 0
    for s in layout:
        lengths = s.lengths if s.lengths is not None else (axis_len - fixed,)
        starts = []
        for n in lengths:
            starts.append(pos)
            pos += n
        out[s.name] = ResolvedSegment(s.name, tuple(starts), tuple(lengths), s.grid)
    return out


def span_ranges(span: Span, segs: dict[str, ResolvedSegment], axis_len: int):
    """The parts a span denotes: a list of ``(start, length, grid)``. An indexed span
    (``resp[i]``) returns every part of its family (paired by the caller); a literal index
    (``resp[2]``) returns that part; a plain span returns the merged ranges of its segments."""
    if span.names == ("*",):
        return [(0, axis_len, None)]
    for n in span.names:
        if n not in segs:
            raise LayoutError(f"unknown span {n!r}; the layout names {sorted(segs)}")
    if span.index is not None:
        (name,) = span.names
        seg = segs[name]
        parts = list(zip(seg.starts, seg.lengths, [seg.grid] * len(seg.starts)))
        if isinstance(span.index, int):
            if not 0 <= span.index < len(parts):
                raise LayoutError(
                    f"{name}[{span.index}] is out of range: {name} has {len(parts)} parts"
                )
            return [parts[span.index]]
        return parts
    ranges = sorted(
        (st, n, segs[name].grid)
        for name in span.names
        for st, n in zip(segs[name].starts, segs[name].lengths)
    )
    merged: list[tuple[int, int, object]] = []
    for st, n, g in ranges:
        if n == 0:
            continue
        if merged and merged[-1][0] + merged[-1][1] == st:
            a, m, _ = merged[-1]
            merged[-1] = (a, m + n, None)
        else:
            merged.append((st, n, g if len(span.names) == 1 else None))
    if len(span.names) == 1 and len(merged) == 1:
        merged[0] = (merged[0][0], merged[0][1], segs[span.names[0]].grid)
    return merged or [(0, 0, None)]


def check_rules(mask: RuleMask) -> None:
    """Static checks of a RuleMask's rules (names, arities, index variables)."""
    check_layout(mask.layout)
    names = {s.name for s in mask.layout} | {"*"}
    for rule in mask.rules:
        rel = rule.relation
        if rel.kind not in RELATION_ARITY:
            raise LayoutError(f"unknown relation {rel.kind!r}; known: {sorted(RELATION_ARITY)}")
        if len(rel.params) != RELATION_ARITY[rel.kind]:
            raise LayoutError(
                f"relation {rel.kind} takes {RELATION_ARITY[rel.kind]} parameters, "
                f"got {len(rel.params)}"
            )
        for sp in (rule.query, rule.key):
            for n in sp.names:
                if n not in names:
                    raise LayoutError(
                        f"unknown span {n!r}; the layout names {sorted(names - {'*'})}"
                    )
            if sp.index is not None and len(sp.names) != 1:
                raise LayoutError("only a single named span can be indexed")
        qv = rule.query.index if isinstance(rule.query.index, str) else None
        kv = rule.key.index if isinstance(rule.key.index, str) else None
        if kv is not None and qv != kv:
            raise LayoutError(
                f"key index variable {kv!r} is not bound by the query span "
                f"(write {rule.query.names[0]}[{kv}] -> ...)"
            )
        for value in rel.params:
            if abs(value) > 2**31 - 1:
                raise LayoutError(f"{rel.kind}{rel.params}: parameters must be below 2**31")
        if rel.kind == "chunk" and rel.params[0] < 1:
            raise LayoutError(f"chunk(c) needs c >= 1, got {rel.params[0]}")
        if rel.kind == "disc" and rel.params[0] < 1:
            raise LayoutError(f"disc(r) needs r >= 1, got {rel.params[0]}")
        if rel.kind in ("box", "natten"):
            for p in rel.params:
                if p < 1 or p % 2 == 0:
                    raise LayoutError(f"{rel.kind}{rel.params} needs odd sizes >= 1")
        if rel.kind == "band" and rel.params[0] > rel.params[1]:
            raise LayoutError(f"band(lo, hi) needs lo <= hi, got {rel.params}")
        _ = GRID_RELATIONS
