"""``compilemask.attention``: masked attention driven by a compiled :class:`MaskPlan`.

The Triton kernel is called through the torch custom op ``compilemask::attention_fwd`` (with a
fake implementation), so ``attention`` runs inside ``torch.compile(fullgraph=True)`` without
graph breaks. The op returns ``(out, lse)`` and takes q, k, v and every plan tensor a backward
needs, so a backward can be attached with ``torch.library.register_autograd`` (saving q, k, v,
out, lse and the schedule tensors from the op's inputs).

Legend: B batch, Hq / Hkv query / key-value heads, Nq / Nk query / key length, D head_dim.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd import forward_ad

from ..compiler.plan import MaskPlan
from ..errors import InputError
from ..kernels.reference import reference_attention
from ..kernels.triton.configs import (
    FwdConfig,
    forward_config,
    has_bitmask_tiles,
    tile_efficiency_128,
)
from ..kernels.triton.schedule import FWD_SCHEDULE_FIELDS, forward_schedule
from . import validate
from .autograd import (
    _attention_bwd_impl,
    backward,
    backward_inputs,
    check_backward_config,
    setup_context,
)


@torch.library.custom_op("compilemask::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    row_lo: torch.Tensor,
    row_hi: torch.Tensor,
    schedule: list[torch.Tensor],
    bwd_schedule: list[torch.Tensor],
    scale: float,
    mask_stride_b: int,
    mask_stride_h: int,
    config: list[int],
    bwd_config: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton forward: ``(out [B, Hq, Nq, D] in q's dtype, lse float32 [B, Hq, Nq])``.

    Args:
        q, k, v: [B, Hq, Nq, D], [B, Hkv, Nk, D] (validated by ``attention``).
        row_lo, row_hi: the plan's int32 [M, Nq, K] row intervals.
        schedule: the forward schedule tensors, in the order of :data:`FWD_SCHEDULE_FIELDS`
            (from ``kernels.triton.forward.forward_schedule``).
        bwd_schedule, bwd_config: the backward's schedule tensors and tilings (see
            ``api/autograd.py``); not read by the forward; empty lists when no input requires
            grad (then backward raises).
        scale: softmax scale.
        mask_stride_b, mask_stride_h: mask index ``m = b * mask_stride_b + h * mask_stride_h``.
        config: ``[BLOCK_M, BLOCK_N, num_warps, num_stages, grid_order, tma, overlap,
            one_loop, prefetch, one_slot]`` (``FwdConfig``'s fields).
    """
    return _attention_fwd_impl(
        q, k, v, row_lo, row_hi, schedule, scale, mask_stride_b, mask_stride_h, config
    )


def _attention_fwd_impl(
    q, k, v, row_lo, row_hi, schedule, scale, mask_stride_b, mask_stride_h, config
):  # fmt: skip
    from ..kernels.triton.forward import attention_forward

    return attention_forward(
        q, k, v, row_lo, row_hi, dict(zip(FWD_SCHEDULE_FIELDS, schedule)), scale=scale,
        mask_stride_b=mask_stride_b, mask_stride_h=mask_stride_h, cfg=FwdConfig(*config),
    )  # fmt: skip


