"""Input validation of :func:`compilemask.attention`: every user mistake becomes an
:class:`~compilemask.errors.InputError` with a precise message (never an ``assert``, never wrong
numbers). All checks read shapes, dtypes and devices only, so they cost nothing under
``torch.compile``.

Legend: B batch, Hq / Hkv query / key-value heads, Nq / Nk query / key length, D head_dim of
q and k, Dv head_dim of v.
"""

from __future__ import annotations

import math
import numbers
import os

import torch

from ..compiler.plan import MaskPlan
from ..errors import InputError
from ..kernels.interface import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_tensors(q: object, k: object, v: object) -> None:
    """Shapes, dtypes and devices of q [B, Hq, Nq, D], k [B, Hkv, Nk, D] and v
    [B, Hkv, Nk, Dv] (Dv may differ from D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(
                f"{name} must have 4 dims [B, H, N, D], got {t.dim()} dims with shape {_shape(t)}"
            )
    if k.shape[:3] != v.shape[:3]:
        raise InputError(
            f"k and v must have the same shape in [B, Hkv, Nk] (v's head_dim may differ), got k "
            f"{_shape(k)} and v {_shape(v)}"
        )
    B, Hq, _, D = q.shape
    if k.shape[0] != B:
        raise InputError(
            f"batch size differs: q {_shape(q)} has B={B}, k {_shape(k)} has B={k.shape[0]}"
        )
    if k.shape[3] != D:
        raise InputError(
            f"head_dim differs: q {_shape(q)} has D={D}, k {_shape(k)} has D={k.shape[3]}"
        )
    Hkv = k.shape[1]
    if Hq == 0 or Hkv == 0:
        raise InputError(f"q and k need at least one head, got q {_shape(q)}, k {_shape(k)}")
    if Hq % Hkv != 0:
        raise InputError(
            f"query heads Hq={Hq} must be a multiple of key/value heads Hkv={Hkv} (GQA/MQA); "
            f"q {_shape(q)}, k {_shape(k)}"
        )
    for name, t in (("q", q), ("v", v)):
        if t.shape[3] not in SUPPORTED_HEAD_DIMS:
            raise InputError(
                f"head_dim={t.shape[3]} of {name} is not supported ({name} {_shape(t)}); "
                f"supported head_dim values are {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise InputError(
            f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if q.dtype not in SUPPORTED_DTYPES:
        raise InputError(
            f"attention supports float16, bfloat16, float32 (and float64 on the reference), "
            f"got {q.dtype}"
        )
    if not (q.device == k.device == v.device):
        raise InputError(
            f"q, k and v must be on the same device, got {q.device}, {k.device}, {v.device}"
        )


def check_plan(q: torch.Tensor, k: torch.Tensor, plan: object, full: bool = False) -> None:
    """The plan was built for these lengths, this batch / head count, and q's device; it was
    not modified since it was built (and checked: ``MaskPlan`` checks itself where it enters);
    its device-side checks, queued when a GPU plan was built, are read back on its first call.

    ``full=True``, or the environment variable ``COMPILEMASK_CHECK_PLAN=1``, runs every check
    of :meth:`MaskPlan.verify` on every call (O(N*K + Tq*Tk) work and one host read each).
    Under ``torch.compile`` only the shape checks run (they trace to nothing).

    Raises:
        InputError: not a plan, or a plan for other lengths / batch / heads / device.
        PlanError: the plan is invalid or was modified after it was built.
    """
    if not isinstance(plan, MaskPlan):
        from ..language.ast import Mask

        hint = ""
        if isinstance(plan, Mask):  # a mask, not yet compiled
            hint = f"; compile the mask first: plan = compilemask.compile(mask, {q.shape[2]})"
        raise InputError(
            f"plan must be a compilemask.MaskPlan (from compilemask.compile or from_dense), "
            f"got {type(plan).__name__}{hint}"
        )
    if not torch.compiler.is_compiling():
        if full or os.environ.get("COMPILEMASK_CHECK_PLAN") == "1":
            plan.verify()
        else:
            plan.check_unchanged()
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
    if plan.q_len != Nq or plan.kv_len != Nk:
        if torch.compiler.is_compiling():  # Dynamo cannot format symbolic sizes
            raise InputError(
                f"the plan was compiled for q_len={plan.q_len}, kv_len={plan.kv_len}, but q's "
                f"length (dim 2) or k's differs; compile the mask for the inputs' lengths"
            )
        raise InputError(
            f"the plan was compiled for q_len={plan.q_len}, kv_len={plan.kv_len} but the inputs "
            f"have Nq={Nq} (q {_shape(q)}) and Nk={Nk} (k {_shape(k)}); compile the mask for "
            f"these lengths"
        )
    if plan.batch is not None and plan.batch != B:
        raise InputError(
            f"the plan was built for batch={plan.batch} (one mask per batch row) but q "
            f"{_shape(q)} has B={B}; build it for B={B}, or without batch= if the mask is the "
            f"same for every row"
        )
    if plan.heads is not None and plan.heads != Hq:
        raise InputError(
            f"the plan was built for heads={plan.heads} (one mask per query head) but q "
            f"{_shape(q)} has Hq={Hq}; build it for Hq={Hq}, or without heads= if the mask is "
            f"the same for every head"
        )
    if plan.device != q.device:
        raise InputError(
            f"the plan is on {plan.device} but q is on {q.device}; move it with plan.to(q.device)"
        )


_F32_TINY = float(torch.finfo(torch.float32).tiny)
_F32_MAX = float(torch.finfo(torch.float32).max)


def check_scale(scale: object, head_dim: int) -> float:
    """The softmax scale as a positive float in float32's normal range (default
    1 / sqrt(head_dim)); Python or numpy reals."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise InputError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise InputError(f"scale must be a positive finite float, got {scale}")
    if not _F32_TINY <= scale <= _F32_MAX:  # the kernels scale scores in float32
        raise InputError(
            f"scale must lie in float32's normal range [{_F32_TINY:.3g}, {_F32_MAX:.3g}] "
            f"(the kernels scale in float32), got {scale:g}"
        )
    return scale


