"""The dense evaluator: the specification of every mask.

Every mask means one boolean predicate ``visible(q, k)`` on absolute token positions (query ``i``
is position ``i``; ``tree`` defines its own coordinates). This module states that predicate as
plainly as possible, with torch broadcasting, and builds dense masks from it. It is slow
(``O(Nq * Nk)``) and deliberately independent of the compiler: it shares nothing with the
lowering except :mod:`.resolve` (where the layout's segments lie), so every compiler stage can be
property-tested against it.

Semantics (from ``docs/workloads.md`` and ``docs/design.md``, the language):

* catalogue builtins -- exactly the table of docs/workloads.md (one ``_builtin_*`` function each);
* :class:`RuleMask` -- the union of its rules; a rule ``Q -> K : REL`` pairs the parts of ``Q``
  and ``K`` (part ``p`` with part ``p`` when both carry the same index variable, every part with
  every range otherwise) and, inside a pair, compares ``q' = q - q_start`` with
  ``k' = k - k_start``;
* :class:`Combine` -- ``|`` union, ``&`` intersection, ``-`` difference;
* :class:`PerHead` / :class:`PerBatch` -- ``masks[h]`` / ``masks[b]``.

Only rows ``0 <= q < q_len`` and keys ``0 <= k < kv_len`` exist; ``visible`` is False elsewhere.
Queries that sit further along the key axis (decoding: the new rows are the last positions) are
rows ``q_offset .. q_offset + q_len - 1`` of the axis: ``dense(..., q_offset=o)``.

Example::

    >>> from compilemask import masks
    >>> dense(masks.sliding_window(2), 4).int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 1, 1, 0],
            [0, 0, 1, 1]], dtype=torch.int32)
"""

from __future__ import annotations

import itertools
import numbers

import torch

from ..errors import CompileMaskError, LayoutError, LengthError, too_deep
from .ast import Builtin, Combine, Mask, PerBatch, PerHead, RuleMask, TiledGrid
from .permutation import grid_permutation
from .resolve import check_rules, fixed_length, resolve, span_ranges
from .values import integer_value

__all__ = ["accepted_lengths", "natural_lengths", "visible", "dense", "offsets_of"]

# Builtins that fix the axis length (q_len == kv_len == that length), by name -> length of args.
_FIXED_LENGTH = {
    "document": lambda lens, causal: sum(lens),
    "shared_prompt": lambda prompts, resps: sum(prompts) + sum(sum(r) for r in resps),
    "hstu": lambda lens, targets, contextual: sum(lens),
    "clear": lambda grid, radius, text_len: text_len + grid[0] * grid[1],
    "natten2d": lambda grid, kernel: grid[0] * grid[1],
}


# --------------------------------------------------------------------------------------------
# Lengths
# --------------------------------------------------------------------------------------------


def natural_lengths(mask: Mask) -> tuple[int | None, int | None]:
    """``(q_len, kv_len)`` a mask fixes by itself (``tree``: ``n`` queries and
    ``prefix_len + n`` keys; a length-fixing layout: its length twice), or ``(None, None)``.

    Example::

        >>> from compilemask import masks
        >>> natural_lengths(masks.tree([-1, 0], 3)), natural_lengths(masks.causal())
        ((2, 5), (None, None))
    """
    if isinstance(mask, Builtin) and mask.name == "tree":
        parents, prefix_len = mask.args
        return len(parents), prefix_len + len(parents)
    if isinstance(mask, (Combine, PerHead, PerBatch, TiledGrid)):
        found = {natural_lengths(c) for c in mask.children()} - {(None, None)}
        return found.pop() if len(found) == 1 else (None, None)
    kv = _own_kv_len(mask, 1)
    return (kv, kv) if kv is not None else (None, None)


