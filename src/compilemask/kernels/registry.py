"""Attention backends by name, and the table ``backend="auto"`` reads.

``get(name)`` returns a registered backend (``reference``, ``triton``, ``cudnn``, ``fa4`` and
``cute`` are registered at import, each loading its library on first use; ``register`` adds
others).
``resolve(name, plan, call)`` returns the backend that runs a call: an explicit name that is
unavailable or does not support the call raises :class:`InputError` with the backend's reason
(never a silent fallback); ``"auto"`` walks :data:`AUTO_TABLE` and takes the first row that
matches the call and whose backend is available and supports it. :func:`explain` says which
one and why.

The table is ordered and keyed by device kind, compute capability, head_dim, dtype, query
length and whether a backward will run; each row carries the measurement behind it (one row per
measured win, from ``compilemask bench``), then the defaults (Triton wherever it runs, else the
reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError
from .interface import AttentionCall, Backend


@dataclass(frozen=True)
class AutoRule:
    """One row of :data:`AUTO_TABLE`: ``backend`` for calls it matches (None matches any).

    Attributes:
        backend: a registered backend name.
        device: ``torch.device.type`` ("cuda", "cpu"), or None.
        min_capability: least CUDA compute capability, e.g. (9, 0), or None.
        head_dims: head_dim values, or None.
        dtypes: input dtypes, or None.
        min_q_len: least query length (tokens per batch row), or None.
        requires_grad: True matches only calls that will run a backward, None any call.
        why: the measurement or reason behind the row (shown by :func:`explain`).
    """

    backend: str
    device: str | None = None
    min_capability: tuple[int, int] | None = None
    head_dims: tuple[int, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    min_q_len: int | None = None
    requires_grad: bool | None = None
    why: str = ""

    def matches(self, call: AttentionCall) -> bool:
        if self.device is not None and call.device.type != self.device:
            return False
        if self.head_dims is not None and call.head_dim not in self.head_dims:
            return False
        if self.dtypes is not None and call.dtype not in self.dtypes:
            return False
        if self.min_q_len is not None and call.q_len < self.min_q_len:
            return False
        if self.requires_grad is not None and call.requires_grad != self.requires_grad:
            return False
        if self.min_capability is not None:
            if call.device.type != "cuda" or _capability(call.device) < self.min_capability:
                return False
        return True


#: What ``backend="auto"`` tries, in order (first match that is available and supports the
#: call). Rows from measurements go above the defaults.
AUTO_TABLE: list[AutoRule] = [
    # H200, bf16, 16 heads, head_dim 128, each (workload, size) in one process:
    # benchmarks/results/h200-backends-2026-12-01.jsonl
    AutoRule(
        "cudnn",
        device="cuda",
        min_capability=(9, 0),
        dtypes=(torch.float16, torch.bfloat16),
        min_q_len=4096,
        requires_grad=True,
        why=(
            "cuDNN-frontend interval attention: forward+backward faster than the Triton "
            "kernels on every seed workload at 4K and 32K tokens per row (H200)"
        ),
    ),
    AutoRule(
        "cudnn",
        device="cuda",
        min_capability=(9, 0),
        dtypes=(torch.float16, torch.bfloat16),
        min_q_len=32768,
        why=(
            "cuDNN-frontend interval attention: forward faster than the Triton kernels on "
            "every seed workload at 32K tokens per row (H200); shorter rows stay on Triton "
            "(cheaper per call)"
        ),
    ),
    AutoRule("triton", why="the fused kernels (default wherever Triton runs)"),
    AutoRule("reference", why="plain PyTorch: runs everywhere"),
]

_BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    """Register ``backend`` under ``backend.name`` (replacing one of the same name)."""
    for attr in ("name", "available", "supports", "prepare", "forward", "backward"):
        if not hasattr(backend, attr):
            raise TypeError(f"a backend needs {attr!r} (kernels/interface.py): {backend!r}")
    _BACKENDS[backend.name] = backend


def install_defaults() -> None:
    """Process-wide defaults of the builtin backends, run at ``import compilemask``: the
    Triton tile builder for plans built on CUDA (``triton/device_builder.py``; it loads
    Triton on first use only)."""
    from .triton.device_builder import install_default

    install_default()


def names() -> tuple[str, ...]:
    """The registered backend names."""
    return tuple(_BACKENDS)


def get(name: str) -> Backend:
    """The backend registered as ``name`` (InputError naming the choices otherwise)."""
    backend = _BACKENDS.get(name)
    if backend is None:
        choices = ", ".join(repr(n) for n in ("auto", *_BACKENDS))
        raise InputError(f"backend must be one of {choices}, got {name!r}")
    return backend


def resolve(name: object, plan, call: AttentionCall) -> Backend:
    """The backend that runs ``call``: ``name`` itself (InputError with its reason when it is
    unavailable or does not support the call), or the pick of :data:`AUTO_TABLE` for
    ``"auto"``."""
    if name == "auto":
        for rule in AUTO_TABLE:
            if rule.matches(call):
                backend = get(rule.backend)
                if backend.available()[0] and backend.supports(plan, call)[0]:
                    return backend
        raise InputError(f"no attention backend supports this call: {explain_call(plan, call)}")
    if not isinstance(name, str):
        raise InputError(f"backend must be a str, got {type(name).__name__}")
    backend = get(name)
    ok, why = backend.available()
    if not ok:
        raise InputError(f"backend={name!r} is unavailable: {why}")
    ok, why = backend.supports(plan, call)
    if not ok:
        raise InputError(f"backend={name!r} does not support this call: {why}")
    return backend


def explain_call(plan, call: AttentionCall) -> dict:
    """Which backend ``"auto"`` picks for ``call`` and why: ``{"backend": name or None,
    "reason": str, "skipped": [(name, why), ...]}``."""
    skipped = []
    for rule in AUTO_TABLE:
        if not rule.matches(call):
            continue
        backend = get(rule.backend)
        ok, why = backend.available()
        if ok:
            ok, why = backend.supports(plan, call)
        if ok:
            return {"backend": backend.name, "reason": rule.why, "skipped": skipped}
        skipped.append((rule.backend, why))
    return {"backend": None, "reason": "no row of the table runs this call", "skipped": skipped}


_CAPABILITY: dict[int, tuple[int, int]] = {}


def _capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _CAPABILITY.get(index)
    if cap is None:
        cap = _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return cap


def _register_builtin() -> None:
    # at import, not on first use: a registry filled while torch.compile traces would change
    # a guarded global and recompile the next call
    from .cudnn.backend import CudnnBackend
    from .cute.backend import CuteBackend
    from .fa4.backend import Fa4Backend
    from .reference.backend import BACKEND as reference
    from .triton.backend import BACKEND as triton

    register(reference)
    register(triton)
    register(CudnnBackend())  # imports cuDNN-frontend on first use only
    register(Fa4Backend())  # imports FlashAttention-4 on first use only
    register(CuteBackend())  # imports cutlass (nvidia-cutlass-dsl) on first use only


_register_builtin()
