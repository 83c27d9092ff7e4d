"""A backend made of two: one backend's forward, another's backward.

``SplitBackend(forward, backward)`` runs the forward kernel of one backend and, when gradients
are asked for, the backward kernels of another, wired by :class:`~compilemask.api.autograd.
BackendAttention`. The two meet only through the contract's tensors (``kernels/interface.py``):
``out [B, Hq, Nq, D]`` in q's dtype and ``lse`` float32 ``[B, Hq, Nq]``, the natural log of the
row's sum of ``exp(scale * q.k)``, ``-inf`` (with ``out`` 0) for rows that see no key. A
backward that recomputes the probabilities as ``exp(scale * q.k - lse)`` from these gives the
gradients of the forward that produced them, whichever kernel that was; each registered pair
is checked against the float64 reference, forward and gradients, with rows that see no key
(``tests/test_backends_gpu.py``; ``tests/test_split_backend.py`` on the CPU).

Score modifiers and sinks (``attend_modified``): where the forward backend runs them in its
``attend`` and the backward backend has ``attend_after`` (the Triton one), the call runs the
forward half's ``attend`` (lse of the modified scores) inside the backward half's autograd
function, which gives the gradients of q, k, v, the sinks and the modifier's learnable
tensors.

Registered pairs are named ``"<forward>+<backward>"`` (``"cudnn+triton"``: cuDNN-frontend's
forward, whose per-call cost is the lowest of ours at 1K, with the Triton backward, the
faster backward there; ``"cute+triton"``: our CuTe-DSL forward, with softcap or ALiBi
too, with the Triton backward). ``backend="auto"`` uses a pair where a measured row of its
table says so (``registry.AUTO_TABLE``); an explicit name runs it like any backend.
"""

from __future__ import annotations

import dataclasses

from .interface import AttentionCall, Backend


@dataclasses.dataclass(frozen=True)
class SplitPrepared:
    """What each half prepared: the forward backend's data (for a call without a backward)
    and the backward backend's (for the call as it is)."""

    forward: object
    backward: object


class SplitBackend:
    """``forward``'s forward kernel and ``backward``'s backward kernels as one backend.

    Args:
        forward: a registered backend with a ``forward`` method (its ``attend``, if any, runs
            the calls with a score modifier or sinks).
        backward: a registered backend with a ``backward`` method.

    The name is ``f"{forward.name}+{backward.name}"``. Calls that take a gradient through
    ``lse`` (``return_lse=True`` with inputs that require grad) are not supported: the
    contract's backward has no lse gradient.
    """

    def __init__(self, forward: Backend, backward: Backend):
        self.forward_backend = forward
        self.backward_backend = backward
        self.name = f"{forward.name}+{backward.name}"

    def available(self) -> tuple[bool, str]:
        for half in (self.forward_backend, self.backward_backend):
            ok, why = half.available()
            if not ok:
                return False, f"{half.name}: {why}"
        return True, ""

    def dispatch_token(self):
        """Both halves' tokens (None, so no call is kept, when either has none)."""
        tokens = []
        for half in (self.forward_backend, self.backward_backend):
            token_of = getattr(half, "dispatch_token", None)
            token = None if token_of is None else token_of()
            if token is None:
                return None
            tokens.append(token)
        return tuple(tokens)

    @staticmethod
    def _forward_call(call: AttentionCall) -> AttentionCall:
        return dataclasses.replace(call, requires_grad=False)

    def supports(self, plan, call: AttentionCall) -> tuple[bool, str]:
        if call.return_lse and call.requires_grad:
            return False, (
                f"no gradient through lse on {self.name}: call without return_lse, or use "
                'backend="triton"'
            )
        ok, why = self.forward_backend.supports(plan, self._forward_call(call))
        if not ok:
            return False, f"{self.forward_backend.name} (forward): {why}"
        modded = call.score_mod is not None or call.has_sinks
        if modded and not hasattr(self.forward_backend, "attend"):
            return False, f"{self.forward_backend.name} (forward) runs no score_mod or sinks"
        if modded and call.requires_grad and not hasattr(self.backward_backend, "attend_after"):
            return False, f"{self.backward_backend.name} (backward) takes no other forward"
        if call.requires_grad:
            ok, why = self.backward_backend.supports(plan, call)
            if not ok:
                return False, f"{self.backward_backend.name} (backward): {why}"
        return True, ""

    def prepare(self, plan, call: AttentionCall) -> SplitPrepared:
        """The forward half prepared for a forward alone, the backward half (only when the
        call will run a backward) for the call itself."""
        fwd = self.forward_backend.prepare(plan, self._forward_call(call))
        bwd = self.backward_backend.prepare(plan, call) if call.requires_grad else None
        return SplitPrepared(fwd, bwd)

    def forward(self, q, k, v, plan, prepared: SplitPrepared, scale: float, need_lse=True):
        """The forward half's ``(out, lse)`` (``lse`` None when ``need_lse`` is False and the
        half skips it)."""
        from .registry import forward_options

        opts = forward_options(self.forward_backend, need_lse)
        return self.forward_backend.forward(q, k, v, plan, prepared.forward, scale, **opts)

    def attend_modified(
        self, q, k, v, plan, prepared: SplitPrepared, scale: float, call: AttentionCall, *,
        score_mod=None, sinks=None,
    ):  # fmt: skip
        """``(out, lse)`` with gradients of a call with a score modifier or sinks: the forward
        half's ``attend`` (a forward-only call) inside the backward half's ``attend_after``
        when a backward will run, alone otherwise. (Calls without them run ``forward`` and
        ``backward`` through the api's autograd function, as any backend's.)"""
        fwd_call = self._forward_call(call)

        def forward(q, k, v):
            return self.forward_backend.attend(
                q, k, v, plan, prepared.forward, scale, fwd_call, score_mod=score_mod,
                sinks=sinks,
            )  # fmt: skip

        if not call.requires_grad:
            return forward(q, k, v)
        return self.backward_backend.attend_after(
            forward, q, k, v, plan, prepared.backward, scale, score_mod=score_mod, sinks=sinks
        )

    def backward(self, q, k, v, out, lse, dout, plan, prepared: SplitPrepared, scale: float):
        """The backward half's ``(dq, dk, dv)`` from the forward half's ``out`` and ``lse``."""
        if prepared.backward is None:
            from ..errors import CompileMaskError

            raise CompileMaskError(
                f"{self.name} was prepared without a backward (no input required grad when the "
                "forward ran)"
            )
        return self.backward_backend.backward(
            q, k, v, out, lse, dout, plan, prepared.backward, scale
        )
