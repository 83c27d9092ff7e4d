"""The mask catalogue: one constructor per named pattern (semantics: docs/masks.md).

Every constructor validates its parameters (raising :class:`CompileMaskError` that names the
parameter) and returns a :class:`~compilemask.language.ast.Builtin`, which prints as text that
:func:`compilemask.parse` reads back (``str(sliding_window(1024)) == "sliding_window(1024)"``).

Example::

    >>> import compilemask as cm
    >>> m = cm.masks.document([3, 5]) | cm.masks.prefix_lm(2)
    >>> cm.parse(str(m)) == m
    True
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from .errors import CompileMaskError
from .language.ast import Builtin, Mask, PerBatch, PerHead
from .language.values import array_kind as _array_kind
from .language.values import integer_value

MAX_INT = 2**31 - 1  # token positions and mask parameters are int32 in plans


def _what(value: object) -> str:
    """How a bad argument is shown: a tensor or array by dimensions and dtype (not its data)."""
    shape = _array_kind(value)
    if shape is None:
        return repr(value)
    meta = " on the meta device (no values)" if shape[1] == "meta" else ""
    return f"a {shape[0]}-D {type(value).__name__} of {value.dtype}{meta}"


def _int(
    value: object, name: str, minimum: int | None = None, error: type = CompileMaskError
) -> int:
    """``value`` as a Python int: an int, a numpy integer, or a 0-d integer tensor / array;
    else ``error`` naming ``name`` (bools, floats, other dimensions; below ``minimum``)."""
    n = integer_value(value)
    if n is None:
        raise error(f"{name} must be an integer, got {_what(value)}")
    value = n
    if minimum is not None and value < minimum:
        raise error(f"{name} must be >= {minimum}, got {value}")
    if abs(value) > MAX_INT:
        raise error(f"{name} must be below 2**31 (plans hold int32 positions), got {value}")
    return value


def _is_int(value: object) -> bool:
    """A scalar that :func:`_int` takes (an integer, not a list)."""
    shape = _array_kind(value)
    if shape is not None:
        return shape[0] == 0
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _ints(
    values: object, name: str, minimum: int | None = None, error: type = CompileMaskError
) -> tuple[int, ...]:
    """``values`` as a tuple of Python ints: a list or tuple of what :func:`_int` takes, or a
    1-D integer tensor / numpy array; else ``error`` naming ``name`` (or ``name[i]``)."""
    shape = _array_kind(values)
    if shape is not None:
        if shape != (1, "i"):
            raise error(f"{name} must be a 1-D list of integers, got {_what(values)}")
        values = values.tolist()
    elif isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise error(f"{name} must be a list of integers, got {values!r}")
    vals = tuple(values)
    # the common case checked at once (thousands of document lengths: ~20x faster); any
    # other value, or one out of range, goes through _int for its conversion or its message
    if all(type(v) is int for v in vals) and (
        not vals
        or (
            (minimum is None or min(vals) >= minimum)
            and max(vals) <= MAX_INT
            and min(vals) >= -MAX_INT
        )
    ):
        return vals
    return tuple(_int(v, f"{name}[{i}]", minimum, error) for i, v in enumerate(vals))


def _pair(value: object, name: str, minimum: int = 1) -> tuple[int, int]:
    vals = _ints(value, name, minimum)
    if len(vals) != 2:
        raise CompileMaskError(f"{name} must be a pair (h, w), got {value!r}")
    return vals  # type: ignore[return-value]


def causal() -> Mask:
    """``k <= q``."""
    return Builtin("causal", ())


def sliding_window(window: int) -> Mask:
    """``k <= q and q - k < window``; ``window >= 1`` keys seen including itself (HF convention)."""
    return Builtin("sliding_window", (_int(window, "window", 1),))


def document(lengths: Sequence[int], causal: bool = True) -> Mask:
    """Packed documents: same document and (``k <= q`` if ``causal``). Fixes the length."""
    lens = _ints(lengths, "lengths", 1)
    if not lens:
        raise CompileMaskError("lengths must hold at least one document")
    if isinstance(causal, np.bool_):
        causal = bool(causal)
    if not isinstance(causal, bool):
        raise CompileMaskError(f"causal must be a bool, got {causal!r}")
    return Builtin("document", (lens, causal))


def prefix_lm(prefix_len: int) -> Mask:
    """``k < prefix_len or k <= q``; ``prefix_len >= 0`` (may exceed the length)."""
    return Builtin("prefix_lm", (_int(prefix_len, "prefix_len", 0),))


def chunked(chunk: int) -> Mask:
    """``q // chunk == k // chunk and k <= q``."""
    return Builtin("chunked", (_int(chunk, "chunk", 1),))


