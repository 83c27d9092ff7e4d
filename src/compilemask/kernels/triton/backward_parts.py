"""The two backward kernels that read no mask (``backward.py`` has the module's overview):

- ``_attn_bwd_preprocess``: per query row ``delta = rowsum(dO * O) - dlse`` and
  ``lse2 = lse * log2(e)`` (+inf where lse = -inf), both fp32 [B, Hq, Nq];
- ``_attn_bwd_dq_ds``: dQ from the dS tiles the dK/dV kernel stored (``BwdConfig.ds_dq``).

Legend: B batch, Hq query heads, Nq / Nk query / key length, D head_dim (of O and dO in the
preprocess: v's), Tq / Tk = number of q- / kv-tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import clamp, grid_position, q_tile_program

_PRE_BLOCK = 64


@triton.jit
def _attn_bwd_preprocess(
    Out, DO, Lse, DLse, Delta, Lse2,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    Hq, Nq,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):  # fmt: skip
    """delta = rowsum(dO * O) - dlse and lse2 = lse * log2(e) (+inf where lse = -inf)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = pid_bh // Hq
    off_h = pid_bh % Hq
    offs_m = pid_m * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_ok = offs_m < Nq
    ok = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    o = tl.load(
        Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
        + rows * stride_om + offs_d[None, :] * stride_od,
        mask=ok, other=0.0,
    )  # fmt: skip
    do = tl.load(
        DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        + rows * stride_dom + offs_d[None, :] * stride_dod,
        mask=ok, other=0.0,
    )  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row_ptr = pid_bh.to(tl.int64) * Nq + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLse + row_ptr, mask=m_ok, other=0.0)
    lse = tl.load(Lse + row_ptr, mask=m_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(Delta + row_ptr, delta, mask=m_ok)
    tl.store(Lse2 + row_ptr, lse2, mask=m_ok)


@triton.jit
def _attn_bwd_dq_ds(
    DS, K, DQ, Slot, QCount, QList, QOrder,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    Hq, gqa_group, Nq, Nk, Tq, Tk, mask_stride_b, mask_stride_h, ds_tiles, scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GRID_ORDER: tl.constexpr,
    K_desc=None,
    DS_desc=None,
    USE_TMA: tl.constexpr = False,
):  # fmt: skip
    """dQ of one q-tile from the stored dS tiles (``BwdConfig.ds_dq``): ``dQ = scale *
    sum over its touched kv-tiles of dS K``, one MMA per tile pair, no mask (dS is zero where
    a pair is not visible and past the lengths). ``DS``: [B * Hq, ds_tiles, BLOCK_N, BLOCK_M]
    dS^T tiles at the slots ``Slot`` [M, Tq, Tk]; the tile lists are the forward schedule's
    at this (dQ) tiling. USE_TMA: K and dS^T tiles through the descriptors."""
    pid_bh, rank = grid_position(GRID_ORDER)
    off_b, off_h, off_hkv, mask_id, qt, tile_row = q_tile_program(
        pid_bh, rank, Hq, gqa_group, mask_stride_b, mask_stride_h, QOrder, Tq, GRID_ORDER
    )
    count = clamp(tl.load(QCount + tile_row), Tk)
    tile_list = QList + tile_row * Tk
    slot_row = Slot + tile_row * Tk
    ds_row0 = pid_bh.to(tl.int64) * ds_tiles
    DS_head = DS + ds_row0 * (BLOCK_N * BLOCK_M)
    K_head = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh

    offs_m_local = tl.arange(0, BLOCK_M)
    offs_n_local = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    # next tile and its slot one iteration ahead (see forward._attn_fwd_inner)
    # (tiles and slots clamped to the schedule's and the buffer's sizes)
    kt_next = clamp(tl.load(tile_list, mask=count > 0, other=0), Tk - 1)
    for i in range(0, count):
        kt = kt_next
        kt_next = clamp(tl.load(tile_list + i + 1, mask=i + 1 < count, other=0), Tk - 1)
        slot = clamp(tl.load(slot_row + kt), ds_tiles - 1).to(tl.int64)
        start_n = kt * BLOCK_N
        if USE_TMA:
            k = K_desc.load([off_b, off_hkv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM_PAD)
            dsT = DS_desc.load([((ds_row0 + slot) * BLOCK_N).to(tl.int32), 0])
        else:
            offs_n = start_n + offs_n_local
            k = tl.load(
                K_head + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=(offs_n < Nk)[:, None] & d_ok[None, :],
                other=0.0,
            )
            dsT = tl.load(
                DS_head + slot * (BLOCK_N * BLOCK_M)
                + offs_n_local[:, None] * BLOCK_M + offs_m_local[None, :]
            )  # fmt: skip
        dq = tl.dot(tl.trans(dsT), k, dq)
    dq = dq * scale
    start_m = qt * BLOCK_M
    offs_m = start_m + offs_m_local
    tl.store(
        DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
        + offs_m.to(tl.int64)[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty), mask=(offs_m < Nq)[:, None] & d_ok[None, :],
    )  # fmt: skip
