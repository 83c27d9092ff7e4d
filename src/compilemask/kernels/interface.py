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
   ``backward`` through the api's generic ``autograd.Function``.

Shapes: q [B, Hq, Nq, D], k and v [B, Hkv, Nk, D]; out like q in q's dtype; lse float32
[B, Hq, Nq], natural log, -inf for rows that see no key (whose out is 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from ..compiler.plan import MaskPlan

#: head_dim values ``compilemask.attention`` accepts (every backend of the package runs them;
#: a backend that runs fewer says so in ``supports``).
SUPPORTED_HEAD_DIMS: tuple[int, ...] = (32, 64, 96, 128, 256)

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
    """

    row_lo: torch.Tensor
    row_hi: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    page_size: int
    kv_len: int
    attention: AttentionCall


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

    def forward(self, q, k, v, plan, prepared, scale) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)``, lse float32."""
        ...

    def backward(
        self, q, k, v, out, lse, dout, plan, prepared, scale
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)`` shaped like q, k, v (``dout`` of out; lse's gradient not taken)."""
        ...


def call_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_lse: bool) -> AttentionCall:
    """The :class:`AttentionCall` of validated q [B, Hq, Nq, D], k and v [B, Hkv, Nk, D]."""
    B, Hq, Nq, D = q.shape
    requires_grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
    )
    return AttentionCall(
        B, Hq, k.shape[1], Nq, k.shape[2], D, q.dtype, q.device, requires_grad, return_lse
    )
