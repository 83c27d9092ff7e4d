"""Autograd for the Triton path of ``compilemask.attention``.

The forward custom op ``compilemask::attention_fwd`` (``functional.py``) carries, besides the
forward's schedule, the tensors and ints the backward needs (``bwd_schedule``, ``bwd_config``:
the tilings of the dK/dV and dQ kernels, chosen when the forward runs). This module

- builds those inputs (:func:`backward_inputs`; empty when no gradient is needed),
- defines the backward custom op ``compilemask::attention_bwd`` (with a fake implementation,
  so ``torch.compile(fullgraph=True)`` traces forward and backward without graph breaks),
- provides ``setup_context`` / ``backward`` for ``torch.library.register_autograd``.

Gradients flow to q, k, v from both outputs: ``out`` and ``lse`` (the LSE's gradient is folded
into the backward's ``delta`` term: ``dS = P * (dP - delta + dlse)``).

Legend: B batch, Hq / Hkv query / key-value heads, Nq / Nk query / key length, D head_dim.
"""

from __future__ import annotations

import weakref

import torch

from ..compiler.plan import MaskPlan
from ..errors import CompileMaskError
from ..kernels.triton.configs import BwdConfig, backward_config, fit_ds_buffer
from ..kernels.triton.schedule import (
    DKDV_SCHEDULE_FIELDS,
    FWD_SCHEDULE_FIELDS,
    dkdv_schedule,
    ds_slots,
    forward_schedule,
)

_N_DKDV = len(DKDV_SCHEDULE_FIELDS)
_N_BWD = _N_DKDV + len(FWD_SCHEDULE_FIELDS)


