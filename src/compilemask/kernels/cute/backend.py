"""``backend="cute"``: the warp-specialised Hopper forward of :mod:`.forward_sm90`.

Forward only (a call that will run a backward is refused with that reason); sm90 GPUs; bf16
and fp16; head_dim 64 and 128; GQA (``Hq % Hkv == 0``); ``q_len != kv_len``; batch- and
head-dependent plans; interval plans and the bitmask plans of ``from_dense`` /
``from_mask_mod`` (every PARTIAL tile is masked from a thread-order page); a lone
:func:`~compilemask.score_mods.softcap` (``cap * tanh(s / cap)`` of the scaled score, a
kernel of its own with the cap a runtime argument) or a lone
:func:`~compilemask.score_mods.alibi` (a kernel of its own, the slopes a runtime argument); no
sinks, no other modifier. ``cutlass`` (package ``nvidia-cutlass-dsl``, extra
``compilemask[cute]``) is imported on first use only.

Costs paid once: per plan the pages of its PARTIAL tiles and per (plan, call shape) the work
list (:func:`.lower.lower`, both cached on the plan; building the pages reads values back to
the host: the number of PARTIAL tiles, per step of pages its slot spans and distinct pages); per
``(head_dim, dtype, modifier)`` the ``cute.compile`` of the kernel (seconds), once per
machine: the compiled kernel is written to a disk cache
(:mod:`.disk_cache`, ``$COMPILEMASK_CACHE_DIR/cute`` or ``~/.cache/compilemask/cute``) and a
later process loads it from there (milliseconds). :func:`compile_seconds` and
:func:`kernel_origins` report the time and where each kernel came from; :func:`precompile`
fills the cache ahead of the first call (it needs ``cutlass``, not a GPU). Shapes and strides
are dynamic arguments of the compiled kernel, so one kernel serves every shape.
"""

from __future__ import annotations

import functools
import importlib.metadata
import time

import torch

from ...compiler.plan import MaskPlan
from ...errors import CompileMaskError
from ..interface import (
    alibi_of,
    plain_attention_reason,
    plan_fit_reason,
    same_device,
    softcap_of,
    under_compile_reason,
)
from .lower import (
    ALIBI_MAX_HEADS,
    BLOCK_M,
    BLOCK_N,
    MODIFIERS,
    CuteLowered,
    l2_kv_group,
    lower,
)

INSTALL_HINT = "install compilemask[cute] (nvidia-cutlass-dsl>=4.8.1)"
HEAD_DIMS = (64, 128)
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
UNDER_COMPILE = under_compile_reason("cute")

#: compiled kernels by (head_dim, dtype name, block_m, block_n, device type, modifier)
_KERNELS: dict[tuple, object] = {}
#: seconds the first call of each key spent getting its kernel (compiling or loading it)
_COMPILE_SECONDS: dict[tuple, float] = {}
#: "compiled" or "disk" per key
_ORIGINS: dict[tuple, str] = {}


def compile_seconds() -> dict[tuple, float]:
    """``{(head_dim, dtype, block_m, block_n, device_type, modifier): seconds}`` this process
    spent
    getting each kernel: ``cute.compile`` (and writing the disk cache), or loading it from the
    disk cache (see :func:`kernel_origins`). Later calls reuse the kernel."""
    return dict(_COMPILE_SECONDS)


def kernel_origins() -> dict[tuple, str]:
    """``{key: "compiled" | "disk"}`` with the keys of :func:`compile_seconds`."""
    return dict(_ORIGINS)


