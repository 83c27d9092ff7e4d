"""Token permutation of ``[B, H, N, D]`` tensors in one Triton launch (``tile_grid`` plans).

``gather_tokens(x, index)`` is ``x.index_select(2, index)``: one program copies ``BLOCK_R``
whole rows (D contiguous elements) of one (batch row, head), reading row ``index[i]`` and
writing row ``i``, so every load and store is a contiguous row: a pure copy at memory
bandwidth. PyTorch's ``index_select`` along a middle dimension takes a generic gather path;
its autograd gradient is an atomic ``index_add`` (slow in 16 bits) where the gradient of a
permutation is the gather by the inverse permutation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_rows(
    X, Out, Index,
    stride_xb, stride_xh, stride_xn,
    stride_ob, stride_oh, stride_on,
    H, M, n_blocks,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
):  # fmt: skip
    # one grid axis (CUDA allows 2^31 - 1 programs there, 65,535 on the others)
    pid = tl.program_id(0)
    pid_r = pid % n_blocks
    pid_bh = pid // n_blocks
    off_b = pid_bh // H
    off_h = pid_bh % H
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M  # rows of the output (entries of Index)
    src = tl.load(Index + rows, mask=row_ok, other=0).to(tl.int64)
    cols = tl.arange(0, D_PAD)
    ok = row_ok[:, None] & (cols < D)[None, :]
    x_ptrs = (
        X
        + off_b.to(tl.int64) * stride_xb
        + off_h.to(tl.int64) * stride_xh
        + src[:, None] * stride_xn
        + cols[None, :]
    )
    o_ptrs = (
        Out
        + off_b.to(tl.int64) * stride_ob
        + off_h.to(tl.int64) * stride_oh
        + rows.to(tl.int64)[:, None] * stride_on
        + cols[None, :]
    )
    tl.store(o_ptrs, tl.load(x_ptrs, mask=ok), mask=ok)


def gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(2, index)`` for ``x`` ``[B, H, N, D]`` (any strides but a unit last
    stride; otherwise, or for other ranks, it falls back to ``index_select``) and ``index``
    an integer ``[M]`` tensor (any stride) with entries in ``[0, N)`` (not checked). Returns a
    new contiguous ``[B, H, M, D]`` tensor."""
    if x.dim() != 4 or x.stride(-1) != 1 or x.numel() == 0:
        return x.index_select(2, index)
    B, H, _, D = x.shape
    M = index.shape[0]
    index = index.contiguous()
    out = torch.empty((B, H, M, D), dtype=x.dtype, device=x.device)
    d_pad = triton.next_power_of_2(D)
    block_r = max(1, min(64, 8192 // d_pad))
    n_blocks = triton.cdiv(M, block_r)
    _gather_rows[(n_blocks * B * H,)](
        x, out, index, x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2), H, M, n_blocks,
        D=D, D_PAD=d_pad, BLOCK_R=block_r, num_warps=4,
    )  # fmt: skip
    return out
