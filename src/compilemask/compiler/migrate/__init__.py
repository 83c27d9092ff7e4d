"""Plans from a dense boolean mask or a FlexAttention ``mask_mod`` (migration helpers).

``from_mask_mod`` first tries to lift the mask_mod analytically (``lift.py``: traced with
``torch.fx``; a common form -- causal, a window, prefix-LM, chunks, documents, CLEAR's disc,
hstu and shared_prompt with per-row tables (``packed.py``) -- is built as its catalogue mask
by ``compile``'s path, ``recognise.py``; a few attention-gym mask_mods with piecewise-affine
rows from a host piece table, ``recognise_pieces.py``; anything else lowered to row intervals
without evaluating the N x N pairs); a mask_mod it does not recognise is evaluated
in blocks (``evaluate.py``), on broadcast indices when that gives FlexAttention's answer, else
under ``torch.vmap`` with FlexAttention's scalar semantics (``modeval.py``). ``plan.source``
(and ``plan.stats()["source"]``) names the path taken: ``from_mask_mod:lifted``,
``from_mask_mod:broadcast`` or ``from_mask_mod:vmap``. A plan is reused (``plan_cache.py``) only
where it is provably the same: a mask_mod that captures no tensor, keyed by its structure
(``trace.py``), or a recognised one keyed by the catalogue mask made of its tables' values (read
fresh on each call: a closure's captured tensors can change between calls). They are admitted
as compiler output (host-side checks only, as ``compile``'s plans; ``plan.verify()`` runs every
check).
"""

from __future__ import annotations

import logging

import torch

from ...errors import CompileMaskError
from ..pipeline import check_plan_size, positive_int, resolve_device, strict_bool
from ..plan import MaskPlan, outside_inference_mode
from . import lift, modeval, plan_cache, trace
from .blockmask import from_block_mask
from .evaluate import build_key_plan, build_plan, check_dense, chunk_rows

log = logging.getLogger("compilemask.migrate")

__all__ = ["from_block_mask", "from_dense", "from_mask_mod"]


@outside_inference_mode
def from_dense(
    mask: torch.Tensor, *, block_m: int = 128, block_n: int = 128, device=None
) -> MaskPlan:
    """Build a plan from a boolean mask, in one blocked pass (never more than a bounded chunk
    of rows copied at once).

    Args:
        mask: bool ``[Nq, Nk]`` (broadcasts over batch and heads) or ``[B, H, Nq, Nk]`` where
            ``B`` or ``H`` may be 1 (then the plan broadcasts over that axis).
        block_m, block_n: tile sizes of the default schedule.
        device: where the plan lives (None: the mask's device).

    Raises:
        CompileMaskError: not a boolean tensor, or not 2-D / 4-D, or an empty axis.

    Example::

        >>> import torch, compilemask as cm
        >>> plan = cm.from_dense(torch.ones(4, 4, dtype=torch.bool).tril())
        >>> plan.row_hi[0, :, 0].tolist()
        [1, 2, 3, 4]
    """
    check_dense(mask)
    block_m, block_n = positive_int(block_m, "block_m"), positive_int(block_n, "block_n")
    device = resolve_device(device, default=mask.device)
    m4 = mask if mask.dim() == 4 else mask[None, None]
    b, h, nq, nk = m4.shape
    rows = chunk_rows(nk, block_m, m4.device)

    def one(bi: int, hi_: int):
        return (m4[bi, hi_, r : r + rows] for r in range(0, nq, rows))

    def chunks():
        return (one(bi, hi_) for bi in range(b) for hi_ in range(h))

    batch = b if b > 1 else None
    heads = h if h > 1 else None
    return build_plan(chunks, nq, nk, batch, heads, block_m, block_n, device, "from_dense")


def _key_rows(call, bh, kv_idx: torch.Tensor) -> torch.Tensor | None:
    """The one row of each (batch row, head) mask, bool ``[len(bh), Nk]``, when the mask_mod's
    value does not depend on ``q_idx`` (on broadcast indices it returns one row for two
    queries: a broadcast view), else None. In the broadcast mode the shape of the result
    does not depend on the indices' values (operations that mix elements or branch on
    values take the vmap mode), so two rows tell for every row."""
    q = torch.arange(2, device=kv_idx.device)
    rows = []
    for b, h in bh:
        out = call(b, h, q, kv_idx)
        if out.stride(0) != 0:
            return None
        rows.append(out[0])
    return torch.stack(rows)


