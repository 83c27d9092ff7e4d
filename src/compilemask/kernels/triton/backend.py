"""``backend="triton"``: the Triton kernels behind the backend contract (``kernels/interface.py``).

This module is the backend's glue: launch configurations and schedules of a call
(:meth:`TritonBackend.prepare`), the custom ops ``compilemask::attention_fwd`` /
``compilemask::attention_bwd`` (with fake implementations, so ``torch.compile(fullgraph=True)``
traces forward and backward without graph breaks) and their eager twin, an
``autograd.Function`` that skips the custom-op dispatch (:meth:`TritonBackend.attend`).

Shape class. A few launch choices depend on the plan's data: at head_dim 128 in 16 bits the
tiling (128x128 for plans whose 128x128 tiles are nearly all visible, see
``configs.DENSE_TILE_EFFICIENCY``; the masked tiling for plans with bitmask tiles), and the dS
buffer of the backward (``BwdConfig.ds_dq``: one slot per touched tile). An eager call reads
them from the plan once (one small host read, as before) and records them, bucketed, in the
plan's ``shape_class``:

- ``"triton.dense128"``: bool, the dense tiling at head_dim 128;
- ``"triton.bitmask"``: bool, the plan's masked tiles are bitmasks;
- ``("triton.ds_tiles", block_m, block_n)``: the dS buffer's tiles per (batch row, head),
  rounded up to a power of two (at most the tiling's tile count).

Under ``torch.compile`` nothing is read back: the choices come from ``shape_class`` (a
guarded constant), or, for a plan no eager call has classified, from its sizes alone (the
masked tiling, bitmask tiles iff the plan can have them, a dS buffer for every tile when it
fits). A compiled graph therefore serves every plan of the same shapes, dtypes and class: new
plans do not recompile. Its results equal eager ones for classified plans.

Legend: B batch, Hq / Hkv query / key-value heads, Nq / Nk query / key length, D head_dim.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import torch

from ...errors import CompileMaskError
from ..interface import AttentionCall
from . import configs as _configs
from .configs import (
    DENSE_TILE_EFFICIENCY,
    BwdConfig,
    FwdConfig,
    backward_config,
    ds_buffer_limit,
    forward_config,
    has_bitmask_tiles,
    tile_efficiency_128,
    touched_tiles_max,
)
from .schedule import (
    DKDV_SCHEDULE_FIELDS,
    FWD_SCHEDULE_FIELDS,
    dkdv_schedule,
    ds_slots,
    forward_schedule,
)

_N_DKDV = len(DKDV_SCHEDULE_FIELDS)
_N_BWD = _N_DKDV + len(FWD_SCHEDULE_FIELDS)
# Looked up once at import (not imported: importing compilemask never loads Triton; and
# torch.compile cannot trace importlib).
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

DENSE128 = "triton.dense128"
BITMASK = "triton.bitmask"
DS_TILES = "triton.ds_tiles"


def triton_usable(device: torch.device) -> tuple[bool, str]:
    """Whether the Triton kernels can run on ``device``, and why not."""
    if not _TRITON_INSTALLED:
        return False, "triton is not installed"
    if device.type == "cuda":
        return True, ""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    return False, (
        f"the Triton kernels run on CUDA tensors (or on the CPU with TRITON_INTERPRET=1), "
        f"got tensors on {device}"
    )


# ------------------------------------------------------------------------------ shape class
def _config_dim(call: AttentionCall) -> int:
    """The head_dim whose launch configuration a call runs: the larger of q's and v's, 192
    taking 256's (its tiles are padded to 256)."""
    d = max(call.head_dim, call.value_dim)
    return 256 if d == 192 else d


def _plan_dependent(call: AttentionCall) -> bool:
    """Launch choices depend on the plan's data at head_dim 128 in 16 bits only."""
    return _config_dim(call) == 128 and call.dtype in (torch.float16, torch.bfloat16)


def _static_bitmask(plan) -> bool:
    """Whether the plan can have bitmask tiles, from its encoding and sizes alone."""
    from ...compiler.tiles import BITS_MIN_SLOTS

    return plan.encoding == "bits" or plan.row_lo.shape[-1] > BITS_MIN_SLOTS


