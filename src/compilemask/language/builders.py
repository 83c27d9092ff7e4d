"""Build rule blocks from Python; the result is the same IR the text gives.

Example (the shared-prompt reward model of docs/design.md, from Python and from text)::

    >>> from compilemask.language.builders import regions, rule, seg
    >>> from compilemask.language.parser import parse
    >>> m = regions(
    ...     [seg("prompt", 2048), seg("resp", [1792] * 8)],
    ...     [
    ...         rule("prompt", "prompt", "causal"),
    ...         rule("resp[i]", "prompt", "full"),
    ...         rule("resp[i]", "resp[i]", "causal"),
    ...     ],
    ... )
    >>> m == parse('''
    ... layout prompt:2048 resp:8x1792
    ... prompt  -> prompt  : causal
    ... resp[i] -> prompt  : full
    ... resp[i] -> resp[i] : causal
    ... ''')
    True
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..errors import CompileMaskError, LayoutError
from ..masks import _int, _ints, _is_int
from .ast import Relation, Rule, RuleMask, Segment, Span
from .parser import parse_layout, parse_relation, parse_rule, parse_span
from .resolve import check_layout, check_rules

__all__ = ["regions", "seg", "grid", "rule"]

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise LayoutError(f"segment name must be an identifier (letters, digits, _), got {name!r}")
    return name


def seg(name: str, length: int | Sequence[int] | str) -> Segment:
    """A layout segment.

    Args:
        name: an identifier (``"prompt"``).
        length: tokens of a single part (``2048``; an int, a numpy integer or a 0-d integer
            tensor), the lengths of a family's parts (``[1792] * 8``, a tuple, a 1-D integer
            numpy array or tensor; addressed as ``name[i]`` in rules), or ``"*"`` for the
            open-ended segment that takes whatever length is left.

    Returns:
        The :class:`~.ast.Segment` (text forms ``prompt:2048``, ``resp:8x1792``, ``rest:*``).

    Raises:
        LayoutError: bad name or length.

    Example::

        >>> seg("resp", [5, 5, 5])
        Segment(name='resp', lengths=(5, 5, 5), grid=None)
    """
    _check_name(name)
    if isinstance(length, str):
        if length != "*":
            raise LayoutError(f'segment {name!r}: a length given as a string must be "*"')
        return Segment(name, None)
    what = f"the length of segment {name!r}"
    if _is_int(length):
        out = Segment(name, (_int(length, what, error=LayoutError),))
    else:
        out = Segment(name, _ints(length, what, error=LayoutError))
    _check_layout_of(out)
    return out


def grid(name: str, h: int, w: int) -> Segment:
    """A 2-D grid segment of ``h * w`` tokens in row-major order (``image:grid(h,w)``).

    Example::

        >>> grid("image", 2, 3)
        Segment(name='image', lengths=(6,), grid=(2, 3))
    """
    _check_name(name)
    h, w = (
        _int(v, f"grid {name!r}: {axis}", error=LayoutError) for v, axis in ((h, "h"), (w, "w"))
    )
    out = Segment(name, (h * w,), (h, w))
    _check_layout_of(out)
    return out


def _check_layout_of(segment: Segment) -> None:
    check_layout((segment,))


def rule(query: str | Span, key: str | Span, relation: str | Relation = "full") -> Rule:
    """A rule ``QUERY -> KEY : RELATION``.

    Args:
        query, key: spans as text (``"prompt"``, ``"a|b"``, ``"*"``, ``"resp[i]"``, ``"doc[2]"``)
            or :class:`~.ast.Span` objects.
        relation: ``"full"``, ``"causal"``, ``"diag"``, ``"band(lo, hi)"``, ``"chunk(c)"``,
            ``"disc(r)"``, ``"box(h, w)"``, ``"natten(kh, kw)"`` or a :class:`~.ast.Relation`.

    Returns:
        The :class:`~.ast.Rule` (checked against a layout by :func:`regions`).

    Raises:
        MaskSyntaxError: a span or relation text does not parse.

    Example::

        >>> rule("resp[i]", "resp[i]", "band(-128, 0)").relation
        Relation(kind='band', params=(-128, 0))
    """
    q = query if isinstance(query, Span) else parse_span(_text(query, "query"))
    k = key if isinstance(key, Span) else parse_span(_text(key, "key"))
    if not isinstance(relation, Relation):
        relation = parse_relation(_text(relation, "relation"))
    return Rule(q, k, relation)


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise CompileMaskError(f"the {what} must be a str or an IR object, got {value!r}")
    return value


def regions(layout: str | Sequence[Segment], rules: Sequence[Rule | str]) -> RuleMask:
    """A mask given by a layout and rules (the union of the rules).

    Args:
        layout: segments from :func:`seg` / :func:`grid`, or the layout as text
            (``"prompt:2048 resp:8x1792 rest:*"``).
        rules: rules from :func:`rule`, or rule texts (``"resp[i] -> prompt : full"``).

    Returns:
        A :class:`~.ast.RuleMask`, equal to the one the same block parses to.

    Raises:
        LayoutError: duplicate or unknown segment names, bad relation parameters, unbound index
            variables (see :func:`.resolve.check_rules`).
        MaskSyntaxError: a text argument does not parse.

    Example::

        >>> m = regions("text:4 image:grid(2,2)", ["* -> text : full", "image -> image : disc(2)"])
        >>> print(m)
        layout text:4 image:grid(2,2)
        * -> text : full
        image -> image : disc(2)
    """
    segs = parse_layout(layout) if isinstance(layout, str) else tuple(layout)
    for s in segs:
        if not isinstance(s, Segment):
            raise CompileMaskError(f"layout items must be seg(...) or grid(...), got {s!r}")
    out = []
    for r in rules:
        if isinstance(r, str):
            r = parse_rule(r)
        if not isinstance(r, Rule):
            raise CompileMaskError(f"rules must be rule(...) objects or rule texts, got {r!r}")
        out.append(r)
    mask = RuleMask(segs, tuple(out))
    check_rules(mask)
    return mask