@outside_inference_mode
def from_mask_mod(
    mask_mod,
    q_len: int,
    kv_len: int | None = None,
    *,
    batch: int | None = None,
    heads: int | None = None,
    block_m: int = 128,
    block_n: int = 128,
    device=None,
    lifting: bool = True,
    cache: bool = True,
) -> MaskPlan:
    """Build a plan from a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``, giving
    exactly the mask of ``torch.nn.attention.flex_attention.create_mask``.

    ``b`` runs over ``range(batch)`` and ``h`` over ``range(heads)`` as in FlexAttention; with
    ``batch=None`` (``heads=None``) the mask_mod is called with ``b = 0`` (``h = 0``) only and
    the plan broadcasts over the batch (heads), as ``create_block_mask(..., B=None)`` does.

    Paths (``plan.source`` names the one taken; the reason for leaving the lifted path is
    logged on the ``compilemask.migrate`` logger at INFO):

    1. ``lifted``: the mask_mod is traced with ``torch.fx`` and lowered to row intervals
       symbolically (comparisons, ``&``, ``|``, ``~``, integer ``+ - * // %``, ``abs``,
       ``clamp``, ``min``/``max``, gathers from tensors indexed by ``q_idx`` or ``kv_idx``),
       O(N * K) work without evaluating the N x N pairs. The trace is cached by the mask_mod's
       code and the structure of what it captures (scalars by value, tensors by dtype, rank
       and device, read fresh on each call): a new closure over new tables of the same kind
       is not traced again.
    2. ``broadcast``: blocked evaluation with ``q_idx`` ``[rows, 1]`` and ``kv_idx``
       ``[1, Nk]`` int64 tensors, when a probe shows it gives the same answer as (3).
    3. ``vmap``: blocked evaluation under ``torch.vmap`` with 0-d indices (FlexAttention's
       scalar semantics, tensor indexing as ``aten.index``).

    Args:
        mask_mod: the predicate (PyTorch FlexAttention convention).
        q_len, kv_len: lengths in tokens (kv_len None: q_len).
        batch, heads: evaluate per batch row / per query head (the plan then depends on them).
        block_m, block_n, device: as in :func:`compilemask.compile` (device None: CPU).
        lifting: try the analytic path first (False: always evaluate).
        cache: reuse the plan of an earlier call where it is provably the same plan
            (``plan_cache.py``): a mask_mod that captures no tensor and whose trace is cached
            by its structure, at the same lengths, batch, heads, tiles and device (any path;
            nothing is computed or read); a mask_mod recognised as a catalogue mask with
            the same values read from its tables (the tables are read, nothing is built).
            Only with ``lifting`` (the trace proves what the mask_mod depends on).

    Raises:
        CompileMaskError: bad lengths, a ``lifting`` or ``cache`` that is not True or False,
            a mask_mod that raises (both ways) or returns a non-boolean or wrongly shaped
            tensor.
    """
    q_len = positive_int(q_len, "q_len")
    kv_len = q_len if kv_len is None else positive_int(kv_len, "kv_len")
    batch = None if batch is None else positive_int(batch, "batch")
    heads = None if heads is None else positive_int(heads, "heads")
    block_m, block_n = positive_int(block_m, "block_m"), positive_int(block_n, "block_n")
    if not callable(mask_mod):
        raise CompileMaskError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    strict_bool(lifting, "lifting")
    strict_bool(cache, "cache")
    device = resolve_device(device)
    if max(q_len, kv_len) > 2**31 - 1:
        raise CompileMaskError(
            f"q_len and kv_len must be below 2**31 (plans hold int32 token positions), got "
            f"q_len={q_len}, kv_len={kv_len}"
        )
    bh = [(b, h) for b in range(batch or 1) for h in range(heads or 1)]
    state, key = False, None
    if lifting:
        state = trace.structure(mask_mod)
        if cache and state is not None and not state[1]:  # no tensor captured
            key = (state[0], q_len, kv_len, batch, heads, block_m, block_n, str(device))
            hit = plan_cache.get_pure(key)
            if hit is not None:
                return hit
        # before any work: a plan whose tile schedule cannot fit is refused, not evaluated
        check_plan_size(1, q_len, kv_len, block_m, block_n, device)
        plan = lift.try_lift(
            mask_mod, q_len, kv_len, batch, heads, bh, block_m, block_n, device, state, cache
        )
        if plan is not None:
            return plan_cache.put_pure(key, plan)
    check_plan_size(len(bh), q_len, kv_len, block_m, block_n, device)
    mode = modeval.choose_mode(mask_mod, q_len, kv_len, bh, device)
    call = modeval.evaluator(mask_mod, mode)
    rows = chunk_rows(kv_len, block_m, device)
    kv_idx = torch.arange(kv_len, device=device)
    source = f"from_mask_mod:{mode}"
    keys = _key_rows(call, bh, kv_idx) if mode == "broadcast" and q_len > block_m else None
    if keys is not None:  # every row alike: one row per mask is the whole mask
        log.debug("mask_mod evaluated as a key mask (its value does not depend on q_idx)")
        plan = build_key_plan(keys, q_len, kv_len, batch, heads, block_m, block_n, source)
        return plan_cache.put_pure(key, plan)

    def one(b: int, h: int):
        for r in range(0, q_len, rows):
            yield call(b, h, torch.arange(r, min(q_len, r + rows), device=device), kv_idx)

    def chunks():
        return (one(b, h) for b, h in bh)

    plan = build_plan(chunks, q_len, kv_len, batch, heads, block_m, block_n, device, source)
    return plan_cache.put_pure(key, plan)