def _tiling_class(plan, call: AttentionCall) -> tuple[float | None, bool]:
    """``(tile_efficiency, bitmask_tiles)`` for :func:`configs.forward_config`: the class's
    bucket (efficiency 1.0 for the dense tiling, 0.0 for the masked one), or None."""
    if not _plan_dependent(call):
        return None, False
    if not torch.compiler.is_compiling():
        dense = tile_efficiency_128(plan) >= DENSE_TILE_EFFICIENCY
        plan.set_class_value(DENSE128, dense)
        plan.set_class_value(BITMASK, has_bitmask_tiles(plan))
    dense = plan.class_value(DENSE128, False)
    bitmask = plan.class_value(BITMASK, _static_bitmask(plan))
    return (1.0 if dense else 0.0), bitmask


def _ds_tiles(plan, cfg: BwdConfig) -> tuple[int, int]:
    """``(bucket, exact)`` tiles of the dS buffer per (batch row, head) at the dQ tiling: the
    power of two at or above the largest touched-tile count of one mask (at most the tiling's
    tile count), and that count in eager calls (the bucket under ``torch.compile``)."""
    bm, bn = cfg.dq_block_m, cfg.dq_block_n
    grid = math.ceil(plan.q_len / bm) * math.ceil(plan.kv_len / bn)
    key = (DS_TILES, bm, bn)
    if torch.compiler.is_compiling():
        bucket = plan.class_value(key, grid)
        return bucket, bucket
    exact = touched_tiles_max(plan, bm, bn)
    bucket = min(grid, 1 << max(exact - 1, 0).bit_length()) if exact else 0
    plan.set_class_value(key, bucket)
    return bucket, exact


def _backward_config(plan, call: AttentionCall) -> BwdConfig:
    cfg = backward_config(_config_dim(call), call.dtype, call.device)
    if not cfg.ds_dq:
        return cfg
    bucket, tiles = _ds_tiles(plan, cfg)
    elem = call.dtype.itemsize
    size = call.batch * call.heads_q * bucket * cfg.dq_block_m * cfg.dq_block_n * elem
    if bucket == 0 or size > ds_buffer_limit(call.device):
        return dataclasses.replace(cfg, ds_dq=0)
    return dataclasses.replace(cfg, ds_dq=tiles)


# ------------------------------------------------------------------------------ schedules
def _bwd_schedule(plan, cfg: BwdConfig) -> list[torch.Tensor]:
    dkdv = dkdv_schedule(plan, cfg.dkdv_block_m, cfg.dkdv_block_n, bits=True)
    dq = forward_schedule(plan, cfg.dq_block_m, cfg.dq_block_n, bits=True)
    tensors = list(dkdv.values()) + list(dq.values())
    if cfg.ds_dq:  # the dQ tiling is the dK/dV tiling (backward_config)
        tensors.append(ds_slots(dkdv["kind"]))
    return tensors


def _ints(cfg) -> list[int]:
    """A config's fields in order (what ``FwdConfig(*ints)`` / ``BwdConfig(*ints)`` rebuild)."""
    return [getattr(cfg, f.name) for f in dataclasses.fields(cfg)]


@dataclasses.dataclass(frozen=True)
class TritonPrepared:
    """What the kernels read for one call: launch configurations (as int lists, the custom
    ops' arguments), schedule tensors and the mask strides."""

    config: list[int]
    schedule: list[torch.Tensor]
    bwd_config: list[int]  # empty when no backward will be asked for
    bwd_schedule: list[torch.Tensor]
    mask_stride_b: int
    mask_stride_h: int


