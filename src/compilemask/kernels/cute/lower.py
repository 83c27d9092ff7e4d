"""A :class:`~compilemask.MaskPlan` lowered to what the sm90 CuTe forward reads (pure torch).

The kernel runs ``BLOCK_M x BLOCK_N`` = 128 x 128 tiles (two consumer warpgroups of 64 query
rows share one kv-tile list). Per plan and call shape it reads:

- ``work``: int32 ``[W, 7]``, one entry ``(b, hq, qt, m, n, nf, list0)`` per (batch row,
  query head, q-tile), ``W = B * Hq * Tq``: in groups of (batch row, kv head) pairs whose K
  and V fit in half of L2 (:func:`l2_kv_group`), most touched kv-tiles first within a group
  (stable), ties in ``(b, kv head, qt, head in the group)`` order, so the heads of one kv
  group run side by side and share their K/V tiles in L2; the kernel's CTAs take the
  entries in this order as they free up (a global counter). ``m`` is the
  plan's mask index of ``(b, hq)``; ``n`` / ``nf`` are ``kv_count[m, qt]`` /
  ``full_count[m, qt]`` (clamped to ``[0, Tk]`` / ``[0, n]``) and ``list0 = (m Tq + qt) Tk``
  the q-tile's first row of ``tiles`` seen as ``[M Tq Tk, 2]``, so that the kernel gets all
  it needs to start an item from the entry's own row: one memory round trip, not two.
- ``kv_list``: int32 ``[M, Tq, Tk]``: per q-tile its touched kv-tiles, FULL tiles first (each
  group ascending), then PARTIAL ones; ``kv_count`` / ``full_count`` int32 ``[M, Tq]``.
- ``tiles``: int32 ``[M, Tq, Tk, 2]``: entry ``i`` of the q-tile's kv list as ``(kt, page)``:
  its kv-tile ``kv_list[m, qt, i]`` (clamped to ``[0, Tk)``) and, for a PARTIAL entry
  (``nf <= i < n``), the row of ``pages`` that masks it (``-1`` for the others). The kernel
  reads one row of it per kv-tile and nothing else of the plan's per-tile tables.
- ``pages``: int64 ``[U, 256]``, the distinct masks of the PARTIAL entries (entries whose
  tiles look alike share a page; at least one page: a zero page when the schedule has no
  PARTIAL entry, so the tensor is never empty), each in **thread order**: word ``t``
  is what consumer thread ``t`` (warpgroup ``t // 128``, warp ``t % 128 // 32``, lane
  ``t % 32``) masks its scores with, bit ``32 r + c`` (``r`` in {0, 1}, ``c`` in 0..31) saying
  whether key ``kt * 128 + col(c)`` is visible to query ``qt * 128 + row(r)``, with the
  wgmma accumulator's own placement (``FlashFwdSm90.mn_layout``): ``row(r) = 64 (t // 128) +
  16 (t % 128 // 32) + (t % 32) // 4 + 8 r`` and ``col(c) = 8 (c // 2) + 2 (t % 4) + c % 2``.
  Rows past ``Nq`` and keys past ``Nk`` are zero bits. So a PARTIAL tile costs the kernel one
  coalesced 64-bit load per thread and no arithmetic to find its mask: the work of turning
  the plan's intervals (or bitmask tiles) into bits is done here, once per plan.

The pages are built from the plan's 128 x 128 schedule (``plan.tiles(128, 128)``): interval
tiles through their rows' slots (``compiler.tiles.tile_bits``), bitmask tiles (plans from
``from_dense`` / ``from_mask_mod`` that store bitmasks, and wide tiles of derived tilings)
from their pages; 2 KB per distinct page (every diagonal tile of a causal or sliding-window
mask is one page; the tiles of a disc along the grid's rows a few dozen). Building them
reads values back to the host (the number of PARTIAL entries, per step of
:data:`PAGES_PER_STEP` entries its slot spans, then the number of distinct pages), once per
plan: the pages are cached on the plan for every call shape (:func:`plan_pages`), the work
list per call shape; calls after that read nothing back. The rest is tensor operations on
the plan's device.

Example::

    >>> import compilemask as cm
    >>> plan = cm.compile(cm.masks.causal(), 256, block_m=128, block_n=128)
    >>> low = lower(plan, batch=1, heads_q=2, heads_kv=1)
    >>> low.work.tolist()  # q-tile 1 touches 2 kv-tiles (1 FULL), q-tile 0 one
    [[0, 0, 1, 0, 2, 1, 2], [0, 1, 1, 0, 2, 1, 2], [0, 0, 0, 0, 1, 0, 0], [0, 1, 0, 0, 1, 0, 0]]
    >>> low.kv_list[0, 1].tolist(), low.full_count[0].tolist()
    ([0, 1], [0, 1])
    >>> low.tiles[0, 1].tolist(), low.pages.shape  # two diagonal tiles: one page
    ([[0, -1], [1, 0]], torch.Size([1, 256]))
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...compiler.pipeline import positive_int
from ...compiler.plan import MaskPlan
from ...compiler.tiles import (
    FULL,
    PARTIAL,
    PARTIAL_BITS,
    distinct_pages,
    pack_bits,
    tile_bits,
    unpack_bits,
)
from ...errors import CompileMaskError
from ...language.values import integer_value
from ..triton.schedule import split_full_first

#: the kernel's tile: query rows per CTA (2 consumer warpgroups x 64) and keys per kv-tile
BLOCK_M = 128
BLOCK_N = 128
#: the kernels by score modifier: none, a lone softcap, a lone ALiBi
MODIFIERS = ("", "softcap", "alibi")
#: the ALiBi kernel keeps the slopes in shared memory: at most this many query heads
ALIBI_MAX_HEADS = 256
#: the kernel's consumer threads (two warpgroups of 128): a page holds one word per thread
CONSUMER_THREADS = 256
#: pages built per step of :func:`thread_pages` (its temporaries: about 0.1 MB per page,
#: chiefly ``unpack_bits``' int32 shifts of each page's 16 K bits)
PAGES_PER_STEP = 256
#: the largest index the kernel's int32 entry and tile-row indices hold
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class CuteLowered:
    """What :func:`lower` builds (see the module docstring for shapes and meaning)."""

    work: torch.Tensor
    kv_list: torch.Tensor
    kv_count: torch.Tensor
    full_count: torch.Tensor
    tiles: torch.Tensor
    pages: torch.Tensor
    block_m: int
    block_n: int
    #: persistent CTAs the kernel launches (they take ``work`` in list order)
    num_ctas: int
    #: the kernel's views of the tensors above, made on the first launch and reused (making
    #: them costs tens of microseconds each per call)
    kernel_views: dict = field(default_factory=dict, compare=False, repr=False)


def schedule_for_kernel(plan: MaskPlan, block_m: int = BLOCK_M, block_n: int = BLOCK_N):
    """The plan's tile schedule at ``block_m x block_n`` (``plan.tiles``, cached on the
    plan): its PARTIAL tiles are intervals or bitmasks, both lowered to pages."""
    return plan.tiles(block_m, block_n)


def work_order(
    q_count: torch.Tensor,
    batch: int,
    heads_q: int,
    heads_kv: int,
    plan_batch,
    plan_heads,
    kv_group: int | None = None,
) -> torch.Tensor:
    """int32 ``[B * Hq * Tq, 4]`` entries ``(b, hq, qt, m)``, heaviest first (see module).

    ``q_count``: int32 ``[M, Tq]`` touched kv-tiles per q-tile of each mask. ``kv_group``:
    None, or the number of consecutive (batch row, kv head) pairs whose entries run together,
    heaviest first within each group (:func:`l2_kv_group`), so that a pair's K and V stay in
    L2 while its q-tiles run.
    """
    dev = q_count.device
    tq = q_count.shape[1]
    group = heads_q // heads_kv
    # enumerate in (b, kv head, qt, head in group) order: that is the tie order
    b = torch.arange(batch, device=dev).view(batch, 1, 1, 1)
    hk = torch.arange(heads_kv, device=dev).view(1, heads_kv, 1, 1)
    qt = torch.arange(tq, device=dev).view(1, 1, tq, 1)
    g = torch.arange(group, device=dev).view(1, 1, 1, group)
    shape = (batch, heads_kv, tq, group)
    b, hq, qt = b.expand(shape), (hk * group + g).expand(shape), qt.expand(shape)
    m = (b if plan_batch else torch.zeros_like(b)) * (plan_heads or 1)
    m = m + (hq if plan_heads else torch.zeros_like(hq))
    b, hq, qt, m = (t.reshape(-1) for t in (b, hq, qt, m))
    weight = q_count[m, qt]
    key = -weight.to(torch.int64)
    if kv_group is not None:  # group first, then heaviest first (0 <= weight < 2**31)
        pair = (b * heads_kv + torch.div(hq, group, rounding_mode="floor")) // kv_group
        key = key + pair.to(torch.int64) * (1 << 32)
    order = torch.sort(key, stable=True).indices
    work = torch.stack((b, hq, qt, m), -1)[order]
    return work.to(torch.int32).contiguous()


def work_entries(
    order: torch.Tensor, kv_count: torch.Tensor, full_count: torch.Tensor, length: int
) -> torch.Tensor:
    """int32 ``[W, 7]`` ``(b, hq, qt, m, n, nf, list0)``: the ``[W, 4]`` entries of
    :func:`work_order` with their q-tile's kv count ``n`` (clamped to ``[0, length]``, the kv
    list's length), FULL count ``nf`` (clamped to ``[0, n]``) and first row of ``tiles``
    ``list0 = (m Tq + qt) length`` as columns 4, 5 and 6 (``kv_count`` ``[M, Tq]``)."""
    m, qt = order[:, 3].long(), order[:, 2].long()
    n = kv_count[m, qt].clamp(0, length)
    nf = torch.minimum(full_count[m, qt], n).clamp(min=0)
    list0 = (m * kv_count.shape[1] + qt) * length
    cols = (order, n[:, None], nf[:, None], list0[:, None])
    return torch.cat([c.to(torch.int64) for c in cols], 1).to(torch.int32).contiguous()


def tile_entries(kv_list: torch.Tensor, page: torch.Tensor, pages: int) -> torch.Tensor:
    """int32 ``[M, Tq, Tk, 2]`` ``(kt, page)`` per kv-list entry (module docstring): ``kt``
    clamped to ``[0, Tk)``, ``page`` (``[M, Tq, Tk]``, per entry) to ``[-1, pages)``."""
    tk = kv_list.shape[-1]
    kt = kv_list.long().clamp(0, max(tk - 1, 0))
    page = page.long().clamp(-1, pages - 1)
    return torch.stack((kt, page), -1).to(torch.int32).contiguous()


def thread_layout(device=None) -> torch.Tensor:
    """int64 ``[256, 64]``: the tile position ``row * 128 + col`` of bit ``32 r + c`` of
    consumer thread ``t``'s word (module docstring: the wgmma accumulator's placement)."""
    t = torch.arange(CONSUMER_THREADS, device=device)
    lane = t % 32
    row0 = 64 * (t // 128) + 16 * (t % 128 // 32) + lane // 4  # [256]
    rows = row0[:, None] + 8 * torch.arange(2, device=device)  # [256, 2]
    c = torch.arange(BLOCK_N // 4, device=device)
    cols = 8 * (c // 2)[None, :] + 2 * (lane % 4)[:, None] + (c % 2)[None, :]  # [256, 32]
    return (rows[:, :, None] * BLOCK_N + cols[:, None, :]).reshape(CONSUMER_THREADS, -1)


def thread_words(bits: torch.Tensor) -> torch.Tensor:
    """int64 ``[P, 256]`` thread-order words of row-major bitmask tiles ``bits``
    (int32 ``[P, 128, 4]``, bit ``c % 32`` of word ``c // 32`` of row ``r``)."""
    vis = unpack_bits(bits).reshape(bits.shape[0], -1)  # [P, 128 * 128]
    halves = pack_bits(vis[:, thread_layout(vis.device)]).to(torch.int64)  # [P, 256, 2]
    # the two int32 halves as one int64 (low: row r = 0), with no signed overflow
    return halves[..., 1] * (1 << 32) + (halves[..., 0] & 0xFFFFFFFF)


def thread_pages(plan: MaskPlan, s, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pages, page_of)``: the distinct thread-order pages of the PARTIAL entries
    ``(m, qt, kt)`` of ``entries`` (int64 ``[P, 3]``) of schedule ``s`` (each from its bitmask
    tile or its rows' interval slots), int64 ``[U, 256]`` with ``1 <= U <= max(P, 1)`` (a zero
    page when ``P == 0``), and ``page_of``: int64 ``[P]``, the page of each entry. Entries
    whose tiles look alike share a page (every diagonal tile of a causal or sliding-window
    mask, a disc's tiles along a grid row): the pages' bytes follow the mask's variety, not
    its length. Built :data:`PAGES_PER_STEP` entries at a time (a few host reads per step:
    whether it holds bitmask and interval tiles, its slot spans), then made distinct
    (:func:`~compilemask.compiler.tiles.distinct_pages`)."""
    dev = s.kind.device
    count = entries.shape[0]
    if count == 0:
        zero = torch.zeros((1, CONSUMER_THREADS), dtype=torch.int64, device=dev)
        return zero, torch.zeros(0, dtype=torch.int64, device=dev)
    out = torch.empty((count, CONSUMER_THREADS), dtype=torch.int64, device=dev)
    for c in range(0, count, PAGES_PER_STEP):
        part = entries[c : c + PAGES_PER_STEP]
        m, qt, kt = part.unbind(1)
        kind = s.kind[m, qt, kt]
        words = torch.zeros((part.shape[0], s.block_m, -(-s.block_n // 32)), dtype=torch.int32,
                            device=dev)  # fmt: skip
        bits = kind == PARTIAL_BITS
        if bool(bits.any()):
            words[bits] = s.bits[s.bits_index[m, qt, kt][bits].long()].to(torch.int32)
        rows = kind == PARTIAL
        if bool(rows.any()):
            sel = part[rows]
            sm, sq, sk = sel.unbind(1)
            words[rows] = tile_bits(
                plan.row_lo, plan.row_hi, sel, s.jlo[sm, sq, sk], s.jhi[sm, sq, sk],
                s.block_m, s.block_n, plan.q_len,
            )  # fmt: skip
        out[c : c + PAGES_PER_STEP] = thread_words(words)
    pages, page_of = distinct_pages(out)
    return pages.contiguous(), page_of


def l2_kv_group(
    batch: int,
    heads_kv: int,
    kv_len: int,
    kv_bytes_per_key: int,
    l2_bytes: int,
) -> int | None:
    """(batch row, kv head) pairs per group of the work list, or None for one group.

    Heaviest first over the whole list runs a pair's q-tiles far apart (1K tokens, B = 32:
    q-tile 7 of every pair, then q-tile 6 ...; 32K hstu: the q-tiles of one weight from every
    user and head), and its K and V have left L2 by the time the next one comes: they are read
    from memory once per q-tile. Groups of pairs whose K and V fill at most half of L2 (at
    least one pair) keep them there while the group's entries run; the CTAs stay balanced as
    the kernel hands the entries out in order as CTAs free up. ``kv_bytes_per_key``: K and V
    bytes of one key (``2 * head_dim * element size``).
    """
    pairs = batch * heads_kv
    group = max(1, l2_bytes // (2 * max(1, kv_len * kv_bytes_per_key)))
    return None if group >= pairs else group


def plan_pages(plan: MaskPlan):
    """``(kv_list, kv_count, full_count, page, pages)``: what the lowering takes from ``plan``
    alone, whatever the call's shape (cached on the plan, so a new batch size or head count
    does not build the pages again): the kv lists with FULL tiles first and their counts,
    ``page`` int64 ``[M, Tq, Tk]`` (the page of each PARTIAL kv-list entry, -1 elsewhere) and
    the distinct ``pages`` (:func:`thread_pages`)."""

    def build():
        s = schedule_for_kernel(plan)
        kv_list, full_count = split_full_first(s.kind, s.q_list, s.q_count)
        kv_count, full_count = s.q_count.to(torch.int32).contiguous(), full_count.contiguous()
        if kv_list.numel() > INT32_MAX:  # rows of ``tiles`` are int32 indices in the kernel
            raise CompileMaskError(
                f"{kv_list.numel()} kv-list entries at 128 x 128 tiles: more than the cute "
                f"kernel indexes (2**31 - 1)"
            )
        # the PARTIAL entries of every kv list, in (m, qt, i) order, and their kv-tiles
        i = torch.arange(kv_list.shape[-1], device=kv_list.device)
        partial = (i >= full_count[..., None]) & (i < kv_count[..., None])
        where = partial.nonzero()  # [P, 3] (m, qt, i): a host read
        kt = kv_list[where[:, 0], where[:, 1], where[:, 2]].long()
        pages, page_of = thread_pages(plan, s, torch.stack((where[:, 0], where[:, 1], kt), 1))
        page = torch.full(kv_list.shape, -1, dtype=torch.int64, device=kv_list.device)
        page[partial] = page_of
        return kv_list, kv_count, full_count, page, pages

    return plan.cached(("cute", "pages"), build)


def lower(
    plan: MaskPlan,
    batch: int,
    heads_q: int,
    heads_kv: int,
    kv_group: int | None = None,
    num_ctas: int = 1,
) -> CuteLowered:
    """The kernel's view of ``plan`` for ``batch`` rows, ``heads_q`` / ``heads_kv`` heads
    (``kv_group``: see :func:`work_order` and :func:`l2_kv_group`), for ``num_ctas``
    persistent CTAs (the kernel runs ``min(num_ctas, W)``; they take the list in order).

    Raises:
        CompileMaskError: ``plan`` not a MaskPlan, ``batch`` / heads that are not positive
            or contradict the plan, or a ``kv_group`` that is neither None nor a positive int.
    """
    if not isinstance(plan, MaskPlan):
        raise CompileMaskError(f"plan must be a MaskPlan, got {type(plan).__name__}")
    batch, heads_q = positive_int(batch, "batch"), positive_int(heads_q, "heads_q")
    heads_kv, num_ctas = positive_int(heads_kv, "heads_kv"), positive_int(num_ctas, "num_ctas")
    if kv_group is not None:
        kv_group = integer_value(kv_group)
        if kv_group is None or kv_group < 1:
            raise CompileMaskError(f"kv_group must be None or a positive int, got {kv_group!r}")
    if heads_q % heads_kv:
        raise CompileMaskError(f"heads_q {heads_q} is not a multiple of heads_kv {heads_kv}")
    if plan.batch is not None and plan.batch != batch:
        raise CompileMaskError(f"batch={batch} but the plan is per-batch for {plan.batch} rows")
    if plan.heads is not None and plan.heads != heads_q:
        raise CompileMaskError(f"heads_q={heads_q} but the plan is per-head for {plan.heads}")
    kv_list, kv_count, full_count, page, pages = plan_pages(plan)
    if batch * heads_q * kv_list.shape[1] > INT32_MAX:  # the kernel's entry index is int32
        raise CompileMaskError(
            f"batch * heads_q * q-tiles = {batch} * {heads_q} * {kv_list.shape[1]} work "
            f"entries: more than the cute kernel indexes (2**31 - 1)"
        )
    order = work_order(kv_count, batch, heads_q, heads_kv, plan.batch, plan.heads, kv_group)
    work = work_entries(order, kv_count, full_count, kv_list.shape[-1])
    return CuteLowered(
        work=work,
        num_ctas=min(num_ctas, work.shape[0]),
        kv_list=kv_list,
        kv_count=kv_count,
        full_count=full_count,
        tiles=tile_entries(kv_list, page, pages.shape[0]),
        pages=pages,
        block_m=BLOCK_M,
        block_n=BLOCK_N,
    )


def dense_from_lowered(
    low: CuteLowered, q_len: int, kv_len: int, m: int, padded: bool = False
) -> torch.Tensor:
    """Boolean ``[Nq, Nk]`` of mask ``m`` as the kernel sees it, through what it reads: per
    q-tile the columns 4-6 of its work entries and the rows ``list0 + i`` of ``tiles``; FULL
    tiles whole, PARTIAL tiles through their page, each consumer thread's word placed by
    the accumulator layout (written out here, not through :func:`thread_layout`), untouched
    tiles hidden (the kernel's rule, for tests). ``padded``: ``[Nq + 128, Nk + 128]``, with
    what the pages say past the lengths (it must be nothing). O(Nq * Nk)."""
    bm, bn = low.block_m, low.block_n
    dense = torch.zeros(q_len + bm, kv_len + bn, dtype=torch.bool)
    counts = {(e[3], e[2]): (e[4], e[5], e[6]) for e in low.work.tolist()}
    rows = low.tiles.cpu().view(-1, 2).tolist()  # as the kernel reads them: row list0 + i
    pages = low.pages.cpu()
    t = torch.arange(CONSUMER_THREADS)
    lane = t % 32
    place = []  # (row, col) of bit 32 r + c of thread t, from the mn_layout formulas
    for r in range(2):
        row = 64 * (t // 128) + 16 * (t % 128 // 32) + lane // 4 + 8 * r
        for c in range(32):
            place.append((row, 8 * (c // 2) + 2 * (lane % 4) + c % 2))
    for qt in range(low.tiles.shape[1]):
        n, nf, list0 = counts[(m, qt)]
        for i in range(n):
            kt, page = rows[list0 + i]
            r0, c0 = qt * bm, kt * bn
            if i < nf:
                dense[r0 : r0 + bm, c0 : c0 + bn] = True
                continue
            word = pages[page]
            for bit, (row, col) in enumerate(place):
                dense[r0 + row, c0 + col] |= ((word >> bit) & 1).bool()
    return dense if padded else dense[:q_len, :kv_len]


__all__ = [
    "BLOCK_M", "BLOCK_N", "CONSUMER_THREADS", "FULL", "CuteLowered", "l2_kv_group", "lower",
    "schedule_for_kernel", "thread_layout", "thread_pages", "thread_words", "tile_entries",
    "work_entries", "work_order",
]  # fmt: skip