@torch.library.custom_op("compilemask::attention_bwd", mutates_args=())
def attention_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    row_lo: torch.Tensor,
    row_hi: torch.Tensor,
    bwd_schedule: list[torch.Tensor],
    scale: float,
    mask_stride_b: int,
    mask_stride_h: int,
    bwd_config: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton backward: ``(dq, dk, dv)`` shaped like q, k, v (contiguous, same dtypes).

    Args:
        q, k, v, out, lse: the forward's inputs and outputs.
        dout: gradient of ``out`` [B, Hq, Nq, D]; dlse: gradient of ``lse`` [B, Hq, Nq] or None.
        row_lo, row_hi: the plan's int32 [M, Nq, K] row intervals.
        bwd_schedule: the dK/dV schedule (:data:`DKDV_SCHEDULE_FIELDS`) followed by the dQ
            schedule (:data:`FWD_SCHEDULE_FIELDS` at the dQ tiling) and, with
            ``BwdConfig.ds_dq``, the dS buffer slots of the tiles (``schedule.ds_slots``).
        scale, mask_stride_b, mask_stride_h: as for the forward op.
        bwd_config: :meth:`BwdConfig.as_list`.
    """
    return _attention_bwd_impl(
        q, k, v, out, lse, dout, dlse, row_lo, row_hi, bwd_schedule, scale, mask_stride_b,
        mask_stride_h, bwd_config,
    )  # fmt: skip


def _attention_bwd_impl(
    q, k, v, out, lse, dout, dlse, row_lo, row_hi, bwd_schedule, scale, mask_stride_b,
    mask_stride_h, bwd_config,
):  # fmt: skip
    from ..kernels.triton.backward import attention_backward

    return attention_backward(
        q, k, v, out, lse, dout, row_lo, row_hi,
        dict(zip(DKDV_SCHEDULE_FIELDS, bwd_schedule[:_N_DKDV])),
        dict(zip(FWD_SCHEDULE_FIELDS, bwd_schedule[_N_DKDV:_N_BWD])),
        scale=scale, mask_stride_b=mask_stride_b, mask_stride_h=mask_stride_h,
        cfg=BwdConfig(*bwd_config), dlse=dlse,
        ds_slots=bwd_schedule[_N_BWD] if len(bwd_schedule) > _N_BWD else None,
    )  # fmt: skip


@attention_bwd.register_fake
def _attention_bwd_fake(
    q, k, v, out, lse, dout, dlse, row_lo, row_hi, bwd_schedule, scale, mask_stride_b,
    mask_stride_h, bwd_config,
):  # fmt: skip
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def setup_context(ctx, inputs, output) -> None:
    """Save q, k, v, out, lse, the row intervals and the backward schedule (no copies)."""
    (q, k, v, row_lo, row_hi, schedule, bwd_schedule, scale, mask_stride_b, mask_stride_h,
     _config, bwd_config) = inputs  # fmt: skip
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, row_lo, row_hi, *bwd_schedule)
    ctx.n_fwd_schedule = len(schedule)
    ctx.n_bwd_schedule = len(bwd_schedule)
    ctx.scale = scale
    ctx.mask_strides = (mask_stride_b, mask_stride_h)
    ctx.bwd_config = list(bwd_config)


def check_backward_config(bwd_config: list[int]) -> None:
    """Raise when the forward ran without a backward schedule (no input required grad)."""
    if not bwd_config:
        raise CompileMaskError(
            "compilemask.attention ran without a backward schedule (no input required grad "
            "when it ran); run the forward with grad enabled on q, k or v"
        )


def backward(ctx, dout, dlse):
    """Gradients for the forward op's inputs (q, k, v; None for the plan tensors), through the
    backward custom op (the eager ``autograd.Function`` of ``functional.py`` has its own)."""
    check_backward_config(ctx.bwd_config)
    q, k, v, out, lse, row_lo, row_hi, *bwd_schedule = ctx.saved_tensors
    dq, dk, dv = torch.ops.compilemask.attention_bwd(
        q, k, v, out, lse, dout, dlse, row_lo, row_hi, bwd_schedule, ctx.scale,
        *ctx.mask_strides, ctx.bwd_config,
    )  # fmt: skip
    return (
        dq, dk, dv, None, None, [None] * ctx.n_fwd_schedule, [None] * ctx.n_bwd_schedule,
        None, None, None, None, None,
    )  # fmt: skip


# Backward schedules per (dK/dV, dQ) TileSchedule pair, kept while both live. Eager only: under
# torch.compile the few tensor ops that build them are traced into the graph.
_Entry = tuple[weakref.ref, weakref.ref, list[torch.Tensor]]
_BWD_SCHEDULES: dict[tuple[int, int, bool], _Entry] = {}


def _build(plan: MaskPlan, cfg: BwdConfig) -> list[torch.Tensor]:
    dkdv = dkdv_schedule(plan, cfg.dkdv_block_m, cfg.dkdv_block_n, bits=True)
    dq = forward_schedule(plan, cfg.dq_block_m, cfg.dq_block_n, bits=True)
    tensors = list(dkdv.values()) + list(dq.values())
    if cfg.ds_dq:  # the dQ tiling is the dK/dV tiling (backward_config)
        tensors.append(ds_slots(dkdv["kind"]))
    return tensors


def backward_inputs(
    plan: MaskPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tile_efficiency: float | None = None,
) -> tuple[list[torch.Tensor], list[int]]:
    """The forward op's ``bwd_schedule`` and ``bwd_config`` for these inputs
    (``tile_efficiency``: see ``configs.tile_efficiency_128``).

    Empty lists when no gradient will be taken (grad mode off, or none of q, k, v requires
    grad), so inference pays nothing for the backward's tilings.
    """
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return [], []
    cfg = backward_config(q.shape[-1], q.dtype, q.device)
    cfg = fit_ds_buffer(cfg, plan, q.shape[0], q.shape[1], q.element_size(), q.device)
    if torch.compiler.is_compiling():
        return _build(plan, cfg), cfg.as_list()
    s1 = plan.tiles(cfg.dkdv_block_m, cfg.dkdv_block_n, bits=True)
    s2 = plan.tiles(cfg.dq_block_m, cfg.dq_block_n, bits=True)
    key = (id(s1), id(s2), bool(cfg.ds_dq))
    hit = _BWD_SCHEDULES.get(key)
    if hit is not None and hit[0]() is s1 and hit[1]() is s2:
        return hit[2], cfg.as_list()
    tensors = _build(plan, cfg)

    def drop(_, key=key):
        _BWD_SCHEDULES.pop(key, None)

    _BWD_SCHEDULES[key] = (weakref.ref(s1, drop), weakref.ref(s2, drop), tensors)
    return tensors, cfg.as_list()