# ------------------------------------------------------------------------------ custom ops
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
        schedule: the forward schedule tensors, in the order of ``FWD_SCHEDULE_FIELDS``.
        bwd_schedule, bwd_config: the backward's schedule tensors and ``BwdConfig`` fields;
            not read by the forward; empty lists when no input requires grad (then backward
            raises).
        scale: softmax scale.
        mask_stride_b, mask_stride_h: mask index ``m = b * mask_stride_b + h * mask_stride_h``.
        config: ``FwdConfig``'s fields in order (``dataclasses.astuple``).
    """
    return _attention_fwd_impl(
        q, k, v, row_lo, row_hi, schedule, scale, mask_stride_b, mask_stride_h, config
    )


def _attention_fwd_impl(
    q, k, v, row_lo, row_hi, schedule, scale, mask_stride_b, mask_stride_h, config
):  # fmt: skip
    return _kernels()[0].attention_forward(
        q, k, v, row_lo, row_hi, dict(zip(FWD_SCHEDULE_FIELDS, schedule)), scale=scale,
        mask_stride_b=mask_stride_b, mask_stride_h=mask_stride_h,
        cfg=_config(FwdConfig, config),
    )  # fmt: skip


_KERNEL_MODULES: list = []
_CONFIGS: dict[tuple, object] = {}


def _kernels() -> list:
    """``[forward, backward]``, the kernel modules, imported on first use (importing
    compilemask never loads Triton; an ``import`` statement per call costs about a
    microsecond). Their functions are looked up per call, so replacing one is honoured."""
    if not _KERNEL_MODULES:
        from . import backward, forward

        _KERNEL_MODULES[:] = (forward, backward)
    return _KERNEL_MODULES


def _config(cls, ints: list[int]):
    """``cls(*ints)`` (``FwdConfig`` / ``BwdConfig``, frozen), one object per distinct list."""
    key = (cls, *ints)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = cls(*ints)
    return cfg


@attention_fwd.register_fake
def _attention_fwd_fake(
    q, k, v, row_lo, row_hi, schedule, bwd_schedule, scale, mask_stride_b, mask_stride_h,
    config, bwd_config,
):  # fmt: skip
    B, Hq, Nq, _ = q.shape
    out = torch.empty((B, Hq, Nq, v.shape[3]), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    return out, lse


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
        bwd_schedule: the dK/dV schedule (``DKDV_SCHEDULE_FIELDS``) followed by the dQ
            schedule (``FWD_SCHEDULE_FIELDS`` at the dQ tiling) and, with
            ``BwdConfig.ds_dq``, the dS buffer slots of the tiles (``schedule.ds_slots``).
        scale, mask_stride_b, mask_stride_h: as for the forward op.
        bwd_config: ``BwdConfig``'s fields in order (``dataclasses.astuple``).
    """
    return _attention_bwd_impl(
        q, k, v, out, lse, dout, dlse, row_lo, row_hi, bwd_schedule, scale, mask_stride_b,
        mask_stride_h, bwd_config,
    )  # fmt: skip


