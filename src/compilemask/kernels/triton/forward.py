"""Triton forward attention over a :class:`MaskPlan` (FlashAttention-2 style).

One program computes one BLOCK_M-row q-tile of one (batch row, query head). The launch order
is ``FwdConfig.grid_order`` (``common.grid_position``): by default the q-tiles of one head run
side by side (in natural order), so that the programs in flight read the same K/V from L2;
order 0 walks heads fastest with q-tiles heaviest first (``q_order``).
The program walks its q-tile's kv-tile list (stored FULL first): the PARTIAL tiles first in
a masked loop (intervals or bitmask, see ``common.py``), then the FULL tiles in an unmasked
loop, so that nothing the masked loop needs stays live across the long one (FlexAttention's
order); the next tile index is loaded one iteration ahead, which keeps the K/V copies of a
multi-stage loop in flight. Online softmax in fp32 in base 2; it writes O and the
natural-log LSE. Rows that see no key get O = 0 and LSE = -inf. With ``FwdConfig.tma`` K and
V come through TMA tensor descriptors.

Legend: B batch, Hq / Hkv query / key-value heads, Nq / Nk query / key length, D head_dim,
M = number of masks in the plan, Tq / Tk = number of q- / kv-tiles.

Source: Dao, "FlashAttention-2" (2023); structure of Triton's fused-attention tutorial.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import (
    check_bits,
    clamp,
    clamp_counts,
    grid_position,
    launch_grid,
    launch_order,
    mask_constants,
    one_interval_per_tile,
    one_slot_mask,
    partial_tile_mask,
    preload_row_slot,
    q_tile_work,
    slot_range,
    slots_mask,
)
from .configs import FwdConfig, check_head_dim, padded_head_dim
from .score_mods import add_sink, apply_mods, natural_scale_args, softcap_alone

_LOG2E = 1.4426950408889634


@triton.jit
def _mask_scores(
    qk, kt, bidx, Kind, Jlo, Jhi, Bits, stride_bits_p, stride_bits_r, RowLo, RowHi, row_base,
    offs_m, offs_n, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, Nq, Nk, n_slots,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPAN: tl.constexpr,
    HAS_BITS: tl.constexpr,
    SLOTS: tl.constexpr,
    ONE_PER_TILE: tl.constexpr = False,
):  # fmt: skip
    """``qk`` with -inf where the PARTIAL tile ``kt`` hides a pair: from the preloaded slots
    ``lo*/hi*`` when SLOTS > 0 (the one slot that meets the tile when ``ONE_PER_TILE``:
    ``common.one_slot_mask``), else from the tile's intervals or bitmask (``bidx``)."""
    if SLOTS > 1 and ONE_PER_TILE:
        start_n = kt * BLOCK_N
        visible = one_slot_mask(
            offs_n, start_n, start_n + BLOCK_N, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, SLOTS
        )
    elif SLOTS > 0:
        visible = slots_mask(offs_n, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, SLOTS)
    else:
        kind = 0
        if HAS_BITS:
            kind = tl.load(Kind + kt)
        jlo, jhi = slot_range(Jlo, Jhi, kt, n_slots)
        visible = partial_tile_mask(
            kind, RowLo, RowHi, row_base, offs_m, offs_n, Nq, Nk, n_slots, jlo, jhi, Bits, bidx,
            stride_bits_p, stride_bits_r, BLOCK_M, BLOCK_N, MAX_SPAN, HAS_BITS,
        )  # fmt: skip
    return tl.where(visible, qk, float("-inf"))