def accepted_lengths(mask: Mask, q_len: int, kv_len: int | None = None) -> tuple[int, int]:
    """Validate the lengths a mask is evaluated (or compiled) at.

    Args:
        mask: any mask.
        q_len: number of query rows ``Nq`` (an int >= 1).
        kv_len: number of keys ``Nk`` (an int >= 1), or None for the mask's own key length when
            it fixes one (``document``, ``tree``, a layout without ``rest:*``, ...), else ``q_len``.

    Returns:
        ``(q_len, kv_len)`` as ints.

    Raises:
        LengthError: a length is not an int >= 1, or the mask does not accept these lengths
            (a length-fixing mask at another length, ``tree`` with ``q_len != len(parents)``,
            children of a combination that fix different lengths, a global token outside the
            axis, a layout longer than the axis).
        LayoutError: a RuleMask's layout or rules are inconsistent.

    Example::

        >>> from compilemask import masks
        >>> accepted_lengths(masks.tree([-1, 0, 0], prefix_len=4), 3)
        (3, 7)
    """
    if not isinstance(mask, Mask):
        raise CompileMaskError(f"expected a mask, got {type(mask).__name__}")
    q_len = _length(q_len, "q_len")
    if kv_len is None:
        own = _own_kv_len(mask, q_len)
        kv_len = q_len if own is None else own
    else:
        kv_len = _length(kv_len, "kv_len")
    _check_lengths(mask, q_len, kv_len)
    return q_len, kv_len


def _length(value: object, name: str) -> int:
    n = integer_value(value)
    if n is None:
        raise LengthError(f"{name} must be an int >= 1, got {value!r}")
    if n < 1:
        raise LengthError(f"{name} must be an int >= 1, got {n}")
    return n


def _describe(mask: Mask) -> str:
    """A short name for error messages: the mask's text, cut to one line."""
    if isinstance(mask, RuleMask):
        return "layout mask (" + " ".join(s.name for s in mask.layout) + ")"
    text = " ".join(str(mask).split())
    return text if len(text) <= 80 else text[:77] + "..."


def _own_kv_len(mask: Mask, q_len: int) -> int | None:
    """The key length a mask fixes by itself (None when it accepts any)."""
    if isinstance(mask, Builtin):
        if mask.name in _FIXED_LENGTH:
            return _FIXED_LENGTH[mask.name](*mask.args)
        if mask.name == "tree":
            parents, prefix_len = mask.args
            return prefix_len + len(parents)
        return None
    if isinstance(mask, RuleMask):
        return fixed_length(mask.layout)
    owners = [(c, _own_kv_len(c, q_len)) for c in mask.children()]
    owners = [(c, n) for c, n in owners if n is not None]
    if len({n for _, n in owners}) > 1:
        detail = ", ".join(f"{_describe(c)} fixes {n}" for c, n in owners)
        raise LengthError(f"combined masks fix different key lengths: {detail}")
    return owners[0][1] if owners else None


def _check_lengths(mask: Mask, q_len: int, kv_len: int) -> None:
    if isinstance(mask, Builtin):
        _check_builtin_lengths(mask, q_len, kv_len)
    elif isinstance(mask, RuleMask):
        check_rules(mask)
        fixed = fixed_length(mask.layout)
        if fixed is not None and not q_len == kv_len == fixed:
            raise LengthError(
                f"the layout fixes the length to {fixed} tokens (q_len = kv_len = {fixed}), "
                f"got q_len={q_len}, kv_len={kv_len}"
            )
        resolve(mask.layout, max(q_len, kv_len))  # raises when the layout does not fit
    elif isinstance(mask, TiledGrid):
        if q_len != kv_len:
            raise LengthError(
                f"tile_grid permutes one axis: needs q_len == kv_len, got {q_len}, {kv_len}"
            )
        _check_lengths(mask.mask, q_len, kv_len)
        grid_permutation(mask.mask, q_len, mask.tile)
    elif isinstance(mask, (Combine, PerHead, PerBatch)):
        for i, child in enumerate(mask.children()):
            try:
                _check_lengths(child, q_len, kv_len)
            except LengthError as err:
                raise LengthError(
                    f"part {i} of a {type(mask).__name__} ({_describe(child)}) does not accept "
                    f"q_len={q_len}, kv_len={kv_len}: {err}"
                ) from None
    else:
        raise CompileMaskError(f"unknown mask node {type(mask).__name__}")