def _kernel(
    head_dim: int, dtype_name: str, device_type: str, args: tuple, stream, modifier: str = ""
):
    """The kernel of ``(head_dim, dtype, modifier)`` for arguments on ``device_type``: from
    this process, else from the disk cache, else compiled on ``args`` (and stored)."""
    from . import disk_cache, launch

    key = (head_dim, dtype_name, BLOCK_M, BLOCK_N, device_type, modifier)
    kernel = _KERNELS.get(key)
    if kernel is None:
        start = time.perf_counter()
        name = disk_cache.entry_name(*key)
        kernel = disk_cache.load(name)
        origin = "disk"
        if kernel is None:
            kernel = launch.compile_forward(head_dim, dtype_name, args, stream, modifier)
            disk_cache.store(kernel, name)
            origin = "compiled"
        _COMPILE_SECONDS[key] = time.perf_counter() - start
        _ORIGINS[key] = origin
        _KERNELS[key] = kernel
    return kernel


def precompile(
    head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, device=None, modifier: str = ""
) -> float:
    """Get the kernel of ``(head_dim, dtype)`` (``modifier``: ``"softcap"`` or ``"alibi"``
    for the kernel of that score modifier, ``""`` the plain one) into this
    process and the disk cache without a call: compiled (or loaded) for arguments on
    ``device`` (default: CUDA when there is a GPU, else the CPU, which compiles a kernel for
    generic pointers, stored under its own name). Needs ``cutlass`` and
    ``CUTE_DSL_ARCH=sm_90a`` on a machine without a GPU. Returns the seconds it took (0 when
    the process had it already).

    Raises:
        CompileMaskError: ``head_dim`` not 64 / 128, ``dtype`` not bfloat16 / float16,
            ``modifier`` not one of ``""``, ``"softcap"``, ``"alibi"``, or no CuTe DSL
            (``nvidia-cutlass-dsl``) installed.
    """
    if type(head_dim) is not int or head_dim not in HEAD_DIMS:
        raise CompileMaskError(f"head_dim must be one of {HEAD_DIMS}, not {head_dim!r}")
    if not isinstance(dtype, torch.dtype) or dtype not in _DTYPES:
        raise CompileMaskError(f"dtype must be torch.bfloat16 or torch.float16, not {dtype!r}")
    if not isinstance(modifier, str) or modifier not in MODIFIERS:
        raise CompileMaskError(f"modifier must be one of {MODIFIERS}, not {modifier!r}")
    try:
        import cuda.bindings.driver as cuda
        import cutlass  # noqa: F401
    except ImportError as exc:
        raise CompileMaskError(
            f"precompile needs the CuTe DSL ({type(exc).__name__}: {exc}): {INSTALL_HINT}"
        ) from None

    from . import launch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    key = (head_dim, _DTYPES[dtype], BLOCK_M, BLOCK_N, device.type, modifier)
    if key in _KERNELS:
        return 0.0
    args = launch.example_args(head_dim, _DTYPES[dtype], device)
    _kernel(head_dim, _DTYPES[dtype], device.type, args, cuda.CUstream(0), modifier)
    return _COMPILE_SECONDS[key]


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
        why = plain_attention_reason(call, "cute", softcap=True, alibi=True)
        if why:
            return False, why

        if call.requires_grad:
            return False, 'cute is forward only (no backward yet): use backend="triton"'
        if alibi_of_call(call) is not None and call.heads_q > ALIBI_MAX_HEADS:
            return False, f"cute's ALiBi kernel runs at most {ALIBI_MAX_HEADS} query heads"
        if call.device.type != "cuda":
            return False, f"cute runs on CUDA tensors, not {call.device.type}"
        if torch.cuda.get_device_capability(call.device) != (9, 0):
            return False, "cute runs on sm90 (Hopper) GPUs only"
        if call.dtype not in _DTYPES:
            return False, f"cute runs bfloat16 / float16, not {call.dtype}"
        if call.head_dim not in HEAD_DIMS:
            return False, f"cute has kernels for head_dim 64 and 128, not {call.head_dim}"
        why = plan_fit_reason(plan, call)
        if why:
            return False, why
        return True, ""

    def prepare(self, plan: MaskPlan, call) -> CuteLowered:
        """The lowered plan (:func:`.lower.lower`), cached on ``plan`` per (B, Hq, Hkv) (its
        pages once per plan)."""
        if not isinstance(plan, MaskPlan):
            raise CompileMaskError(f"plan must be a MaskPlan, got {type(plan).__name__}")
        if not same_device(plan.device, call.device):
            raise CompileMaskError(f"the plan is on {plan.device}, the tensors on {call.device}")
        group = _kv_group(plan, call)
        ctas = _num_sms(call.device) if call.device.type == "cuda" else 1
        key = ("cute", call.batch, call.heads_q, call.heads_kv, group, ctas)
        return plan.cached(
            key, lambda: lower(plan, call.batch, call.heads_q, call.heads_kv, group, ctas)
        )

    def forward(
        self, q, k, v, plan: MaskPlan, prepared: CuteLowered, scale: float, need_lse=True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, Hq, Nq, D], lse fp32 [B, Hq, Nq])`` of q ``[B, Hq, Nq, D]``, k, v
        ``[B, Hkv, Nk, D]`` in the plan's token order."""
        return run_forward(q, k, v, prepared, scale)

    def attend(
        self, q, k, v, plan: MaskPlan, prepared: CuteLowered, scale: float, call, *,
        score_mod=None, sinks=None,
    ):  # fmt: skip
        """``(out, lse)`` of a forward call with ``score_mod`` None, a lone softcap or a lone
        ALiBi (``supports`` refuses the rest, sinks and calls with gradients)."""
        if score_mod is None:
            return run_forward(q, k, v, prepared, scale)
        slopes = alibi_of(score_mod)
        if slopes is not None:
            return run_forward(q, k, v, prepared, scale, slopes=slopes)
        return run_forward(q, k, v, prepared, scale, softcap_of(score_mod))

    def backward(self, *args, **kwargs):
        raise CompileMaskError('the cute backend is forward only: use backend="triton"')


