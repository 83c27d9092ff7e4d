"""``backend="cudnn"``: CompileMask plans run on cuDNN-frontend's interval attention.

The kernel is ``cudnn.flex_attention`` (package ``nvidia-cudnn-frontend`` >= 1.32, an open
CuTe-DSL kernel family); ``cudnn`` is imported here lazily, inside the methods. What it reads
and returns (from the 1.32.0 sources, ``cudnn/flex_attention/``):

- Mask: ``create_mask_plan(mask_func, q, k, v, build_backward=...)`` takes int32
  ``[Hmask, nfunc, B * Nq]`` endpoints, ``nfunc`` odd; row ``b * Nq + q`` sees keys
  ``[0, F0) U [F1, F2) U ...`` (batch-local positions, each clamped to ``[0, Nk]``); ``Hmask``
  is 1 or ``Hq`` (:mod:`.lower` builds it). The builder reads only the shapes, dtype and device
  of q, k, v, and reads one header back from the device (one host synchronisation per plan).
  The plan is tied to ``(B, Nq, Nk, Hq, Hkv, D, dtype, device)`` and, with
  ``build_backward=True``, carries the backward's schedule as well.
- Layout: BSHD ``q [B, Nq, Hq, D]``, ``k, v [B, Nk, Hkv, D]``, last dim contiguous, other
  strides 16-byte aligned (128 for the head_dim 256 backward). cuDNN's compiled-plan path
  validates layouts and copies nothing: a transpose view of our ``[B, H, N, D]`` tensors is
  passed as it is, any other layout is made contiguous first (:func:`_native`).
  GQA: ``Hq % Hkv == 0`` (heads packed when ``Hmask == 1`` and the ratio is a power
  of two). ``Nq != Nk``: supported (fixed-length mode).
- dtype fp16 / bf16; head dims: ``Dqk, Dv`` each in ``[8, 128]`` and divisible by 8, or
  ``(192, 128)``, or ``(256, 256)``; here ``Dqk == Dv`` so ``D % 8 == 0, 8 <= D <= 128`` or
  ``D == 256``. GPUs: sm90, sm100, sm103.
- ``flex_attn_func(q, k, v, mask_plan=, softmax_scale=, return_lse=True)`` returns
  ``out [B, Nq, Hq, D]`` and ``lse`` fp32 ``[B, Hq, Nq]``: natural log of the sum of
  ``exp(scale * q.k)`` (the kernels keep log2 inside and multiply by ln 2 when storing), which
  is our convention. A row that sees no key gets ``lse = -inf`` and ``out = 0`` from the kernel
  itself (``Softmax.finalize``: a zero row sum gives -inf and a unit rescale of a zero
  accumulator; q-tiles without any visible key are scheduled as zero-cost work and written the
  same way), so no fix-up pass is run (the GPU test checks both exactly).
- Backward: ``flex_attn_func`` returns tensors with autograd (``FlexAttnFunc``), whose
  backward calls ``cudnn.flex_attention.execution._flex_attention_backward(q, k, v, out, dout,
  lse, mask_plan=, softmax_scale=, deterministic=, dlse_tensor=)``. :meth:`backward` calls
  that function directly with the saved ``out`` and ``lse``: the same kernels as autograd,
  without re-running the forward and without keeping an autograd graph alive between the
  calls. It is not part of cuDNN's ``__all__``: :meth:`available` checks that it exists.
  ``deterministic=False`` (dQ accumulated with atomics), as in ``flex_attn_func``'s default.
  The contract's backward has no lse gradient, so none is passed (``dlse_tensor=None``).
- Costs paid once: per (plan, call shape) the endpoints and ``create_mask_plan`` (cached on
  the plan, :meth:`CudnnBackend.prepare`); per tensor shape and layout cuDNN JIT-compiles its
  CuTe kernels on the first call (seconds; cached by cuDNN in the process).
"""

from __future__ import annotations

import functools
import importlib.metadata
from dataclasses import dataclass

import torch

from ...compiler.plan import MaskPlan
from ...errors import CompileMaskError
from ..interface import plain_attention_reason, plan_fit_reason, same_device, under_compile_reason
from .lower import endpoints