def _check_builtin_lengths(mask: Builtin, q_len: int, kv_len: int) -> None:
    name, args = mask.name, mask.args
    if name in _FIXED_LENGTH:
        fixed = _FIXED_LENGTH[name](*args)
        if not q_len == kv_len == fixed:
            raise LengthError(
                f"{name} fixes the length to {fixed} tokens (q_len = kv_len = {fixed}), "
                f"got q_len={q_len}, kv_len={kv_len}"
            )
    elif name == "tree":
        parents, prefix_len = args
        n = len(parents)
        if q_len != n or kv_len != prefix_len + n:
            raise LengthError(
                f"tree of {n} nodes with prefix_len={prefix_len} needs q_len={n} and "
                f"kv_len={prefix_len + n}, got q_len={q_len}, kv_len={kv_len}"
            )
    elif name == "global_local":
        _, global_tokens = args
        axis_len = max(q_len, kv_len)
        outside = [g for g in global_tokens if g >= axis_len]
        if outside:
            raise LengthError(
                f"global_local: global tokens {outside} lie outside the axis of "
                f"max(q_len, kv_len) = {axis_len} tokens"
            )
    elif name not in _BUILTINS:
        raise CompileMaskError(f"unknown catalogue mask {name!r}; known: {sorted(_BUILTINS)}")


# --------------------------------------------------------------------------------------------
# visible / dense
# --------------------------------------------------------------------------------------------


def visible(
    mask: Mask,
    q_idx: torch.Tensor | int,
    k_idx: torch.Tensor | int,
    *,
    q_len: int,
    kv_len: int | None = None,
    b: int = 0,
    h: int = 0,
) -> torch.Tensor:
    """Whether query position ``q_idx`` sees key position ``k_idx`` (the specification).

    Args:
        mask: any mask.
        q_idx, k_idx: broadcastable int64 tensors (or ints) of absolute positions.
        q_len, kv_len: the lengths (validated by :func:`accepted_lengths`).
        b, h: batch row and query head; used by ``per_batch`` / ``per_head`` masks only.

    Returns:
        bool tensor of the broadcast shape of ``q_idx`` and ``k_idx``; False for positions
        outside ``[0, q_len) x [0, kv_len)``.

    Raises:
        CompileMaskError: bad lengths (see :func:`accepted_lengths`), or ``b`` / ``h`` outside
            the mask's batch / head count.

    Example::

        >>> from compilemask import masks
        >>> visible(masks.causal(), torch.tensor([3]), torch.tensor([2, 3, 4]), q_len=5)
        tensor([ True,  True, False])
    """
    q_len, kv_len = accepted_lengths(mask, q_len, kv_len)
    q = _positions(q_idx, "q_idx")
    k = _positions(k_idx, "k_idx")
    q, k = torch.broadcast_tensors(q, k)
    exists = (q >= 0) & (q < q_len) & (k >= 0) & (k < kv_len)
    return exists & _visible(mask, q, k, q_len, kv_len, _index(b, "b"), _index(h, "h"))


def _positions(value: object, name: str) -> torch.Tensor:
    """Integer positions as int64 (floats and bools are refused, not truncated)."""
    t = torch.as_tensor(value)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise CompileMaskError(f"{name} must hold integer positions, got dtype {t.dtype}")
    return t.to(torch.int64)


#: the most booleans :func:`dense` builds (8 GiB of them; its evaluation needs a few times more)
DENSE_MAX_CELLS = 2**33


