"""The mask IR: small frozen dataclasses, hashable, printable, parsed back by :mod:`.parser`.

A mask is one of

* :class:`RuleMask` -- a layout (named spans of the token axis) and rules
  ``QUERY_SPAN -> KEY_SPAN : RELATION`` whose union is the mask;
* :class:`Builtin` -- a catalogue constructor (``causal()``, ``sliding_window(1024)``, ...), kept
  by name and canonical arguments so it prints as text and parses back;
* :class:`Combine` -- ``a | b`` (union), ``a & b`` (intersection), ``a - b`` (difference);
* :class:`PerHead` / :class:`PerBatch` -- one mask per query head / per batch row.

Positions are absolute token positions on one axis; query ``i`` is position ``i`` (top-left
alignment). Relations compare positions relative to the first token of each span
(``q' = q - q_span_start``, ``k' = k - k_span_start``).

Two masks are *equal* when they give the same dense mask at every length both accept; the
dataclass equality used here (structural) implies it, which is what ``parse(str(m)) == m`` checks.
"""

from __future__ import annotations

from dataclasses import dataclass

# Relation kinds and the number of integer parameters each takes.
RELATION_ARITY = {
    "full": 0,
    "causal": 0,
    "diag": 0,
    "band": 2,  # band(lo, hi): q' + lo <= k' <= q' + hi
    "chunk": 1,  # chunk(c): q' // c == k' // c
    "disc": 1,  # disc(r): dy^2 + dx^2 < r^2 (grids)
    "box": 2,  # box(h, w): |dy| <= h // 2 and |dx| <= w // 2, h and w odd (grids)
    "natten": 2,  # natten(kh, kw): NATTEN window, shifted inward at borders (grids)
}
GRID_RELATIONS = ("disc", "box", "natten")


class Mask:
    """Base class of every mask node. Combine masks with ``|``, ``&`` and ``-``."""

    def __or__(self, other: Mask) -> Mask:
        return Combine("|", self, _check_mask(other, "|"))

    def __and__(self, other: Mask) -> Mask:
        return Combine("&", self, _check_mask(other, "&"))

    def __sub__(self, other: Mask) -> Mask:
        return Combine("-", self, _check_mask(other, "-"))

    def __invert__(self):
        from ..errors import CompileMaskError

        raise CompileMaskError(
            "~mask: masks have no complement operator; subtract the mask from the one that "
            "should remain, e.g. parse('{ layout a:*; a -> a : full }') - mask"
        )

    def __str__(self) -> str:
        from .printer import to_text

        return to_text(self)

    def children(self) -> tuple[Mask, ...]:
        return ()

    @property
    def head_count(self) -> int | None:
        """Number of heads this mask distinguishes (None when it is the same for every head)."""
        counts = {c.head_count for c in self.children()} - {None}
        if len(counts) > 1:
            from ..errors import LayoutError

            raise LayoutError(f"per_head masks of different head counts are combined: {counts}")
        return counts.pop() if counts else None

    @property
    def batch_count(self) -> int | None:
        """Number of batch rows this mask distinguishes (None when shared by every row)."""
        counts = {c.batch_count for c in self.children()} - {None}
        if len(counts) > 1:
            from ..errors import LayoutError

            raise LayoutError(f"per_batch masks of different batch counts are combined: {counts}")
        return counts.pop() if counts else None

    def cache_key(self) -> str:
        return str(self)


def _check_mask(other: object, op: str) -> Mask:
    if not isinstance(other, Mask):
        from ..errors import CompileMaskError

        raise CompileMaskError(f"cannot combine a mask with {type(other).__name__} using {op!r}")
    return other


@dataclass(frozen=True)
class Segment:
    """A named span of the layout.

    ``lengths``: the lengths of its parts (one part: a plain segment ``prompt:2048``; several: a
    family ``resp:8x1792`` / ``doc:[3,5,2]`` whose parts are addressed as ``resp[i]``); ``None``
    for the open-ended ``rest:*`` that takes whatever length is left. ``grid``: ``(h, w)`` for a
    2-D grid of ``h*w`` tokens in row-major order (one part).
    """

    name: str
    lengths: tuple[int, ...] | None
    grid: tuple[int, int] | None = None


