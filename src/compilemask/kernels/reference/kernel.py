"""Reference attention over a :class:`MaskPlan` in plain PyTorch: the correctness oracle.

Computes ``softmax(scale * q @ k^T + mask) @ v`` row chunk by row chunk (memory stays bounded:
about 2^26 score elements per chunk), with the mask of each chunk from ``plan.dense_rows`` (row
intervals, or tile bitmasks for bits-encoded plans). Runs on any device, in any float dtype,
differentiably (chunks are recomputed in the backward, so the backward's memory is bounded
too), and traces under ``torch.compile`` without graph breaks for interval-encoded plans
(no host synchronisation; with ``dynamic=True`` one graph for every length whose rows fit one
chunk: the lengths stay symbolic sizes).

Two uses (docs/design.md, "Correctness measure"):

- the float64 oracle: ``reference_attention(q, k, v, plan, compute_dtype=torch.float64)``;
- the same-dtype reference: ``compute_dtype=torch.float32, matmul_dtype=q.dtype`` (matmuls in
  the kernel's dtype, softmax in float32, output rounded to q's dtype).

Rows that see no key give output 0 and LSE -inf.

Legend: B batch, Hq / Hkv query / key-value heads, Nq / Nk query / key length, D head_dim,
M = number of masks in the plan (1, B, Hq or B * Hq), K = interval slots per row.
"""

from __future__ import annotations

import math

import torch
import torch.utils.checkpoint

_CHUNK_ELEMENTS = 1 << 26


