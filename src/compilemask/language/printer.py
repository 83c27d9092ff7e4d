"""Print the mask IR as text that :func:`.parser.parse` reads back (``parse(to_text(m)) == m``).

A rule block at the top level prints as lines, nested in an expression as ``{ ...; ... }``::

    layout prompt:2048 resp:8x1792 doc:[3,5,2] image:grid(128,256) rest:*
    prompt -> prompt : causal
    resp[i] -> resp[i] : band(-128, 0)

Catalogue masks print as calls with their canonical arguments: those without a default
positionally, those with one as ``name=value`` and only when not the default
(``document([3, 5])``, ``document([3, 5], causal=false)``, ``hstu([9], [2], contextual=3)``);
combinations print with the fewest parentheses that keep their
structure (``&`` binds tighter than ``|`` and ``-``, which are left associative), plus those that
make the text read the same as a Python expression (where ``-`` binds tighter than ``&``).
"""

from __future__ import annotations

import functools
import inspect

from ..errors import CompileMaskError, too_deep
from .ast import (
    Builtin,
    Combine,
    Mask,
    PerBatch,
    PerHead,
    Relation,
    Rule,
    RuleMask,
    Segment,
    Span,
    TiledGrid,
)

__all__ = ["to_text", "segment_text", "span_text", "relation_text", "rule_text"]

# Binding strength: "|" and "-" < "&" < atoms (calls, blocks, per_head, parentheses).
_PRECEDENCE = {"|": 1, "-": 1, "&": 2}
_ATOM = 3


def segment_text(seg: Segment) -> str:
    """``prompt:2048``, ``resp:8x1792``, ``doc:[3,5,2]``, ``rest:*``, ``image:grid(128,256)``."""
    if seg.grid is not None:
        h, w = seg.grid
        return f"{seg.name}:grid({h},{w})"
    if seg.lengths is None:
        return f"{seg.name}:*"
    if len(seg.lengths) == 1:
        return f"{seg.name}:{seg.lengths[0]}"
    if len(set(seg.lengths)) == 1:
        return f"{seg.name}:{len(seg.lengths)}x{seg.lengths[0]}"
    return f"{seg.name}:[{','.join(str(n) for n in seg.lengths)}]"


def span_text(span: Span) -> str:
    """``prompt``, ``a|b``, ``*``, ``resp[i]``, ``resp[3]``."""
    text = "|".join(span.names)
    return text if span.index is None else f"{text}[{span.index}]"


def relation_text(rel: Relation) -> str:
    """``causal``, ``band(-128, 0)``, ``natten(7, 7)``."""
    if not rel.params:
        return rel.kind
    return f"{rel.kind}({', '.join(str(p) for p in rel.params)})"


def rule_text(rule: Rule) -> str:
    """``resp[i] -> prompt : full``."""
    return f"{span_text(rule.query)} -> {span_text(rule.key)} : {relation_text(rule.relation)}"


def _block_lines(mask: RuleMask) -> list[str]:
    head = " ".join(["layout", *(segment_text(s) for s in mask.layout)])
    return [head, *(rule_text(r) for r in mask.rules)]


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, (tuple, list)):
        if all(type(x) is int for x in v):  # thousands of document lengths: one join
            return "[" + ", ".join(map(str, v)) + "]"
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise CompileMaskError(f"cannot print mask argument {v!r} of type {type(v).__name__}")


@functools.lru_cache(maxsize=64)
def _keywords(name: str) -> tuple:
    """Per parameter of the catalogue constructor ``name``: ``(keyword, default)`` for one that
    has a default (printed as ``keyword=value`` unless the default), None for the others."""
    from ..masks import CATALOGUE

    fn = CATALOGUE.get(name)
    if fn is None:
        return ()
    empty = inspect.Parameter.empty
    return tuple(
        None if p.default is empty else (p.name, p.default)
        for p in inspect.signature(fn).parameters.values()
    )


def _builtin(m: Builtin) -> str:
    args = m.args
    if m.name == "shared_prompt" and len(args) == 2 and len(args[0]) == 1 and len(args[1]) == 1:
        args = (args[0][0], args[1][0])  # one group: shared_prompt(1024, [500, 400])
    keywords = _keywords(m.name)
    parts = []
    for i, a in enumerate(args):
        kw = keywords[i] if i < len(keywords) else None
        if kw is None:
            parts.append(_value(a))
        elif not (type(a) is type(kw[1]) and a == kw[1]):
            parts.append(f"{kw[0]}={_value(a)}")
    return f"{m.name}({', '.join(parts)})"


def _needs_parens(op: str, child: Mask, right: bool) -> bool:
    """Parentheses around an operand of ``op``: where the text's precedence needs them, and also
    where Python's precedence (``-`` above ``&`` above ``|``) would read the text differently, so
    printed masks mean the same when pasted into Python (``(a | b) - c``, ``a - (b & c)``)."""
    if not isinstance(child, Combine):
        return False
    if child.op == op:
        return right  # both are left associative
    return not (op == "|" and child.op == "&")


def _expr(mask: Mask) -> tuple[str, int]:
    """Text of ``mask`` as an expression and its binding strength."""
    if isinstance(mask, Combine):
        prec = _PRECEDENCE[mask.op]
        left, right = _expr(mask.left)[0], _expr(mask.right)[0]
        if _needs_parens(mask.op, mask.left, right=False):
            left = f"({left})"
        if _needs_parens(mask.op, mask.right, right=True):
            right = f"({right})"
        return f"{left} {mask.op} {right}", prec
    if isinstance(mask, RuleMask):
        return "{ " + "; ".join(_block_lines(mask)) + " }", _ATOM
    if isinstance(mask, Builtin):
        return _builtin(mask), _ATOM
    if isinstance(mask, TiledGrid):
        return f"tile_grid({_expr(mask.mask)[0]}, [{mask.tile[0]}, {mask.tile[1]}])", _ATOM
    if isinstance(mask, (PerHead, PerBatch)):
        name = "per_head" if isinstance(mask, PerHead) else "per_batch"
        return f"{name}([{', '.join(_expr(m)[0] for m in mask.masks)}])", _ATOM
    raise CompileMaskError(f"cannot print {type(mask).__name__}: not a mask")


@too_deep
def to_text(mask: Mask) -> str:
    """The text of ``mask``: a rule block as lines, anything else as one expression.

    Args:
        mask: any mask IR node.

    Returns:
        Text that :func:`compilemask.language.parser.parse` turns back into an equal mask.

    Raises:
        CompileMaskError: ``mask`` is not a mask or holds an argument that has no text form.

    Example::

        >>> from compilemask import masks
        >>> to_text(masks.causal() & (masks.sliding_window(8) | masks.prefix_lm(2)))
        'causal() & (sliding_window(8) | prefix_lm(2))'
        >>> to_text(masks.shared_prompt(4, [2, 3]))
        'shared_prompt(4, [2, 3])'
    """
    if isinstance(mask, RuleMask):
        return "\n".join(_block_lines(mask))
    return _expr(mask)[0]
