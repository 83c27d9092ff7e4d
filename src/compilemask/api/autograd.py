"""Autograd for backends that give a plain ``forward`` / ``backward`` pair
(``kernels/interface.py``).

Backends with their own autograd wiring (``attend``: the reference, through torch autograd;
Triton, through its custom ops and their eager twin) do not pass here.
"""

from __future__ import annotations

import torch

from ..errors import CompileMaskError


class BackendAttention(torch.autograd.Function):
    """``(out, lse)`` of ``backend.forward``; gradients to q, k, v from ``backend.backward``
    (through ``out``: the contract's backward takes no gradient of ``lse``)."""

    @staticmethod
    def forward(ctx, q, k, v, backend, plan, prepared, scale):
        out, lse = backend.forward(q, k, v, plan, prepared, scale)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.backend, ctx.plan, ctx.prepared, ctx.scale = backend, plan, prepared, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dlse is not None:
            raise CompileMaskError(
                f"backend={ctx.backend.name!r} has no gradient through lse; use the output only "
                f'or backend="reference"'
            )
        if dout is None:
            return (None,) * 7
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backend.backward(
            q, k, v, out, lse, dout, ctx.plan, ctx.prepared, ctx.scale
        )
        return dq, dk, dv, None, None, None, None