@dataclass(frozen=True)
class Span:
    """A query or key span: the union of named segments (``"*"``: the whole axis), optionally
    indexed: ``index`` is a family variable (``"i"``, pairing the i-th query part with the i-th
    key part) or a literal part number."""

    names: tuple[str, ...]
    index: str | int | None = None


@dataclass(frozen=True)
class Relation:
    """``kind`` from :data:`RELATION_ARITY` with its integer parameters."""

    kind: str
    params: tuple[int, ...] = ()


@dataclass(frozen=True)
class Rule:
    query: Span
    key: Span
    relation: Relation


@dataclass(frozen=True, eq=True)
class RuleMask(Mask):
    """A layout and the rules on it; the mask is the union of the rules."""

    layout: tuple[Segment, ...]
    rules: tuple[Rule, ...]


@dataclass(frozen=True, eq=True)
class Builtin(Mask):
    """A catalogue constructor by name with its canonical arguments (signature order)."""

    name: str
    args: tuple

    def __repr__(self) -> str:
        return f"Builtin({self})"


@dataclass(frozen=True, eq=True)
class Combine(Mask):
    """``op`` is ``"|"`` (union), ``"&"`` (intersection) or ``"-"`` (difference)."""

    op: str
    left: Mask
    right: Mask

    def __repr__(self) -> str:
        return f"Combine({self})"

    def children(self) -> tuple[Mask, ...]:
        return (self.left, self.right)

    def _flat(self) -> tuple:
        """The tree in prefix order, ``Combine`` nodes as their ``op``, other nodes as
        themselves: walked with a stack, so hashing and comparing masks chained thousands
        deep does not recurse."""
        out, stack = [], [self]
        while stack:
            node = stack.pop()
            if isinstance(node, Combine):
                out.append(node.op)
                stack.append(node.right)
                stack.append(node.left)
            else:
                out.append(node)
        return tuple(out)

    def __hash__(self) -> int:
        return hash(("Combine",) + self._flat())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Combine):
            return NotImplemented
        a, b = self._flat(), other._flat()
        # a leaf of one tree may face an op string of the other: compare types first
        return len(a) == len(b) and all(
            type(x) is type(y) and x == y for x, y in zip(a, b, strict=True)
        )


@dataclass(frozen=True, eq=True)
class TiledGrid(Mask):
    """``mask`` with the tokens of every 2-D grid it holds reordered into ``tile = (th, tw)``
    tiles (tiles row-major over the grid, tokens row-major inside a tile); other tokens keep
    their place. Position ``i`` of this mask is position ``permutation[i]`` of ``mask``
    (:func:`compilemask.language.permutation.grid_permutation`)."""

    mask: Mask
    tile: tuple[int, int]

    def children(self) -> tuple[Mask, ...]:
        return (self.mask,)


@dataclass(frozen=True, eq=True)
class PerHead(Mask):
    """``masks[h]`` applies to query head ``h``."""

    masks: tuple[Mask, ...]

    def children(self) -> tuple[Mask, ...]:
        return self.masks

    @property
    def head_count(self) -> int | None:
        inner = {m.head_count for m in self.masks} - {None}
        if inner:
            from ..errors import LayoutError

            raise LayoutError("per_head masks cannot be nested inside per_head")
        return len(self.masks)


@dataclass(frozen=True, eq=True)
class PerBatch(Mask):
    """``masks[b]`` applies to batch row ``b``."""

    masks: tuple[Mask, ...]

    def children(self) -> tuple[Mask, ...]:
        return self.masks

    @property
    def batch_count(self) -> int | None:
        inner = {m.batch_count for m in self.masks} - {None}
        if inner:
            from ..errors import LayoutError

            raise LayoutError("per_batch masks cannot be nested inside per_batch")
        return len(self.masks)