def block_causal(block: int) -> Mask:
    """``k // block <= q // block``."""
    return Builtin("block_causal", (_int(block, "block", 1),))


def shared_prompt(prompt_len, response_lens) -> Mask:
    """One prompt, several responses: ``k <= q and same group and (k in the group's prompt or k in
    q's response)``. One group: ``prompt_len`` an int and ``response_lens`` a list; several packed
    groups: a list of ints and a list of lists. Fixes the length."""
    if _is_int(prompt_len):
        prompts = (_int(prompt_len, "prompt_len", 0),)
        groups = (response_lens,)
    else:
        prompts = _ints(prompt_len, "prompt_len", 0)
        if isinstance(response_lens, (str, bytes)) or not isinstance(response_lens, Sequence):
            raise CompileMaskError("response_lens must be a list of lists with several groups")
        groups = tuple(response_lens)
        if len(groups) != len(prompts):
            raise CompileMaskError(
                f"response_lens has {len(groups)} groups but prompt_len has {len(prompts)}"
            )
    if not prompts:
        raise CompileMaskError("shared_prompt needs at least one group")
    resp = tuple(_ints(r, f"response_lens[{g}]", 1) for g, r in enumerate(groups))
    for g, r in enumerate(resp):
        if not r:
            raise CompileMaskError(f"response_lens[{g}] must hold at least one response")
    return Builtin("shared_prompt", (prompts, resp))


def hstu(lengths: Sequence[int], num_targets: Sequence[int], contextual: int = 0) -> Mask:
    """HSTU recommender mask, per user (lists per user). ``0 <= num_targets < length``;
    ``contextual`` is clipped to each user's history. Fixes the length."""
    lens = _ints(lengths, "lengths", 1)
    targets = _ints(num_targets, "num_targets", 0)
    if not lens:
        raise CompileMaskError("lengths must hold at least one user")
    if len(targets) != len(lens):
        raise CompileMaskError(
            f"num_targets has {len(targets)} entries but lengths has {len(lens)} users"
        )
    for u, (n, t) in enumerate(zip(lens, targets)):
        if t >= n:
            raise CompileMaskError(f"num_targets[{u}] = {t} must be < lengths[{u}] = {n}")
    return Builtin("hstu", (lens, targets, _int(contextual, "contextual", 0)))


def clear(grid: tuple[int, int], radius: int, text_len: int) -> Mask:
    """CLEAR: ``[text | image grid h x w row-major]``; ``q is text or k is text or
    dy^2 + dx^2 < radius^2``. Fixes the length (``text_len + h * w``)."""
    return Builtin(
        "clear", (_pair(grid, "grid"), _int(radius, "radius", 1), _int(text_len, "text_len", 0))
    )


def global_local(window: int, global_tokens: Sequence[int]) -> Mask:
    """``|q - k| <= window or q in G or k in G`` (bidirectional; ``window >= 0`` is a radius;
    ``G`` distinct positions, may be empty)."""
    g = _ints(global_tokens, "global_tokens", 0)
    if len(set(g)) != len(g):
        raise CompileMaskError(f"global_tokens must be distinct positions, got {list(g)}")
    return Builtin("global_local", (_int(window, "window", 0), tuple(sorted(g))))


def tree(parents: Sequence[int], prefix_len: int) -> Mask:
    """Tree drafts (speculative decoding): query ``i`` is node ``i`` at key position
    ``prefix_len + i``; it sees the prefix, itself and its ancestors. ``parents[i] < i``; roots
    have -1. ``q_len = len(parents)``, ``kv_len = prefix_len + len(parents)``."""
    par = _ints(parents, "parents", -1)
    if not par:
        raise CompileMaskError("parents must hold at least one node")
    for i, p in enumerate(par):
        if p >= i:
            raise CompileMaskError(f"parents[{i}] = {p} must be < {i} (or -1 for a root)")
    return Builtin("tree", (par, _int(prefix_len, "prefix_len", 0)))


