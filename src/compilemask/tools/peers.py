"""Peers for side-by-side benchmarks: FlexAttention mask_mods written as a Flex user would, and
the optional peer libraries (imported lazily; a peer that does not import is reported skipped).

``flex_mask_mod(mask, device)`` turns the seed workloads' catalogue masks (causal, hstu,
shared_prompt, clear, document, sliding_window) into the natural FlexAttention ``mask_mod``:
per-token lookup tensors and a few compares -- not our intervals, so Flex runs its best form.

``cudnn_endpoints(plan, batch)`` turns a plan's row intervals into the endpoint tensor of
cuDNN-frontend interval attention (``cudnn.flex_attention.create_mask_plan``);
``endpoints_dense`` is its inverse, for checks.
"""

from __future__ import annotations

import torch

from ..errors import CompileMaskError
from ..language.ast import Builtin, Mask


def _ids(lengths, device) -> torch.Tensor:
    return torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )


def flex_mask_mod(mask: Mask, device):
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` for a catalogue mask."""
    if not isinstance(mask, Builtin):
        raise CompileMaskError(f"no hand-written Flex mask_mod for {mask}")
    name, args = mask.name, mask.args
    if name == "causal":
        return lambda b, h, q, k: k <= q
    if name == "sliding_window":
        (w,) = args
        return lambda b, h, q, k: (k <= q) & (q - k < w)
    if name == "document":
        lengths, causal = args
        doc = _ids(lengths, device)
        if causal:
            return lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q)
        return lambda b, h, q, k: doc[q] == doc[k]
    if name == "hstu":
        lengths, targets, contextual = args
        user = _ids(lengths, device)
        starts = torch.cumsum(torch.tensor([0, *lengths[:-1]], device=device), 0)
        hist_end = (
            starts + torch.tensor(lengths, device=device) - torch.tensor(targets, device=device)
        )
        ctx_end = starts + torch.minimum(torch.full_like(hist_end, contextual), hist_end - starts)
        he, ce = hist_end[user], ctx_end[user]

        def hstu_mod(b, h, q, k):
            same = user[q] == user[k]
            hist_key = k < he[q]
            sees_hist = (k <= q) | (q < ce[q]) | (q >= he[q])
            return same & ((hist_key & sees_hist) | (k == q))

        return hstu_mod
    if name == "shared_prompt":
        prompts, responses = args
        group, resp, pend = [], [], []
        rid = 0
        pos = 0
        for gi, (p, rs) in enumerate(zip(prompts, responses)):
            group += [gi] * (p + sum(rs))
            resp += [-1] * p
            pend += [pos + p] * (p + sum(rs))
            for n in rs:
                resp += [rid] * n
                rid += 1
            pos += p + sum(rs)
        g_t = torch.tensor(group, device=device)
        r_t = torch.tensor(resp, device=device)
        p_t = torch.tensor(pend, device=device)

        def shared_mod(b, h, q, k):
            return (k <= q) & (g_t[q] == g_t[k]) & ((k < p_t[q]) | (r_t[k] == r_t[q]))

        return shared_mod
    if name == "clear":
        (gh, gw), r, text = args
        r2 = r * r

        def clear_mod(b, h, q, k):
            qi, ki = q - text, k - text
            dy, dx = qi // gw - ki // gw, qi % gw - ki % gw
            return (q < text) | (k < text) | (dy * dy + dx * dx < r2)

        return clear_mod
    raise CompileMaskError(f"no hand-written Flex mask_mod for {name}")


# ------------------------------------------------------------------ cuDNN-frontend endpoints


def cudnn_endpoints(plan, batch: int) -> torch.Tensor:
    """The plan's row intervals as cuDNN-frontend interval-attention endpoints.

    cuDNN's ``create_mask_plan(mask_func, q, k, v)`` takes ``mask_func`` int32
    ``[Hmask, nfunc, B * Nq]`` (batch-major rows, ``Hmask`` 1 or Hq, ``nfunc`` odd): row ``r``
    sees keys ``[0, F0) U [F1, F2) U [F3, F4) U ...`` with ``F = mask_func[h, :, r]``
    non-decreasing and inside ``[0, Nk]``.

    A plan row holds ``K`` slots ``[row_lo[j], row_hi[j])``: the first ``row_count`` sorted,
    disjoint intervals, the rest empty. They map to ``2K + 1`` endpoints
    ``F = (0, lo_0, hi_0, lo_1, hi_1, ...)`` (``[0, 0)`` is empty); every unused slot is set
    to ``[Nk, Nk)``, so the sequence stays non-decreasing (valid intervals are sorted and end
    at or before ``Nk``). When every non-empty row starts at key 0 (causal, prefix masks) the
    shorter ``2K - 1`` form ``F = (hi_0, lo_1, hi_1, ...)`` is used, with ``F0 = 0`` on rows
    that see nothing.

    Args:
        plan: an interval-encoded :class:`~compilemask.MaskPlan` (not ``encoding="bits"``).
        batch: B, the batch rows of the call (a plan that depends on the batch row must have
            exactly B rows).

    Returns:
        int32 ``[Hmask, nfunc, batch * Nq]`` on the plan's device, contiguous;
        ``Hmask = plan.heads or 1``.

    Raises:
        CompileMaskError: a bits-encoded plan, a plan with a token permutation, or a batch
            that does not match the plan.

    Example::

        >>> import compilemask as cm
        >>> ends = cudnn_endpoints(cm.compile(cm.masks.causal(), 4), batch=1)
        >>> ends[0].tolist()
        [[1, 2, 3, 4]]
    """
    if plan.encoding != "intervals":
        raise CompileMaskError(
            f"cuDNN endpoints need an interval-encoded plan, got encoding={plan.encoding!r}"
        )
    if getattr(plan, "permutation", None) is not None:
        raise CompileMaskError(
            "the plan reorders tokens (tile_grid): build endpoints from plan.in_permuted_order() "
            "and give cuDNN q, k, v in the tiled order"
        )
    mb, mh = plan.batch or 1, plan.heads or 1
    if plan.batch and plan.batch != batch:
        raise CompileMaskError(f"the plan was compiled for batch={plan.batch}, not {batch}")
    nq, nk = plan.q_len, plan.kv_len
    lo, hi, count = plan.row_lo, plan.row_hi, plan.row_count  # [M, Nq, K], [M, Nq]
    slots = lo.shape[-1]
    valid = torch.arange(slots, device=lo.device) < count[..., None]
    lo = torch.where(valid, lo, nk)
    hi = torch.where(valid, hi, nk)
    pairs = torch.stack((lo, hi), dim=-1).flatten(-2)  # [M, Nq, 2K]
    starts_at_zero = bool(((count == 0) | (lo[..., 0] == 0)).all()) if slots else False
    if starts_at_zero:
        first = torch.where(count > 0, hi[..., 0], 0)
        ends = torch.cat((first[..., None], pairs[..., 2:]), dim=-1)  # 2K - 1
    else:
        ends = torch.cat((torch.zeros_like(count)[..., None], pairs), dim=-1)  # 2K + 1
    nfunc = ends.shape[-1]
    ends = ends.view(mb, mh, nq, nfunc).expand(batch, mh, nq, nfunc)
    return ends.permute(1, 3, 0, 2).reshape(mh, nfunc, batch * nq).to(torch.int32).contiguous()


def endpoints_dense(ends: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The boolean mask ``[Hmask, rows, Nk]`` that cuDNN endpoints ``[Hmask, nfunc, rows]``
    describe (``[0, F0) U [F1, F2) U ...``); memory O(rows * Nk), for checks."""
    keys = torch.arange(kv_len, device=ends.device)
    e = ends.transpose(1, 2)[..., None]  # [Hmask, rows, nfunc, 1]
    visible = keys < e[:, :, 0]
    for j in range(1, ends.shape[1], 2):
        visible |= (keys >= e[:, :, j]) & (keys < e[:, :, j + 1])
    return visible
