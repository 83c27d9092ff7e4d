"""Plans FlashAttention-4 runs without any mask arithmetic: exactly causal, or a causal
sliding window, over ``q_len == kv_len`` rows.

FlashAttention-4's own causal and local paths skip the masked-tile machinery of the
block-sparse one (no tile lists, no ``mask_mod``); on an H200 they are its fastest kernels
(``docs/perf-notes.md``, "Backends"). A plan qualifies when the compiler named it ``causal()``
or ``sliding_window(w)`` (its ``source``) *and* its intervals are exactly that mask: the name
only selects the candidates, so hstu, document, ... plans cost nothing here, and a plan whose
tensors say otherwise (built by hand, or modified in place) runs the block-sparse path. The
check reads one value back to the host, once per plan (cached with the tensors' versions).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ...compiler.plan import MaskPlan

_FORMS = re.compile(r"^(?:(causal)\(\)|sliding_window\((\d+)\))$")


@dataclass(frozen=True)
class Fa4Native:
    """What ``Fa4Backend.prepare`` returns for a native plan: ``window`` 0 for causal, else the
    keys each row sees (``sliding_window(window)``: FlashAttention's ``window_size =
    (window - 1, 0)``)."""

    window: int

    def flash_args(self) -> dict:
        """Keyword arguments of ``flash_attn_func`` for this mask."""
        if self.window == 0:
            return {"causal": True}
        return {"causal": False, "window_size": (self.window - 1, 0)}

    def bwd_args(self) -> dict:
        """Keyword arguments of ``_flash_attn_bwd`` for this mask."""
        if self.window == 0:
            return {"causal": True}
        return {"causal": False, "window_size_left": self.window - 1, "window_size_right": 0}


def native_form(plan: MaskPlan) -> Fa4Native | None:
    """The native mask of ``plan`` (see the module docstring), or None."""
    if (
        plan.batch is not None
        or plan.heads is not None
        or plan.permutation is not None
        or plan.encoding != "intervals"
        or plan.q_len != plan.kv_len
    ):
        return None
    match = _FORMS.match(plan.source or "")
    if match is None:
        return None
    window = 0 if match.group(1) else int(match.group(2))
    if window >= plan.q_len:
        window = 0  # every row sees all keys up to itself: causal
    key = (
        "fa4-native", window, plan.row_lo._version, plan.row_hi._version,
        plan.row_count._version,
    )  # fmt: skip
    return Fa4Native(window) if plan.cached(key, lambda: _intervals_are(plan, window)) else None


def _intervals_are(plan: MaskPlan, window: int) -> bool:
    """Whether every row ``q`` sees exactly ``[max(0, q - window + 1), q + 1)`` (``window``
    0: ``[0, q + 1)``); one host read."""
    n = plan.q_len
    rows = torch.arange(n, device=plan.row_lo.device, dtype=plan.row_lo.dtype)
    lo = (rows - (window - 1)).clamp_min(0) if window else torch.zeros_like(rows)
    ok = (
        (plan.row_count == 1).all()
        & (plan.row_lo[..., 0] == lo).all()
        & (plan.row_hi[..., 0] == rows + 1).all()
    )
    return bool(ok)