#: the oldest nvidia-cudnn-frontend with ``cudnn.flex_attention`` as read here
MIN_VERSION = (1, 32)
INSTALL_HINT = "install compilemask[cudnn] (nvidia-cudnn-frontend>=1.32)"
SUPPORTED_ARCHS = (90, 100, 103)
_DTYPES = (torch.float16, torch.bfloat16)


def head_dim_supported(head_dim: int) -> bool:
    """Whether cuDNN has a kernel for ``Dqk == Dv == head_dim``."""
    return (head_dim % 8 == 0 and 8 <= head_dim <= 128) or head_dim == 256


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _arch(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _native(t: torch.Tensor, align_bytes: int = 16) -> torch.Tensor:
    """``t`` when cuDNN takes its layout as it is (last dim contiguous, pointer and other
    strides ``align_bytes``-aligned), else a contiguous copy: cuDNN's compiled-plan path
    validates layouts and makes no copies itself (an upstream gradient expanded from a sum
    has stride 0 everywhere, for one)."""
    step = max(1, align_bytes // t.element_size())
    aligned = t.stride(-1) == 1 and t.data_ptr() % align_bytes == 0
    if aligned and all(s == 0 or s % step == 0 for s in t.stride()[:-1]):
        return t
    return t.contiguous()


@dataclass(frozen=True)
class CudnnPrepared:
    """What :meth:`CudnnBackend.prepare` builds once per (plan, call shape).

    Attributes:
        mask_func: int32 ``[Hmask, nfunc, B * Nq]``, the endpoints cuDNN's plan was built from.
        mask_plan: cuDNN's ``MaskPlan`` (its tile schedule and packed partial-tile masks).
        has_backward: the cuDNN plan carries the backward's payloads.
    """

    mask_func: torch.Tensor
    mask_plan: object
    has_backward: bool


UNDER_COMPILE = under_compile_reason("cudnn")


@functools.cache
def _availability() -> tuple[bool, str]:
    no_gpu = "" if torch.cuda.is_available() else "it needs a CUDA GPU (sm90 / sm100), none here; "
    try:
        version = importlib.metadata.version("nvidia-cudnn-frontend")
    except importlib.metadata.PackageNotFoundError:
        return False, no_gpu + INSTALL_HINT
    if _version_tuple(version) < MIN_VERSION:
        return False, f"nvidia-cudnn-frontend {version} is too old: {INSTALL_HINT}"
    try:
        import cudnn.flex_attention  # noqa: F401
        from cudnn.flex_attention.execution import _flex_attention_backward  # noqa: F401
    except ImportError as exc:
        return False, f"cudnn.flex_attention does not import ({exc}): {INSTALL_HINT}"
    except Exception as exc:  # CUDA / cuDNN libraries missing or broken: not available
        return False, f"cudnn.flex_attention does not load ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return False, "cudnn.flex_attention needs a CUDA GPU"
    arch = _arch(torch.device("cuda"))
    if arch not in SUPPORTED_ARCHS:
        return False, f"cudnn.flex_attention runs on sm90, sm100 and sm103, not sm{arch}"
    return True, ""


class CudnnBackend:
    """CompileMask plans on ``cudnn.flex_attention`` (see the module docstring).

    Example::

        >>> be = CudnnBackend()
        >>> ok, why = be.available()  # (False, "install compilemask[cudnn] ...") without it
    """

    name = "cudnn"

    def available(self) -> tuple[bool, str]:
        """(True, "") when ``cudnn.flex_attention`` imports and a supported GPU is present
        (probed once per process: the package lookup alone costs about a millisecond).
        Not under ``torch.compile``: its calls go through a plain autograd Function."""
        if torch.compiler.is_compiling():
            return False, UNDER_COMPILE
        return _availability()

    def dispatch_token(self):
        """What ``supports`` and ``prepare`` read beyond the plan and the call
        (``registry.dispatch_state``): nothing (availability is probed once per process), so
        ``compilemask.attention`` keeps a call's checks and preparation per call signature."""
        return ()

    def supports(self, plan: MaskPlan, call) -> tuple[bool, str]:
        """Whether cuDNN runs this call; (False, reason) otherwise. Reads no tensor data."""
        why = plain_attention_reason(call, "cudnn")
        if why:
            return False, why
        if call.return_lse and call.requires_grad:
            return False, (
                'no gradient through lse on cudnn: call without return_lse, or use backend="triton"'
            )
        if call.device.type != "cuda":
            return False, f"cudnn runs on CUDA tensors, not {call.device.type}"
        if call.dtype not in _DTYPES:
            return False, f"cudnn runs float16 / bfloat16, not {call.dtype}"
        if not head_dim_supported(call.head_dim):
            return False, (
                f"cudnn has no kernel for head_dim {call.head_dim} "
                "(needs a multiple of 8 in [8, 128], or 256)"
            )
        why = plan_fit_reason(plan, call)
        if why:
            return False, why
        if call.batch * call.q_len >= 2**31:
            return False, "B * Nq must fit in int32 for cudnn"
        if torch.cuda.is_available():
            arch = _arch(call.device)
            if arch not in SUPPORTED_ARCHS:
                return False, f"cudnn.flex_attention runs on sm90, sm100 and sm103, not sm{arch}"
        return True, ""

    def prepare(self, plan: MaskPlan, call) -> CudnnPrepared:
        """Endpoints and cuDNN's mask plan, built once per ``(B, Hq, Hkv, D, dtype, device,
        backward)`` and cached on ``plan`` (a plan with backward payloads also serves calls
        without a backward). Two host reads on the first call: the smallest ``nfunc`` and
        the header ``create_mask_plan`` reads back; none afterwards."""
        if not same_device(plan.device, call.device):
            raise CompileMaskError(f"the plan is on {plan.device}, the tensors on {call.device}")
        base = ("cudnn", call.batch, call.heads_q, call.heads_kv, call.head_dim, call.dtype)
        if not call.requires_grad:  # a plan prepared with its backward serves forwards too
            hit = plan._cache.get((*base, True))
            if hit is not None:
                return hit
        need_bwd = bool(call.requires_grad)
        return plan.cached((*base, need_bwd), lambda: self._build(plan, call, need_bwd))

    @staticmethod
    def _build(plan: MaskPlan, call, build_backward: bool) -> CudnnPrepared:
        from cudnn.flex_attention import create_mask_plan

        mask_func = endpoints(plan, call.batch, call.heads_q, trim=True)
        # cuDNN's builder reads shapes, dtype and device only: stride-0 views, no allocation
        row_q = torch.empty(call.head_dim, dtype=call.dtype, device=call.device)
        q = row_q.expand(call.batch, call.q_len, call.heads_q, call.head_dim)
        kv = row_q.expand(call.batch, call.kv_len, call.heads_kv, call.head_dim)
        mask_plan = create_mask_plan(mask_func, q, kv, kv, build_backward=build_backward)
        return CudnnPrepared(mask_func, mask_plan, build_backward)

    def forward(
        self, q, k, v, plan: MaskPlan, prepared: CudnnPrepared, scale: float, need_lse=True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out [B, Hq, Nq, D], lse fp32 [B, Hq, Nq])`` of q ``[B, Hq, Nq, D]``, k, v
        ``[B, Hkv, Nk, D]`` in the plan's token order. ``out`` is a transpose view of cuDNN's
        BSHD output. ``need_lse=False`` asks cuDNN for no lse (None is returned)."""
        from cudnn.flex_attention import flex_attn_func

        qb, kb, vb = (_native(t.transpose(1, 2)) for t in (q, k, v))
        with torch.no_grad():
            res = flex_attn_func(
                qb, kb, vb, mask_plan=prepared.mask_plan, softmax_scale=scale,
                return_lse=need_lse,
            )  # fmt: skip
        out, lse = res if isinstance(res, tuple) else (res, None)
        return out.transpose(1, 2), (lse if need_lse else None)

    def backward(
        self, q, k, v, out, lse, dout, plan: MaskPlan, prepared: CudnnPrepared, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` in the shapes of q, k, v, from the forward's ``out`` and ``lse``."""
        from cudnn.flex_attention.execution import _flex_attention_backward

        if not prepared.has_backward:
            raise CompileMaskError(
                "the cudnn plan was prepared without a backward (call.requires_grad was False)"
            )
        align = 128 if q.shape[-1] == 256 else 16  # cuDNN's head_dim 256 backward wants 128
        qb, kb, vb, ob, dob = (_native(t.transpose(1, 2), align) for t in (q, k, v, out, dout))
        with torch.no_grad():
            dq, dk, dv = _flex_attention_backward(
                qb, kb, vb, ob, dob, _native(lse, 4), mask_plan=prepared.mask_plan,
                softmax_scale=scale,
            )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
