"""``backend="cute"``: the warp-specialised Hopper forward of :mod:`.forward_sm90`.

Forward only (a call that will run a backward is refused with that reason); sm90 GPUs; bf16
and fp16; head_dim 64 and 128; GQA (``Hq % Hkv == 0``); ``q_len != kv_len``; batch- and
head-dependent plans; interval plans (a ``from_dense`` / ``from_mask_mod`` plan that stores
bitmasks is refused). ``cutlass`` (package ``nvidia-cutlass-dsl``, extra
``compilemask[cute]``) is imported on first use only.

Costs paid once: per (plan, call shape) the lowering (:func:`.lower.lower`, cached on the
plan, no host synchronisation); per ``(head_dim, dtype)`` in the process the ``cute.compile``
of the kernel (seconds; :func:`compile_seconds` reports it). Shapes and strides are dynamic
arguments of the compiled kernel, so one compilation serves every shape.
"""

from __future__ import annotations

import functools
import importlib.metadata
import time

import torch

from ...compiler.plan import MaskPlan
from ...errors import CompileMaskError
from ..interface import plain_attention_reason, plan_fit_reason, same_device, under_compile_reason
from .lower import CuteLowered, lower

INSTALL_HINT = "install compilemask[cute] (nvidia-cutlass-dsl>=4.8.1)"
HEAD_DIMS = (64, 128)
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
UNDER_COMPILE = under_compile_reason("cute")

#: compiled kernels by (head_dim, dtype name, tile config)
_KERNELS: dict[tuple, object] = {}
#: seconds the first call of each key spent in ``cute.compile``
_COMPILE_SECONDS: dict[tuple, float] = {}


def compile_seconds() -> dict[tuple, float]:
    """``{(head_dim, dtype, block_m, block_n): seconds}`` spent in ``cute.compile`` by this
    process (the first call of each key; later calls reuse the kernel)."""
    return dict(_COMPILE_SECONDS)


@functools.cache
def _availability() -> tuple[bool, str]:
    try:
        importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        no_gpu = "" if torch.cuda.is_available() else "it needs a CUDA sm90 GPU, none here; "
        return False, no_gpu + INSTALL_HINT
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as exc:  # missing or broken CUDA libraries: not available
        return False, f"cutlass does not import ({type(exc).__name__}: {exc}): {INSTALL_HINT}"
    if not torch.cuda.is_available():
        return False, "the cute kernel needs a CUDA sm90 GPU, none here"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return False, f"the cute kernel runs on sm90 (Hopper), not sm{major}{minor}"
    return True, ""


class CuteBackend:
    """The sm90 CuTe-DSL forward (see the module docstring)."""

    name = "cute"

    def available(self) -> tuple[bool, str]:
        """(True, "") when ``cutlass`` imports and the current GPU is sm90."""
        if torch.compiler.is_compiling():
            return False, UNDER_COMPILE
        return _availability()

    def dispatch_token(self):
        """What ``supports`` and ``prepare`` read beyond the plan and the call
        (``registry.dispatch_state``): nothing (availability is probed once per process), so
        ``compilemask.attention`` keeps a call's checks and preparation per call signature."""
        return ()

    def supports(self, plan: MaskPlan, call) -> tuple[bool, str]:
        """Whether the kernel runs this call; (False, reason) otherwise. Reads no tensor data."""
        why = plain_attention_reason(call, "cute")
        if why:
            return False, why
        if call.requires_grad:
            return False, 'cute is forward only (no backward yet): use backend="triton"'
        if call.device.type != "cuda":
            return False, f"cute runs on CUDA tensors, not {call.device.type}"
        if torch.cuda.get_device_capability(call.device) != (9, 0):
            return False, "cute runs on sm90 (Hopper) GPUs only"
        if call.dtype not in _DTYPES:
            return False, f"cute runs bfloat16 / float16, not {call.dtype}"
        if call.head_dim not in HEAD_DIMS:
            return False, f"cute has kernels for head_dim 64 and 128, not {call.head_dim}"
        if plan.encoding == "bits":
            return False, "cute reads row intervals; this plan stores bitmasks (from_dense)"
        why = plan_fit_reason(plan, call)
        if why:
            return False, why
        return True, ""

    def prepare(self, plan: MaskPlan, call) -> CuteLowered:
        """The lowered plan (:func:`.lower.lower`), cached on ``plan`` per (B, Hq, Hkv)."""
        if not same_device(plan.device, call.device):
            raise CompileMaskError(f"the plan is on {plan.device}, the tensors on {call.device}")
        key = ("cute", call.batch, call.heads_q, call.heads_kv)
        return plan.cached(key, lambda: lower(plan, call.batch, call.heads_q, call.heads_kv))

    def forward(
        self, q, k, v, plan: MaskPlan, prepared: CuteLowered, scale: float, need_lse=True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, Hq, Nq, D], lse fp32 [B, Hq, Nq])`` of q ``[B, Hq, Nq, D]``, k, v
        ``[B, Hkv, Nk, D]`` in the plan's token order."""
        return run_forward(q, k, v, prepared, scale)

    def backward(self, *args, **kwargs):
        raise CompileMaskError('the cute backend is forward only: use backend="triton"')


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` when TMA takes it as it is (D contiguous, other strides and the pointer 16-byte
    aligned), else a contiguous copy."""
    step = 16 // t.element_size()
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0
    if ok and all(s % step == 0 for s in t.stride()[:-1]):
        return t
    return t.contiguous()


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def run_forward(q, k, v, low: CuteLowered, scale: float):
    """Launch the kernel (compiling it on the first call of its ``(head_dim, dtype)``)."""
    import cuda.bindings.driver as cuda

    from . import forward_sm90 as fwd

    q, k, v = (_tma_ready(t) for t in (q, k, v))
    B, Hq, Nq, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    num_ctas = max(1, min(low.work.shape[0], _num_sms(q.device)))
    args = fwd.kernel_args(q, k, v, out, lse, low, scale, num_ctas)
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    key = (D, _DTYPES[q.dtype], low.block_m, low.block_n)
    kernel = _KERNELS.get(key)
    if kernel is None:
        start = time.perf_counter()
        kernel = fwd.compile_forward(D, _DTYPES[q.dtype], args, stream)
        _COMPILE_SECONDS[key] = time.perf_counter() - start
        _KERNELS[key] = kernel
    kernel(*args, stream)
    return out, lse
