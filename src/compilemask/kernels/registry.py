"""Attention backends by name, and the table ``backend="auto"`` reads.

``get(name)`` returns a registered backend (``reference``, ``triton``, ``cudnn``, ``fa4`` and
``cute`` are registered at import, each loading its library on first use, with the pair
``cudnn+triton``: cuDNN-frontend's forward, the Triton backward, ``split.py``; ``register``
adds others).
``resolve(name, plan, call)`` returns the backend that runs a call: an explicit name that is
unavailable or does not support the call raises :class:`InputError` with the backend's reason
(never a silent fallback); ``"auto"`` walks :data:`AUTO_TABLE` and takes the first row that
matches the call and whose backend is available and supports it. :func:`explain` says which
one and why.

The table is ordered and keyed by device kind, compute capability, head_dim, dtype, query
length (least and largest) and whether a backward will run; each row carries the measurement
behind it (one row per measured win, from ``compilemask bench``), then the defaults (Triton
wherever it runs, else the reference).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
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
        max_q_len: largest query length (tokens per batch row), or None.
        requires_grad: True matches only calls that will run a backward, None any call.
        modifiers: True matches only calls with a ``score_mod``, False only calls without,
            None any call.
        plans: a test of the plan (``plan -> bool``) the row also needs, or None.
        why: the measurement or reason behind the row (shown by :func:`explain`).
    """

    backend: str
    device: str | None = None
    min_capability: tuple[int, int] | None = None
    head_dims: tuple[int, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    min_q_len: int | None = None
    max_q_len: int | None = None
    requires_grad: bool | None = None
    modifiers: bool | None = None
    plans: Callable[[object], bool] | None = None
    why: str = ""

    def matches(self, call: AttentionCall, plan=None) -> bool:
        """Whether the row applies to ``call`` (and ``plan``, when the row tests plans: after
        every field of the call matched)."""
        if self.device is not None and call.device.type != self.device:
            return False
        if self.head_dims is not None and call.head_dim not in self.head_dims:
            return False
        if self.dtypes is not None and call.dtype not in self.dtypes:
            return False
        if self.min_q_len is not None and call.q_len < self.min_q_len:
            return False
        if self.max_q_len is not None and call.q_len > self.max_q_len:
            return False
        if self.requires_grad is not None and call.requires_grad != self.requires_grad:
            return False
        if self.modifiers is not None:
            if (getattr(call, "score_mod", None) is not None) != self.modifiers:
                return False
        if self.min_capability is not None:
            if call.device.type != "cuda" or _capability(call.device) < self.min_capability:
                return False
        if self.plans is not None and (plan is None or not self.plans(plan)):
            return False
        return True


def _fa4_causal(plan) -> bool:
    """Plans FlashAttention-4 runs as its own causal kernel (``fa4/native.py``)."""
    from .fa4.native import native_form

    if torch.compiler.is_compiling():  # its check reads the plan back (fa4 is eager-only)
        return False
    fa4 = _BACKENDS.get("fa4")
    if fa4 is None or not fa4.available()[0]:  # no host read for a backend that cannot run
        return False
    native = native_form(plan)
    return native is not None and native.window == 0


#: interval slots per row from which a plan counts as many-interval (clear at 1K: 17)
MANY_INTERVALS = 8


def _many_intervals(plan) -> bool:
    """Plans whose rows hold ``MANY_INTERVALS`` or more interval slots (a shape: no host read)."""
    lo = getattr(plan, "row_lo", None)
    return lo is not None and lo.dim() == 3 and lo.shape[-1] >= MANY_INTERVALS


def _gpu_row(backend: str, **fields) -> AutoRule:
    """A measured row: CUDA GPUs of compute capability 9.0 or more, 16-bit inputs."""
    return AutoRule(
        backend, device="cuda", min_capability=(9, 0), dtypes=(torch.float16, torch.bfloat16),
        **fields,
    )  # fmt: skip


#: What ``backend="auto"`` tries, in order (first match that is available and supports the
#: call). Rows from measurements go above the defaults.
AUTO_TABLE: list[AutoRule] = [
    # H200, bf16, 16 heads, head_dim 128: h200-backends-2026-12-01.jsonl, causal forward +
    # backward, FA4 against cuDNN-frontend (ms): 4K 3.589 / 3.665 and 16K 12.764 / 12.843
    # (5e7155f), 32K 24.955 / 25.503 (0d54193); the fa4 backend on causal plans at 904dc43:
    # 4K 3.483 (cuDNN-frontend 3.725), 1K 1.292 (cuDNN-frontend 1.244, Triton 1.483 at 377b5dd)
    _gpu_row(
        "fa4",
        requires_grad=True,
        plans=_fa4_causal,
        why=(
            "FlashAttention-4's causal kernel for plans that are exactly causal: "
            "forward+backward faster than cuDNN-frontend at 4K to 32K tokens per row and "
            "than Triton at 1K (H200)"
        ),
    ),
    # H200, bf16, 16 heads, head_dim 128, each (workload, size) in one process:
    # benchmarks/results/h200-backends-2026-12-01.jsonl (1K forwards at eb2e108; hstu at 1K
    # and 4K with compilemask-auto at 9263479, where a forward-only row without
    # requires_grad=False also caught 1K backward steps: cudnn 1.640 ms against Triton
    # 1.286), regenerated by
    #   compilemask bench --modes fwd fwd+bwd --systems compilemask-triton compilemask-cudnn \
    #     compilemask-fa4 compilemask-cute compilemask-auto cudnn-fe fa4 flex-fa4 flex-triton
    # (fa4's block-sparse path has no row: at 1K and 32K it is not the fastest of ours on any
    # seed workload; docs/perf-notes.md, "Backends")
    _gpu_row(
        "cudnn",
        min_q_len=4096,
        requires_grad=True,
        why=(
            "cuDNN-frontend interval attention: forward+backward faster than the Triton "
            "kernels on every seed workload at 4K and 32K tokens per row (H200)"
        ),
    ),
    # below 4K with a backward, by intervals per row (904dc43, 1K forward+backward): clear
    # (17 slots per row) cudnn 1.839 ms against Triton 2.610; shared_prompt (2 per row)
    # Triton 1.382 against cudnn 1.540
    _gpu_row(
        "cudnn",
        requires_grad=True,
        plans=_many_intervals,
        why=(
            "cuDNN-frontend interval attention: forward+backward faster than the Triton "
            f"kernels at 1K on plans of {MANY_INTERVALS} or more intervals per row (clear; H200)"
        ),
    ),
    # below 4K with a backward, the other plans: cuDNN-frontend's forward with the Triton
    # backward (h200-backends-2026-12-02.jsonl, 7a1fa5b, 1K forward+backward, ms):
    # cudnn+triton / Triton hstu 1.234 / 1.291, shared_prompt 1.325 / 1.410 (cudnn alone on
    # hstu 1.640 at 9263479)
    _gpu_row(
        "cudnn+triton",
        requires_grad=True,
        why=(
            "cuDNN-frontend's forward with the Triton backward: forward+backward faster than "
            "either alone below 4K tokens per row (H200)"
        ),
    ),
    # forwards with a lone softcap (cap 50), H200, bf16, 16 heads, head_dim 128, 32K, each
    # workload in one process (h200-score-mods-2026-12-02.jsonl, 465df2c, ms): cute / Triton /
    # Flex (Triton) causal 8.352 / 9.955 / 21.597, hstu 1.087 / 1.346 / 2.985, shared_prompt
    # 1.417 / 2.214 / 4.045, clear 5.005 / 5.583 / 14.057; at 1K (B = 32, 7a9266c), cute /
    # Triton causal 0.532 / 0.798, hstu 0.327 / 0.715, shared_prompt 0.339 / 0.725, clear
    # 0.602 / 0.964; a lone ALiBi (e1caaa6, same file), cute / Triton, 32K causal 8.046 /
    # 10.319, hstu 1.009 / 1.498, shared_prompt 1.448 / 2.212, clear 4.873 / 5.663; 1K 0.564 /
    # 0.850, 0.541 / 0.743, 0.636 / 0.637, 0.557 / 1.050 (cuDNN-frontend has no score_mod;
    # other modifiers and sinks: cute refuses them and the row passes them on)
    _gpu_row(
        "cute",
        requires_grad=False,
        modifiers=True,
        why=(
            "our CuTe-DSL forward with a lone softcap or ALiBi: faster than the Triton kernels "
            "with the same modifier on every seed workload at 32K tokens per row, and at 1K "
            "but for shared_prompt's ALiBi (equal; H200)"
        ),
    ),
    # forwards at 1K, H200, bf16, 16 heads, head_dim 128, B = 32, each workload in one
    # process (h200-cute-ab-2026-12-02.jsonl, 7fb38f5, ms): cute / cuDNN-frontend hstu 0.283 /
    # 0.368, shared_prompt 0.296 / 0.383, causal 0.285 / 0.525 (FA4 0.328), clear 0.500 /
    # 0.510; the cudnn backend runs cuDNN-frontend's kernels through the same launch path
    _gpu_row(
        "cute",
        max_q_len=2048,
        requires_grad=False,
        why=(
            "our CuTe-DSL forward: faster than cuDNN-frontend and FlashAttention-4 forwards "
            "on every seed workload at 1K tokens per row (H200)"
        ),
    ),
    _gpu_row(
        "cudnn",
        requires_grad=False,
        why=(
            "cuDNN-frontend interval attention: forward faster than the Triton kernels on "
            "every seed workload at 1K and 32K tokens per row (H200; at 1K since the call "
            "path keeps its dispatch per call signature, eb2e108)"
        ),
    ),
    AutoRule("triton", why="the fused kernels (default wherever Triton runs)"),
    AutoRule("reference", why="plain PyTorch: runs everywhere"),
]


def _fa4_decode_rows(call) -> bool:
    from .fa4.paged import many_rows

    return many_rows(call)


#: What ``backend="auto"`` tries for calls over a KV cache (``interface.DecodeCall``), in
#: order, each with the calls it takes (None: every call it supports). H200, bf16, head_dim
#: 128, 32 / 8 heads, batch 64, causal at 8K and 32K (h200-decode-2026-12-01.jsonl):
#: FlashAttention-4's paged kernel is faster than the split-KV kernel for 16 and 64 new
#: tokens, slower for 1 and 4 (docs/perf-notes.md, "Decoding").
DECODE_AUTO_ORDER = (("fa4", _fa4_decode_rows), ("triton", None), ("reference", None))

_BACKENDS: dict[str, Backend] = {}
#: names of registered backends whose ``forward`` takes ``need_lse`` (backends written before
#: the keyword existed are called without it)
_TAKES_NEED_LSE: set[str] = set()


#: bumped by every ``register`` (cached dispatch decisions of older registries are dropped)
_GENERATION = [0]


def register(backend: Backend) -> None:
    """Register ``backend`` under ``backend.name`` (replacing one of the same name)."""
    for attr in ("name", "available", "supports", "prepare", "forward", "backward"):
        if not hasattr(backend, attr):
            raise TypeError(f"a backend needs {attr!r} (kernels/interface.py): {backend!r}")
    _BACKENDS[backend.name] = backend
    _GENERATION[0] += 1
    params = inspect.signature(backend.forward).parameters
    takes = "need_lse" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    (_TAKES_NEED_LSE.add if takes else _TAKES_NEED_LSE.discard)(backend.name)


def forward_options(backend: Backend, need_lse: bool) -> dict:
    """The keyword arguments of ``backend.forward`` beyond the contract's first six:
    ``need_lse`` for backends that take it."""
    return {"need_lse": need_lse} if backend.name in _TAKES_NEED_LSE else {}


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
            if rule.matches(call, plan):
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


def token_gather(backend: Backend):
    """The row gather ``(x, index) -> x.index_select(2, index)`` that permutes the tokens of
    ``tile_grid`` plans around ``backend``: its own ``gather_tokens``, else the Triton
    backend's (one row-copy launch on CUDA, about 3x faster than ``index_select`` there) where
    Triton runs, else None (``index_select``). The permutation is a copy, exact on every
    backend."""
    own = getattr(backend, "gather_tokens", None)
    if own is not None:
        return own
    triton_backend = _BACKENDS.get("triton")
    if triton_backend is not None and triton_backend.available()[0]:
        return getattr(triton_backend, "gather_tokens", None)
    return None


def dispatch_state(backend: Backend) -> tuple | None:
    """What a decision of :func:`resolve` for ``backend`` depends on besides the plan and the
    call: the registry (its registrations and :data:`AUTO_TABLE`'s rows) and the backend's
    own ``dispatch_token()`` (process state its ``supports`` / ``prepare`` read, e.g. a
    launch-configuration override). ``compilemask.attention`` keeps a decision, with its
    prepared data, while this compares equal. None: do not keep it (a backend without
    ``dispatch_token``, or whose token is None)."""
    token_of = getattr(backend, "dispatch_token", None)
    token = None if token_of is None else token_of()
    if token is None or _BACKENDS.get(backend.name) is not backend:
        return None
    return (_GENERATION[0], id(_BACKENDS), len(_BACKENDS), tuple(AUTO_TABLE), token)


def explain_call(plan, call: AttentionCall) -> dict:
    """Which backend ``"auto"`` picks for ``call`` and why: ``{"backend": name or None,
    "reason": str, "skipped": [(name, why), ...]}``."""
    skipped = []
    for rule in AUTO_TABLE:
        if not rule.matches(call, plan):
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
    from .split import SplitBackend
    from .triton.backend import BACKEND as triton

    register(reference)
    register(triton)
    register(CudnnBackend())  # imports cuDNN-frontend on first use only
    register(Fa4Backend())  # imports FlashAttention-4 on first use only
    register(CuteBackend())  # imports cutlass (nvidia-cutlass-dsl) on first use only
    # cuDNN-frontend's forward with the Triton backward (kernels/split.py)
    register(SplitBackend(_BACKENDS["cudnn"], triton))
    # our CuTe-DSL forward (softcap and ALiBi too) with the Triton backward
    register(SplitBackend(_BACKENDS["cute"], triton))


_register_builtin()
