"""The host side of the cute forward (:mod:`.forward_sm90`): its launch arguments from torch
tensors and a lowered plan, example arguments to compile it without a call, and the compile
itself. Imports ``cutlass`` (the backend imports this module on first use only)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .forward_sm90 import LOG2E, FlashFwdSm90
from .lower import BLOCK_M, BLOCK_N, CONSUMER_THREADS

_TORCH_TO_CUTLASS = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


def kernel_args(
    q, k, v, out, lse, low, scale: float, num_ctas: int, counter, softcap: float | None = None,
    slopes=None,
):  # fmt: skip
    """The kernel's arguments from torch tensors: q, out ``[B, Hq, Nq, D]``, k, v
    ``[B, Hkv, Nk, D]`` (D contiguous, 16-byte aligned), lse fp32 ``[B, Hq, Nq]`` and the
    lowered plan ``low`` (:class:`~.lower.CuteLowered`); ``counter``: a zeroed int32 ``[1]``
    tensor (the CTAs' entry counter). ``softcap``: the cap of the softcap kernel (scores
    ``cap * tanh(s * scale / cap)``: the kernel takes ``tanh(s * scale / cap)`` and the
    exponent scale ``cap * log2 e``), None for the others. ``slopes``: the ALiBi kernel's
    float32 ``[Hq]`` slopes (contiguous, on q's device), None for the others."""
    from cutlass.cute.runtime import from_dlpack

    def dyn(t, leading):
        return from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=leading)

    def ints(t):
        return from_dlpack(t, assumed_align=4).mark_layout_dynamic(leading_dim=t.dim() - 1)

    plan_views = low.kernel_views.get("ints")
    if plan_views is None:  # the plan's tensors do not change: their views are made once
        plan_views = low.kernel_views["ints"] = tuple(
            ints(t) for t in (low.work, low.tiles.view(-1, 2))
        ) + (dyn(low.pages, 1),)  # 64-bit words: each thread's word in one aligned load
    if slopes is None:  # the other kernels take a placeholder they do not read
        slope_view = low.kernel_views.get("no_slopes")
        if slope_view is None:
            import torch

            none = torch.zeros(1, dtype=torch.float32, device=low.work.device)
            slope_view = low.kernel_views["no_slopes"] = from_dlpack(none, assumed_align=4)
    else:
        slope_view = from_dlpack(slopes, assumed_align=4)
    return (
        dyn(q.permute(2, 3, 1, 0), 1),
        dyn(k.permute(2, 3, 1, 0), 1),
        dyn(v.permute(3, 2, 1, 0), 0),
        dyn(out.permute(2, 3, 1, 0), 1),
        from_dlpack(lse.permute(2, 1, 0), assumed_align=4).mark_layout_dynamic(leading_dim=0),
        *plan_views,
        slope_view,
        Float32((scale if softcap is None else softcap) * LOG2E),
        Float32(1.0 if softcap is None else scale / softcap),
        Int32(num_ctas), from_dlpack(counter, assumed_align=4),
    )  # fmt: skip


def example_args(head_dim: int, dtype_name: str, device) -> tuple:
    """Arguments of the kernel's signature from small zero tensors on ``device`` (every
    shape and stride is dynamic, so their sizes do not matter): what :func:`compile_forward`
    needs to compile without a call at hand."""
    import torch

    from .lower import CuteLowered

    dt = getattr(torch, dtype_name)
    q = torch.zeros(1, 2, BLOCK_M, head_dim, dtype=dt, device=device)
    k = torch.zeros(1, 1, BLOCK_N, head_dim, dtype=dt, device=device)
    lse = torch.zeros(1, 2, BLOCK_M, dtype=torch.float32, device=device)

    def ints(*shape):
        return torch.zeros(*shape, dtype=torch.int32, device=device)

    low = CuteLowered(
        work=ints(2, 7), kv_list=ints(2, 2, 2), kv_count=ints(2, 2), full_count=ints(2, 2),
        tiles=ints(2, 2, 2, 2), pages=torch.zeros(1, CONSUMER_THREADS, dtype=torch.int64,
        device=device), block_m=BLOCK_M, block_n=BLOCK_N, num_ctas=1,
    )  # fmt: skip
    return kernel_args(q, k, k, torch.zeros_like(q), lse, low, head_dim**-0.5, 1, ints(1))


def compile_forward(head_dim: int, dtype_name: str, example_args: tuple, stream, modifier=""):
    """``cute.compile`` of :class:`FlashFwdSm90` for ``(head_dim, dtype, modifier)`` on
    ``example_args`` (from :func:`kernel_args`; only their types and ranks matter)."""
    kernel = FlashFwdSm90(head_dim, _TORCH_TO_CUTLASS[dtype_name], modifier)
    return cute.compile(kernel, *example_args, stream)