@too_deep
def dense(
    mask: Mask,
    q_len: int,
    kv_len: int | None = None,
    *,
    batch: int | None = None,
    heads: int | None = None,
    q_offset=0,
) -> torch.Tensor:
    """The dense boolean mask, built by calling :func:`visible` on index grids.

    Args:
        mask: any mask.
        q_len, kv_len: lengths (``kv_len`` None: the mask's own key length, else
            ``q_offset + q_len``; with one offset per batch row, ``max(q_offset) + q_len``
            for every row, as :func:`compilemask.compile` builds it).
        batch, heads: sizes; they must equal ``mask.batch_count`` / ``mask.head_count`` when the
            mask depends on the batch row / head, and are ignored otherwise (it broadcasts).
        q_offset: where the query rows sit on the key axis: row ``i`` is position
            ``q_offset + i`` (an int >= 0; default 0, the rows start at the first key), or a
            ``[B]`` integer tensor / sequence with one offset per batch row (ragged caches).
            The mask is evaluated on a query axis of ``q_offset + q_len`` positions of which the
            last ``q_len`` rows are returned, so ``dense(m, n, q_offset=o)`` equals
            ``dense(m, o + n)[o:]``. ``q_offset = kv_len - q_len`` is the bottom-right
            alignment of decoding. ``tree`` defines its own query coordinates (row ``i`` is
            draft node ``i``): use offset 0 with it.

    Returns:
        bool ``[Nq, Nk]`` when the mask depends on neither batch row nor head and ``q_offset``
        is an int, else ``[B or 1, H or 1, Nq, Nk]`` (``B = mask.batch_count``, or the length
        of a per-row ``q_offset``; ``H = mask.head_count``).

    Raises:
        CompileMaskError: bad lengths or offsets, ``batch`` / ``heads`` that contradict the
            mask, or a mask of more than ``DENSE_MAX_CELLS`` booleans.

    Example::

        >>> from compilemask import masks
        >>> dense(masks.per_head([masks.causal(), masks.dilated(1, 1)]), 3, heads=2).shape
        torch.Size([1, 2, 3, 3])
        >>> dense(masks.causal(), 1, 4, q_offset=3).int()
        tensor([[1, 1, 1, 1]], dtype=torch.int32)
    """
    offsets = offsets_of(q_offset)
    if isinstance(offsets, list):
        B = mask.batch_count
        if B is not None and B != len(offsets):
            raise CompileMaskError(
                f"q_offset has {len(offsets)} rows but the mask is per_batch with {B} entries"
            )
        _check_size(batch, len(offsets), "batch", "per-row q_offset")
        if kv_len is None:  # one key axis for every row, as compile builds it
            kv_len = max(offsets) + _length(q_len, "q_len")
        rows = []
        for b, off in enumerate(offsets):
            one = dense(mask, q_len, kv_len, heads=heads, q_offset=off)
            if one.dim() == 2:
                one = one[None, None]
            rows.append(one[b if one.shape[0] > 1 else 0])
        return torch.stack(rows)
    full = _length(q_len, "q_len") + offsets
    full, kv_len = accepted_lengths(mask, full, kv_len)
    B, H = mask.batch_count, mask.head_count
    _check_size(batch, B, "batch", "per_batch")
    _check_size(heads, H, "heads", "per_head")
    cells = (full - offsets) * kv_len * (B or 1) * (H or 1)
    if cells > DENSE_MAX_CELLS:
        raise CompileMaskError(
            f"dense would hold {cells:,} booleans (q_len={full - offsets}, kv_len={kv_len}"
            f"{f', batch={B}' if B else ''}{f', heads={H}' if H else ''}), more than "
            f"{DENSE_MAX_CELLS:,}; compile(mask, q_len) builds the plan without the dense mask"
        )
    q = torch.arange(offsets, full).view(-1, 1)
    k = torch.arange(kv_len).view(1, -1)
    if B is None and H is None:
        return visible(mask, q, k, q_len=full, kv_len=kv_len)
    return torch.stack(
        [
            torch.stack(
                [visible(mask, q, k, q_len=full, kv_len=kv_len, b=b, h=h) for h in range(H or 1)]
            )
            for b in range(B or 1)
        ]
    )


def offsets_of(q_offset) -> int | list[int]:
    """``q_offset`` as an int >= 0, or (a ``[B]`` tensor or sequence of them) a list of ints.

    Raises:
        CompileMaskError: not integers, negative, or a tensor that is not one-dimensional.
    """
    if isinstance(q_offset, torch.Tensor):
        if q_offset.dim() == 0:
            q_offset = q_offset.item()
        elif (
            q_offset.dim() != 1 or q_offset.dtype.is_floating_point or q_offset.dtype == torch.bool
        ):
            raise CompileMaskError(
                f"q_offset must be an int or a [B] integer tensor, got a tensor of shape "
                f"{tuple(q_offset.shape)} and dtype {q_offset.dtype}"
            )
        else:
            q_offset = q_offset.tolist()
    if isinstance(q_offset, (list, tuple)):
        if not q_offset:
            raise CompileMaskError("q_offset must hold one offset per batch row, got none")
        return [offsets_of(o) for o in q_offset]
    if isinstance(q_offset, bool) or not isinstance(q_offset, numbers.Integral) or q_offset < 0:
        raise CompileMaskError(f"q_offset must be an int >= 0, got {q_offset!r}")
    return int(q_offset)