def alibi_of_call(call):
    """The slopes of ``call``'s lone ALiBi modifier, else None."""
    mod = getattr(call, "score_mod", None)
    return None if mod is None else alibi_of(mod)


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


def _kv_group(plan: MaskPlan, call) -> int | None:
    """The work list's (batch row, kv head) pairs per L2 group for ``call``
    (:func:`.lower.l2_kv_group`); None off CUDA."""
    if call.device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(call.device)
    kv_key = 2 * call.head_dim * call.dtype.itemsize
    return l2_kv_group(call.batch, call.heads_kv, call.kv_len, kv_key, props.L2_cache_size)


def run_forward(q, k, v, low: CuteLowered, scale: float, softcap: float | None = None, slopes=None):
    """Launch the kernel (compiled or loaded from disk on the first call of its
    ``(head_dim, dtype, modifier)``) on ``low.num_ctas`` CTAs, with a zeroed int32
    entry counter per call (no host synchronisation). ``softcap``: the cap of a softcap
    modifier (scores ``cap * tanh(s * scale / cap)``; lse of the capped scores); ``slopes``:
    ALiBi's ``[Hq]`` slopes (scores ``s * scale + slopes[h] (kv_idx - q_idx)``; lse of those)."""
    import cuda.bindings.driver as cuda

    from . import launch

    # detached: the kernel is forward only, and DLPack refuses tensors that require grad (a
    # call from ``cute+triton``'s autograd function passes its inputs as they are)
    q, k, v = (_tma_ready(t.detach()) for t in (q, k, v))
    B, Hq, Nq, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    modifier = "softcap" if softcap is not None else ""
    if slopes is not None:
        modifier = "alibi"
        slopes = slopes.detach().to(device=q.device, dtype=torch.float32).contiguous()
    args = launch.kernel_args(q, k, v, out, lse, low, scale, low.num_ctas, counter, softcap, slopes)
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    kernel = _kernel(D, _DTYPES[q.dtype], q.device.type, args, stream, modifier)
    kernel(*args, stream)
    return out, lse
