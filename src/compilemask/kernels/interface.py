"""The contract between ``compilemask.attention`` (``api/``) and an attention backend.

A backend is one folder under ``kernels/`` (``reference``, ``triton``; others written against
the same contract) holding an object with the :class:`Backend` protocol, registered by name in
``kernels/registry.py``. The api validates the inputs, applies the plan's permutation (q, k, v
reach the backend in the plan's tiled token order, out and lse leave it in that order too),
resolves the backend through the registry, and calls:

1. ``available()`` and ``supports(plan, call)``: an explicit backend that answers False raises
   ``InputError`` with its reason; ``backend="auto"`` moves on to the next one of its table;
2. ``prepare(plan, call)``: what the kernels read, lowered from the plan (cached on the plan
   with ``plan.cached(key, fn)`` in eager calls; traced from the plan's tensors under
   ``torch.compile``);
3. ``attend(q, k, v, plan, prepared, scale, call)`` when the backend has it (it wires its own
   autograd: the Triton backend's custom ops and their eager twin), else ``forward`` and
   ``backward`` through the api's generic ``autograd.Function``; a backend with ``forward``
   and ``backward`` may also have ``attend_modified(..., score_mod=, sinks=)`` for the calls
   with a score modifier or sinks (the split backends of ``split.py``).

Shapes: q [B, Hq, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv] (Dv may differ from D: the
call's ``head_dim_v``); out [B, Hq, Nq, Dv] in q's dtype; lse float32 [B, Hq, Nq], natural
log, -inf for rows that see no key (whose out is 0; with sinks, lse is the sink's logit).

A backend may also have ``dispatch_token()``: a hashable token of the process state its
``supports`` and ``prepare`` read besides the plan and the call (``()`` when none), or None
while that state makes a call's outcome unrepeatable. With it, ``compilemask.attention``
keeps the outcome of steps 1-2 per (plan, call signature) and skips them on later calls with
the same key (``registry.dispatch_state``); without it, every call runs them.

Score modifiers and sinks (``docs/score-mods.md``): the call records them (``score_mod``,
``has_sinks``); a backend that lacks them refuses them in ``supports`` with its reason. A
backend that runs them has ``attend``, which receives them as the keyword arguments
``score_mod`` and ``sinks`` (the generic ``forward`` / ``backward`` pair never sees them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from ..compiler.plan import MaskPlan

#: head_dim values ``compilemask.attention`` accepts for q / k and for v (a backend that runs
#: fewer, or only equal ones, says so in ``supports``; cudnn runs no 192).
SUPPORTED_HEAD_DIMS: tuple[int, ...] = (32, 64, 96, 128, 192, 256)

#: Input dtypes ``compilemask.attention`` accepts (each backend narrows them in ``supports``).
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)


@dataclass(frozen=True)
class AttentionCall:
    """What one attention call asks of a backend (shapes after validation, tiled token order)."""

    batch: int
    heads_q: int
    heads_kv: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool  # a backward will be asked for
    return_lse: bool
    head_dim_v: int | None = None  # v's head_dim (None: head_dim)
    score_mod: object = None  # a compilemask.score_mods modifier, or None
    has_sinks: bool = False  # per-head sink logits were given

    @property
    def value_dim(self) -> int:
        """v's head_dim (Dv)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v