@attention_fwd.register_fake
def _attention_fwd_fake(
    q, k, v, row_lo, row_hi, schedule, bwd_schedule, scale, mask_stride_b, mask_stride_h,
    config, bwd_config,
):  # fmt: skip
    B, Hq, Nq, D = q.shape
    out = torch.empty((B, Hq, Nq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    return out, lse


# Gradients to q, k, v through out and lse: the custom op compilemask::attention_bwd.
attention_fwd.register_autograd(backward, setup_context=setup_context)


def _forward_only(
    q, k, v, row_lo, row_hi, schedule, bwd_schedule, scale, msb, msh, config, bwd_config
):  # fmt: skip
    return _attention_fwd_impl(q, k, v, row_lo, row_hi, schedule, scale, msb, msh, config)


class _EagerAttention(torch.autograd.Function):
    """The custom ops' eager twin: the same forward and backward functions, called without the
    custom-op dispatch (torch.library's argument flattening and redispatch cost about half of
    the host time of a small fwd+bwd step). ``torch.compile`` traces the custom ops instead
    (their fake implementations keep the graph whole).

    Host time per step (``benchmarks/results/h200-launch-cost-2026-11-30.jsonl``), hence:

    - the context is set inside ``forward`` (the classic form): with a separate
      ``setup_context``, ``Function.apply`` binds the arguments through ``inspect.signature``
      on every call;
    - only q, k, v, out and lse go through ``save_for_backward``; the plan's tensors (row
      intervals, backward schedule: 21 tensors, constants of the plan's cache that nothing
      writes) are kept as attributes, so the backward does not unpack them one by one;
    - gradients are not materialised: an unused ``lse`` (the usual case) reaches the backward
      as None instead of a zero-filled tensor, and the backward then skips its dlse term.
    """

    @staticmethod
    def forward(
        ctx, q, k, v, row_lo, row_hi, schedule, bwd_schedule, scale, msb, msh, config,
        bwd_config,
    ):  # fmt: skip
        out, lse = _attention_fwd_impl(q, k, v, row_lo, row_hi, schedule, scale, msb, msh, config)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan_tensors = (row_lo, row_hi, bwd_schedule)
        ctx.scale = scale
        ctx.mask_strides = (msb, msh)
        ctx.bwd_config = list(bwd_config)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:
            return (None,) * 12
        check_backward_config(ctx.bwd_config)
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:  # only lse was used
            dout = torch.zeros_like(out)
        row_lo, row_hi, bwd_schedule = ctx.plan_tensors
        with torch.no_grad():
            dq, dk, dv = _attention_bwd_impl(
                q, k, v, out, lse, dout, dlse, row_lo, row_hi, bwd_schedule, ctx.scale,
                *ctx.mask_strides, ctx.bwd_config,
            )  # fmt: skip
        if torch.is_grad_enabled():  # create_graph=True: no double backward
            dq, dk, dv = _NoDoubleBackward.apply(dq, dk, dv, q, k, v, dout, dlse)
        return (dq, dk, dv) + (None,) * 9


class _NoDoubleBackward(torch.autograd.Function):
    """The gradients of a Triton backward run with ``create_graph=True``, tied in the graph to
    q, k, v and the incoming gradients: differentiating them again (``backward()`` or
    ``torch.autograd.grad(..., inputs=q)``) raises a clear error. Without it, a second-order
    term through them (a gradient penalty) was a constant and dropped silently.
    (``once_differentiable`` guards the incoming gradients only.)"""

    @staticmethod
    def forward(ctx, dq, dk, dv, *inputs):
        return dq.clone(), dk.clone(), dv.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "compilemask.attention (backend='triton') has no double backward: its gradients "
            "cannot be differentiated again (create_graph=True); use backend='reference' for "
            "higher-order gradients"
        )


# Forward schedules (FULL tiles first) per TileSchedule object, kept while it lives. Eager only:
# under torch.compile the few tensor ops that build them are traced into the graph.
_FWD_SCHEDULES: dict[int, tuple[weakref.ref, list[torch.Tensor]]] = {}


def _forward_schedule(plan: MaskPlan, cfg: FwdConfig) -> list[torch.Tensor]:
    sched = plan.tiles(cfg.block_m, cfg.block_n, bits=True)
    if torch.compiler.is_compiling():
        return list(forward_schedule(plan, cfg.block_m, cfg.block_n, bits=True).values())
    hit = _FWD_SCHEDULES.get(id(sched))
    if hit is not None and hit[0]() is sched:
        return hit[1]
    tensors = list(forward_schedule(plan, cfg.block_m, cfg.block_n, bits=True).values())
    key = id(sched)
    ref = weakref.ref(sched, lambda _, key=key: _FWD_SCHEDULES.pop(key, None))
    _FWD_SCHEDULES[key] = (ref, tensors)
    return tensors


def _gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(2, index)``; on CUDA in eager mode one Triton row-copy launch
    (``kernels/triton/permute.py``); traced as ``index_select`` under ``torch.compile``."""
    if x.is_cuda and not torch.compiler.is_compiling():
        from ..kernels.triton.permute import gather_tokens

        return gather_tokens(x, index)
    return x.index_select(2, index)


class _TokenOrder(torch.autograd.Function):
    """``x.index_select(2, index)`` whose gradient is a gather too (``grad.index_select(2,
    inverse)``, ``inverse`` the inverse permutation of ``index``), not the atomic
    ``index_add`` of autograd's ``index_select`` backward (slow in 16 bits)."""

    @staticmethod
    def forward(x, index, inverse):
        return _gather_tokens(x, index)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1], inputs[2])
        ctx.index = inputs[1]  # for jvp

    @staticmethod
    def backward(ctx, grad):
        index, inverse = ctx.saved_tensors
        # itself a _TokenOrder, so that gradients of gradients (create_graph=True) flow
        return _TokenOrder.apply(grad, inverse, index), None, None

    @staticmethod
    def jvp(ctx, x_t, index_t, inverse_t):
        return _gather_tokens(x_t, ctx.index)


