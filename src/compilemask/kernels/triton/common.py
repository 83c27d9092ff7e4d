"""Masking helpers shared by the Triton forward and backward kernels.

A tile is a BLOCK_M x BLOCK_N box of (query, key) pairs. The plan classifies every tile
(``TileSchedule.kind``): FULL tiles are applied without a mask; PARTIAL tiles are masked by
comparing key indices with the intervals ``[row_lo, row_hi)`` of each query row (slots
``j in [jlo, jhi)`` of the tile); PARTIAL_BITS tiles read one bit per pair from a packed
bitmask. The kernel branches per tile, never per element.

Host side, ``schedule.split_full_first`` reorders each q-tile's kv-tile list so that the FULL tiles
come first: the kernels then run an unmasked loop (software-pipelined) over
``list[0:full_count]`` and a masked loop over ``list[full_count:count]`` (the structure of
Triton's fused-attention tutorial, with the tile lists of the plan instead of a causal split).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Tile kinds of ``TileSchedule.kind`` (keep in sync with the compiler).
KIND_EMPTY = tl.constexpr(0)
KIND_FULL = tl.constexpr(1)
KIND_PARTIAL = tl.constexpr(2)
KIND_PARTIAL_BITS = tl.constexpr(3)


@triton.jit
def interval_tile_mask(
    RowLo,
    RowHi,
    row_base,
    offs_m,
    offs_n,
    Nq,
    n_slots,
    jlo,
    jhi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPAN: tl.constexpr,
):
    """visible[r, c] = OR over slots j in [jlo, jhi) of row_lo[r, j] <= c < row_hi[r, j].

    ``row_base`` is the int64 offset of mask m's first row in RowLo/RowHi ([M, Nq, n_slots]);
    ``offs_m`` / ``offs_n`` are absolute query / key indices. Rows >= Nq see nothing. A slot
    range read from plan data is clamped to [0, n_slots) by the caller (:func:`slot_range`).
    """
    row_ok = offs_m < Nq
    row_ptr = row_base + offs_m.to(tl.int64) * n_slots
    visible = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int1)
    if MAX_SPAN >= 0:
        # a fixed trip count: no loop of unknown length inside the kv loop, which keeps that
        # loop software-pipelined; slots past jhi are masked off
        for step in tl.static_range(MAX_SPAN):
            ok = row_ok & (jlo + step < jhi)
            lo = tl.load(RowLo + row_ptr + jlo + step, mask=ok, other=0)
            hi = tl.load(RowHi + row_ptr + jlo + step, mask=ok, other=0)
            visible = visible | ((offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None]))
    else:
        for j in range(jlo, jhi):
            lo = tl.load(RowLo + row_ptr + j, mask=row_ok, other=0)
            hi = tl.load(RowHi + row_ptr + j, mask=row_ok, other=0)
            visible = visible | ((offs_n[None, :] >= lo[:, None]) & (offs_n[None, :] < hi[:, None]))
    return visible


@triton.jit
def bits_tile_mask(
    Bits, bits_idx, stride_bits_p, stride_bits_r, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """visible[r, c] = bit c % 32 of word c // 32 of row r of bitmask ``bits_idx``.

    The words are read as 16-bit halves (little-endian: half h holds columns 16h..16h+15),
    each loaded once per row (``BLOCK_N // 16`` loads of ``[BLOCK_M]``) and broadcast along
    its 16 columns: in the MMA layout the half index of a register is a compile-time constant
    (a thread's columns differ by less than 8 inside an aligned group of 8), so the selection
    folds away and an element costs a shift and a test, not a load. 16-bit loads are too
    narrow for the software pipeliner's asynchronous copies, so they stay in registers: 32-bit
    words were staged through shared memory (512 bytes per stage at 64x64), which pushed the
    64x64 forward with 3 stages past two programs per SM.
    """
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    base = Bits + bits_idx.to(tl.int64) * stride_bits_p + rows * stride_bits_r
    half = base.to(tl.pointer_type(tl.uint16))
    word = tl.load(half)[:, None].to(tl.int32) + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for j in tl.static_range(1, (BLOCK_N + 15) // 16):
        word = tl.where((cols // 16 == j)[None, :], tl.load(half + j)[:, None].to(tl.int32), word)
    return ((word >> (cols % 16)[None, :]) & 1) != 0


@triton.jit
def preload_row_slot(
    RowLo, RowHi, row_ptr, row_ok, Nk, slot: tl.constexpr, SLOTS: tl.constexpr
):  # fmt: skip
    """(lo, hi) of slot ``slot`` of rows ``row_ptr`` ([BLOCK_M] int32; empty where the row is
    out of range or ``slot >= SLOTS``), ``hi`` clamped to Nk (no key past the length is ever
    visible, whatever the plan says)."""
    if slot < SLOTS:
        lo = tl.load(RowLo + row_ptr + slot, mask=row_ok, other=0)
        hi = tl.minimum(tl.load(RowHi + row_ptr + slot, mask=row_ok, other=0), Nk)
    else:
        lo = tl.zeros(row_ptr.shape, dtype=tl.int32)
        hi = lo
    return lo, hi


@triton.jit
def slots_mask(offs_n, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, SLOTS: tl.constexpr):
    """visible[r, c] = OR over the first SLOTS (<= 4) slots of lo_j[r] <= c < hi_j[r].

    The forward and dQ kernels load the intervals of their q-tile's rows once, before the kv
    loop, when the plan has at most 4 slots per row (causal, document, hstu, shared_prompt,
    sliding window...): a PARTIAL tile then costs comparisons only, no memory access.
    """
    n = offs_n[None, :]
    visible = (n >= lo0[:, None]) & (n < hi0[:, None])
    if SLOTS > 1:
        visible = visible | ((n >= lo1[:, None]) & (n < hi1[:, None]))
    if SLOTS > 2:
        visible = visible | ((n >= lo2[:, None]) & (n < hi2[:, None]))
    if SLOTS > 3:
        visible = visible | ((n >= lo3[:, None]) & (n < hi3[:, None]))
    return visible


@triton.jit
def one_slot_mask(
    offs_n, start_n, end_n, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3, SLOTS: tl.constexpr
):  # fmt: skip
    """:func:`slots_mask` for a plan in which no row has two intervals in one kv-tile
    (:func:`one_interval_per_tile`): per row, the one slot that meets the tile's keys
    ``[start_n, end_n)`` (slot 0 when none does: it then hides the whole tile) is picked from
    the preloaded slots with a few row-wise selects, and each score costs two comparisons
    instead of two per slot (four compares and three logic operations at 2 slots)."""
    lo = lo0
    hi = hi0
    if SLOTS > 1:
        hit = (lo1 < hi1) & (lo1 < end_n) & (hi1 > start_n)
        lo = tl.where(hit, lo1, lo)
        hi = tl.where(hit, hi1, hi)
    if SLOTS > 2:
        hit = (lo2 < hi2) & (lo2 < end_n) & (hi2 > start_n)
        lo = tl.where(hit, lo2, lo)
        hi = tl.where(hit, hi2, hi)
    if SLOTS > 3:
        hit = (lo3 < hi3) & (lo3 < end_n) & (hi3 > start_n)
        lo = tl.where(hit, lo3, lo)
        hi = tl.where(hit, hi3, hi)
    n = offs_n[None, :]
    return (n >= lo[:, None]) & (n < hi[:, None])


@triton.jit
def partial_tile_mask(
    kind,
    RowLo,
    RowHi,
    row_base,
    offs_m,
    offs_n,
    Nq,
    Nk,
    n_slots,
    jlo,
    jhi,
    Bits,
    bits_idx,
    stride_bits_p,
    stride_bits_r,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPAN: tl.constexpr,
    HAS_BITS: tl.constexpr,
):
    """The visibility of a PARTIAL or PARTIAL_BITS tile (one branch per tile).

    Only kernels without preloaded slots call it (``SLOTS == 0``). ``HAS_BITS``: 0 no bitmask
    tile in the schedule (``kind`` is not read), 1 both encodings (a branch on ``kind``), 2
    every masked tile is a bitmask (no branch).
    """
    if HAS_BITS == 2:
        visible = bits_tile_mask(Bits, bits_idx, stride_bits_p, stride_bits_r, BLOCK_M, BLOCK_N)
        visible = visible & (offs_m[:, None] < Nq) & (offs_n[None, :] < Nk)
    elif HAS_BITS:
        if kind == KIND_PARTIAL_BITS:
            visible = bits_tile_mask(Bits, bits_idx, stride_bits_p, stride_bits_r, BLOCK_M, BLOCK_N)
            visible = visible & (offs_m[:, None] < Nq) & (offs_n[None, :] < Nk)
        else:
            visible = interval_tile_mask(
                RowLo, RowHi, row_base, offs_m, offs_n, Nq, n_slots, jlo, jhi,
                BLOCK_M, BLOCK_N, MAX_SPAN,
            )  # fmt: skip
    else:
        visible = interval_tile_mask(
            RowLo, RowHi, row_base, offs_m, offs_n, Nq, n_slots, jlo, jhi,
            BLOCK_M, BLOCK_N, MAX_SPAN,
        )  # fmt: skip
    return visible


# Transposed views, for the dK/dV kernel: the same tile data read as visible_t[key, query]
# ([BLOCK_N, BLOCK_M]), so that no register transpose is needed.


@triton.jit
def interval_tile_mask_t(
    RowLo,
    RowHi,
    row_base,
    offs_m,
    offs_n,
    Nq,
    n_slots,
    jlo,
    jhi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPAN: tl.constexpr,
):
    """visible_t[c, r] = OR over slots j in [jlo, jhi) of row_lo[r, j] <= c < row_hi[r, j]."""
    row_ok = offs_m < Nq
    row_ptr = row_base + offs_m.to(tl.int64) * n_slots
    visible = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int1)
    if MAX_SPAN >= 0:
        # a fixed trip count: no loop of unknown length inside the kv loop, which keeps that
        # loop software-pipelined; slots past jhi are masked off
        for step in tl.static_range(MAX_SPAN):
            ok = row_ok & (jlo + step < jhi)
            lo = tl.load(RowLo + row_ptr + jlo + step, mask=ok, other=0)
            hi = tl.load(RowHi + row_ptr + jlo + step, mask=ok, other=0)
            visible = visible | ((offs_n[:, None] >= lo[None, :]) & (offs_n[:, None] < hi[None, :]))
    else:
        for j in range(jlo, jhi):
            lo = tl.load(RowLo + row_ptr + j, mask=row_ok, other=0)
            hi = tl.load(RowHi + row_ptr + j, mask=row_ok, other=0)
            visible = visible | ((offs_n[:, None] >= lo[None, :]) & (offs_n[:, None] < hi[None, :]))
    return visible


@triton.jit
def bits_tile_mask_t(
    BitsT, bits_idx, stride_bits_p, stride_bits_r, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """visible_t[c, r] = bit r % 32 of word r // 32 of row c of the transposed bitmask
    ``bits_idx`` (``schedule.transposed_bits``: rows are keys), read like
    :func:`bits_tile_mask` with the roles of the axes swapped."""
    return bits_tile_mask(BitsT, bits_idx, stride_bits_p, stride_bits_r, BLOCK_N, BLOCK_M)


@triton.jit
def partial_tile_mask_t(
    kind,
    RowLo,
    RowHi,
    row_base,
    offs_m,
    offs_n,
    Nq,
    Nk,
    n_slots,
    jlo,
    jhi,
    Bits,
    bits_idx,
    stride_bits_p,
    stride_bits_r,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MAX_SPAN: tl.constexpr,
    HAS_BITS: tl.constexpr,
    SLOTS: tl.constexpr,
):
    """:func:`partial_tile_mask` transposed: ``[BLOCK_N, BLOCK_M]`` (keys x queries).

    ``SLOTS > 0``: every row has at most SLOTS (<= 4) slots and the schedule no bitmask tile;
    the mask ORs all slots of each row (no per-tile slot range is read). ``HAS_BITS`` as in
    :func:`partial_tile_mask`.
    """
    if SLOTS > 0:
        visible = interval_tile_mask_t(
            RowLo, RowHi, row_base, offs_m, offs_n, Nq, n_slots, 0, SLOTS,
            BLOCK_M, BLOCK_N, SLOTS,
        )  # fmt: skip
    elif HAS_BITS == 2:
        visible = bits_tile_mask_t(Bits, bits_idx, stride_bits_p, stride_bits_r, BLOCK_M, BLOCK_N)
        visible = visible & (offs_m[None, :] < Nq) & (offs_n[:, None] < Nk)
    elif HAS_BITS:
        if kind == KIND_PARTIAL_BITS:
            visible = bits_tile_mask_t(
                Bits, bits_idx, stride_bits_p, stride_bits_r, BLOCK_M, BLOCK_N
            )
            visible = visible & (offs_m[None, :] < Nq) & (offs_n[:, None] < Nk)
        else:
            visible = interval_tile_mask_t(
                RowLo, RowHi, row_base, offs_m, offs_n, Nq, n_slots, jlo, jhi,
                BLOCK_M, BLOCK_N, MAX_SPAN,
            )  # fmt: skip
    else:
        visible = interval_tile_mask_t(
            RowLo, RowHi, row_base, offs_m, offs_n, Nq, n_slots, jlo, jhi,
            BLOCK_M, BLOCK_N, MAX_SPAN,
        )  # fmt: skip
    return visible


# ------------------------------------------------------------------------------- launch order


@triton.jit
def grid_position(GRID_ORDER: tl.constexpr):
    """(pid_bh, rank) of this program: its (batch row, head) index and its tile rank.

    GRID_ORDER 0 lays the grid out as (B * H, T) (heads fastest); every other order as
    (T, B * H), so that consecutive programs are neighbouring tiles of one head (the layout of
    FlexAttention's and Triton's tutorial kernels: programs in flight share K/V in L2).
    """
    if GRID_ORDER == 0:
        pid_bh = tl.program_id(0)
        rank = tl.program_id(1)
    else:
        rank = tl.program_id(0)
        pid_bh = tl.program_id(1)
    return pid_bh, rank


@triton.jit
def clamp(x, hi):
    """``x`` clamped to [0, hi]: every index a kernel reads from plan data goes through it (or
    a masked load), so a malformed plan gives wrong numbers at worst, never an access out of
    bounds."""
    return tl.minimum(tl.maximum(x, 0), hi)


@triton.jit
def slot_range(Jlo, Jhi, tile, n_slots):
    """The slot range ``[jlo, jhi)`` of the tile at offset ``tile``, clamped to [0, n_slots)
    (a malformed tile never reads another row's slots)."""
    return tl.maximum(tl.load(Jlo + tile), 0), tl.minimum(tl.load(Jhi + tile), n_slots)


@triton.jit
def clamp_counts(count, full_count, T, n_complete):
    """A tile's list length clamped to [0, T] and its FULL prefix to [0, count]; no FULL tile
    when the axis has no complete tile (``n_complete`` = tiles of BLOCK entries inside the
    length: FULL tiles are read without bounds checks)."""
    count = clamp(count, T)
    full_count = clamp(full_count, tl.where(n_complete > 0, count, 0))
    return count, full_count


@triton.jit
def tile_of_rank(Order, rank, T, GRID_ORDER: tl.constexpr):
    """The tile a program of ``rank`` computes: ``Order[rank]`` (the plan's heaviest-first
    order, clamped to [0, T)) for GRID_ORDER 0 and 3, ``rank`` for 1, ``T - 1 - rank`` for
    2."""
    if GRID_ORDER == 1:
        tile = rank
    elif GRID_ORDER == 2:
        tile = T - 1 - rank
    else:
        tile = clamp(tl.load(Order + rank), T - 1)
    return tile


@triton.jit
def q_tile_program(
    pid_bh, rank, Hq, gqa_group, mask_stride_b, mask_stride_h, QOrder, Tq,
    GRID_ORDER: tl.constexpr,
):  # fmt: skip
    """The q-tile of a program that owns one (forward, dQ): ``(off_b, off_h, off_hkv,
    mask_id, qt, tile_row)`` for its (batch row, query head) index ``pid_bh`` and tile
    ``rank``; ``mask_id`` (int64) picks the plan's mask, ``tile_row = mask_id * Tq + qt`` the
    row of the [M, Tq, ...] schedule arrays."""
    off_b = pid_bh // Hq
    off_h = pid_bh % Hq
    off_hkv = off_h // gqa_group
    mask_id = (off_b * mask_stride_b + off_h * mask_stride_h).to(tl.int64)
    qt = tile_of_rank(QOrder + mask_id * Tq, rank, Tq, GRID_ORDER)
    tile_row = mask_id * Tq + qt
    return off_b, off_h, off_hkv, mask_id, qt, tile_row


@triton.jit
def work_entry(Work, row):
    """``(tile, count, full_count, first FULL tile, first PARTIAL tile)`` of entry ``row`` of
    a work list (``schedule.work_list``: 8 int32 per entry, one 32-byte sector)."""
    work = Work + row * 8
    return tl.load(work), tl.load(work + 1), tl.load(work + 2), tl.load(work + 3), tl.load(work + 4)


@triton.jit
def q_tile_work(
    pid_bh, rank, Hq, gqa_group, mask_stride_b, mask_stride_h, QOrder, QWork, QCount,
    QFullCount, Tq, GRID_ORDER: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """:func:`q_tile_program` plus the q-tile's counts and the first tile of its two loops:
    ``(off_b, off_h, off_hkv, mask_id, qt, tile_row, count, full_count, kt_full,
    kt_partial)``. PREFETCH (launch orders 0 and 3 only): all from one 32-byte work entry
    ``QWork[mask, rank]`` (``schedule.work_list``) instead of the chain of dependent loads
    order -> counts (the first tiles are then 0: the loops load them from the list)."""
    if PREFETCH:
        off_b = pid_bh // Hq
        off_h = pid_bh % Hq
        off_hkv = off_h // gqa_group
        mask_id = (off_b * mask_stride_b + off_h * mask_stride_h).to(tl.int64)
        qt, count, full_count, kt_full, kt_partial = work_entry(QWork, mask_id * Tq + rank)
        qt = clamp(qt, Tq - 1)
        tile_row = mask_id * Tq + qt
    else:
        off_b, off_h, off_hkv, mask_id, qt, tile_row = q_tile_program(
            pid_bh, rank, Hq, gqa_group, mask_stride_b, mask_stride_h, QOrder, Tq, GRID_ORDER
        )
        count = tl.load(QCount + tile_row)
        full_count = tl.load(QFullCount + tile_row)
        kt_full = 0
        kt_partial = 0
    return off_b, off_h, off_hkv, mask_id, qt, tile_row, count, full_count, kt_full, kt_partial


def launch_order(grid_order: int, bh: int) -> int:
    """``grid_order``, or 0 when the (T, B * H) layout would put more than 65,535 programs on
    the grid's second axis (CUDA's limit)."""
    if grid_order not in (0, 1, 2, 3):
        raise ValueError(f"grid_order must be 0, 1, 2 or 3, got {grid_order}")
    return grid_order if bh <= 65535 else 0


def launch_grid(grid_order: int, bh: int, tiles: int) -> tuple[int, int]:
    """The launch grid of :func:`grid_position` for ``bh`` (batch row, head) pairs."""
    return (bh, tiles) if grid_order == 0 else (tiles, bh)


# ------------------------------------------------------------------------------------ host side
#: Interval-masked tiles whose slot range is at most this wide are masked with a fixed
#: (unrolled) loop; a schedule with a wider one uses the loop of run-time length.
MAX_STATIC_SPAN = 8
#: Plans with at most this many interval slots per row are masked from preloaded slots
#: (``slots_mask``) when their schedule has no bitmask tile.
MAX_PRELOAD_SLOTS = 4
_MASK_CONSTANTS: dict[int, tuple[object, tuple[int, int, int]]] = {}
_ONE_PER_TILE: dict[tuple[int, int], tuple[object, bool]] = {}


def one_interval_per_tile(row_lo, row_hi, block_n: int) -> bool:
    """Whether no row of the plan has two of its intervals in one kv-tile of ``block_n`` keys
    (then :func:`one_slot_mask` masks a PARTIAL tile exactly).

    A row's intervals are sorted and do not touch (``hi[j] < lo[j + 1]``), so two of them
    meet the same tile exactly when two consecutive used slots do, that is when
    ``(hi[j] - 1) // block_n == lo[j + 1] // block_n``. True for one slot per row. Read back
    once (one small copy) and cached while ``row_lo`` lives.
    """
    import weakref

    import torch

    if row_lo.shape[-1] < 2 or row_lo.numel() == 0:
        return True
    key = (id(row_lo), block_n)
    hit = _ONE_PER_TILE.get(key)
    if hit is not None and hit[0]() is row_lo:
        return hit[1]
    lo, hi = row_lo, row_hi
    both_used = (lo[..., :-1] < hi[..., :-1]) & (lo[..., 1:] < hi[..., 1:])
    last = torch.div(hi[..., :-1] - 1, block_n, rounding_mode="floor")
    same_tile = last == torch.div(lo[..., 1:], block_n, rounding_mode="floor")
    value = not bool((both_used & same_tile).any())
    _ONE_PER_TILE[key] = (
        weakref.ref(row_lo, lambda _, key=key: _ONE_PER_TILE.pop(key, None)),
        value,
    )
    return value


def mask_constants(kind, jlo, jhi, n_slots: int) -> tuple[int, int, int]:
    """The masking constexprs of a schedule: ``(MAX_SPAN, SLOTS, HAS_BITS)``.

    MAX_SPAN: the widest slot range ``jhi - jlo`` of its interval-masked (PARTIAL) tiles, or
    -1 when that exceeds :data:`MAX_STATIC_SPAN`; HAS_BITS: 0 when no tile is a PARTIAL_BITS
    tile, 2 when every masked tile is one, else 1; SLOTS: ``n_slots`` when it is at most
    :data:`MAX_PRELOAD_SLOTS` and there is no bitmask tile, else 0. Read back once per
    schedule (one small device-to-host copy) and cached while the tensor lives.
    """
    import torch

    hit = _MASK_CONSTANTS.get(id(jlo))
    if hit is not None and hit[0]() is jlo:
        return hit[1]
    if kind.numel():
        span, has_bits, has_ints = (
            int(x) for x in torch.stack(_constant_parts(kind, jlo, jhi)).tolist()
        )
    else:
        span, has_bits, has_ints = 0, 0, 0
    value = _constants(span, has_bits, has_ints, n_slots)
    _remember(jlo, value)
    return value


def prime_mask_constants(schedules, n_slots: int) -> None:
    """:func:`mask_constants` of several schedules (dicts with ``kind``, ``jlo``, ``jhi``) in
    one device-to-host copy: a training step on a new plan reads the forward's, dQ's and
    dK/dV's constants back once instead of three times. Schedules already known are skipped."""
    import torch

    todo = []
    for s in schedules:
        hit = _MASK_CONSTANTS.get(id(s["jlo"]))
        if (hit is None or hit[0]() is not s["jlo"]) and s["kind"].numel():
            todo.append(s)
    if len(todo) < 2:
        return  # nothing to batch: mask_constants reads a lone schedule when launched
    parts = [t for s in todo for t in _constant_parts(s["kind"], s["jlo"], s["jhi"])]
    values = torch.stack(parts).tolist()
    for i, s in enumerate(todo):
        span, has_bits, has_ints = (int(x) for x in values[3 * i : 3 * i + 3])
        _remember(s["jlo"], _constants(span, has_bits, has_ints, n_slots))


def _constant_parts(kind, jlo, jhi) -> list:
    """Device scalars ``[widest PARTIAL slot range, any PARTIAL_BITS tile, any PARTIAL tile]``
    of one schedule (one dtype, to be stacked and read back)."""
    import torch

    span = torch.where(kind == int(KIND_PARTIAL), jhi - jlo, 0).max()
    bits = (kind == int(KIND_PARTIAL_BITS)).any().to(span.dtype)
    return [span, bits, (kind == int(KIND_PARTIAL)).any().to(span.dtype)]


def _constants(span: int, has_bits: int, has_ints: int, n_slots: int) -> tuple[int, int, int]:
    if has_bits and not has_ints:
        has_bits = 2
    max_span = span if span <= MAX_STATIC_SPAN else -1
    slots = n_slots if (n_slots <= MAX_PRELOAD_SLOTS and not has_bits) else 0
    return max_span, slots, has_bits


def _remember(jlo, value: tuple[int, int, int]) -> None:
    import weakref

    key = id(jlo)
    _MASK_CONSTANTS[key] = (
        weakref.ref(jlo, lambda _, key=key: _MASK_CONSTANTS.pop(key, None)),
        value,
    )


def check_bits(bits, has_bits: int, rows: int, cols: int) -> None:
    """Raise ValueError unless the bitmask tiles ``bits`` ([P, rows, words] int32) cover
    ``rows`` x ``cols`` tiles when the schedule has bitmask tiles (``has_bits``): the kernels
    read ``rows`` rows of ``cols / 16`` 16-bit halves from every page (a shape check on the
    host, no device read)."""
    if has_bits and (bits.dim() != 3 or bits.shape[1] < rows or bits.shape[2] * 32 < cols):
        raise ValueError(
            f"schedule['bits'] of shape {tuple(bits.shape)} does not hold {rows}x{cols} "
            "bitmask tiles"
        )