@dataclass(frozen=True)
class DecodeCall:
    """An attention call over a KV cache (``compilemask.attention(..., block_table=...,
    cache_seqlens=...)``), for a backend's optional ``decode(q, k_cache, v_cache, call,
    scale) -> (out, lse)`` (forward only).

    ``k_cache`` / ``v_cache`` reach ``decode`` as ``[num_pages, page_size, Hkv, D]`` (a
    contiguous cache as one page of ``Nk`` keys per batch row, ``block_table[b] = [b]``).

    Attributes:
        row_lo, row_hi: int32 ``[Mb, Nq, K]`` (``Mb`` 1 or B): the visible key intervals of
            each query row (absolute key positions; shared by the heads).
        block_table: int32 ``[B, P]``: the pages of each batch row in key order.
        cache_seqlens: int32 ``[B]``: keys in each batch row's cache; later keys are hidden.
        page_size: keys per page; kv_len: ``P * page_size``.
        attention: the call's sizes (``kv_len`` = the capacity per batch row).
        plan_seqlens: int ``[B]`` or None: a ``DecodePlan``'s own cache lengths, which
            ``cache_seqlens`` must equal.
        len_limit: the largest valid cache length (``kv_len``, or a DecodePlan's key axis).
        row_count: int32 ``[Mb, Nq]``: intervals per row (0: the row sees no key).
        native_window: a DecodePlan's :meth:`~compilemask.DecodePlan.native_window` (0:
            causal, ``w``: sliding window, bottom-right), or None.

    Page ids and cache lengths are checked by the call on the host (one read), unless the
    backend sets ``checks_cache_values = True``: then, on CUDA, its ``decode`` checks what
    it reads and gives NaN out and lse to a batch row with a bad value (no host read).
    A backend with a ``decode_supports(call) -> (ok, reason)`` method says which cache calls
    it runs (else its ``supports(None, call.attention)`` does).
    """

    row_lo: torch.Tensor
    row_hi: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    page_size: int
    kv_len: int
    attention: AttentionCall
    plan_seqlens: torch.Tensor | None = None
    len_limit: int | None = None
    row_count: torch.Tensor | None = None
    native_window: int | None = None


