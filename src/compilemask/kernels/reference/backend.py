"""``backend="reference"``: :func:`.kernel.reference_attention` behind the backend contract.

Runs on any device and dtype (float16 to float64), differentiably through torch autograd
(forward-mode AD and higher-order gradients included), and traces under ``torch.compile``
with symbolic lengths (one graph for every sequence length with ``dynamic=True``).
"""

from __future__ import annotations

import torch

from ..interface import SUPPORTED_DTYPES, AttentionCall
from .kernel import reference_attention, reference_attention_backward
from .paged import paged_reference_attention


class ReferenceBackend:
    name = "reference"

    def available(self) -> tuple[bool, str]:
        return True, ""

    def supports(self, plan, call: AttentionCall) -> tuple[bool, str]:
        if call.dtype not in SUPPORTED_DTYPES:
            return False, f"supports float16, bfloat16, float32 and float64, got {call.dtype}"
        return True, ""

    def prepare(self, plan, call: AttentionCall):
        """The plan without its permutation (q, k, v arrive in its tiled order)."""
        return plan.in_permuted_order()

    def attend(
        self, q, k, v, plan, prepared, scale: float, call: AttentionCall, *, score_mod=None,
        sinks=None,
    ):  # fmt: skip
        """``(out, lse)`` through torch autograd (the api calls this instead of forward /
        backward: the reference is differentiable as it stands, in the sinks and the score
        modifier's tensors too)."""
        out, lse = reference_attention(q, k, v, prepared, scale, score_mod=score_mod, sinks=sinks)
        return out.to(q.dtype), lse.to(torch.float32)

    def forward(self, q, k, v, plan, prepared, scale: float, need_lse: bool = True):
        with torch.no_grad():
            out, lse = reference_attention(q, k, v, prepared, scale)
        return out.to(q.dtype), lse.to(torch.float32)

    def backward(self, q, k, v, out, lse, dout, plan, prepared, scale: float):
        with torch.no_grad():
            return reference_attention_backward(q, k, v, prepared, dout, scale)

    def decode(self, q, k_cache, v_cache, call, scale: float):
        """``(out, lse)`` over a paged cache (``interface.DecodeCall``): pages gathered, then
        the definition."""
        out, lse = paged_reference_attention(
            q, k_cache, v_cache, call.row_lo, call.row_hi, call.block_table, call.cache_seqlens,
            scale,
        )  # fmt: skip
        return out.to(q.dtype), lse.to(torch.float32)


BACKEND = ReferenceBackend()