def natten2d(grid: tuple[int, int], kernel: tuple[int, int]) -> Mask:
    """NATTEN 2-D neighbourhood attention on a row-major ``h x w`` grid with a ``kh x kw`` window
    that shifts inward at borders. ``kernel`` odd and ``<= grid`` per axis. Fixes the length."""
    g = _pair(grid, "grid")
    k = _pair(kernel, "kernel")
    for axis, (kk, e) in enumerate(zip(k, g)):
        if kk % 2 == 0:
            raise CompileMaskError(f"kernel[{axis}] = {kk} must be odd")
        if kk > e:
            raise CompileMaskError(f"kernel[{axis}] = {kk} must be <= grid[{axis}] = {e}")
    return Builtin("natten2d", (g, k))


def dilated(window: int, dilation: int) -> Mask:
    """``|q - k| <= window and (q - k) % dilation == 0`` (bidirectional)."""
    return Builtin("dilated", (_int(window, "window", 0), _int(dilation, "dilation", 1)))


def tile_grid(mask: Mask, tile: tuple[int, int] = (8, 16)) -> Mask:
    """Reorder the tokens of the mask's 2-D grids into ``th x tw`` tiles (a compiler pass for
    local 2-D windows: a disc or window of neighbouring cells then covers few tiles).
    ``compilemask.attention`` with a plan of this mask takes q, k, v in the ORIGINAL token
    order: it permutes them, runs the tiled plan and puts the output back
    (``plan.permutation``); ``plan.in_permuted_order()`` drops that step for models that keep
    their tokens tiled. Needs ``q_len == kv_len``.

    Args:
        mask: a mask holding at least one 2-D grid (``clear``, ``natten2d`` or a layout's
            ``grid(h, w)`` segment), outermost (not combined with other masks afterwards).
        tile: ``(th, tw)`` cells per tile, each >= 1 (edge tiles may be smaller).

    Returns:
        The tiled mask (position ``i`` holds the token at ``permutation[i]`` of ``mask``).

    Raises:
        CompileMaskError: ``tile`` is not a pair of positive ints; when compiled, a mask without
            a grid, or ``q_len != kv_len``.

    Source: the project's design notes (token permutation for grid masks); CLEAR (Liu et
    al., 2024) for the disc-shaped local attention it speeds up.

    Example::

        >>> m = tile_grid(clear((128, 256), 16, 512), (8, 16))
        >>> str(m)
        'tile_grid(clear([128, 256], 16, 512), [8, 16])'
    """
    from .language.ast import TiledGrid

    if not isinstance(mask, Mask):
        raise CompileMaskError(f"tile_grid needs a mask, got {type(mask).__name__}")
    return TiledGrid(mask, _pair(tile, "tile"))


def _mask_list(masks: object, name: str) -> tuple[Mask, ...]:
    """``masks`` as a non-empty tuple of masks, else a CompileMaskError naming the bad item."""
    try:
        if isinstance(masks, (Mask, str)):
            raise TypeError
        ms = tuple(masks)
    except TypeError:
        raise CompileMaskError(
            f"{name} needs a list of masks, got {type(masks).__name__}"
        ) from None
    if not ms:
        raise CompileMaskError(f"{name} needs a non-empty list of masks, got an empty one")
    for i, m in enumerate(ms):
        if not isinstance(m, Mask):
            raise CompileMaskError(
                f"{name}: masks[{i}] must be a compilemask Mask, got {type(m).__name__}"
            )
    return ms


def per_head(masks: Sequence[Mask]) -> Mask:
    """``masks[h]`` for query head ``h`` (compile with ``heads=len(masks)``). Raises
    CompileMaskError for an empty list or an item that is not a mask."""
    return PerHead(_mask_list(masks, "per_head"))


def per_batch(masks: Sequence[Mask]) -> Mask:
    """``masks[b]`` for batch row ``b`` (compile with ``batch=len(masks)``). Raises
    CompileMaskError for an empty list or an item that is not a mask."""
    return PerBatch(_mask_list(masks, "per_batch"))


CATALOGUE = {
    f.__name__: f
    for f in (
        causal,
        sliding_window,
        document,
        prefix_lm,
        chunked,
        block_causal,
        shared_prompt,
        hstu,
        clear,
        global_local,
        tree,
        natten2d,
        dilated,
    )
}
