"""The greedy rounds of :mod:`compilemask.kernels.cute.rounds` in one Triton program (see
there): which persistent CTA of the CuTe forward runs which work-list entry."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounds_kernel(cost_ptr, cta_ptr, W, C, BLOCK: tl.constexpr, WMAX: tl.constexpr):
    """``cta[i]``: the CTA of entry ``i`` of ``W`` (cost ``cost[i]``) over ``C`` CTAs.

    Keys pack a value above 16 lane bits, so one ascending sort orders the CTAs by work so far
    (ties by CTA number) and the round's entries heaviest first (ties by place)."""
    lanes = tl.arange(0, BLOCK)
    big = tl.full([BLOCK], 0x7FFFFFFFFFFFFFFF, tl.int64)
    state = tl.where(lanes < C, lanes.to(tl.int64), big)  # (load << 16) | cta
    for r0 in range(0, W, C):
        idx = r0 + lanes
        live = (lanes < C) & (idx < W)
        x = tl.load(cost_ptr + idx, mask=live, other=0).to(tl.int64)
        key = tl.where(live, ((WMAX - x) << 16) | lanes.to(tl.int64), big)
        key = tl.sort(key)
        state = tl.sort(state)
        ok = lanes < tl.minimum(W - r0, C)
        item = key & 0xFFFF
        heavy = WMAX - (key >> 16)
        tl.store(cta_ptr + r0 + item, state & 0xFFFF, mask=ok)
        state = tl.where(ok, state + (heavy << 16), state)