def _check_size(given: int | None, count: int | None, name: str, kind: str) -> None:
    if given is None:
        return
    n = integer_value(given)
    if n is None or n < 1:
        raise CompileMaskError(f"{name} must be an int >= 1 or None, got {given!r}")
    given = n
    if count is not None and given != count:
        raise CompileMaskError(f"the mask is a {kind} mask of {count}, but {name}={given}")


def _index(value: object, name: str) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise CompileMaskError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def _visible(mask: Mask, q, k, q_len: int, kv_len: int, b: int, h: int) -> torch.Tensor:
    """``visible`` without validation; ``q`` and ``k`` have the same shape."""
    if isinstance(mask, Builtin):
        return _BUILTINS[mask.name](q, k, *mask.args)
    if isinstance(mask, RuleMask):
        return _rule_mask_visible(mask, q, k, q_len, kv_len)
    if isinstance(mask, Combine):
        left = _visible(mask.left, q, k, q_len, kv_len, b, h)
        right = _visible(mask.right, q, k, q_len, kv_len, b, h)
        if mask.op == "|":
            return left | right
        if mask.op == "&":
            return left & right
        if mask.op == "-":
            return left & ~right
        raise CompileMaskError(f"unknown combination operator {mask.op!r}")
    if isinstance(mask, TiledGrid):
        perm = grid_permutation(mask.mask, max(q_len, kv_len), mask.tile).to(q.device)
        qi, ki = q.clamp(0, len(perm) - 1), k.clamp(0, len(perm) - 1)
        return _visible(mask.mask, perm[qi], perm[ki], q_len, kv_len, b, h)
    if isinstance(mask, PerHead):
        if h >= len(mask.masks):
            raise CompileMaskError(
                f"head h={h} is out of range for a per_head of {len(mask.masks)}"
            )
        return _visible(mask.masks[h], q, k, q_len, kv_len, b, h)
    if isinstance(mask, PerBatch):
        if b >= len(mask.masks):
            raise CompileMaskError(
                f"batch row b={b} is out of range for a per_batch of {len(mask.masks)}"
            )
        return _visible(mask.masks[b], q, k, q_len, kv_len, b, h)
    raise CompileMaskError(f"unknown mask node {type(mask).__name__}")


# --------------------------------------------------------------------------------------------
# The catalogue (docs/workloads.md, "The catalogue"), one function per constructor.
# ``q`` and ``k`` are int64 position tensors of one shape. Per-position tables (document id,
# user, role, ...) are looked up at clamped indices; positions outside the axis are masked off by
# ``visible``.
# --------------------------------------------------------------------------------------------