def _permute_tokens(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x.index_select(2, index)``: through :class:`_TokenOrder` in eager mode; traced as
    ``index_select`` under ``torch.compile`` (Dynamo does not trace a custom ``jvp``)."""
    if torch.compiler.is_compiling():
        return x.index_select(2, index)
    return _TokenOrder.apply(x, index, inverse)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: MaskPlan,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Masked attention ``softmax(scale * q @ k^T + mask) @ v`` with the mask of ``plan``.

    Each query row attends exactly to the key intervals the plan compiled for it; rows that see
    no key give output 0 (and LSE -inf), never NaN. Heads are grouped (GQA / MQA): query head h
    reads key/value head ``h // (Hq // Hkv)``.

    Args:
        q: [B, Hq, Nq, D] float16 or bfloat16 (float32 also works; float64 on the reference).
        k, v: [B, Hkv, Nk, D], same dtype and device as q, Hq % Hkv == 0.
            D (head_dim) is one of 32, 64, 96, 128, 256. Any strides.
        plan: a :class:`MaskPlan` compiled for (Nq, Nk), on q's device, and for this B / Hq
            when its mask depends on the batch row / head. A plan of a ``tile_grid`` mask
            carries a permutation: q, k, v are given (and out returned) in the original token
            order, and the kernels run in tiled order.
        scale: softmax scale, default 1 / sqrt(D).
        return_lse: also return the log-sum-exp of each row's scaled scores.
        backend: "auto" (Triton on CUDA, or on the CPU when TRITON_INTERPRET=1; else the
            reference), "triton" or "reference".

    Differentiable in q, k and v through out and lse (Triton: deterministic FlashAttention-2
    backward kernels, also under ``torch.compile``; the opt-in atomic dQ of
    ``BwdConfig.atomic_dq`` is not, and is off under ``torch.use_deterministic_algorithms``;
    reference: torch autograd with per-chunk recomputation). Forward-mode AD (dual tensors of
    ``torch.autograd.forward_ad``, ``torch.func.jvp``) and higher-order gradients on the
    reference backend only (Triton: gradients taken with ``create_graph=True`` raise when
    differentiated again).

    Returns:
        out [B, Hq, Nq, D] in q's dtype; with ``return_lse``, ``(out, lse)`` with lse float32
        [B, Hq, Nq] (natural log; -inf for rows that see no key).

    Raises:
        InputError: mismatching shapes, dtypes or devices, unsupported head_dim, a plan built
            for other lengths / batch / heads or on another device, an unavailable backend,
            the Triton backend under a torch.func transform (grad, vjp, jvp, vmap) or on
            dual tensors of forward-mode AD (``torch.autograd.forward_ad``).

    Example::

        >>> plan = cm.compile(cm.masks.sliding_window(256), 4096, device="cuda")
        >>> out = cm.attention(q, k, v, plan)  # q, k, v: [2, 16, 4096, 128] bf16 on CUDA

    Source: FlashAttention-2 (Dao, 2023) over the plan's tile lists.
    """
    validate.check_tensors(q, k, v)
    validate.check_plan(q, k, plan)
    scale = validate.check_scale(scale, q.shape[-1])
    backend = validate.resolve_backend(backend, q)
    if (
        backend == "triton"
        and torch._C._are_functorch_transforms_active()
        and not torch.compiler.is_compiling()
    ):
        raise InputError(
            'backend="triton" does not run under torch.func transforms (grad, vjp, jvp, vmap): '
            "the kernels take plain tensors; differentiate with torch.autograd (.backward(), "
            "torch.autograd.grad) instead"
        )
    # forward-mode AD: tangents exist only inside a dual level (else one attribute read); eager
    # only: tracing sees no tangents
    if backend == "triton" and forward_ad._current_level >= 0 and not torch.compiler.is_compiling():
        validate.check_no_tangents(q, k, v)
    if plan.permutation is not None:  # a tile_grid plan: run in tiled order, answer in ours
        perm, inv = plan.permutation, plan.inverse_permutation
        q, k, v = (_permute_tokens(t, perm, inv) for t in (q, k, v))
        out, lse = _attention_tiled_order(q, k, v, plan, scale, backend)
        out, lse = _permute_tokens(out, inv, perm), _permute_tokens(lse, inv, perm)
    else:
        out, lse = _attention_tiled_order(q, k, v, plan, scale, backend)
    return (out, lse) if return_lse else out


def _attention_tiled_order(q, k, v, plan: MaskPlan, scale: float, backend: str):
    """``(out, lse)`` of validated inputs given in the plan's (tiled) token order.

    The Triton path reads the plan's fields only (they are in tiled order), never a copy of
    the plan made here: under ``torch.compile`` a plan object created while tracing cannot be
    handed to the functions that Dynamo calls as constants (``tile_efficiency_128``).
    """
    if backend == "reference":
        out, lse = reference_attention(q, k, v, plan.in_permuted_order(), scale)
        out = out.to(q.dtype)
        lse = lse.to(torch.float32)
    else:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        # plan-dependent tilings exist for head_dim 128 in 16 bits only (configs.py)
        eff = None
        if q.shape[-1] == 128 and q.dtype in (torch.float16, torch.bfloat16):
            eff = tile_efficiency_128(plan)
        cfg = forward_config(q.shape[-1], q.dtype, q.device, eff, has_bitmask_tiles(plan))
        heads = plan.heads or 1
        mask_stride_b = heads if plan.batch else 0
        mask_stride_h = 1 if plan.heads else 0
        bwd_schedule, bwd_config = backward_inputs(plan, q, k, v, eff)
        if torch.compiler.is_compiling():
            op = torch.ops.compilemask.attention_fwd
        elif bwd_config:
            op = _EagerAttention.apply
        else:  # no gradient will be taken: the forward alone
            op = _forward_only
        out, lse = op(
            q, k, v, plan.row_lo, plan.row_hi, _forward_schedule(plan, cfg), bwd_schedule,
            scale, mask_stride_b, mask_stride_h,
            [
                cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.grid_order,
                cfg.tma, cfg.overlap, cfg.one_loop, cfg.prefetch, cfg.one_slot,
            ],  # fmt: skip
            bwd_config,
        )  # fmt: skip
    return out, lse
