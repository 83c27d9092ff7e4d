"""Triton split-KV decode attention over a paged (or contiguous) KV cache.

Decode steps have few query rows (1 to a few dozen per batch row) and long caches: one program
per q-tile leaves most of a GPU idle. Here one program serves all the query heads of one
kv head (GQA packed: the rows ``r = g * Nq + i`` of the ``G = Hq / Hkv`` heads that read the
kv head, ``BLOCK_M`` of them per program) and one of ``S`` slices of the keys those rows see
(the span from their smallest visible key to their largest, cut in ``S`` equal parts): the
grid is ``(S, row blocks, B * Hkv)``. Each program runs FlashAttention's online softmax over
its slice, masking every key by the rows' intervals (a few compares per key and slot), and
writes its partial output and LSE; the slices are merged with their LSEs
(flash-decoding). ``S`` is chosen so that the grid fills the GPU (:func:`choose_splits`).

Keys are read through the page table: key ``t`` of batch row ``b`` is
``k_cache[block_table[b, t // page_size], t % page_size]``; any page size works (tested
16 to 256), pages in any order. A contiguous cache is the case of one page per batch row.
Every index read from the plan or the page table is clamped to the real sizes.

Legend: B batch, Hq / Hkv query / kv heads, G = Hq / Hkv, Nq new query rows, D head_dim,
K interval slots per row, S key slices, P pages per batch row.

Forward only: decoding needs no gradient.

Source: Dao et al., "Flash-Decoding for long-context inference" (2023).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _decode_kernel(
    Q, Kc, Vc, BlockTable, Seqlens, PlanLens, RowLo, RowHi, Opart, Lpart,
    sq_b, sq_h, sq_m, sq_d,
    sk_p, sk_s, sk_h, sk_d,
    sv_p, sv_s, sv_h, sv_d,
    sbt_b, sbt_p,
    srow_b, srow_m,
    so_s, so_b, so_h, so_m,
    sl_s, sl_b, sl_h,
    Hkv, Nq, R, num_pages, pages_per_row, capacity, len_limit, sm_scale, SPLITS,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    SLOTS: tl.constexpr,
    HAS_PLAN_LENS: tl.constexpr,
):  # fmt: skip
    pid_s = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv

    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < R
    g = offs_r // Nq
    qi = tl.where(row_ok, offs_r % Nq, 0)
    h = hk * G + tl.where(row_ok, g, 0)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D

    raw_len = tl.load(Seqlens + b)
    seqlen = tl.minimum(tl.maximum(raw_len, 0), capacity)
    # a bad cache length or page id makes the batch row's outputs NaN (``bad``): no host read
    bad = ((raw_len < 0) | (raw_len > len_limit)).to(tl.int32)
    if HAS_PLAN_LENS:
        bad = bad | (tl.load(PlanLens + b) != raw_len).to(tl.int32)
    row_base = RowLo + b.to(tl.int64) * srow_b + qi * srow_m  # srow_b = 0: shared rows
    hi_base = RowHi + b.to(tl.int64) * srow_b + qi * srow_m

    # the span of keys the rows see: [kmin, kmax)
    kmin = capacity
    kmax = capacity * 0
    for j in tl.static_range(SLOTS):
        lo = tl.load(row_base + j, mask=row_ok, other=0)
        hi = tl.minimum(tl.load(hi_base + j, mask=row_ok, other=0), seqlen)
        live = row_ok & (lo < hi)
        kmin = tl.minimum(kmin, tl.min(tl.where(live, lo, capacity), 0))
        kmax = tl.maximum(kmax, tl.max(tl.where(live, hi, 0), 0))
    kmin = tl.maximum(kmin, 0)
    # keys every row sees (inside every row's first interval): their blocks need no mask. The
    # first interval stays in registers for the masked blocks (one live value per row instead
    # of two row pointers: the 4-token kernel stays under 128 registers, two programs per SM)
    lo0 = tl.load(row_base, mask=row_ok, other=0)
    hi0 = tl.minimum(tl.load(hi_base, mask=row_ok, other=0), seqlen)
    full_lo = tl.max(tl.where(row_ok, lo0, 0), 0)
    full_hi = tl.min(tl.where(row_ok, hi0, capacity), 0)
    per = tl.cdiv(tl.cdiv(tl.maximum(kmax - kmin, 0), SPLITS), BLOCK_N) * BLOCK_N
    start = kmin + pid_s * per
    end = tl.minimum(start + per, kmax)

    q_ptrs = (
        Q
        + b.to(tl.int64) * sq_b
        + h[:, None].to(tl.int64) * sq_h
        + qi[:, None] * sq_m
        + offs_d[None, :] * sq_d
    )
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = BlockTable + b.to(tl.int64) * sbt_b
    # the page ids of [start, end), checked once (the key loop below clamps them)
    for p0 in range(start // PAGE, tl.cdiv(end, PAGE), BLOCK_N):
        pg = p0 + tl.arange(0, BLOCK_N)
        ids = tl.load(bt_row + tl.minimum(pg, pages_per_row - 1) * sbt_p, mask=pg * PAGE < end)
        bad = bad | tl.max(((ids < 0) | (ids >= num_pages)).to(tl.int32), 0)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < end
        page_no = tl.minimum(offs_n // PAGE, pages_per_row - 1)
        page = tl.load(bt_row + page_no * sbt_p, mask=key_ok, other=0)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        slot = offs_n % PAGE
        k = tl.load(
            Kc + page[:, None] * sk_p + slot[:, None] * sk_s + hk * sk_h + offs_d[None, :] * sk_d,
            mask=key_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        qk = tl.dot(q, tl.trans(k)) * qk_scale
        if (start_n < full_lo) | (start_n + BLOCK_N > tl.minimum(full_hi, end)):
            visible = (offs_n[None, :] >= lo0[:, None]) & (offs_n[None, :] < hi0[:, None])
            for j in tl.static_range(1, SLOTS):
                lo = tl.load(row_base + j, mask=row_ok, other=0)
                hi = tl.minimum(tl.load(hi_base + j, mask=row_ok, other=0), seqlen)
                visible = visible | (
                    (offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None])
                )
            qk = tl.where(visible & key_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            Vc + page[:, None] * sv_p + slot[:, None] * sv_s + hk * sv_h + offs_d[None, :] * sv_d,
            mask=key_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i * 0.6931471805599453 + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    out = tl.where(bad != 0, float("nan"), out)
    lse = tl.where(bad != 0, float("nan"), lse)
    o_ptrs = (
        Opart
        + pid_s.to(tl.int64) * so_s
        + b.to(tl.int64) * so_b
        + h[:, None].to(tl.int64) * so_h
        + qi[:, None] * so_m
        + offs_d[None, :]
    )
    tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
    l_ptrs = Lpart + pid_s.to(tl.int64) * sl_s + b.to(tl.int64) * sl_b + h.to(tl.int64) * sl_h + qi
    tl.store(l_ptrs, lse, mask=row_ok)


def launch_config(rows: int, head_dim: int) -> tuple[int, int, int, int]:
    """``(block_m, block_n, num_warps, num_stages)`` for ``rows = G * Nq`` packed query rows.

    Measured on an H200 (bf16, head_dim 128, batch 64, 32 / 8 heads, page size 64;
    ``benchmarks/tune_decode.py``, ``benchmarks/results/h200-decode-tune-2026-12-01.jsonl``):
    up to 64 rows, 128 keys a step with 8 warps (causal, 4 new tokens: 509 us against 666 us
    at 64 keys and 4 warps; 1 token: equal); more rows, 128-row blocks with 8 warps and 3
    stages (64 new tokens: causal 1622 us, tree 1809 us, against 2178 / 2114 us with 64-row
    blocks). head_dim 256 (not measured): 32 keys a step and 4 warps.
    """
    if head_dim > 128:
        return max(16, min(64, triton.next_power_of_2(rows))), 32, 4, 2
    if rows > 64:
        return 128, 128, 8, 3
    return max(16, triton.next_power_of_2(rows)), 128, 8, 2


def choose_splits(programs: int, capacity: int, device: torch.device) -> int:
    """Key slices per (row block, batch row, kv head): enough for about two programs per
    streaming multiprocessor, at most one per 256 keys of the cache capacity."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 2
    want = -(-2 * sms // max(programs, 1))
    return int(max(1, min(want, -(-capacity // 256), 64)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row_lo: torch.Tensor,
    row_hi: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    plan_seqlens: torch.Tensor | None = None,
    len_limit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV masked attention of few query rows over a paged KV cache.

    Args:
        q: [B, Hq, Nq, D] float16 / bfloat16 / float32, any strides.
        k_cache, v_cache: [num_pages, page_size, Hkv, D], q's dtype, any strides.
        row_lo, row_hi: int32 [Mb, Nq, K] (Mb = 1 or B): the visible key intervals of each
            query row (absolute key positions), shared by every head.
        block_table: int32 [B, P]: the pages of each batch row, in key order.
        cache_seqlens: int32 [B]: keys in each batch row's cache (keys at or past it are never
            read, whatever the intervals say).
        scale: softmax scale.
        num_splits: key slices S per program column (None: :func:`choose_splits`).
        block_n, block_m, num_warps, num_stages: keys per inner iteration, packed query rows
            per program, warps and pipelining stages (None: :func:`launch_config`).
        plan_seqlens: int [B] or None: the cache lengths the plan was built for (a
            ``DecodePlan``'s), which ``cache_seqlens`` must equal.
        len_limit: the largest valid cache length (None: the capacity, ``P * page_size``).

    A batch row whose cache length lies outside ``[0, len_limit]`` or differs from
    ``plan_seqlens``, or that reads a page id outside ``[0, num_pages)``, gets NaN in out and
    lse (every head; rows of other batch rows are unaffected): the kernel checks what it reads,
    with no host read. Pages a row does not read may hold anything.

    Returns:
        (out, lse): out [B, Hq, Nq, D] in q's dtype; lse float32 [B, Hq, Nq] (natural log,
        -inf for rows that see no key, whose out is 0).
    """
    B, Hq, Nq, D = q.shape
    num_pages, page, Hkv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    R = G * Nq
    pages_per_row = block_table.shape[1]
    capacity = pages_per_row * page
    bm, bn, warps, stages = launch_config(R, D)
    block_m = bm if block_m is None else block_m
    block_n = bn if block_n is None else block_n
    num_warps = warps if num_warps is None else num_warps
    num_stages = stages if num_stages is None else num_stages
    m_blocks = triton.cdiv(R, block_m)
    if num_splits is None:
        num_splits = choose_splits(B * Hkv * m_blocks, capacity, q.device)
    block_d = triton.next_power_of_2(D)
    opart = torch.empty((num_splits, B, Hq, Nq, D), dtype=torch.float32, device=q.device)
    lpart = torch.empty((num_splits, B, Hq, Nq), dtype=torch.float32, device=q.device)
    row_lo, row_hi = row_lo.contiguous(), row_hi.contiguous()
    grid = (num_splits, m_blocks, B * Hkv)
    limit = capacity if len_limit is None else int(len_limit)
    plan_lens = cache_seqlens if plan_seqlens is None else plan_seqlens
    _decode_kernel[grid](
        q, k_cache, v_cache, block_table, cache_seqlens, plan_lens, row_lo, row_hi, opart, lpart,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_table.stride(),
        row_lo.stride(0) if row_lo.shape[0] > 1 else 0, row_lo.stride(1),
        *opart.stride()[:4], *lpart.stride()[:3],
        Hkv, Nq, R, num_pages, pages_per_row, capacity, limit, float(scale), num_splits,
        G=G, D=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page,
        SLOTS=row_lo.shape[-1], HAS_PLAN_LENS=plan_seqlens is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits == 1:
        return opart[0].to(q.dtype), lpart[0]
    return merge_splits(opart, lpart, q.dtype)


def merge_splits(opart: torch.Tensor, lpart: torch.Tensor, dtype: torch.dtype):
    """Merge partial outputs ``[S, ...]`` by their LSEs: ``lse = logsumexp_s(lse_s)``,
    ``out = sum_s exp(lse_s - lse) * out_s`` (rows with every ``lse_s = -inf``: 0, -inf; rows
    with a NaN ``lse_s``, marked bad by the kernel: NaN)."""
    lse = torch.logsumexp(lpart, dim=0)
    finite = torch.isfinite(lse)
    w = torch.exp(lpart - torch.where(finite, lse, 0.0)).nan_to_num_(0.0)
    out = (w[..., None] * opart).sum(0)
    bad = torch.isnan(lse)
    out = torch.where(bad[..., None], float("nan"), out)
    return out.to(dtype), torch.where(finite | bad, lse, float("-inf"))


# ------------------------------------------------------------------ one-launch decoding plans
#: the catalogue masks :func:`step_rows` builds, by kernel code
STEP_KINDS = {"causal": 0, "sliding_window": 1, "prefix_lm": 2, "chunked": 3, "block_causal": 4}


@triton.jit
def _step_row(Lens, Offset, Tail, Nq, B, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    """Batch row ``b = program_id(0)`` of a step-plan kernel: its cache length ``L`` and first
    query position ``off`` (int64; bottom-right ``L - Nq`` without an offset), stored by the
    row's first program at ``Tail`` (offsets ``[B]``, then lengths ``[B]``), and the program's
    new rows ``i`` with their mask ``ok``."""
    b = tl.program_id(0)
    L = tl.load(Lens + b).to(tl.int64)
    if HAS_OFFSET:
        off = tl.load(Offset + b).to(tl.int64)
    else:
        off = L - Nq
    if tl.program_id(1) == 0:
        tl.store(Tail + b, off.to(tl.int32))
        tl.store(Tail + B + b, L.to(tl.int32))
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return b, L, off, i, i < Nq


@triton.jit
def _step_rows_kernel(
    Lens, Offset, Out, Nq, B, kv_len, param,
    KIND: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Batch row ``b``: the one interval of each new row (``Out`` holds lo ``[B, Nq]``, hi,
    count, then the offsets and lengths ``[B]``), as ``compiler.decode.step_plan``."""
    b, L, off, i, ok = _step_row(Lens, Offset, Out + 3 * B * Nq, Nq, B, HAS_OFFSET, BLOCK)
    p = off + i
    pp = tl.maximum(p, 0)
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = pp + 1
    if KIND == 1:
        lo = pp - param + 1
    elif KIND == 2:
        hi = tl.maximum(pp + 1, param)
    elif KIND == 3:
        lo = pp // param * param
    elif KIND == 4:
        hi = (pp // param + 1) * param
    end = tl.where(p >= 0, tl.minimum(L, kv_len), 0)
    lo = tl.maximum(lo, 0)
    hi = tl.minimum(hi, end)
    live = lo < hi
    base = b * Nq + i
    tl.store(Out + base, tl.where(live, lo, kv_len).to(tl.int32), mask=ok)
    tl.store(Out + B * Nq + base, tl.where(live, hi, kv_len).to(tl.int32), mask=ok)
    tl.store(Out + 2 * B * Nq + base, live.to(tl.int32), mask=ok)


def step_rows(name: str, param: int, lens, offset, q_len: int, kv_len: int):
    """``(lo [B, Nq, 1], hi, count [B, Nq], offset [B], lens [B])`` int32 of a one-interval
    catalogue mask in one launch (the registered fast path of ``compiler.decode.step_plan``);
    ``offset`` None: bottom-right. ``param``: the window, prefix length, chunk or block."""
    B = lens.shape[0]
    out = torch.empty(3 * B * q_len + 2 * B, dtype=torch.int32, device=lens.device)
    block = min(1024, triton.next_power_of_2(q_len))
    grid = (B, triton.cdiv(q_len, block))
    param = max(1, min(int(param), kv_len + q_len + 1))
    _step_rows_kernel[grid](
        lens, offset if offset is not None else lens, out, q_len, B, kv_len, param,
        KIND=STEP_KINDS[name], HAS_OFFSET=offset is not None, BLOCK=block, num_warps=1,
    )  # fmt: skip
    n = B * q_len
    lo, hi = out[:n].view(B, q_len, 1), out[n : 2 * n].view(B, q_len, 1)
    return lo, hi, out[2 * n : 3 * n].view(B, q_len), out[3 * n : 3 * n + B], out[3 * n + B :]


@triton.jit
def _step_tree_kernel(
    Lens, Offset, Runs, Out, Nq, B, kv_len,
    K: tl.constexpr, KP: tl.constexpr, HAS_OFFSET: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Batch row ``b``, nodes ``[BLOCK * pid1, ...)``: the prefix ``[0, off)`` and the runs
    ``off + Runs[:, i, :]`` of each node, clipped to ``[0, end)``, empties dropped, touching
    runs merged (``Out``: lo ``[B, Nq, K + 1]``, hi, count ``[B, Nq]``, offsets, lengths)."""
    tail = Out + 2 * B * Nq * (K + 1) + B * Nq
    b, L, off, i, ok = _step_row(Lens, Offset, tail, Nq, B, HAS_OFFSET, BLOCK)
    end = tl.where(off + i >= 0, tl.minimum(L, kv_len), 0)  # rows before the axis: nothing
    slot = tl.arange(0, KP)
    out_lo = tl.full([BLOCK, KP], kv_len, dtype=tl.int32)  # live intervals end by kv_len
    out_hi = tl.full([BLOCK, KP], kv_len, dtype=tl.int32)
    n = tl.zeros([BLOCK], dtype=tl.int64)  # intervals written so far
    cur = tl.full([BLOCK], -1, dtype=tl.int64)  # the end of the last one (-1: none)
    for j in tl.static_range(K + 1):
        if j == 0:
            lo = tl.zeros([BLOCK], dtype=tl.int64)
            hi = tl.zeros([BLOCK], dtype=tl.int64) + off
        else:
            lo = off + tl.load(Runs + i * K + (j - 1), mask=ok, other=0)
            hi = off + tl.load(Runs + Nq * K + i * K + (j - 1), mask=ok, other=0)
        lo = tl.maximum(lo, 0)
        hi = tl.minimum(hi, end)
        live = lo < hi
        joins = live & (lo <= cur)  # touches the last interval: extend it
        n = tl.where(live & ~joins, n + 1, n)
        here = slot[None, :] == (n - 1)[:, None]
        out_lo = tl.where(here & (live & ~joins)[:, None], lo.to(tl.int32)[:, None], out_lo)
        out_hi = tl.where(here & live[:, None], hi.to(tl.int32)[:, None], out_hi)
        cur = tl.where(live, hi, cur)
    base = (b * Nq + i)[:, None] * (K + 1) + slot[None, :]
    put = ok[:, None] & (slot[None, :] < K + 1)
    tl.store(Out + base, out_lo, mask=put)
    tl.store(Out + B * Nq * (K + 1) + base, out_hi, mask=put)
    tl.store(Out + 2 * B * Nq * (K + 1) + b * Nq + i, n.to(tl.int32), mask=ok)


def step_tree(runs, lens, offset, q_len: int, kv_len: int):
    """``(lo [B, Nq, K + 1], hi, count [B, Nq], offset [B], lens [B])`` int32 of a ``tree``
    draft in one launch (the registered fast path of ``compiler.decode.step_plan``; the same
    tensors as its tensor build). ``runs``: int32 ``[2, Nq, K]`` on ``lens``' device, per node
    the merged runs ``[a, b)`` of node indices on its root path, ascending (unused slots
    ``(0, 0)``; ``compiler.decode._tree_table``); ``offset`` None: bottom-right."""
    B, k = lens.shape[0], runs.shape[-1]
    out = torch.empty(2 * B * q_len * (k + 1) + B * q_len + 2 * B, dtype=torch.int32,
                      device=lens.device)  # fmt: skip
    kp = triton.next_power_of_2(k + 1)
    block = max(1, min(triton.next_power_of_2(q_len), 1024 // kp))
    grid = (B, triton.cdiv(q_len, block))
    _step_tree_kernel[grid](
        lens, offset if offset is not None else lens, runs, out, q_len, B, kv_len,
        K=k, KP=kp, HAS_OFFSET=offset is not None, BLOCK=block,
        num_warps=min(8, max(1, block * kp // 128)),
    )  # fmt: skip
    return _split(out, B, q_len, k + 1)


def _split(out: torch.Tensor, B: int, q_len: int, k: int):
    """The views ``(lo [B, Nq, K], hi, count [B, Nq], offset [B], lens [B])`` of one buffer."""
    n = B * q_len * k
    lo, hi = out[:n].view(B, q_len, k), out[n : 2 * n].view(B, q_len, k)
    c = 2 * n + B * q_len
    return lo, hi, out[2 * n : c].view(B, q_len), out[c : c + B], out[c + B :]


#: the piecewise catalogue masks :func:`step_pieces` builds
PIECEWISE = ("document", "shared_prompt", "hstu")


@triton.jit
def _step_pieces_kernel(
    Lens, Offset, Table, Out, Nq, B, kv_len, n_pieces,
    K: tl.constexpr, KP: tl.constexpr, STEPS: tl.constexpr, HAS_OFFSET: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Batch row ``b``, rows ``[BLOCK * pid1, ...)`` at position ``p``: the piece of ``q =
    max(p, 0)`` (the first whose end passes ``q``, else the last), its ``K`` intervals ``[a * q
    + b)`` cut to ``[0, end)``, empties padded (``Out``: lo ``[B, Nq, K]``, hi, count, offsets,
    lengths). ``Table``: per piece ``[end, lo_a[K], hi_a[K], lo_b[K], hi_b[K]]``."""
    W = 1 + 4 * K
    tail = Out + 2 * B * Nq * K + B * Nq
    b, L, off, i, ok = _step_row(Lens, Offset, tail, Nq, B, HAS_OFFSET, BLOCK)
    p = off + i
    q = tl.maximum(p, 0)
    end = tl.where(p >= 0, tl.minimum(L, kv_len), 0)  # rows before the axis: nothing
    first = tl.zeros([BLOCK], dtype=tl.int64)  # binary search: ends[first - 1] <= q
    last = tl.zeros([BLOCK], dtype=tl.int64) + n_pieces  # ends[last] > q
    for _ in tl.static_range(STEPS):
        active = first < last
        mid = (first + last) // 2
        e = tl.load(Table + mid * W, mask=ok & active, other=0)
        first = tl.where(active & (e <= q), mid + 1, first)
        last = tl.where(active & (e > q), mid, last)
    row = Table + tl.minimum(first, n_pieces - 1) * W
    slot = tl.arange(0, KP)
    take = ok[:, None] & (slot[None, :] < K)
    at = row[:, None] + 1 + slot[None, :]
    lo = tl.load(at, mask=take, other=0) * q[:, None] + tl.load(at + 2 * K, mask=take, other=0)
    hi = tl.load(at + K, mask=take, other=0) * q[:, None] + tl.load(at + 3 * K, mask=take, other=0)
    hi = tl.minimum(hi, end[:, None])
    live = take & (lo < hi)
    base = (b * Nq + i)[:, None] * K + slot[None, :]
    tl.store(Out + base, tl.where(live, lo, kv_len).to(tl.int32), mask=take)
    tl.store(Out + B * Nq * K + base, tl.where(live, hi, kv_len).to(tl.int32), mask=take)
    count = tl.sum(live.to(tl.int32), 1)
    tl.store(Out + 2 * B * Nq * K + b * Nq + i, count, mask=ok)


def step_pieces(table, lens, offset, q_len: int, kv_len: int):
    """``(lo [B, Nq, K], hi, count [B, Nq], offset [B], lens [B])`` int32 of a piecewise
    catalogue mask (``document``, ``shared_prompt``, ``hstu``) in one launch (the registered
    fast path of ``compiler.decode.step_plan``; the same tensors as its tensor build).
    ``table``: int32 ``[n, 1 + 4 K]`` on ``lens``' device, per piece its end and the ``a``,
    ``b`` of its intervals ``[lo_a * q + lo_b, hi_a * q + hi_b)`` (``compiler.decode.
    _pieces_table``); ``offset`` None: bottom-right."""
    B, (n, w) = lens.shape[0], table.shape
    k = (w - 1) // 4
    out = torch.empty(2 * B * q_len * k + B * q_len + 2 * B, dtype=torch.int32,
                      device=lens.device)  # fmt: skip
    kp = triton.next_power_of_2(k)
    block = min(1024, triton.next_power_of_2(q_len))
    grid = (B, triton.cdiv(q_len, block))
    _step_pieces_kernel[grid](
        lens, offset if offset is not None else lens, table, out, q_len, B, kv_len, n,
        K=k, KP=kp, STEPS=n.bit_length(), HAS_OFFSET=offset is not None, BLOCK=block,
        num_warps=4 if block >= 128 else 1,
    )  # fmt: skip
    return _split(out, B, q_len, k)