def check_sinks(sinks: object, q: torch.Tensor) -> None:
    """``sinks``: a floating-point tensor [Hq] on q's device (any float dtype; learnable), of
    finite values (checked on the CPU; a GPU tensor is not read back)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise InputError(f"sinks must be a torch.Tensor [Hq] or None, got {type(sinks).__name__}")
    Hq = q.shape[1]
    if sinks.dim() != 1 or sinks.shape[0] != Hq:
        raise InputError(
            f"sinks must have shape [Hq] = [{Hq}] (one logit per query head), got {_shape(sinks)}"
        )
    if not sinks.is_floating_point():
        raise InputError(f"sinks must be a floating-point tensor, got {sinks.dtype}")
    if sinks.device != q.device:
        raise InputError(f"sinks are on {sinks.device} but q is on {q.device}")
    check_sink_values(sinks)


def check_sink_values(sinks: torch.Tensor) -> None:
    """``sinks``' values are finite, checked where it costs no host synchronisation (on the
    CPU; a GPU tensor is not read back). Runs on every call, cached dispatch included."""
    if sinks.device.type == "cpu" and not torch.compiler.is_compiling():
        if not bool(torch.isfinite(sinks.detach()).all()):
            raise InputError(f"sinks must be finite, got {sinks.detach().tolist()}")


def check_score_mod(score_mod: object, q: torch.Tensor, k: torch.Tensor, plan: MaskPlan):
    """``score_mod``: None, a :mod:`compilemask.score_mods` modifier or a list of them (their
    composition); returns the modifier (a list becomes ``compose(*list)``) after checking its
    tensors against q [B, Hq, Nq, D] and k [B, Hkv, Nk, D]. Position-dependent modifiers see
    the plan's token positions, so a ``tile_grid`` plan (which runs in a permuted order) takes
    none."""
    if score_mod is None:
        return None
    from .. import score_mods

    mod = score_mods.as_score_mod(score_mod)
    if plan.permutation is not None:
        raise InputError(
            "score_mod is not supported with a tile_grid plan (the kernels run in a permuted "
            "token order); compile the mask without tile_grid"
        )
    B, Hq, Nq, _ = q.shape
    mod.check(B, Hq, Nq, k.shape[2], q.device)
    return mod