def _row_chunks(Nq, per_row: int) -> list[tuple]:
    """``[start, end)`` query-row chunks of at most ``_CHUNK_ELEMENTS // per_row`` rows (at
    least one row each; none when ``Nq == 0``). When every row fits, the one chunk
    ``(0, Nq)`` takes no Python arithmetic on ``Nq``: under ``torch.compile(dynamic=True)``
    the length stays symbolic (guarded by ``Nq * per_row <= _CHUNK_ELEMENTS``, not by its
    value), so one graph serves every length that fits one chunk."""
    if Nq == 0:
        return []
    if Nq * per_row <= _CHUNK_ELEMENTS:
        return [(0, Nq)]
    chunk = max(1, _CHUNK_ELEMENTS // per_row)
    return [(start, min(Nq, start + chunk)) for start in range(0, Nq, chunk)]


def _mask_for_chunk(plan, start: int, end: int, B: int, Hq: int, Hkv: int) -> torch.Tensor:
    """bool [B or 1, Hkv or 1, G or 1, rows, Nk], broadcastable against grouped scores."""
    rows = plan.dense_rows(start, end)
    mb = plan.batch if plan.batch else 1
    mh = plan.heads if plan.heads else 1
    rows = rows.view(mb, mh, end - start, plan.kv_len)
    if mh == 1:
        return rows[:, :, None]
    return rows.view(mb, Hkv, Hq // Hkv, end - start, plan.kv_len)


def _chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype,
    matmul_dtype: torch.dtype,
    score_mod=None,
    sinks: torch.Tensor | None = None,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped chunk: q [B, Hkv, G, n, D], k [B, Hkv, 1, Nk, D], v [B, Hkv, 1, Nk, Dv]; out
    in compute_dtype. ``score_mod`` (a ``compilemask.score_mods`` modifier) changes the scaled
    scores before the mask, with the indices b, h, q (``start`` + row) and kv broadcast
    against the scores; ``sinks`` [Hq] add ``exp(sink_h)`` to every row's denominator (and
    to its lse)."""
    scores = torch.matmul(q.to(matmul_dtype), k.to(matmul_dtype).transpose(-1, -2))
    scores = scores.to(compute_dtype) * scale
    if score_mod is not None:
        B, Hkv, G, n, Nk = scores.shape
        dev = scores.device
        b = torch.arange(B, device=dev).view(B, 1, 1, 1, 1)
        h = torch.arange(Hkv * G, device=dev).view(1, Hkv, G, 1, 1)
        qi = (start + torch.arange(n, device=dev)).view(1, 1, 1, n, 1)
        ki = torch.arange(Nk, device=dev).view(1, 1, 1, 1, Nk)
        scores = score_mod(scores, b, h, qi, ki)
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    if sinks is not None:
        Hkv, G = q.shape[1], q.shape[2]
        sink = sinks.to(compute_dtype).view(1, Hkv, G, 1, 1)
        row_max = torch.maximum(row_max, sink)  # finite: a row that sees nothing gets the sink
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(scores - row_max)
    denom = p.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    out = torch.matmul(p.to(matmul_dtype), v.to(matmul_dtype)).to(compute_dtype)
    out = out / torch.where(denom == 0, torch.ones_like(denom), denom)
    lse = (row_max + torch.log(denom)).squeeze(-1)
    return out, lse


def _masked_chunk_attention(
    q, k, v, plan, start, end, scale, compute_dtype, matmul_dtype, score_mod=None, sinks=None
):  # fmt: skip
    """:func:`_chunk_attention` of query rows ``[start, end)`` with the mask built inside (so
    that a checkpoint of it keeps no dense mask alive between forward and backward)."""
    B, Hkv, G = q.shape[:3]
    visible = _mask_for_chunk(plan, start, end, B, Hkv * G, Hkv)
    return _chunk_attention(
        q, k, v, visible, scale, compute_dtype, matmul_dtype, score_mod, sinks, start
    )


def _precision(in_dtype, head_dim, compute_dtype, matmul_dtype, scale):
    """``(compute_dtype, matmul_dtype, out_dtype, scale)`` with the defaults filled in: softmax
    and accumulation in float64 for float64 inputs, else float32; matmuls in compute_dtype;
    outputs in float64 for a float64 computation, else the inputs' dtype; 1 / sqrt(D)."""
    if compute_dtype is None:
        compute_dtype = torch.float64 if in_dtype == torch.float64 else torch.float32
    out_dtype = torch.float64 if compute_dtype == torch.float64 else in_dtype
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    return compute_dtype, matmul_dtype or compute_dtype, out_dtype, scale


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan,
    scale: float | None = None,
    *,
    compute_dtype: torch.dtype | None = None,
    matmul_dtype: torch.dtype | None = None,
    score_mod=None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention by the definition, chunked over query rows.

    Args:
        q: [B, Hq, Nq, D]; k: [B, Hkv, Nk, D]; v: [B, Hkv, Nk, Dv] with Hq % Hkv == 0 (GQA /
            MQA; Dv may differ from D). Inputs are assumed validated
            (``compilemask.attention`` validates).
        plan: a ``MaskPlan`` for (Nq, Nk) on q's device; a ``tile_grid`` plan's permutation is
            applied as ``compilemask.attention`` applies it (inputs and outputs in the
            original token order).
        scale: softmax scale, default 1 / sqrt(D).
        compute_dtype: dtype of the softmax and accumulation: float32 or float64 (default:
            float64 for float64 inputs, else float32).
        matmul_dtype: dtype the two matmuls run in; default ``compute_dtype``. Pass q.dtype
            for the same-dtype reference.
        score_mod: a ``compilemask.score_mods`` modifier (its torch twin runs on the scaled
            scores of each chunk, before the mask; differentiable in its tensors), or None.
            Not with a ``tile_grid`` plan (positions would be the permuted ones).
        sinks: [Hq] sink logits (differentiable), or None.

    Returns:
        (out, lse): out [B, Hq, Nq, Dv] in q's dtype, or float64 when ``compute_dtype`` is
        float64 (the oracle keeps full precision); lse [B, Hq, Nq] in compute_dtype, natural
        log (with sinks: ``log(sum_j exp(s_ij) + exp(sink_h))``). Rows that see no key: out
        0, lse -inf (with sinks: lse = sink_h).

    Example::

        >>> ref64, _ = reference_attention(q, k, v, plan, compute_dtype=torch.float64)
        >>> same, _ = reference_attention(q, k, v, plan, compute_dtype=torch.float32,
        ...                               matmul_dtype=q.dtype)
    """
    if plan.permutation is not None:  # a tile_grid plan: inputs and outputs in our order
        perm, inv = plan.permutation, plan.inverse_permutation
        if score_mod is not None:
            raise ValueError("score_mod with a tile_grid plan is not supported")
        out, lse = reference_attention(
            *(t.index_select(2, perm) for t in (q, k, v)), plan.in_permuted_order(), scale,
            compute_dtype=compute_dtype, matmul_dtype=matmul_dtype, sinks=sinks,
        )  # fmt: skip
        return out.index_select(2, inv), lse.index_select(2, inv)
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    compute_dtype, matmul_dtype, out_dtype, scale = _precision(
        q.dtype, D, compute_dtype, matmul_dtype, scale
    )

    qg = q.view(B, Hkv, G, Nq, D) if q.is_contiguous() else q.reshape(B, Hkv, G, Nq, D)
    kg, vg = k[:, :, None], v[:, :, None]
    slots = max(plan.row_lo.shape[-1], 1)
    per_row = max(B * Hq * max(Nk, 1), plan.num_masks * (max(Nk, 1) + slots))
    # (not under torch.func transforms: checkpoint's saved-tensor hooks do not run there)
    learnable = (sinks is not None and sinks.requires_grad) or (
        score_mod is not None and score_mod.requires_grad()
    )
    use_checkpoint = (
        torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad or learnable)
        and not torch._C._are_functorch_transforms_active()
    )

    if Nq == 0:
        out = q.new_zeros((B, Hq, 0, Dv), dtype=out_dtype)
        return out, q.new_zeros((B, Hq, 0), dtype=compute_dtype)
    outs, lses = [], []
    for start, end in _row_chunks(Nq, per_row):
        q_chunk = qg[:, :, :, start:end]
        args = (
            q_chunk, kg, vg, plan, start, end, scale, compute_dtype, matmul_dtype, score_mod,
            sinks,
        )  # fmt: skip
        if use_checkpoint:  # the chunk's mask is rebuilt in the backward, not kept
            o, lse = torch.utils.checkpoint.checkpoint(
                _masked_chunk_attention, *args, use_reentrant=False
            )
        else:
            o, lse = _masked_chunk_attention(*args)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs, dim=3).reshape(B, Hq, Nq, Dv).to(out_dtype)
    lse = torch.cat(lses, dim=3).reshape(B, Hq, Nq)
    return out, lse


def reference_attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan,
    do: torch.Tensor,
    scale: float | None = None,
    *,
    dlse: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    matmul_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact gradients of masked softmax attention, recomputed chunk by chunk of query rows.

    With ``S = scale * q k^T`` (masked), ``P = softmax(S)``, ``out = P v``,
    ``lse = logsumexp(S)`` and upstream gradients ``do`` (of out) and ``dlse`` (of lse)::

        dv = P^T do        dP = do v^T        delta = rowsum(P * dP) - dlse
        dS = P * (dP - delta)        dq = scale * dS k        dk = scale * dS^T q

    (``rowsum(P * dP) = rowsum(do * out)``)

    (``d lse_i / d S_ij = P_ij``). Grouped heads (GQA / MQA) sum dk, dv over the query heads
    of a group. Rows that see no key have P = 0 and contribute nothing; keys no row sees get
    dk = dv = 0. Memory stays bounded: a chunk holds about 2^26 score elements (never
    [B, Hq, Nq, Nk] at once for large N) plus the [B, Hkv, Nk, D] dk, dv accumulators.

    Args:
        q: [B, Hq, Nq, D]; k: [B, Hkv, Nk, D]; v: [B, Hkv, Nk, Dv]; do: [B, Hq, Nq, Dv]
            (no score modifier, no sinks: their gradients come from torch autograd through
            :func:`reference_attention`).
        plan: a ``MaskPlan`` for (Nq, Nk) on q's device (a ``tile_grid`` plan's permutation is
            applied, as in :func:`reference_attention`).
        scale: softmax scale, default 1 / sqrt(D).
        dlse: optional [B, Hq, Nq] gradient of the LSE output (None: zero).
        compute_dtype: dtype of the softmax and the accumulation (float32 or float64; default
            float64 for float64 inputs, else float32).
        matmul_dtype: dtype of the matmuls (default ``compute_dtype``); pass q.dtype for the
            same-dtype reference of docs/design.md (P and dS are rounded to it before
            their matmuls, as a kernel does).

    Returns:
        (dq, dk, dv) shaped like q, k, v; float64 when ``compute_dtype`` is float64, else in
        q's dtype.

    Example::

        >>> dq64, dk64, dv64 = reference_attention_backward(q, k, v, plan, do,
        ...                                                 compute_dtype=torch.float64)

    Source: the FlashAttention-2 backward (Dao, 2023), without tiling.
    """
    if plan.permutation is not None:  # a tile_grid plan: inputs and outputs in our order
        perm, inv = plan.permutation, plan.inverse_permutation
        grads = reference_attention_backward(
            *(t.index_select(2, perm) for t in (q, k, v)), plan.in_permuted_order(),
            do.index_select(2, perm), scale,
            dlse=None if dlse is None else dlse.index_select(2, perm),
            compute_dtype=compute_dtype, matmul_dtype=matmul_dtype,
        )  # fmt: skip
        return tuple(g.index_select(2, inv) for g in grads)
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    compute_dtype, mm, out_dtype, scale = _precision(q.dtype, D, compute_dtype, matmul_dtype, scale)

    qg = q.reshape(B, Hkv, G, Nq, D).to(mm)
    dog = do.reshape(B, Hkv, G, Nq, Dv).to(mm)
    dlse_g = None if dlse is None else dlse.reshape(B, Hkv, G, Nq).to(compute_dtype)
    kg, vg = k.to(mm)[:, :, None], v.to(mm)[:, :, None]
    slots = max(plan.row_lo.shape[-1], 1)
    per_row = max(B * Hq * max(Nk, 1), plan.num_masks * (max(Nk, 1) + slots))

    dk = torch.zeros((B, Hkv, Nk, D), dtype=compute_dtype, device=q.device)
    dv = torch.zeros((B, Hkv, Nk, Dv), dtype=compute_dtype, device=q.device)
    dqs = []
    for start, end in _row_chunks(Nq, per_row):
        visible = _mask_for_chunk(plan, start, end, B, Hq, Hkv)
        qc, doc = qg[:, :, :, start:end], dog[:, :, :, start:end]
        scores = torch.matmul(qc, kg.transpose(-1, -2)).to(compute_dtype) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        row_max = scores.amax(-1, keepdim=True)
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        p = torch.exp(scores - row_max)
        del scores
        denom = p.sum(-1, keepdim=True)
        p = p / torch.where(denom == 0, torch.ones_like(denom), denom)
        dv += torch.matmul(p.to(mm).transpose(-1, -2), doc).to(compute_dtype).sum(2)
        dp = torch.matmul(doc, vg.transpose(-1, -2)).to(compute_dtype)
        delta = (p * dp).sum(-1, keepdim=True)
        if dlse_g is not None:
            delta = delta - dlse_g[:, :, :, start:end, None]
        ds = (p * (dp - delta)).to(mm)
        del p, dp
        dqs.append(torch.matmul(ds, kg).to(compute_dtype) * scale)
        dk += torch.matmul(ds.transpose(-1, -2), qc).to(compute_dtype).sum(2) * scale
    if Nq == 0:
        dq = torch.zeros((B, Hq, 0, D), dtype=out_dtype, device=q.device)
    else:
        dq = torch.cat(dqs, dim=3).reshape(B, Hq, Nq, D).to(out_dtype)
    return dq, dk.to(out_dtype), dv.to(out_dtype)