def _attention_bwd_impl(
    q, k, v, out, lse, dout, dlse, row_lo, row_hi, bwd_schedule, scale, mask_stride_b,
    mask_stride_h, bwd_config,
):  # fmt: skip
    return _kernels()[1].attention_backward(
        q, k, v, out, lse, dout, row_lo, row_hi,
        dict(zip(DKDV_SCHEDULE_FIELDS, bwd_schedule[:_N_DKDV])),
        dict(zip(FWD_SCHEDULE_FIELDS, bwd_schedule[_N_DKDV:_N_BWD])),
        scale=scale, mask_stride_b=mask_stride_b, mask_stride_h=mask_stride_h,
        cfg=_config(BwdConfig, bwd_config), dlse=dlse,
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


def _backward(ctx, dout, dlse):
    """Gradients for the forward op's inputs (q, k, v; None for the plan tensors), through the
    backward custom op (:class:`_EagerAttention` has its own)."""
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


# Gradients to q, k, v through out and lse (the LSE's gradient is folded into the backward's
# ``delta`` term: ``dS = P * (dP - delta + dlse)``).
attention_fwd.register_autograd(_backward, setup_context=setup_context)


def _forward_only(
    q, k, v, row_lo, row_hi, schedule, bwd_schedule, scale, msb, msh, config, bwd_config
):  # fmt: skip
    return _attention_fwd_impl(q, k, v, row_lo, row_hi, schedule, scale, msb, msh, config)


class _EagerAttention(torch.autograd.Function):
    """The custom ops' eager twin: the same forward and backward functions, called without the
    custom-op dispatch (torch.library's argument flattening and redispatch cost about half of
    the host time of a small fwd+bwd step). ``torch.compile`` traces the custom ops instead
    (their fake implementations keep the graph whole).

    Host time per step (``benchmarks/launch_cost.py``), hence:

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


# ------------------------------------------------------------------------------ the backend
class TritonBackend:
    name = "triton"

    def available(self) -> tuple[bool, str]:
        if not _TRITON_INSTALLED:
            return False, "triton is not installed"
        return True, ""

    def supports(self, plan, call: AttentionCall) -> tuple[bool, str]:
        usable, why = triton_usable(call.device)
        if not usable:
            return False, why
        if call.dtype not in TRITON_DTYPES:
            return False, f"supports float16, bfloat16 and float32 inputs, got {call.dtype}"
        if call.device.type == "cpu" and call.dtype == torch.bfloat16:
            return False, (
                "on the CPU (Triton's interpreter) it supports float16 and float32 inputs only "
                '(its bfloat16 dots are wrong), got torch.bfloat16; use backend="reference" '
                "or a GPU"
            )
        if call.score_mod is not None or call.has_sinks:
            if torch.compiler.is_compiling():
                return False, (
                    "score_mod and sinks run in eager calls only (under torch.compile the "
                    'reference runs them: backend="reference")'
                )
            custom = (
                [st for st in call.score_mod.stages() if st.kind == 5] if call.score_mod else []
            )
            if call.requires_grad and custom and custom[0].triton_grad_fn is None:
                return False, (
                    "the custom score modifier has no triton_grad_fn, so the Triton kernels "
                    "run its forward only, and this call needs a backward"
                )
        if not torch.compiler.is_compiling() and torch._C._are_functorch_transforms_active():
            return False, (
                "it does not run under torch.func transforms (grad, vjp, jvp, vmap): the "
                "kernels take plain tensors; differentiate with torch.autograd (.backward(), "
                "torch.autograd.grad) instead"
            )
        return True, ""

    def dispatch_token(self):
        """What ``supports`` and ``prepare`` read beyond the plan and the call (``registry.
        dispatch_state``): nothing, except while a launch configuration is overridden
        (``configs.override_forward_config`` / ``override_backward_config``: None, so such
        calls are not kept)."""
        return None if _configs._OVERRIDE or _configs._BWD_OVERRIDE else ()

    #: the decode kernel marks batch rows that read a bad page id or cache length with NaN
    #: (``interface.DecodeCall``), so CUDA cache calls skip the host-read check
    checks_cache_values = True

    def decode(self, q, k_cache, v_cache, call, scale: float):
        """``(out, lse)`` over a paged cache (``interface.DecodeCall``): the split-KV kernel
        of ``decode.py``."""
        from .decode import decode_attention

        return decode_attention(
            q, k_cache, v_cache, call.row_lo, call.row_hi, call.block_table, call.cache_seqlens,
            scale, plan_seqlens=call.plan_seqlens, len_limit=call.len_limit,
        )  # fmt: skip

    def prepare(self, plan, call: AttentionCall) -> TritonPrepared:
        """Launch configurations and schedules of ``call`` (schedules cached on the plan per
        tiling in eager calls; traced from the plan's tensors under ``torch.compile``)."""
        efficiency, bitmask = _tiling_class(plan, call)
        cfg = forward_config(_config_dim(call), call.dtype, call.device, efficiency, bitmask)
        bm, bn = cfg.block_m, cfg.block_n
        schedule = plan.cached(
            ("triton.fwd", bm, bn), lambda: list(forward_schedule(plan, bm, bn, bits=True).values())
        )
        bwd_schedule, bwd_config = [], []
        if call.requires_grad:
            bcfg = _backward_config(plan, call)
            key = (
                "triton.bwd", bcfg.dkdv_block_m, bcfg.dkdv_block_n, bcfg.dq_block_m,
                bcfg.dq_block_n, bool(bcfg.ds_dq),
            )  # fmt: skip
            bwd_schedule = plan.cached(key, lambda: _bwd_schedule(plan, bcfg))
            bwd_config = _ints(bcfg)
            if not torch.compiler.is_compiling():  # the three kernels' constants, one read
                from .common import prime_mask_constants

                prime_mask_constants(
                    [
                        dict(zip(FWD_SCHEDULE_FIELDS, schedule)),
                        dict(zip(DKDV_SCHEDULE_FIELDS, bwd_schedule[:_N_DKDV])),
                        dict(zip(FWD_SCHEDULE_FIELDS, bwd_schedule[_N_DKDV:_N_BWD])),
                    ],
                    plan.row_lo.shape[-1],
                )
        heads = plan.heads or 1
        return TritonPrepared(
            _ints(cfg), schedule, bwd_config, bwd_schedule,
            heads if plan.batch else 0, 1 if plan.heads else 0,
        )  # fmt: skip

    def attend(
        self, q, k, v, plan, p: TritonPrepared, scale: float, call: AttentionCall, *,
        score_mod=None, sinks=None,
    ):  # fmt: skip
        """``(out, lse)`` with gradients: the custom op under ``torch.compile``, its eager twin
        when a backward will be asked for, the forward alone otherwise; with ``score_mod`` or
        ``sinks``, ``modded.ModdedAttention`` (eager calls)."""
        compiling = torch.compiler.is_compiling()
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        if score_mod is not None or sinks is not None:
            from .modded import modded_attention

            return modded_attention(q, k, v, plan, p, scale, score_mod, sinks)
        if compiling:
            op = torch.ops.compilemask.attention_fwd
        elif p.bwd_config:
            op = _EagerAttention.apply
        else:
            op = _forward_only
        return op(
            q, k, v, plan.row_lo, plan.row_hi, p.schedule, p.bwd_schedule, scale,
            p.mask_stride_b, p.mask_stride_h, p.config, p.bwd_config,
        )  # fmt: skip

    def attend_after(
        self, forward, q, k, v, plan, p: TritonPrepared, scale: float, *, score_mod=None,
        sinks=None,
    ):  # fmt: skip
        """``(out, lse)`` of ``forward(q, k, v)`` (another backend's forward with the same
        ``score_mod`` and ``sinks``: lse of the modified scores) with this backend's backward
        (``modded.ModdedAttention``, eager calls): what ``SplitBackend`` runs for modifiers."""
        from .modded import modded_attention

        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        return modded_attention(q, k, v, plan, p, scale, score_mod, sinks, forward)

    def forward(self, q, k, v, plan, p: TritonPrepared, scale: float, need_lse: bool = True):
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        return _attention_fwd_impl(
            q, k, v, plan.row_lo, plan.row_hi, p.schedule, scale, p.mask_stride_b,
            p.mask_stride_h, p.config,
        )  # fmt: skip

    def backward(self, q, k, v, out, lse, dout, plan, p: TritonPrepared, scale: float):
        check_backward_config(p.bwd_config)
        return _attention_bwd_impl(
            q, k, v, out, lse, dout, None, plan.row_lo, plan.row_hi, p.bwd_schedule, scale,
            p.mask_stride_b, p.mask_stride_h, p.bwd_config,
        )  # fmt: skip

    def gather_tokens(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``x.index_select(2, index)``: one Triton row-copy launch on CUDA in eager calls
        (``permute.py``) where Triton runs, ``index_select`` elsewhere and while tracing."""
        if x.is_cuda and not torch.compiler.is_compiling() and triton_usable(x.device)[0]:
            from .permute import gather_tokens

            return gather_tokens(x, index)
        return x.index_select(2, index)


def backward_inputs(plan, q, k, v) -> tuple[list[torch.Tensor], list[int]]:
    """The forward op's ``bwd_schedule`` and ``bwd_config`` for these inputs: empty lists when
    no gradient will be taken (grad mode off, or none of q, k, v requires grad), so inference
    pays nothing for the backward's tilings."""
    from ..interface import call_of

    call = call_of(q, k, v, False)
    if not call.requires_grad:
        return [], []
    p = BACKEND.prepare(plan, call)
    return p.bwd_schedule, p.bwd_config


BACKEND = TritonBackend()
