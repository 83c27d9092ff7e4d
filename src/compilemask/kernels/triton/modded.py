"""Triton attention with a score modifier and / or sinks (eager calls): an
``autograd.Function`` over the same forward and backward launchers as the plain path, with
the gradients of the sinks and of the modifier's learnable tensors.

Gradients (``score_mods.py`` has the kernels' side):

- sinks: with ``P_sink,i = exp(sink_h - lse_i)`` (lse includes the sink) and
  ``delta_i = rowsum(dO_i * O_i) - dlse_i``, ``d sink_h = -sum_{b, i} P_sink,i * delta_i``
  (the sink's column of ``dS = P * (dP - delta)``, its dP being 0: it carries no value);
- relative-bias table: per (batch row, head, kv-tile) bucket sums written by the dK/dV
  kernel, summed here over B and the kv-tiles; bias: one element per pair, summed over the
  broadcast dimensions. No atomics: two runs give the same bits.
"""

from __future__ import annotations

import contextlib

import torch

from ...errors import InputError
from .configs import BwdConfig, FwdConfig
from .schedule import DKDV_SCHEDULE_FIELDS, FWD_SCHEDULE_FIELDS
from .score_mods import pack, sink_grad

_N_DKDV = len(DKDV_SCHEDULE_FIELDS)
_N_BWD = _N_DKDV + len(FWD_SCHEDULE_FIELDS)


class _Args:
    """The non-tensor arguments of one call (plan tensors, configurations, the modifier, and
    ``forward``: another backend's forward ``(q, k, v) -> (out, lse)`` with the same modifier,
    or None for the Triton forward)."""

    def __init__(self, plan, prepared, scale, score_mod, forward=None):
        self.plan, self.p, self.scale, self.score_mod = plan, prepared, scale, score_mod
        self.forward = forward


@contextlib.contextmanager
def _custom_errors(score_mod):
    """Triton's errors from a modifier with custom stages, as an InputError naming the stage
    and the innermost error (a compile or interpreter error of the user's ``@triton.jit``
    functions arrives wrapped several times)."""
    try:
        yield
    except Exception as exc:
        from ...score_mods import CUSTOM

        custom = [st for st in score_mod.stages() if st.kind == CUSTOM] if score_mod else []
        if not custom or not type(exc).__module__.startswith("triton"):
            raise
        root = exc
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        names = ", ".join(repr(st.name) for st in custom)
        lines = str(root).strip().splitlines()
        raise InputError(
            f"custom score_mod {names}: its Triton functions failed "
            f"({type(root).__name__}: {lines[-1] if lines else ''})"
        ) from exc


class ModdedAttention(torch.autograd.Function):
    """``(out, lse)`` of q, k, v with ``score_mod`` and ``sinks``; differentiable in q, k, v,
    the sinks and the modifier's learnable tensors (``ScoreMod.tensors()``, in that order)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, args: _Args, *learn):
        from .forward import attention_forward

        plan, p = args.plan, args.p
        Nq, Nk = q.shape[2], k.shape[2]
        # tanh.approx.f32 (relative error 2^-10.7) is below 16-bit precision, not float32's
        fast = q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
        mods = pack(args.score_mod, Nq, Nk, q.device, fast) if args.score_mod is not None else None
        sinks_f = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
        if args.forward is not None:  # another backend's forward: its lse, of the same scores
            out, lse = args.forward(q, k, v)
        else:
            with _custom_errors(args.score_mod):
                out, lse = attention_forward(
                    q, k, v, plan.row_lo, plan.row_hi,
                    dict(zip(FWD_SCHEDULE_FIELDS, p.schedule)), scale=args.scale,
                    mask_stride_b=p.mask_stride_b, mask_stride_h=p.mask_stride_h,
                    cfg=FwdConfig(*p.config), mods=mods, sinks=sinks_f,
                )  # fmt: skip
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args, ctx.mods, ctx.n_learn = args, mods, len(learn)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from .backend import check_backward_config
        from .backward import attention_backward

        nothing = (None,) * (5 + ctx.n_learn)
        if dout is None and dlse is None:
            return nothing
        args, mods = ctx.args, ctx.mods
        p = args.p
        check_backward_config(p.bwd_config)
        if mods is not None and mods.score_fn is not None and mods.score_dfn is None:
            raise RuntimeError(
                "the custom score modifier has no triton_grad_fn: the Triton backend runs its "
                'forward only; give triton_grad_fn or use backend="reference"'
            )
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        B, Hq, Nq = q.shape[:3]
        Nk = k.shape[2]
        sched = p.bwd_schedule
        dkdv = dict(zip(DKDV_SCHEDULE_FIELDS, sched[:_N_DKDV]))
        Tk = dkdv["kind"].shape[2]
        mod_grad = mods.grad_buffer(B, Hq, Nq, Nk, Tk) if mods is not None else None
        delta = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
        with torch.no_grad(), _custom_errors(args.score_mod):
            dq, dk, dv = attention_backward(
                q, k, v, out, lse.contiguous(), dout, args.plan.row_lo, args.plan.row_hi, dkdv,
                dict(zip(FWD_SCHEDULE_FIELDS, sched[_N_DKDV:_N_BWD])), scale=args.scale,
                mask_stride_b=p.mask_stride_b, mask_stride_h=p.mask_stride_h,
                cfg=BwdConfig(*p.bwd_config), dlse=dlse,
                ds_slots=sched[_N_BWD] if len(sched) > _N_BWD else None,
                mods=mods, mod_grad=mod_grad, delta=delta,
            )  # fmt: skip
            dsink = None
            if sinks is not None and ctx.needs_input_grad[3]:
                dsink = sink_grad(sinks, lse, delta)
            learn = mods.table_grads(mod_grad) if mods is not None and mods.learn else []
        return (dq, dk, dv, dsink, None, *learn)


def modded_attention(q, k, v, plan, prepared, scale, score_mod, sinks, forward=None):
    """``(out, lse)`` through :class:`ModdedAttention` (``forward``: see :class:`_Args`)."""
    learn = score_mod.tensors() if score_mod is not None else []
    args = _Args(plan, prepared, scale, score_mod, forward)
    return ModdedAttention.apply(q, k, v, sinks, args, *learn)