@runtime_checkable
class Backend(Protocol):
    """One attention implementation over a :class:`~compilemask.MaskPlan`."""

    name: str  # "reference", "triton", "cudnn", "fa4", "cute"

    def available(self) -> tuple[bool, str]:
        """``(False, why)`` when its library is not importable or no device runs it."""
        ...

    def supports(self, plan: MaskPlan, call: AttentionCall) -> tuple[bool, str]:
        """``(False, why)`` when it cannot run this call (dtype, head_dim, device, plan)."""
        ...

    def prepare(self, plan: MaskPlan, call: AttentionCall) -> object:
        """Lower the plan to what the kernel reads; cached on the plan (``plan.cached``), no
        host synchronisation where the kernel allows."""
        ...

    def forward(
        self, q, k, v, plan, prepared, scale, need_lse: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(out, lse)``, lse float32. ``need_lse=False``: the caller discards lse (a forward
        without gradients or ``return_lse``); a backend may skip it and return None."""
        ...

    def backward(
        self, q, k, v, out, lse, dout, plan, prepared, scale
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` shaped like q, k, v (``dout`` of out; lse's gradient not taken)."""
        ...


def call_of(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    return_lse: bool,
    *,
    score_mod: object = None,
    sinks: torch.Tensor | None = None,
) -> AttentionCall:
    """The :class:`AttentionCall` of validated q [B, Hq, Nq, D], k [B, Hkv, Nk, D] and v
    [B, Hkv, Nk, Dv]; a backward is asked for when grad mode is on and q, k, v, the sinks or
    a learnable tensor of ``score_mod`` requires grad."""
    B, Hq, Nq, D = q.shape
    requires_grad = torch.is_grad_enabled() and (
        q.requires_grad
        or k.requires_grad
        or v.requires_grad
        or (sinks is not None and sinks.requires_grad)
        or (score_mod is not None and score_mod.requires_grad())
    )
    return AttentionCall(
        B, Hq, k.shape[1], Nq, k.shape[2], D, q.dtype, q.device, requires_grad, return_lse,
        v.shape[3], score_mod, sinks is not None,
    )  # fmt: skip


def plain_attention_reason(
    call, backend: str, softcap_and_sinks: bool = False, softcap: bool = False, alibi=False
) -> str:
    """Why ``backend`` (one that runs plain masked attention only, in eager calls: no score
    modifiers, no sinks, ``Dv == Dqk``, not under ``torch.compile``) refuses ``call``, or ""
    when it does not; ``softcap_and_sinks=True``: the backend also runs a lone
    :func:`~compilemask.score_mods.softcap` and sinks; ``softcap=True``: a lone softcap, no
    sinks; ``alibi=True`` (with ``softcap=True``): a lone :func:`~compilemask.score_mods.alibi`
    too. Reads the fields with ``getattr`` so calls built before they existed
    (``SimpleNamespace`` ones in tests) pass."""
    if torch.compiler.is_compiling():
        return under_compile_reason(backend)
    mod = getattr(call, "score_mod", None)
    if softcap_and_sinks or softcap:
        lone = mod is None or softcap_of(mod) is not None or (alibi and alibi_of(mod) is not None)
        if not lone:
            runs = "softcap(cap) alone" + (" (and sinks)" if softcap_and_sinks else "")
            runs += " or alibi(slopes) alone" if alibi else ""
            return (
                f"the {backend} backend runs score_mod={runs}, not {mod!r}; use "
                'backend="triton" or "reference"'
            )
        if softcap and getattr(call, "has_sinks", False):
            return f'the {backend} backend has no sinks; use backend="triton" or "reference"'
    elif mod is not None or getattr(call, "has_sinks", False):
        return (
            f'the {backend} backend has no score modifiers or sinks; use backend="triton" or '
            '"reference"'
        )
    dv = getattr(call, "head_dim_v", None)
    if dv is not None and dv != call.head_dim:
        return (
            f"the {backend} backend runs v's head_dim equal to q's only, got Dqk "
            f'{call.head_dim}, Dv {dv}; use backend="triton" or "reference"'
        )
    return ""


def softcap_of(score_mod) -> float | None:
    """The cap of a modifier that is one :func:`~compilemask.score_mods.softcap` stage, else
    None (any other modifier, or a composition)."""
    from ..score_mods import SOFTCAP

    stages = score_mod.stages() if hasattr(score_mod, "stages") else []
    if len(stages) == 1 and stages[0].kind == SOFTCAP:
        return stages[0].cap
    return None


def alibi_of(score_mod):
    """The slopes of a modifier that is one :func:`~compilemask.score_mods.alibi` stage, else
    None (any other modifier, or a composition)."""
    from ..score_mods import ALIBI

    stages = score_mod.stages() if hasattr(score_mod, "stages") else []
    if len(stages) == 1 and stages[0].kind == ALIBI:
        return stages[0].slopes
    return None


def plan_fit_reason(plan: MaskPlan, call) -> str:
    """Why ``plan`` does not fit ``call`` for a backend that reads it as it is (GQA grouping,
    per-head / per-batch plans, lengths), or "" when it fits."""
    if call.heads_kv < 1 or call.heads_q % call.heads_kv:
        return f"heads_q {call.heads_q} is not a multiple of heads_kv {call.heads_kv}"
    if plan.heads is not None and plan.heads != call.heads_q:
        return f"the plan is per-head for {plan.heads} heads, call: {call.heads_q}"
    if plan.batch is not None and plan.batch != call.batch:
        return f"the plan is per-batch for {plan.batch} rows, the call has {call.batch}"
    if (plan.q_len, plan.kv_len) != (call.q_len, call.kv_len):
        return (
            f"the plan is for q_len {plan.q_len}, kv_len {plan.kv_len}; "
            f"the call has {call.q_len}, {call.kv_len}"
        )
    return ""


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (``cuda`` and ``cuda:<current>`` are)."""
    if a.type != b.type or (a.index != b.index and a.type != "cuda"):
        return False
    if a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def under_compile_reason(backend: str) -> str:
    """The reason a backend driven through an eager library call gives under torch.compile."""
    return f'{backend} does not run under torch.compile (use backend="triton")'
