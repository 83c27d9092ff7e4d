"""Triton backward attention over a :class:`MaskPlan` (FlashAttention-2 style, deterministic).

Three kernels, each output element written by exactly one program (no atomics, so two runs are
bit-identical):

1. ``_attn_bwd_preprocess``, grid (cdiv(Nq, BLOCK), B * Hq): per query row
   ``delta = rowsum(dO * O) - dlse`` and ``lse2 = lse * log2(e)`` (+inf for rows that see no
   key, so that ``exp2(s - lse2) = 0`` there: no ``-inf - -inf`` NaN), both fp32 [B, Hq, Nq].
2. ``_attn_bwd_dkdv``, one program per (batch row, kv head, kv-tile), launched in the order
   ``BwdConfig.dkdv_order`` (``common.grid_position``; default: the kv-tiles of one head side
   by side, in natural order). The program keeps K, V of its BLOCK_N keys and fp32 dK, dV
   accumulators on chip and, for every query head h of its GQA group, walks the kv-tile's
   q-tile list ``kv_list[m(b, h), kt]`` (stored FULL first): the PARTIAL q-tiles first,
   masked with the same tile data as the forward, read transposed ([keys, queries],
   ``common.*_t``), then the FULL ones in an unmasked loop. It recomputes
   ``P^T = exp2(K Q^T * scale * log2 e - lse2)`` and accumulates ``dV += P^T dO`` and
   ``dK += dS^T Q`` with ``dS = P * (dO V^T - delta)``; it writes dK, dV once (zero for keys
   nobody sees).
3. ``_attn_bwd_dq``, one program per (batch row, query head, q-tile) in
   ``BwdConfig.dq_order``: keeps Q, dO, dQ of its q-tile and walks ``q_list`` (PARTIAL
   tiles, then FULL): ``dQ += dS K``; writes dQ once (zero for rows that see nothing).

Both walk their lists loading the next tile index one iteration ahead (see the forward);
``BwdConfig.tma`` loads the streamed tiles through TMA tensor descriptors.

The two kernels use their own tilings (``BwdConfig``): dK/dV streams small query tiles past a
large key tile, dQ the opposite. Gradient of the LSE output: ``d lse_i / d s_ij = P_ij``, so
``dS = P * (dP - delta + dlse)``, i.e. dlse is folded into delta by the preprocess kernel.

Legend: B batch, Hq / Hkv query / key-value heads (G = Hq / Hkv), Nq / Nk query / key length,
D head_dim, M = number of masks in the plan, Tq / Tk = number of q- / kv-tiles.

Source: Dao, "FlashAttention-2" (2023), section 3.1.2 (backward pass); structure of Triton's
fused-attention tutorial (preprocess, dK/dV, dQ kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backward_parts import _PRE_BLOCK, _attn_bwd_dq_ds, _attn_bwd_preprocess
from .common import (
    check_bits,
    clamp,
    clamp_counts,
    grid_position,
    launch_grid,
    launch_order,
    mask_constants,
    partial_tile_mask,
    partial_tile_mask_t,
    preload_row_slot,
    q_tile_program,
    slot_range,
    slots_mask,
    tile_of_rank,
)
from .configs import BwdConfig, check_head_dim, padded_head_dim
from .forward import tma_descriptors
from .score_mods import apply_mods_bwd, exp2_scale, mod_grads, softcap_alone, store_table_grad

_LOG2E = 1.4426950408889634


@triton.jit
def _mask_p_t(
    pT, tile, Kind, Jlo, Jhi, BitsIndex, Bits, stride_bits_p, stride_bits_r, RowLo, RowHi,
    row_base, offs_m, offs_n, Nq, Nk, n_slots, n_bits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPAN: tl.constexpr,
    HAS_BITS: tl.constexpr,
    SLOTS: tl.constexpr,
):  # fmt: skip
    """``pT`` ([BLOCK_N, BLOCK_M]) with 0 where the PARTIAL tile at offset ``tile`` of the
    tile arrays hides a pair (transposed interval or bitmask masking; the bitmask index
    clamped to [0, n_bits))."""
    kind = 0
    if HAS_BITS:
        kind = tl.load(Kind + tile)
    jlo = 0
    jhi = 0
    if SLOTS == 0:
        jlo, jhi = slot_range(Jlo, Jhi, tile, n_slots)
    visible = partial_tile_mask_t(
        kind, RowLo, RowHi, row_base, offs_m, offs_n, Nq, Nk, n_slots, jlo, jhi, Bits,
        clamp(tl.load(BitsIndex + tile), n_bits - 1), stride_bits_p, stride_bits_r,
        BLOCK_M, BLOCK_N, MAX_SPAN, HAS_BITS, SLOTS,
    )  # fmt: skip
    return tl.where(visible, pT, 0.0)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, Q_desc, DO_desc, off_b, off_h, Q_head, DO_head, Lse2_head, Delta_head,
    stride_qm, stride_qd, stride_dom, stride_dod, TileList, Kind, Jlo, Jhi, BitsIndex, Bits,
    stride_bits_p, stride_bits_r, tile_stride, RowLo, RowHi, row_base, offs_n, Nq, Nk, n_slots,
    list_start, list_end, qt_max, n_bits, qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LOAD_T: tl.constexpr,
    MAX_SPAN: tl.constexpr,
    HAS_BITS: tl.constexpr,
    SLOTS: tl.constexpr,
    USE_TMA: tl.constexpr,
    DS_head=None,
    SlotCol=None,
    STORE_DS: tl.constexpr = False,
    DS_desc=None,
    ds_row0=0,
    DS_TMA: tl.constexpr = False,
    ds_tiles=1,
    tbl=0.0,
    Hq=1,
    NB_PAD: tl.constexpr = 16,
    scale=1.0,
    HEAD_DIM_V: tl.constexpr = 0,
    HEAD_DIM_V_PAD: tl.constexpr = 0,
    ModF=None,
    ModI=None,
    ModMeta=None,
    ModG=None,
    MOD0: tl.constexpr = 0,
    MOD1: tl.constexpr = 0,
    MOD2: tl.constexpr = 0,
    MOD3: tl.constexpr = 0,
    SCORE_FN: tl.constexpr = None,
    SCORE_DFN: tl.constexpr = None,
):  # fmt: skip
    """Accumulate dK, dV of one kv-tile over the q-tiles ``TileList[list_start:list_end]``.

    ``Kind`` etc. point at this kv-tile's column of the [Tq, Tk] tile arrays (entry of q-tile qt
    at ``qt * tile_stride``). MASKED=False: FULL tiles (no mask, no row bounds checks).
    USE_TMA: Q and dO tiles through the descriptors ``Q_desc, DO_desc`` (rows past Nq read as
    zeros), not per-thread pointers. STORE_DS:
    also store ``dS^T`` (keys x queries, the inputs' dtype) of every tile into the dS buffer
    ``DS_head`` at the tile's slot ``SlotCol[qt * tile_stride]`` (``BwdConfig.ds_dq``);
    DS_TMA: through the 2-D descriptor ``DS_desc`` (rows ``(ds_row0 + slot) * BLOCK_N``), an
    asynchronous bulk store from shared memory (``BwdConfig.ds_tma``). MOD0..MOD3 != 0: the
    score modifier's chain (``score_mods``), its learnable gradients into ``ModG`` and the
    relative-bias bucket sums into ``tbl`` (returned with dK, dV).
    """
    offs_m_local = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    dv_ok = offs_dv < HEAD_DIM_V
    # next tile index one iteration ahead, with a plain load (see forward._attn_fwd_inner)
    # (q-tiles clamped to [0, qt_max]: the FULL loop's loads are not bounds-checked)
    qt_next = clamp(tl.load(TileList + list_start, mask=list_start < list_end, other=0), qt_max)
    for i in range(list_start, list_end):
        qt = qt_next
        qt_next = clamp(tl.load(TileList + i + 1, mask=i + 1 < list_end, other=0), qt_max)
        start_m = qt * BLOCK_M
        offs_m = start_m + offs_m_local
        qT_ptrs = (
            Q_head
            + start_m.to(tl.int64) * stride_qm
            + offs_m_local[None, :] * stride_qm
            + offs_d[:, None] * stride_qd
        )
        do_ptrs = (
            DO_head
            + start_m.to(tl.int64) * stride_dom
            + offs_m_local[:, None] * stride_dom
            + offs_dv[None, :] * stride_dod
        )
        if MASKED:
            m_ok = offs_m < Nq
        if USE_TMA:
            qT = tl.trans(Q_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM_PAD))
            if MASKED:
                lse2 = tl.load(Lse2_head + offs_m, mask=m_ok, other=float("inf"))
            else:
                lse2 = tl.load(Lse2_head + offs_m)
        elif MASKED:
            qT = tl.load(qT_ptrs, mask=m_ok[None, :] & d_ok[:, None], other=0.0)
            lse2 = tl.load(Lse2_head + offs_m, mask=m_ok, other=float("inf"))
        elif HEAD_DIM == HEAD_DIM_PAD:
            qT = tl.load(qT_ptrs)
            lse2 = tl.load(Lse2_head + offs_m)
        else:
            qT = tl.load(qT_ptrs, mask=d_ok[:, None], other=0.0)
            lse2 = tl.load(Lse2_head + offs_m)
        qkT = tl.dot(k, qT, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        # a lone fast softcap: t = tanh(s / cap), exponent t * cap * log2 e
        if MOD0 == 6 and MOD1 == 0:
            qkT = softcap_alone(qkT, scale, ModF, ModMeta)
            dmodT = 1.0 - qkT * qkT
            g0 = 1.0
            g1 = 1.0
            g2 = 1.0
            g3 = 1.0
        elif MOD0 != 0:
            qkT, dmodT, g0, g1, g2, g3 = apply_mods_bwd(
                qkT * scale, off_b, off_h, offs_m[None, :], offs_n[:, None], Nq, Nk, ModF, ModI,
                ModMeta, MOD0, MOD1, MOD2, MOD3, SCORE_FN, SCORE_DFN,
            )  # fmt: skip
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        if MASKED:
            pT = _mask_p_t(
                pT, qt * tile_stride, Kind, Jlo, Jhi, BitsIndex, Bits, stride_bits_p,
                stride_bits_r, RowLo, RowHi, row_base, offs_m, offs_n, Nq, Nk, n_slots, n_bits,
                BLOCK_M, BLOCK_N, MAX_SPAN, HAS_BITS, SLOTS,
            )  # fmt: skip
        if USE_TMA:
            do = DO_desc.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM_V_PAD)
            if MASKED:
                delta = tl.load(Delta_head + offs_m, mask=m_ok, other=0.0)
            else:
                delta = tl.load(Delta_head + offs_m)
        elif MASKED:
            do = tl.load(do_ptrs, mask=m_ok[:, None] & dv_ok[None, :], other=0.0)
            delta = tl.load(Delta_head + offs_m, mask=m_ok, other=0.0)
        elif HEAD_DIM_V == HEAD_DIM_V_PAD:
            do = tl.load(do_ptrs)
            delta = tl.load(Delta_head + offs_m)
        else:
            do = tl.load(do_ptrs, mask=dv_ok[None, :], other=0.0)
            delta = tl.load(Delta_head + offs_m)
        if LOAD_T:  # fp32: a second load instead of a register transpose
            doT_ptrs = (
                DO_head
                + start_m.to(tl.int64) * stride_dom
                + offs_m_local[None, :] * stride_dom
                + offs_dv[:, None] * stride_dod
            )
            q_ptrs = (
                Q_head
                + start_m.to(tl.int64) * stride_qm
                + offs_m_local[:, None] * stride_qm
                + offs_d[None, :] * stride_qd
            )
            if MASKED:
                doT = tl.load(doT_ptrs, mask=m_ok[None, :] & dv_ok[:, None], other=0.0)
                q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            else:
                doT = tl.load(doT_ptrs, mask=dv_ok[:, None], other=0.0)
                q = tl.load(q_ptrs, mask=d_ok[None, :], other=0.0)
        else:
            doT = tl.trans(do)
            q = tl.trans(qT)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dpT = tl.dot(v, doT, input_precision=DOT_PRECISION)  # [BLOCK_N, BLOCK_M]
        dsT = pT * (dpT - delta[None, :])
        if MOD0 != 0:
            tbl = mod_grads(
                tbl, dsT, g0, g1, g2, g3, off_b, off_h, offs_m[None, :], offs_n[:, None], Hq, Nq,
                Nk, ModI, ModMeta, ModG, MOD0, MOD1, MOD2, MOD3, NB_PAD,
            )  # fmt: skip
            dsT = dsT * dmodT
        dsT = dsT.to(q.dtype)
        dk = tl.dot(dsT, q, dk, input_precision=DOT_PRECISION)
        if STORE_DS:
            slot = clamp(tl.load(SlotCol + qt * tile_stride), ds_tiles - 1)
            if DS_TMA:
                DS_desc.store([(ds_row0 + slot) * BLOCK_N, 0], dsT)
            else:
                ds_ptrs = (
                    DS_head
                    + slot.to(tl.int64) * (BLOCK_N * BLOCK_M)
                    + tl.arange(0, BLOCK_N)[:, None] * BLOCK_M
                    + offs_m_local[None, :]
                )
                tl.store(ds_ptrs, dsT)
    return dk, dv, tbl


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, Lse2, Delta, DK, DV,
    RowLo, RowHi, Kind, Jlo, Jhi, BitsIndex, Bits, KvCount, KvFullCount, KvList, KvOrder,
    stride_qb, stride_qh, stride_qm: tl.constexpr, stride_qd: tl.constexpr,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom: tl.constexpr, stride_dod: tl.constexpr,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    stride_bits_p, stride_bits_r,
    Hq, Hkv, gqa_group, Nq, Nk, n_slots, Tq, Tk, n_bits, mask_stride_b, mask_stride_h,
    scale, qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LOAD_T: tl.constexpr,
    MAX_SPAN: tl.constexpr,
    HAS_BITS: tl.constexpr,
    SLOTS: tl.constexpr,
    GRID_ORDER: tl.constexpr,
    Q_desc=None,
    DO_desc=None,
    USE_TMA: tl.constexpr = False,
    DS=None,
    Slot=None,
    ds_tiles=0,
    STORE_DS: tl.constexpr = False,
    DS_desc=None,
    DS_TMA: tl.constexpr = False,
    TABLE_STAGE: tl.constexpr = -1,
    NB_PAD: tl.constexpr = 16,
    HEAD_DIM_V: tl.constexpr = 0,
    HEAD_DIM_V_PAD: tl.constexpr = 0,
    ModF=None,
    ModI=None,
    ModMeta=None,
    ModG=None,
    MOD0: tl.constexpr = 0,
    MOD1: tl.constexpr = 0,
    MOD2: tl.constexpr = 0,
    MOD3: tl.constexpr = 0,
    SCORE_FN: tl.constexpr = None,
    SCORE_DFN: tl.constexpr = None,
):  # fmt: skip
    """dK, dV of one kv-tile (see the module docstring)."""
    pid_bh, rank = grid_position(GRID_ORDER)
    off_b = pid_bh // Hkv
    off_hkv = pid_bh % Hkv
    h_first = off_hkv * gqa_group
    first_mask = (off_b * mask_stride_b + h_first * mask_stride_h).to(tl.int64)
    # the group's first head orders the tiles
    kt = tile_of_rank(KvOrder + first_mask * Tk, rank, Tk, GRID_ORDER)

    start_n = kt * BLOCK_N
    offs_n_local = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_n_local
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    n_ok = offs_n < Nk
    nd_ok = n_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    ndv_ok = n_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    k = tl.load(
        K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
        + start_n.to(tl.int64) * stride_kn
        + offs_n_local[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=nd_ok, other=0.0,
    )  # fmt: skip
    v = tl.load(
        V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh
        + start_n.to(tl.int64) * stride_vn
        + offs_n_local[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
        mask=ndv_ok, other=0.0,
    )  # fmt: skip
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_V_PAD], dtype=tl.float32)

    for g in range(0, gqa_group):
        off_h = h_first + g
        bh = off_b.to(tl.int64) * Hq + off_h
        mask_id = (off_b * mask_stride_b + off_h * mask_stride_h).to(tl.int64)
        col = mask_id * Tk + kt  # row of the [M, Tk, ...] per-kv-tile arrays
        count, full_count = clamp_counts(
            tl.load(KvCount + col), tl.load(KvFullCount + col), Tq, tl.minimum(Tq, Nq // BLOCK_M)
        )
        tile_list = KvList + col * Tq
        tile_col = mask_id * Tq * Tk + kt  # (qt=0, kt) in the [M, Tq, Tk] tile arrays
        row_base = mask_id * Nq * n_slots
        Q_head = Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        DO_head = DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        DS_head = DS
        SlotCol = Slot
        ds_row0 = 0
        if STORE_DS:
            DS_head = DS + bh * ds_tiles * (BLOCK_N * BLOCK_M)
            SlotCol = Slot + tile_col
            ds_row0 = (bh * ds_tiles).to(tl.int32)
        tbl = 0.0
        if TABLE_STAGE >= 0:
            tbl = tl.zeros([NB_PAD], dtype=tl.float32)
        # PARTIAL q-tiles: interval or bitmask masking, transposed.
        dk, dv, tbl = _attn_bwd_dkdv_inner(
            dk, dv, k, v, Q_desc, DO_desc, off_b, off_h, Q_head, DO_head,
            Lse2 + bh * Nq, Delta + bh * Nq,
            stride_qm, stride_qd, stride_dom, stride_dod,
            tile_list, Kind + tile_col, Jlo + tile_col, Jhi + tile_col, BitsIndex + tile_col,
            Bits, stride_bits_p, stride_bits_r, Tk,
            RowLo, RowHi, row_base, offs_n, Nq, Nk, n_slots, full_count, count, Tq - 1, n_bits,
            qk_scale,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, True, DOT_PRECISION, LOAD_T, MAX_SPAN,
            HAS_BITS, SLOTS, USE_TMA, DS_head, SlotCol,
            STORE_DS, DS_desc, ds_row0, DS_TMA, ds_tiles, tbl, Hq, NB_PAD, scale,
            HEAD_DIM_V=HEAD_DIM_V, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, ModF=ModF, ModI=ModI,
            ModMeta=ModMeta, ModG=ModG, MOD0=MOD0, MOD1=MOD1, MOD2=MOD2, MOD3=MOD3,
            SCORE_FN=SCORE_FN, SCORE_DFN=SCORE_DFN,
        )  # fmt: skip
        # FULL q-tiles: no mask, no bounds checks.
        dk, dv, tbl = _attn_bwd_dkdv_inner(
            dk, dv, k, v, Q_desc, DO_desc, off_b, off_h, Q_head, DO_head,
            Lse2 + bh * Nq, Delta + bh * Nq,
            stride_qm, stride_qd, stride_dom, stride_dod,
            tile_list, Kind + tile_col, Jlo + tile_col, Jhi + tile_col, BitsIndex + tile_col,
            Bits, stride_bits_p, stride_bits_r, Tk,
            RowLo, RowHi, row_base, offs_n, Nq, Nk, n_slots, 0, full_count,
            tl.minimum(Tq, Nq // BLOCK_M) - 1, n_bits, qk_scale,
            HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, False, DOT_PRECISION, LOAD_T, MAX_SPAN,
            HAS_BITS, SLOTS, USE_TMA, DS_head, SlotCol,
            STORE_DS, DS_desc, ds_row0, DS_TMA, ds_tiles, tbl, Hq, NB_PAD, scale,
            HEAD_DIM_V=HEAD_DIM_V, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, ModF=ModF, ModI=ModI,
            ModMeta=ModMeta, ModG=ModG, MOD0=MOD0, MOD1=MOD1, MOD2=MOD2, MOD3=MOD3,
            SCORE_FN=SCORE_FN, SCORE_DFN=SCORE_DFN,
        )  # fmt: skip

        if TABLE_STAGE >= 0:
            store_table_grad(tbl, off_b, off_h, kt, Hq, Tk, ModMeta, ModG, TABLE_STAGE, NB_PAD)

    dk = dk * scale
    tl.store(
        DK + off_b.to(tl.int64) * stride_dkb + off_hkv.to(tl.int64) * stride_dkh
        + start_n.to(tl.int64) * stride_dkn
        + offs_n_local[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
        dk.to(DK.dtype.element_ty), mask=nd_ok,
    )  # fmt: skip
    tl.store(
        DV + off_b.to(tl.int64) * stride_dvb + off_hkv.to(tl.int64) * stride_dvh
        + start_n.to(tl.int64) * stride_dvn
        + offs_n_local[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd,
        dv.to(DV.dtype.element_ty), mask=ndv_ok,
    )  # fmt: skip


@triton.jit
def _attn_bwd_dq_inner(
    dq, q, do, lse2, delta, K_desc, V_desc, off_b, off_hkv, K_head, V_head, stride_kn,
    stride_kd, stride_vn, stride_vd, TileList, Kind, Jlo, Jhi, BitsIndex, Bits, stride_bits_p,
    stride_bits_r, RowLo, RowHi, row_base, offs_m, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, Nq,
    Nk, n_slots, list_start, list_end, kt_max, n_bits, qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LOAD_T: tl.constexpr,
    MAX_SPAN: tl.constexpr,
    HAS_BITS: tl.constexpr,
    SLOTS: tl.constexpr,
    USE_TMA: tl.constexpr,
    off_h=0,
    scale=1.0,
    HEAD_DIM_V: tl.constexpr = 0,
    HEAD_DIM_V_PAD: tl.constexpr = 0,
    ModF=None,
    ModI=None,
    ModMeta=None,
    ModG=None,
    MOD0: tl.constexpr = 0,
    MOD1: tl.constexpr = 0,
    MOD2: tl.constexpr = 0,
    MOD3: tl.constexpr = 0,
    SCORE_FN: tl.constexpr = None,
    SCORE_DFN: tl.constexpr = None,
):  # fmt: skip
    """Accumulate dQ of one q-tile over the kv-tiles ``TileList[list_start:list_end]``
    (masks as in the forward: preloaded slots when SLOTS > 0; USE_TMA: K and V tiles through
    the descriptors ``K_desc, V_desc``, rows past Nk read as zeros; MOD0..MOD3: the score
    modifier's chain rule)."""
    offs_n_local = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    dv_ok = offs_dv < HEAD_DIM_V
    # next tile index one iteration ahead, with a plain load (see forward._attn_fwd_inner)
    # (kv-tiles clamped to [0, kt_max]: the FULL loop's loads are not bounds-checked)
    kt_next = clamp(tl.load(TileList + list_start, mask=list_start < list_end, other=0), kt_max)
    for i in range(list_start, list_end):
        kt = kt_next
        kt_next = clamp(tl.load(TileList + i + 1, mask=i + 1 < list_end, other=0), kt_max)
        start_n = kt * BLOCK_N
        offs_n = start_n + offs_n_local
        kT_ptrs = (
            K_head
            + start_n.to(tl.int64) * stride_kn
            + offs_n_local[None, :] * stride_kn
            + offs_d[:, None] * stride_kd
        )
        vT_ptrs = (
            V_head
            + start_n.to(tl.int64) * stride_vn
            + offs_n_local[None, :] * stride_vn
            + offs_dv[:, None] * stride_vd
        )
        if MASKED:
            n_ok = offs_n < Nk
        if USE_TMA:
            k_tile = K_desc.load([off_b, off_hkv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM_PAD)
            kT = tl.trans(k_tile)
            vT = tl.trans(
                V_desc.load([off_b, off_hkv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM_V_PAD)
            )
        elif MASKED:
            kT = tl.load(kT_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            vT = tl.load(vT_ptrs, mask=n_ok[None, :] & dv_ok[:, None], other=0.0)
        elif HEAD_DIM == HEAD_DIM_PAD and HEAD_DIM_V == HEAD_DIM_V_PAD:
            kT = tl.load(kT_ptrs)
            vT = tl.load(vT_ptrs)
        else:
            kT = tl.load(kT_ptrs, mask=d_ok[:, None], other=0.0)
            vT = tl.load(vT_ptrs, mask=dv_ok[:, None], other=0.0)
        qk = tl.dot(q, kT, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        # a lone fast softcap: t = tanh(s / cap), exponent t * cap * log2 e
        if MOD0 == 6 and MOD1 == 0:
            qk = softcap_alone(qk, scale, ModF, ModMeta)
            dmod = 1.0 - qk * qk
        elif MOD0 != 0:
            qk, dmod, _g0, _g1, _g2, _g3 = apply_mods_bwd(
                qk * scale, off_b, off_h, offs_m[:, None], offs_n[None, :], Nq, Nk, ModF, ModI,
                ModMeta, MOD0, MOD1, MOD2, MOD3, SCORE_FN, SCORE_DFN,
            )  # fmt: skip
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            if SLOTS > 0:
                visible = slots_mask(offs_n, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, SLOTS)
            else:
                kind = 0
                if HAS_BITS:
                    kind = tl.load(Kind + kt)
                jlo, jhi = slot_range(Jlo, Jhi, kt, n_slots)
                visible = partial_tile_mask(
                    kind, RowLo, RowHi, row_base, offs_m, offs_n, Nq, Nk, n_slots, jlo, jhi,
                    Bits, clamp(tl.load(BitsIndex + kt), n_bits - 1),
                    stride_bits_p, stride_bits_r, BLOCK_M, BLOCK_N, MAX_SPAN, HAS_BITS,
                )  # fmt: skip
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do, vT, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if MOD0 != 0:
            ds = ds * dmod
        if LOAD_T:  # fp32: a second load instead of a register transpose
            k_ptrs = (
                K_head
                + start_n.to(tl.int64) * stride_kn
                + offs_n_local[:, None] * stride_kn
                + offs_d[None, :] * stride_kd
            )
            if MASKED:
                k = tl.load(k_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            else:
                k = tl.load(k_ptrs, mask=d_ok[None, :], other=0.0)
        elif USE_TMA:
            k = k_tile
        else:
            k = tl.trans(kT)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, Lse2, Delta, DQ,
    RowLo, RowHi, Kind, Jlo, Jhi, BitsIndex, Bits, QCount, QFullCount, QList, QOrder,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_bits_p, stride_bits_r,
    Hq, gqa_group, Nq, Nk, n_slots, Tq, Tk, n_bits, mask_stride_b, mask_stride_h,
    scale, qk_scale,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    LOAD_T: tl.constexpr,
    MAX_SPAN: tl.constexpr,
    HAS_BITS: tl.constexpr,
    SLOTS: tl.constexpr,
    GRID_ORDER: tl.constexpr,
    K_desc=None,
    V_desc=None,
    USE_TMA: tl.constexpr = False,
    HEAD_DIM_V: tl.constexpr = 0,
    HEAD_DIM_V_PAD: tl.constexpr = 0,
    ModF=None,
    ModI=None,
    ModMeta=None,
    ModG=None,
    MOD0: tl.constexpr = 0,
    MOD1: tl.constexpr = 0,
    MOD2: tl.constexpr = 0,
    MOD3: tl.constexpr = 0,
    SCORE_FN: tl.constexpr = None,
    SCORE_DFN: tl.constexpr = None,
):  # fmt: skip
    pid_bh, rank = grid_position(GRID_ORDER)
    off_b, off_h, off_hkv, mask_id, qt, tile_row = q_tile_program(
        pid_bh, rank, Hq, gqa_group, mask_stride_b, mask_stride_h, QOrder, Tq, GRID_ORDER
    )
    count, full_count = clamp_counts(
        tl.load(QCount + tile_row),
        tl.load(QFullCount + tile_row),
        Tk,
        tl.minimum(Tk, Nk // BLOCK_N),
    )
    tile_list = QList + tile_row * Tk
    kind_row = tile_row * Tk
    row_base = mask_id * Nq * n_slots

    start_m = qt * BLOCK_M
    offs_m_local = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_m_local
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_ok = offs_m < Nq
    md_ok = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
    mdv_ok = m_ok[:, None] & (offs_dv < HEAD_DIM_V)[None, :]
    q = tl.load(
        Q + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        + start_m.to(tl.int64) * stride_qm
        + offs_m_local[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=md_ok, other=0.0,
    )  # fmt: skip
    do = tl.load(
        DO + off_b.to(tl.int64) * stride_dob + off_h.to(tl.int64) * stride_doh
        + start_m.to(tl.int64) * stride_dom
        + offs_m_local[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
        mask=mdv_ok, other=0.0,
    )  # fmt: skip
    lse2 = tl.load(Lse2 + pid_bh.to(tl.int64) * Nq + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(Delta + pid_bh.to(tl.int64) * Nq + offs_m, mask=m_ok, other=0.0)
    K_head = K + off_b.to(tl.int64) * stride_kb + off_hkv.to(tl.int64) * stride_kh
    V_head = V + off_b.to(tl.int64) * stride_vb + off_hkv.to(tl.int64) * stride_vh

    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    row_ptr = row_base + offs_m.to(tl.int64) * n_slots
    lo0, hi0 = preload_row_slot(RowLo, RowHi, row_ptr, m_ok, Nk, 0, SLOTS)
    lo1, hi1 = preload_row_slot(RowLo, RowHi, row_ptr, m_ok, Nk, 1, SLOTS)
    lo2, hi2 = preload_row_slot(RowLo, RowHi, row_ptr, m_ok, Nk, 2, SLOTS)
    lo3, hi3 = preload_row_slot(RowLo, RowHi, row_ptr, m_ok, Nk, 3, SLOTS)
    # PARTIAL kv-tiles: interval or bitmask masking.
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, K_desc, V_desc, off_b, off_hkv, K_head, V_head,
        stride_kn, stride_kd, stride_vn, stride_vd,
        tile_list, Kind + kind_row, Jlo + kind_row, Jhi + kind_row, BitsIndex + kind_row, Bits,
        stride_bits_p, stride_bits_r, RowLo, RowHi, row_base, offs_m,
        lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, Nq, Nk, n_slots,
        full_count, count, Tk - 1, n_bits, qk_scale,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, True, DOT_PRECISION, LOAD_T, MAX_SPAN,
        HAS_BITS, SLOTS, USE_TMA, off_h, scale,
        HEAD_DIM_V=HEAD_DIM_V, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, ModF=ModF, ModI=ModI,
            ModMeta=ModMeta, ModG=ModG, MOD0=MOD0, MOD1=MOD1, MOD2=MOD2, MOD3=MOD3,
            SCORE_FN=SCORE_FN, SCORE_DFN=SCORE_DFN,
    )  # fmt: skip
    # FULL kv-tiles: no mask, no bounds checks.
    dq = _attn_bwd_dq_inner(
        dq, q, do, lse2, delta, K_desc, V_desc, off_b, off_hkv, K_head, V_head,
        stride_kn, stride_kd, stride_vn, stride_vd,
        tile_list, Kind + kind_row, Jlo + kind_row, Jhi + kind_row, BitsIndex + kind_row,
        Bits, stride_bits_p, stride_bits_r, RowLo, RowHi, row_base, offs_m,
        lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, Nq, Nk, n_slots,
        0, full_count, tl.minimum(Tk, Nk // BLOCK_N) - 1, n_bits, qk_scale,
        HEAD_DIM, HEAD_DIM_PAD, BLOCK_M, BLOCK_N, False, DOT_PRECISION, LOAD_T, MAX_SPAN,
        HAS_BITS, SLOTS, USE_TMA, off_h, scale,
        HEAD_DIM_V=HEAD_DIM_V, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, ModF=ModF, ModI=ModI,
            ModMeta=ModMeta, ModG=ModG, MOD0=MOD0, MOD1=MOD1, MOD2=MOD2, MOD3=MOD3,
            SCORE_FN=SCORE_FN, SCORE_DFN=SCORE_DFN,
    )  # fmt: skip
    dq = dq * scale
    tl.store(
        DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
        + start_m.to(tl.int64) * stride_dqm
        + offs_m_local[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
        dq.to(DQ.dtype.element_ty), mask=md_ok,
    )  # fmt: skip


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    row_lo: torch.Tensor,
    row_hi: torch.Tensor,
    dkdv_schedule: dict[str, torch.Tensor],
    dq_schedule: dict[str, torch.Tensor],
    *,
    scale: float,
    mask_stride_b: int,
    mask_stride_h: int,
    cfg: BwdConfig,
    dlse: torch.Tensor | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    ds_slots: torch.Tensor | None = None,
    mods=None,
    mod_grad: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels (internal: inputs are assumed validated).

    Args:
        q: [B, Hq, Nq, D]; k: [B, Hkv, Nk, D]; v: [B, Hkv, Nk, Dv]; any strides with unit
            last stride.
        out: the forward output [B, Hq, Nq, Dv]; lse: its float32 [B, Hq, Nq] contiguous LSE
            (natural log, -inf for rows that see nothing; including the sink, if any).
        do: the gradient of ``out`` [B, Hq, Nq, Dv], any strides.
        row_lo, row_hi: int32 [M, Nq, n_slots] contiguous, the plan's row intervals.
        dkdv_schedule: :func:`~.schedule.dkdv_schedule` at (cfg.dkdv_block_m, cfg.dkdv_block_n).
        dq_schedule: :func:`~.schedule.forward_schedule` at (cfg.dq_block_m, cfg.dq_block_n).
        scale: softmax scale of the forward.
        mask_stride_b, mask_stride_h: mask index m = b * mask_stride_b + h * mask_stride_h.
        cfg: tile sizes and launch options.
        dlse: optional float32 [B, Hq, Nq], the gradient of ``lse`` (None: zero).
        dq, dk, dv: optional output buffers shaped like q, k, v (written in full).
        ds_slots: with ``cfg.ds_dq`` > 0, the dS buffer slots of the dK/dV tiling's tiles
            (``schedule.ds_slots``, int32 [M, Tq, Tk]); dQ then comes from the stored dS
            (16-bit, dQ tiling equal to the dK/dV tiling; else the dQ kernel runs as without
            it).
        mods: a ``score_mods.Packed`` score modifier (None: none); its learnable stages'
            gradients go to ``mod_grad`` (``Packed.grad_buffer`` at the dK/dV tiling's Tk).
        delta: optional float32 [B, Hq, Nq] buffer that receives ``rowsum(dO * O) - dlse``
            (the sinks' gradient is taken from it).

    Returns:
        (dq, dk, dv) in the dtypes of q, k, v (or of the given buffers). Rows that see no key
        get dq = 0; keys no row sees get dk = dv = 0.
    """
    B, Hq, Nq, D = q.shape
    Hkv, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    check_head_dim(D)
    check_head_dim(Dv)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if dq is None else dq
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if dk is None else dk
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if dv is None else dv
    if B * Hq * D == 0:
        return dq, dk, dv
    if Nq == 0 or Nk == 0:  # nothing is visible: every gradient is zero
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv
    if not lse.is_contiguous():
        lse = lse.contiguous()
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    d_pad, dv_pad = padded_head_dim(D), padded_head_dim(Dv)
    kinds = mods.kinds if mods is not None else (0, 0, 0, 0)
    qk_scale = exp2_scale(scale, mods)
    mod_args = dict(
        HEAD_DIM_V=Dv, HEAD_DIM_V_PAD=dv_pad,
        ModF=mods.f if mods is not None else None, ModI=mods.i if mods is not None else None,
        ModMeta=mods.bwd_meta if mods is not None else None, ModG=mod_grad,
        MOD0=kinds[0], MOD1=kinds[1], MOD2=kinds[2], MOD3=kinds[3],
        SCORE_FN=mods.score_fn if mods is not None else None,
        SCORE_DFN=mods.score_dfn if mods is not None else None,
    )  # fmt: skip
    n_slots = row_lo.shape[-1]
    # fp32: tf32x3 dots (about fp32 accuracy, on tensor cores), as the forward; operands are
    # loaded in both layouts rather than transposed in registers (32-bit MMA operands must be
    # K-major, so a register transpose would go through shared memory anyway).
    dot_precision = "tf32x3" if q.dtype == torch.float32 else "tf32"
    load_t = q.dtype == torch.float32

    if delta is None:
        delta = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(delta)
    _attn_bwd_preprocess[(triton.cdiv(Nq, _PRE_BLOCK), B * Hq)](
        out, do, lse, dlse if dlse is not None else lse, delta, lse2,
        *out.stride(), *do.stride(), Hq, Nq,
        HEAD_DIM=Dv, HEAD_DIM_PAD=dv_pad, BLOCK=_PRE_BLOCK, HAS_DLSE=dlse is not None,
    )  # fmt: skip

    # TMA (cfg.tma, 16-bit, aligned strides): Q / dO tiles of dK/dV, K / V tiles of dQ
    tma = bool(cfg.tma) and not load_t
    qdo_descs = tma_descriptors(q, do, cfg.dkdv_block_m, d_pad, dv_pad) if tma else None
    kv_descs = tma_descriptors(k, v, cfg.dq_block_n, d_pad, dv_pad) if tma else None

    s = dkdv_schedule
    Tq, Tk = s["kind"].shape[1], s["kind"].shape[2]
    bm, bn = cfg.dkdv_block_m, cfg.dkdv_block_n
    use_ds = (
        cfg.ds_dq > 0
        and ds_slots is not None
        and not load_t
        and (cfg.dq_block_m, cfg.dq_block_n) == (bm, bn)
        and tuple(ds_slots.shape) == tuple(dq_schedule["kind"].shape)
    )
    ds_buf = (
        torch.empty((B * Hq * cfg.ds_dq * bn, bm), dtype=q.dtype, device=q.device)
        if use_ds
        else None
    )
    # the dS buffer as [rows, bm] for TMA (int32 coordinates): dS^T loads of the dS GEMM, and
    # with cfg.ds_tma the stores of the dK/dV kernel
    ds_desc = None
    if use_ds and qdo_descs is not None and ds_buf.shape[0] < 2**31:
        from triton.tools.tensor_descriptor import TensorDescriptor

        ds_desc = TensorDescriptor.from_tensor(ds_buf, [bn, bm])
    ds_tma = ds_desc is not None and bool(cfg.ds_tma)
    bits = s["bits"]
    span, slots, has_bits = mask_constants(s["kind"], s["jlo"], s["jhi"], n_slots)
    check_bits(bits, has_bits, cfg.dkdv_block_n, cfg.dkdv_block_m)  # transposed tiles
    order = launch_order(cfg.dkdv_order, B * Hkv)
    _attn_bwd_dkdv[launch_grid(order, B * Hkv, Tk)](
        q, k, v, do, lse2, delta, dk, dv,
        row_lo, row_hi, s["kind"], s["jlo"], s["jhi"], s["bits_index"], bits,
        s["kv_count"], s["kv_full_count"], s["kv_list"], s["kv_order"],
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        bits.stride(0), bits.stride(1),
        Hq, Hkv, Hq // Hkv, Nq, Nk, n_slots, Tq, Tk, bits.shape[0], mask_stride_b, mask_stride_h,
        scale, qk_scale,
        HEAD_DIM=D, HEAD_DIM_PAD=d_pad, BLOCK_M=cfg.dkdv_block_m, BLOCK_N=cfg.dkdv_block_n,
        DOT_PRECISION=dot_precision, LOAD_T=load_t,
        MAX_SPAN=span, HAS_BITS=has_bits, SLOTS=slots,
        GRID_ORDER=order, Q_desc=qdo_descs[0] if qdo_descs else None,
        DO_desc=qdo_descs[1] if qdo_descs else None, USE_TMA=qdo_descs is not None,
        DS=ds_buf, Slot=ds_slots if use_ds else None, ds_tiles=cfg.ds_dq if use_ds else 1,
        STORE_DS=use_ds, DS_desc=ds_desc if ds_tma else None, DS_TMA=ds_tma,
        TABLE_STAGE=mods.table_stage if mods is not None and mods.table_learnable else -1,
        NB_PAD=mods.nb_pad if mods is not None else 16, **mod_args,
        num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages,
    )  # fmt: skip

    s = dq_schedule
    Tq, Tk = s["kind"].shape[1], s["kind"].shape[2]
    if use_ds:
        if kv_descs is None:  # K through pointers: dS too
            ds_desc = None
        order = launch_order(cfg.dq_order, B * Hq)
        _attn_bwd_dq_ds[launch_grid(order, B * Hq, Tq)](
            ds_buf, k, dq, ds_slots, s["q_count"], s["q_list"], s["q_order"],
            *k.stride(), *dq.stride(),
            Hq, Hq // Hkv, Nq, Nk, Tq, Tk, mask_stride_b, mask_stride_h, cfg.ds_dq, scale,
            HEAD_DIM=D, HEAD_DIM_PAD=d_pad, BLOCK_M=bm, BLOCK_N=bn, GRID_ORDER=order,
            K_desc=kv_descs[0] if kv_descs else None, DS_desc=ds_desc,
            USE_TMA=ds_desc is not None,
            num_warps=cfg.dq_warps, num_stages=cfg.dq_stages,
        )  # fmt: skip
        return dq, dk, dv
    bits = s["bits"]
    span, slots, has_bits = mask_constants(s["kind"], s["jlo"], s["jhi"], n_slots)
    check_bits(bits, has_bits, cfg.dq_block_m, cfg.dq_block_n)
    order = launch_order(cfg.dq_order, B * Hq)
    _attn_bwd_dq[launch_grid(order, B * Hq, Tq)](
        q, k, v, do, lse2, delta, dq,
        row_lo, row_hi, s["kind"], s["jlo"], s["jhi"], s["bits_index"], bits,
        s["q_count"], s["q_full_count"], s["q_list"], s["q_order"],
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        bits.stride(0), bits.stride(1),
        Hq, Hq // Hkv, Nq, Nk, n_slots, Tq, Tk, bits.shape[0], mask_stride_b, mask_stride_h,
        scale, qk_scale,
        HEAD_DIM=D, HEAD_DIM_PAD=d_pad, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n,
        DOT_PRECISION=dot_precision, LOAD_T=load_t,
        MAX_SPAN=span, HAS_BITS=has_bits, SLOTS=slots,
        GRID_ORDER=order,
        K_desc=kv_descs[0] if kv_descs else None, V_desc=kv_descs[1] if kv_descs else None,
        USE_TMA=kv_descs is not None, **mod_args,
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages,
    )  # fmt: skip
    return dq, dk, dv