@triton.jit
def _attn_fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    K_tile,
    V_tile,
    K_desc,
    V_desc,
    off_b,
    off_hkv,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    TileList,
    Kind,
    Jlo,
    Jhi,
    BitsIndex,
    Bits,
    stride_bits_p,
    stride_bits_r,
    RowLo,
    RowHi,
    row_base,
    offs_m,
    lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3,
    Nq,
    Nk,
    n_slots,
    list_start,
    list_end,
    kt_max,
    n_bits,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MAX_SPAN: tl.constexpr,
    HAS_BITS: tl.constexpr,
    SLOTS: tl.constexpr,
    USE_TMA: tl.constexpr,
    kt_first=0,
    HAS_FIRST: tl.constexpr = False,
    ONE_PER_TILE: tl.constexpr = False,
    HEAD_DIM_V: tl.constexpr = 0,
    HEAD_DIM_V_PAD: tl.constexpr = 0,
    off_h=0,
    sm_scale=1.0,
    ModF=None,
    ModI=None,
    ModMeta=None,
    MOD0: tl.constexpr = 0,
    MOD1: tl.constexpr = 0,
    MOD2: tl.constexpr = 0,
    MOD3: tl.constexpr = 0,
    SCORE_FN: tl.constexpr = None,
):  # fmt: skip
    """Online softmax over the kv-tiles ``TileList[list_start:list_end]``.

    MASKED=False: the tiles are FULL (inside [0, Nq) x [0, Nk), all pairs visible): no
    bounds checks, no mask. MASKED=True: PARTIAL tiles; loads are bounds-checked and scores
    masked, from the preloaded slots ``lo*/hi*`` when SLOTS > 0, else from the tile's data.
    USE_TMA: K and V tiles come through the tensor descriptors ``K_desc, V_desc`` (Hopper TMA;
    rows past Nk and columns past HEAD_DIM read as zeros), not per-thread pointers.
    HAS_FIRST: ``kt_first`` is ``TileList[list_start]``, loaded by the caller before (from the
    program's work entry, ``schedule.work_list``), so the loop's first K/V copies need no
    load of the list first. Tile indices are clamped to [0, kt_max] (the FULL loop's
    ``kt_max`` is the last complete kv-tile: its loads are not bounds-checked), bitmask
    indices to [0, n_bits). HEAD_DIM_V (_PAD): v's head_dim. MOD0..MOD3 != 0: the score
    modifier's stages (``score_mods.apply_mods``) on ``sm_scale * qk``; ``qk_scale`` is then
    log2(e) alone, or ``cap * log2 e`` for a lone fast softcap (``score_mods.softcap_alone``).
    """
    offs_n_local = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    dv_ok = offs_dv < HEAD_DIM_V
    # The next tile index is loaded one iteration ahead with a plain load: an index load inside
    # the pipelined loop becomes the last async copy group of each iteration, and waiting for
    # it at the top of the next one waits for every copy in flight (no pipelining at all).
    if HAS_FIRST:
        kt_next = clamp(kt_first, kt_max)
    else:
        kt_next = clamp(tl.load(TileList + list_start, mask=list_start < list_end, other=0), kt_max)
    # likewise the bitmask index of a masked tile: its words' loads then need nothing loaded
    # in the same iteration
    bidx_next = 0
    if MASKED and HAS_BITS:
        bidx_next = clamp(
            tl.load(BitsIndex + kt_next, mask=list_start < list_end, other=0), n_bits - 1
        )
    for i in range(list_start, list_end):
        # clamped here, not where it is loaded: a clamp between the index load and the end of
        # the iteration takes the whole loop out of Triton's software pipeliner (every K/V
        # copy and MMA then waits for the previous one: clear at 32K 8.2 ms against 5.1)
        kt = clamp(kt_next, kt_max)
        bidx = bidx_next
        kt_next = tl.load(TileList + i + 1, mask=i + 1 < list_end, other=0)
        if MASKED and HAS_BITS:
            bidx_next = clamp(
                tl.load(BitsIndex + clamp(kt_next, kt_max), mask=i + 1 < list_end, other=0),
                n_bits - 1,
            )
        start_n = kt * BLOCK_N
        offs_n = start_n + offs_n_local
        k_ptrs = (
            K_tile
            + start_n.to(tl.int64) * stride_kn
            + offs_n_local[None, :] * stride_kn
            + offs_d[:, None] * stride_kd
        )
        v_ptrs = (
            V_tile
            + start_n.to(tl.int64) * stride_vn
            + offs_n_local[:, None] * stride_vn
            + offs_dv[None, :] * stride_vd
        )
        if MASKED:
            n_ok = offs_n < Nk
        if USE_TMA:
            k = tl.trans(K_desc.load([off_b, off_hkv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM_PAD))
        elif MASKED:
            k = tl.load(k_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        elif HEAD_DIM == HEAD_DIM_PAD:
            k = tl.load(k_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
        # unscaled scores: the scale (> 0, so it commutes with max) is folded into the FFMA of
        # the exponent below, one multiply per score fewer
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)
        if MOD0 == 6 and MOD1 == 0:  # a lone fast softcap (score_mods.softcap_alone)
            qk = softcap_alone(qk, sm_scale, ModF, ModMeta)
        elif MOD0 != 0:
            qk = apply_mods(
                qk * sm_scale, off_b, off_h, offs_m[:, None], offs_n[None, :], Nq, Nk, ModF,
                ModI, ModMeta, MOD0, MOD1, MOD2, MOD3, SCORE_FN,
            )  # fmt: skip
        if MASKED:
            qk = _mask_scores(
                qk, kt, bidx, Kind, Jlo, Jhi, Bits, stride_bits_p, stride_bits_r, RowLo, RowHi,
                row_base, offs_m, offs_n, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, Nq, Nk,
                n_slots, BLOCK_M, BLOCK_N, MAX_SPAN, HAS_BITS, SLOTS, ONE_PER_TILE,
            )  # fmt: skip
        if MASKED:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            # A row that has seen nothing yet keeps m = -inf: subtract 0 instead (p = 0).
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_new
        p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            v = V_desc.load([off_b, off_hkv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM_V_PAD)
        elif MASKED:
            v = tl.load(v_ptrs, mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        elif HEAD_DIM_V == HEAD_DIM_V_PAD:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_two_loops(
    acc, l_i, m_i, q, K_tile, V_tile, K_desc, V_desc, off_b, off_hkv,
    stride_kn, stride_kd, stride_vn, stride_vd,
    TileList, Kind, Jlo, Jhi, BitsIndex, Bits, stride_bits_p, stride_bits_r,
    RowLo, RowHi, row_base, offs_m, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3,
    Nq, Nk, n_slots, full_count, count, qk_scale, kt_full, kt_partial, Tk, n_bits,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MAX_SPAN: tl.constexpr,
    HAS_BITS: tl.constexpr,
    SLOTS: tl.constexpr,
    USE_TMA: tl.constexpr,
    HAS_FIRST: tl.constexpr,
    ONE_PER_TILE: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    HEAD_DIM_V_PAD: tl.constexpr,
    off_h,
    sm_scale,
    ModF,
    ModI,
    ModMeta,
    MOD0: tl.constexpr,
    MOD1: tl.constexpr,
    MOD2: tl.constexpr,
    MOD3: tl.constexpr,
    SCORE_FN: tl.constexpr,
):  # fmt: skip
    """The PARTIAL tiles ``TileList[full_count:count]`` in a masked loop, then the FULL tiles
    ``TileList[0:full_count]`` in an unmasked one.
    HAS_FIRST: ``kt_partial`` / ``kt_full`` are the first entries of the two ranges. The FULL
    loop's tiles are clamped to the complete kv-tiles (``clamp_counts`` runs no FULL loop
    when there is none)."""
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, K_tile, V_tile, K_desc, V_desc, off_b, off_hkv,
        stride_kn, stride_kd, stride_vn, stride_vd,
        TileList, Kind, Jlo, Jhi, BitsIndex, Bits, stride_bits_p, stride_bits_r,
        RowLo, RowHi, row_base, offs_m, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3,
        Nq, Nk, n_slots, full_count, count, Tk - 1, n_bits, qk_scale,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, True, DOT_PRECISION, MAX_SPAN, HAS_BITS,
        SLOTS, USE_TMA, kt_partial, HAS_FIRST, ONE_PER_TILE,
        HEAD_DIM_V=HEAD_DIM_V, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, off_h=off_h, sm_scale=sm_scale,
        ModF=ModF, ModI=ModI, ModMeta=ModMeta, MOD0=MOD0, MOD1=MOD1, MOD2=MOD2, MOD3=MOD3,
        SCORE_FN=SCORE_FN,
    )  # fmt: skip
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, K_tile, V_tile, K_desc, V_desc, off_b, off_hkv,
        stride_kn, stride_kd, stride_vn, stride_vd,
        TileList, Kind, Jlo, Jhi, BitsIndex, Bits, stride_bits_p, stride_bits_r,
        RowLo, RowHi, row_base, offs_m, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3,
        Nq, Nk, n_slots, 0, full_count, tl.minimum(Tk, Nk // BLOCK_N) - 1, n_bits, qk_scale,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, False, DOT_PRECISION, MAX_SPAN, HAS_BITS,
        SLOTS, USE_TMA, kt_full, HAS_FIRST,
        HEAD_DIM_V=HEAD_DIM_V, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, off_h=off_h, sm_scale=sm_scale,
        ModF=ModF, ModI=ModI, ModMeta=ModMeta, MOD0=MOD0, MOD1=MOD1, MOD2=MOD2, MOD3=MOD3,
        SCORE_FN=SCORE_FN,
    )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, Out, Lse, K_desc, V_desc,
    RowLo, RowHi, Kind, Jlo, Jhi, BitsIndex, Bits, QCount, QFullCount, QList, QOrder, QWork,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_bits_p, stride_bits_r,
    Hq, gqa_group, Nq, Nk, n_slots, Tq, Tk, n_bits, mask_stride_b, mask_stride_h,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MAX_SPAN: tl.constexpr,
    HAS_BITS: tl.constexpr,
    SLOTS: tl.constexpr,
    GRID_ORDER: tl.constexpr,
    USE_TMA: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    ONE_PER_TILE: tl.constexpr = False,
    HEAD_DIM_V: tl.constexpr = 0,
    HEAD_DIM_V_PAD: tl.constexpr = 0,
    sm_scale=1.0,
    ModF=None,
    ModI=None,
    ModMeta=None,
    MOD0: tl.constexpr = 0,
    MOD1: tl.constexpr = 0,
    MOD2: tl.constexpr = 0,
    MOD3: tl.constexpr = 0,
    SCORE_FN: tl.constexpr = None,
    Sinks=None,
    HAS_SINKS: tl.constexpr = False,
):  # fmt: skip
    pid_bh, rank = grid_position(GRID_ORDER)
    # PREFETCH (launch orders 0 and 3 only): the q-tile, its counts and the first tile of each
    # loop come from one 32-byte work entry (schedule.work_list), not a chain of dependent loads
    off_b, off_h, off_hkv, mask_id, qt, tile_row, count, full_count, kt_full, kt_partial = (
        q_tile_work(
            pid_bh, rank, Hq, gqa_group, mask_stride_b, mask_stride_h, QOrder, QWork, QCount,
            QFullCount, Tq, GRID_ORDER, PREFETCH,
        )
    )  # fmt: skip
    count, full_count = clamp_counts(count, full_count, Tk, tl.minimum(Tk, Nk // BLOCK_N))
    tile_list = QList + tile_row * Tk
    kind_row = tile_row * Tk  # offset of kind / jlo / jhi / bits_index rows
    row_base = mask_id * Nq * n_slots

    start_m = qt * BLOCK_M
    offs_m_local = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_m_local
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_ok = offs_m < Nq
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    dv_ok = offs_dv < HEAD_DIM_V

    q_ptrs = (
        Q
        + off_b.to(tl.int64) * stride_qb
        + off_h.to(tl.int64) * stride_qh
        + start_m.to(tl.int64) * stride_qm
        + offs_m_local[:, None] * stride_qm
        + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    K_tile = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    V_tile = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], dtype=tl.float32)
    # the rows' intervals, loaded once when there are few slots (SLOTS > 0)
    row_ptr = row_base + offs_m.to(tl.int64) * n_slots
    lo0, hi0 = preload_row_slot(RowLo, RowHi, row_ptr, m_ok, Nk, 0, SLOTS)
    lo1, hi1 = preload_row_slot(RowLo, RowHi, row_ptr, m_ok, Nk, 1, SLOTS)
    lo2, hi2 = preload_row_slot(RowLo, RowHi, row_ptr, m_ok, Nk, 2, SLOTS)
    lo3, hi3 = preload_row_slot(RowLo, RowHi, row_ptr, m_ok, Nk, 3, SLOTS)

    acc, l_i, m_i = _attn_fwd_two_loops(
        acc, l_i, m_i, q, K_tile, V_tile, K_desc, V_desc, off_b, off_hkv,
        stride_kn, stride_kd, stride_vn, stride_vd,
        tile_list, Kind + kind_row, Jlo + kind_row, Jhi + kind_row, BitsIndex + kind_row,
        Bits, stride_bits_p, stride_bits_r, RowLo, RowHi, row_base, offs_m,
        lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, Nq, Nk, n_slots, full_count, count, qk_scale,
        kt_full, kt_partial, Tk, n_bits,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, DOT_PRECISION, MAX_SPAN, HAS_BITS, SLOTS,
        USE_TMA, PREFETCH, ONE_PER_TILE, HEAD_DIM_V, HEAD_DIM_V_PAD, off_h, sm_scale,
        ModF, ModI, ModMeta, MOD0, MOD1, MOD2, MOD3, SCORE_FN,
    )  # fmt: skip
    if HAS_SINKS:
        m_i, l_i, acc = add_sink(m_i, l_i, acc, Sinks, off_h)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_ptrs = (
        Out
        + off_b.to(tl.int64) * stride_ob
        + off_h.to(tl.int64) * stride_oh
        + start_m.to(tl.int64) * stride_om
        + offs_m_local[:, None] * stride_om
        + offs_dv[None, :] * stride_od
    )
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])
    lse_ptrs = Lse + pid_bh.to(tl.int64) * Nq + offs_m
    tl.store(lse_ptrs, lse, mask=m_ok)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    row_lo: torch.Tensor,
    row_hi: torch.Tensor,
    schedule: dict[str, torch.Tensor],
    *,
    scale: float,
    mask_stride_b: int,
    mask_stride_h: int,
    cfg: FwdConfig,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    mods=None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel (internal: inputs are assumed validated).

    Args:
        q: [B, Hq, Nq, D]; k: [B, Hkv, Nk, D]; v: [B, Hkv, Nk, Dv]; any strides; fp16, bf16
            or fp32.
        row_lo, row_hi: int32 [M, Nq, n_slots] contiguous, the plan's row intervals.
        schedule: from :func:`forward_schedule` for ``cfg``'s tiling.
        scale: softmax scale.
        mask_stride_b, mask_stride_h: mask index m = b * mask_stride_b + h * mask_stride_h.
        cfg: tile sizes and launch options.
        out: optional [B, Hq, Nq, Dv] buffer of q's dtype (written in full).
        lse: optional float32 [B, Hq, Nq] contiguous buffer (written in full).
        mods: a ``score_mods.Packed`` score modifier, or None.
        sinks: float32 [Hq] contiguous sink logits, or None.

    Returns:
        (out, lse): out [B, Hq, Nq, Dv] in q's dtype; lse float32 [B, Hq, Nq], natural log
        (including the sink).
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    check_head_dim(D)
    check_head_dim(Dv)
    if out is None:
        out = torch.empty((B, Hq, Nq, Dv), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    if not lse.is_contiguous():
        raise ValueError("lse buffer must be contiguous")
    n_slots = row_lo.shape[-1]
    kind = schedule["kind"]
    Tq, Tk = kind.shape[1], kind.shape[2]
    if B * Hq * Nq == 0:
        return out, lse
    bits = schedule["bits"]
    span, slots, has_bits = mask_constants(kind, schedule["jlo"], schedule["jhi"], n_slots)
    check_bits(bits, has_bits, cfg.block_m, cfg.block_n)
    order = launch_order(cfg.grid_order, B * Hq)
    d_pad, dv_pad = padded_head_dim(D), padded_head_dim(Dv)
    descs = tma_descriptors(k, v, cfg.block_n, d_pad, dv_pad) if cfg.tma else None
    sm_scale, qk_scale = natural_scale_args(scale, mods)
    kinds = mods.kinds if mods is not None else (0, 0, 0, 0)
    one_per_tile = (
        bool(cfg.one_slot) and slots > 1 and one_interval_per_tile(row_lo, row_hi, cfg.block_n)
    )
    _attn_fwd[launch_grid(order, B * Hq, Tq)](
        q, k, v, out, lse, *(descs or (k, v)),
        row_lo, row_hi, kind, schedule["jlo"], schedule["jhi"], schedule["bits_index"], bits,
        schedule["q_count"], schedule["q_full_count"], schedule["q_list"], schedule["q_order"],
        schedule["q_work"], *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        bits.stride(0), bits.stride(1),
        Hq, Hq // Hkv, Nq, Nk, n_slots, Tq, Tk, bits.shape[0], mask_stride_b, mask_stride_h,
        qk_scale,
        HEAD_DIM=D,
        HEAD_DIM_PAD=d_pad,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        # fp32: three TF32 MMAs per dot (about fp32 accuracy). "ieee" would take Triton's FMA
        # dot path, which fails to compile this kernel on sm_90 with triton 3.6.
        DOT_PRECISION="tf32x3" if q.dtype == torch.float32 else "tf32",
        MAX_SPAN=span,
        HAS_BITS=has_bits,
        SLOTS=slots,
        GRID_ORDER=order,
        USE_TMA=descs is not None,
        PREFETCH=bool(cfg.prefetch) and order in (0, 3),
        ONE_PER_TILE=one_per_tile,
        HEAD_DIM_V=Dv,
        HEAD_DIM_V_PAD=dv_pad,
        sm_scale=sm_scale,
        ModF=mods.f if mods is not None else None,
        ModI=mods.i if mods is not None else None,
        ModMeta=mods.meta if mods is not None else None,
        MOD0=kinds[0], MOD1=kinds[1], MOD2=kinds[2], MOD3=kinds[3],
        SCORE_FN=mods.score_fn if mods is not None else None,
        Sinks=sinks,
        HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, lse


def tma_descriptors(
    k: torch.Tensor, v: torch.Tensor, block_n: int, d_pad: int, dv_pad: int | None = None
) -> tuple[object, object] | None:
    """Host TMA descriptors of ``k`` and ``v`` ([B, H, N, D] and [B, H, N, Dv]) with
    [1, 1, block_n, d_pad] and [1, 1, block_n, dv_pad] blocks (``dv_pad`` default d_pad), or
    None where TMA cannot take them: not 16-bit, a pad > 128, an empty dimension,
    a last stride other than 1, a zero stride (``expand``) on a dimension longer than 1, or a
    base or stride that is not 16-byte aligned (the kernel then loads through pointers)."""
    dv_pad = d_pad if dv_pad is None else dv_pad
    if k.dtype not in (torch.float16, torch.bfloat16) or max(d_pad, dv_pad) > 128:
        return None
    strides = []
    for t in (k, v):
        if min(t.shape) == 0 or t.stride(-1) != 1 or t.data_ptr() % 16:
            return None
        # a dimension of size 1 is never stepped: any valid stride will do (views may carry 0)
        st = [t.stride(i) if t.shape[i] > 1 else t.shape[-1] * 8 for i in range(t.dim() - 1)]
        if any(s <= 0 or s * t.element_size() % 16 for s in st):  # e.g. expand()ed: stride 0
            return None
        strides.append([*st, 1])
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(
        TensorDescriptor(t, list(t.shape), st, [1, 1, block_n, pad])
        for t, st, pad in zip((k, v), strides, (d_pad, dv_pad))
    )


def default_scale(head_dim: int) -> float:
    """1 / sqrt(head_dim)."""
    return 1.0 / math.sqrt(head_dim)