def _lookup(table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return table[pos.clamp(0, len(table) - 1)]


def _ids(lengths) -> torch.Tensor:
    """``ids[p]`` = which of the consecutive runs of ``lengths`` position ``p`` falls in."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _builtin_causal(q, k):
    return k <= q


def _builtin_sliding_window(q, k, window):
    return (k <= q) & (q - k < window)


def _builtin_document(q, k, lengths, causal):
    doc = _ids(lengths)
    same = _lookup(doc, q) == _lookup(doc, k)
    return same & (k <= q) if causal else same


def _builtin_prefix_lm(q, k, prefix_len):
    return (k < prefix_len) | (k <= q)


def _builtin_chunked(q, k, chunk):
    return (q // chunk == k // chunk) & (k <= q)


def _builtin_block_causal(q, k, block):
    return k // block <= q // block


def _builtin_shared_prompt(q, k, prompts, responses):
    # Per position: its group, whether it is a prompt token, and a response id (unique over the
    # whole axis; -1 for prompt tokens).
    group, is_prompt, response = [], [], []
    next_response = 0
    for g, (p, rs) in enumerate(zip(prompts, responses, strict=True)):
        group += [g] * (p + sum(rs))
        is_prompt += [True] * p + [False] * sum(rs)
        response += [-1] * p
        for r in rs:
            response += [next_response] * r
            next_response += 1
    group, is_prompt, response = map(torch.tensor, (group, is_prompt, response))
    same_group = _lookup(group, q) == _lookup(group, k)
    k_in_prompt = _lookup(is_prompt, k)
    k_in_q_response = (_lookup(response, k) == _lookup(response, q)) & ~k_in_prompt
    return (k <= q) & same_group & (k_in_prompt | k_in_q_response)


def _builtin_hstu(q, k, lengths, num_targets, contextual):
    # Per position: its user, whether it is a history token, whether it is a contextual row.
    user, is_history, is_contextual = [], [], []
    for u, (n, t) in enumerate(zip(lengths, num_targets, strict=True)):
        history = n - t
        c = min(contextual, history)
        user += [u] * n
        is_history += [True] * history + [False] * t
        is_contextual += [True] * c + [False] * (n - c)
    user, is_history, is_contextual = map(torch.tensor, (user, is_history, is_contextual))
    same_user = _lookup(user, q) == _lookup(user, k)
    q_history, q_contextual = _lookup(is_history, q), _lookup(is_contextual, q)
    k_history = _lookup(is_history, k)
    q_target = ~q_history
    # history row: history keys k <= q; contextual row: all history keys;
    # target row: all history keys and itself.
    sees = k_history & ((q_history & (k <= q)) | q_contextual | q_target)
    return same_user & (sees | (q_target & (k == q)))


def _builtin_clear(q, k, grid, radius, text_len):
    h, w = grid
    q_text, k_text = q < text_len, k < text_len
    qi, ki = q - text_len, k - text_len  # image token index (row-major)
    dy = qi // w - ki // w
    dx = qi % w - ki % w
    near = ~q_text & ~k_text & (dy * dy + dx * dx < radius * radius)
    return q_text | k_text | near


def _builtin_global_local(q, k, window, global_tokens):
    g = torch.tensor(global_tokens, dtype=torch.int64)
    return ((q - k).abs() <= window) | torch.isin(q, g) | torch.isin(k, g)


def _builtin_tree(q, k, parents, prefix_len):
    n = len(parents)
    # ancestor_or_self[i, j]: node j is node i or one of its ancestors (parents[i] < i, so one
    # pass in index order sees every parent's row complete).
    ancestor_or_self = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            ancestor_or_self[i] |= ancestor_or_self[p]
    node = k - prefix_len
    on_path = ancestor_or_self[q.clamp(0, n - 1), node.clamp(0, n - 1)]
    return (k < prefix_len) | ((node >= 0) & (node < n) & on_path)


def _natten_axis(c_q, c_k, kernel: int, extent: int):
    """NATTEN along one axis: the window of ``kernel`` cells centred on the query, shifted inward
    at the borders so it always holds ``kernel`` cells."""
    r = kernel // 2
    centre = c_q.clamp(r, extent - 1 - r)
    return (centre - c_k).abs() <= r


def _builtin_natten2d(q, k, grid, kernel):
    h, w = grid
    kh, kw = kernel
    return _natten_axis(q // w, k // w, kh, h) & _natten_axis(q % w, k % w, kw, w)


def _builtin_dilated(q, k, window, dilation):
    d = q - k
    return (d.abs() <= window) & (d % dilation == 0)


_BUILTINS = {
    "causal": _builtin_causal,
    "sliding_window": _builtin_sliding_window,
    "document": _builtin_document,
    "prefix_lm": _builtin_prefix_lm,
    "chunked": _builtin_chunked,
    "block_causal": _builtin_block_causal,
    "shared_prompt": _builtin_shared_prompt,
    "hstu": _builtin_hstu,
    "clear": _builtin_clear,
    "global_local": _builtin_global_local,
    "tree": _builtin_tree,
    "natten2d": _builtin_natten2d,
    "dilated": _builtin_dilated,
}


# --------------------------------------------------------------------------------------------
# Rule masks (docs/design.md, the language)
# --------------------------------------------------------------------------------------------


def _rule_mask_visible(mask: RuleMask, q, k, q_len: int, kv_len: int) -> torch.Tensor:
    axis_len = max(q_len, kv_len)
    segs = resolve(mask.layout, axis_len)
    out = torch.zeros_like(q, dtype=torch.bool)
    for rule in mask.rules:
        for (qs, ql, qg), (ks, kl, kg) in _rule_pairs(rule, segs, axis_len):
            in_pair = (q >= qs) & (q < qs + ql) & (k >= ks) & (k < ks + kl)
            out |= in_pair & _relation(rule.relation, q - qs, k - ks, qg, kg)
    return out


def _rule_pairs(rule, segs, axis_len: int):
    """The (query range, key range) pairs of a rule, each ``(start, length, grid)``, after the
    checks of docs/design.md: contiguous spans for relations other than ``full``, equal part lengths
    for an indexed pair, and matching grids for grid relations."""
    kind = rule.relation.kind
    q_parts = span_ranges(rule.query, segs, axis_len)
    k_parts = span_ranges(rule.key, segs, axis_len)
    for span, parts in ((rule.query, q_parts), (rule.key, k_parts)):
        if kind != "full" and span.index is None and len(parts) > 1:
            raise LayoutError(
                f"relation {kind} needs contiguous spans, but {'|'.join(span.names)} covers "
                f"{len(parts)} separate ranges (only 'full' may use it)"
            )
    variable = rule.query.index if isinstance(rule.query.index, str) else None
    if variable is not None and rule.key.index == variable:
        if len(q_parts) != len(k_parts):
            raise LayoutError(
                f"{rule.query.names[0]}[{variable}] has {len(q_parts)} parts but "
                f"{rule.key.names[0]}[{variable}] has {len(k_parts)}"
            )
        pairs = list(zip(q_parts, k_parts, strict=True))
        if kind != "full":
            for p, ((_, ql, _), (_, kl, _)) in enumerate(pairs):
                if ql != kl:
                    raise LayoutError(
                        f"relation {kind} pairs spans of equal length, but part {p} of "
                        f"{rule.query.names[0]}[{variable}] has {ql} tokens and of "
                        f"{rule.key.names[0]}[{variable}] {kl}"
                    )
    else:
        pairs = list(itertools.product(q_parts, k_parts))
    if kind in ("disc", "box", "natten"):
        for (_, _, qg), (_, _, kg) in pairs:
            if qg is None or kg is None or qg != kg:
                raise LayoutError(
                    f"relation {kind} needs a grid query span and a grid key span of the same "
                    f"shape, got {qg} and {kg}"
                )
            if kind == "natten" and (
                rule.relation.params[0] > qg[0] or rule.relation.params[1] > qg[1]
            ):
                raise LayoutError(f"natten{rule.relation.params} is larger than the grid {qg}")
    return pairs


def _relation(relation, qp, kp, q_grid, k_grid) -> torch.Tensor:
    """A relation on span-relative positions ``q'`` and ``k'`` (meaningful inside the pair)."""
    kind, params = relation.kind, relation.params
    if kind == "full":
        return torch.ones_like(qp, dtype=torch.bool)
    if kind == "causal":
        return kp <= qp
    if kind == "diag":
        return kp == qp
    if kind == "band":
        lo, hi = params
        return (qp + lo <= kp) & (kp <= qp + hi)
    if kind == "chunk":
        (c,) = params
        return qp // c == kp // c
    # grid relations: (y, x) = cell of a token in the row-major grid (q_grid == k_grid)
    gh, gw = q_grid
    yq, xq, yk, xk = qp // gw, qp % gw, kp // gw, kp % gw
    if kind == "disc":
        (r,) = params
        return (yq - yk) ** 2 + (xq - xk) ** 2 < r * r
    if kind == "box":
        bh, bw = params
        return ((yq - yk).abs() <= bh // 2) & ((xq - xk).abs() <= bw // 2)
    if kind == "natten":
        kh, kw = params
        return _natten_axis(yq, yk, kh, gh) & _natten_axis(xq, xk, kw, gw)
    raise LayoutError(f"unknown relation {kind!r}")
