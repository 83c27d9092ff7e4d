"""Errors raised by CompileMask. Every user error is a :class:`CompileMaskError`."""

from __future__ import annotations


class CompileMaskError(ValueError):
    """Base class of every error caused by user input (bad masks, lengths, tensors)."""


class MaskSyntaxError(CompileMaskError):
    """A mask text does not parse. The message shows line, column and a caret."""

    def __init__(self, message: str, text: str, pos: int):
        line_no = text.count("\n", 0, pos) + 1
        line_start = text.rfind("\n", 0, pos) + 1
        line_end = text.find("\n", pos)
        line = text[line_start : (None if line_end < 0 else line_end)]
        col = pos - line_start + 1
        self.line, self.column = line_no, col
        super().__init__(
            f"{message} (line {line_no}, column {col})\n  {line}\n  {' ' * (col - 1)}^"
        )


class LayoutError(CompileMaskError):
    """A layout, span or relation is inconsistent (unknown name, wrong length, bad pairing)."""


class LengthError(CompileMaskError):
    """A mask is compiled for lengths it does not accept."""


class InputError(CompileMaskError):
    """Tensors given to ``attention`` (or a dense mask) do not match what was expected."""


class PlanError(CompileMaskError):
    """A :class:`~compilemask.MaskPlan` breaks an invariant the kernels rely on (built by hand,
    edited, or loaded from a corrupt file), or its tensors were modified after it was built.
    The message names the field."""


def too_deep(fn):
    """Turn a ``RecursionError`` of ``fn`` (a mask expression nested or chained thousands of
    levels deep: each ``|`` / ``&`` / parenthesis is a level) into a :class:`CompileMaskError`."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RecursionError:
            raise CompileMaskError(
                f"{fn.__name__}(): the mask expression is nested too deeply (each |, & and "
                "parenthesis is a level; a few hundred are supported): combine many terms with "
                "a catalogue mask (document, per_batch, ...) or a rule block"
            ) from None

    return wrapper
