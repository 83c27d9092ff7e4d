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
  the q-tile's first row of ``tiles`` seen as ``[M Tq Tk, 4]``, so that the kernel gets all
  it needs to start an item from the entry's own row: one memory round trip, not two.
- ``kv_list``: int32 ``[M, Tq, Tk]``: per q-tile its touched kv-tiles, FULL tiles first (each
  group ascending), then PARTIAL ones; ``kv_count`` / ``full_count`` int32 ``[M, Tq]``.
- ``tiles``: int32 ``[M, Tq, Tk, 4]``: entry ``i`` of the q-tile's kv list with what the kernel
  looks up through it, ``(kt, jlo, jhi, page)`` = ``kv_list[m, qt, i]`` and that tile's
  ``jlo`` / ``jhi`` / ``bits_index`` (below), clamped to their ranges (``kt`` to
  ``[0, Tk)``, slots to ``[0, K]``, ``page`` to ``[-1, P)``): the kernel reads one row of it
  per kv-tile and indexes nothing else of the plan's per-tile tables.
- ``jlo`` / ``jhi``: int32 ``[M, Tq, Tk]``: the slots ``[jlo, jhi)`` of ``row_lo`` /
  ``row_hi`` whose intervals can meet a PARTIAL tile (the plan's own, see
  ``compiler.tiles``); the kernel's ``row_bounds`` reads the intervals of one row from them.
- ``row_lo`` / ``row_hi``: the plan's int32 ``[M, Nq, K]`` row intervals.
- ``bits_index``: int32 ``[M, Tq, Tk]``: the page of ``bits`` of a PARTIAL tile stored as a
  bitmask (PARTIAL_BITS in ``compiler.tiles``: a wide slot range in a plan with more than
  ``BITS_MIN_SLOTS`` slots per row), else -1. ``bits``: int32 ``[P, 128, 4]``: bit ``c % 32``
  of word ``c // 32`` of page row ``r`` says key ``kt * 128 + c`` is visible to query
  ``qt * 128 + r`` (rows past ``Nq`` are zero); at least one page (a zero page when the
  schedule has none), so the tensor is never empty. The kernel masks such a tile from its
  bitmask, every other PARTIAL tile from the intervals.

The schedule is the plan's ``plan.tiles(128, 128, bits=True)``: the plan's own when it holds
its bitmasks, else built once and cached on the plan; building bitmask tiles reads one value
back to the host (their number), once per plan. Plans with at most ``BITS_MIN_SLOTS`` slots per
row have no bitmask tiles and read nothing back. The rest is tensor operations of static shapes
on the plan's device.

Example::

    >>> import compilemask as cm
    >>> plan = cm.compile(cm.masks.causal(), 256, block_m=128, block_n=128)
    >>> low = lower(plan, batch=1, heads_q=2, heads_kv=1)
    >>> low.work.tolist()  # q-tile 1 touches 2 kv-tiles (1 FULL), q-tile 0 one
    [[0, 0, 1, 0, 2, 1, 2], [0, 1, 1, 0, 2, 1, 2], [0, 0, 0, 0, 1, 0, 0], [0, 1, 0, 0, 1, 0, 0]]
    >>> low.kv_list[0, 1].tolist(), low.full_count[0].tolist()
    ([0, 1], [0, 1])
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...compiler.plan import MaskPlan
from ...compiler.tiles import FULL, unpack_bits
from ...errors import CompileMaskError
from ..triton.schedule import split_full_first

#: the kernel's tile: query rows per CTA (2 consumer warpgroups x 64) and keys per kv-tile
BLOCK_M = 128
BLOCK_N = 128
#: the kernels by score modifier: none, a lone softcap, a lone ALiBi
MODIFIERS = ("", "softcap", "alibi")
#: the ALiBi kernel keeps the slopes in shared memory: at most this many query heads
ALIBI_MAX_HEADS = 256


@dataclass(frozen=True)
class CuteLowered:
    """What :func:`lower` builds (see the module docstring for shapes and meaning)."""

    work: torch.Tensor
    kv_list: torch.Tensor
    kv_count: torch.Tensor
    full_count: torch.Tensor
    tiles: torch.Tensor
    jlo: torch.Tensor
    jhi: torch.Tensor
    row_lo: torch.Tensor
    row_hi: torch.Tensor
    bits_index: torch.Tensor
    bits: torch.Tensor
    block_m: int
    block_n: int
    #: persistent CTAs the kernel launches (they take ``work`` in list order)
    num_ctas: int
    #: the kernel's views of the tensors above, made on the first launch and reused (making
    #: them costs tens of microseconds each per call)
    kernel_views: dict = field(default_factory=dict, compare=False, repr=False)


def schedule_for_kernel(plan: MaskPlan, block_m: int = BLOCK_M, block_n: int = BLOCK_N):
    """The plan's tile schedule at ``block_m x block_n`` with its bitmask tiles
    (``plan.tiles(..., bits=True)``, cached on the plan; see the module docstring)."""
    return plan.tiles(block_m, block_n, bits=True)


def bitmask_pages(s) -> torch.Tensor:
    """The schedule's ``bits`` ``[P, block_m, ceil(block_n / 32)]`` as the kernel reads them:
    int32, contiguous, at least one page (a zero page when ``P == 0``)."""
    bits = s.bits
    if bits.shape[0] == 0:
        bits = torch.zeros((1, *bits.shape[1:]), dtype=torch.int32, device=bits.device)
    return bits.to(torch.int32).contiguous()


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


def tile_entries(
    kv_list: torch.Tensor,
    jlo: torch.Tensor,
    jhi: torch.Tensor,
    bits_index: torch.Tensor,
    slots: int,
    pages: int,
) -> torch.Tensor:
    """int32 ``[M, Tq, Tk, 4]`` ``(kt, jlo, jhi, page)`` per kv-list entry (module docstring):
    ``kt`` clamped to ``[0, Tk)``, ``jlo`` / ``jhi`` to ``[0, slots]``, ``page`` to
    ``[-1, pages)``. Gathers of static shapes on the plan's device."""
    tk = kv_list.shape[-1]
    kt = kv_list.long().clamp(0, max(tk - 1, 0))
    j0 = jlo.gather(-1, kt).clamp(0, slots)
    j1 = jhi.gather(-1, kt).clamp(0, slots)
    page = bits_index.gather(-1, kt).clamp(-1, pages - 1)
    return torch.stack((kt, j0.long(), j1.long(), page.long()), -1).to(torch.int32).contiguous()


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
        CompileMaskError: ``plan`` not a MaskPlan, a bitmask plan (``encoding == "bits"``: no
            row intervals to read),
            ``batch`` / heads that are not positive or contradict the plan, or a ``kv_group``
            that is neither None nor a positive int.
    """
    if not isinstance(plan, MaskPlan):
        raise CompileMaskError(f"plan must be a MaskPlan, got {type(plan).__name__}")
    named = (("batch", batch), ("heads_q", heads_q), ("heads_kv", heads_kv), ("num_ctas", num_ctas))
    for name, value in named:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CompileMaskError(f"{name} must be a positive int, got {value!r}")
    if kv_group is not None and (
        isinstance(kv_group, bool) or not isinstance(kv_group, int) or kv_group < 1
    ):
        raise CompileMaskError(f"kv_group must be None or a positive int, got {kv_group!r}")
    if heads_q % heads_kv:
        raise CompileMaskError(f"heads_q {heads_q} is not a multiple of heads_kv {heads_kv}")
    if plan.encoding == "bits":
        raise CompileMaskError("the cute kernel reads row intervals; this plan stores bitmasks")
    if plan.batch is not None and plan.batch != batch:
        raise CompileMaskError(f"batch={batch} but the plan is per-batch for {plan.batch} rows")
    if plan.heads is not None and plan.heads != heads_q:
        raise CompileMaskError(f"heads_q={heads_q} but the plan is per-head for {plan.heads}")
    s = schedule_for_kernel(plan)
    kv_list, full_count = split_full_first(s.kind, s.q_list, s.q_count)
    order = work_order(s.q_count, batch, heads_q, heads_kv, plan.batch, plan.heads, kv_group)
    kv_count, full_count = s.q_count.to(torch.int32).contiguous(), full_count.contiguous()
    bits_index, bits = s.bits_index.to(torch.int32).contiguous(), bitmask_pages(s)
    jlo, jhi = s.jlo.contiguous(), s.jhi.contiguous()
    work = work_entries(order, kv_count, full_count, kv_list.shape[-1])
    return CuteLowered(
        work=work,
        num_ctas=min(num_ctas, work.shape[0]),
        kv_list=kv_list,
        kv_count=kv_count,
        full_count=full_count,
        tiles=tile_entries(kv_list, jlo, jhi, bits_index, plan.row_lo.shape[-1], bits.shape[0]),
        jlo=jlo,
        jhi=jhi,
        row_lo=plan.row_lo,
        row_hi=plan.row_hi,
        bits_index=bits_index,
        bits=bits,
        block_m=s.block_m,
        block_n=s.block_n,
    )


def columns_below(d, minimum=min):
    """How many of a thread's 32 columns of a kv-tile lie below ``col0 + d`` (``d >= 0``),
    ``col0`` being its first: the columns are ``col0 + 8 (c // 2) + c % 2`` for c = 0..31
    (``FlashFwdSm90.mn_layout``), two in each 8 columns. Plain integer operators and
    ``minimum`` (``cutlass.min`` in the kernel), so tests run it on Python ints."""
    return minimum(2 * (d >> 3) + minimum(d & 7, 2), BLOCK_N // 4)


def seen_from_word(x, w: int):
    """The bits of word ``w`` of a bitmask row that one thread holds, as bits ``8 w .. 8 w + 7``
    of its ``seen`` word in the kernel's ``apply_mask``; ``x`` is the word shifted right by
    ``2 (lane % 4)``.

    The thread's column ``c`` (0..31, ``FlashFwdSm90.mn_layout``) is tile column
    ``8 (c // 2) + 2 (lane % 4) + c % 2``; those in word ``w`` are ``c = 8 w + 2 j + e``
    (j 0..3, e 0..1) at bit ``8 j + 2 (lane % 4) + e`` of the word, i.e. bit ``8 j + e`` of
    ``x``. Plain integer operators: the kernel passes DSL integers, tests Python ints or tensors.
    Bits of ``x`` above 25 are never read, so ``x`` may come from an arithmetic shift."""
    return ((x & 0x3) | ((x >> 6) & 0xC) | ((x >> 12) & 0x30) | ((x >> 18) & 0xC0)) << (8 * w)


def dense_from_lowered(low: CuteLowered, q_len: int, kv_len: int, m: int) -> torch.Tensor:
    """Boolean ``[Nq, Nk]`` of mask ``m`` as the kernel sees it, through what it reads: per
    q-tile the columns 4-6 of its work entries and the rows ``list0 + i`` of ``tiles``; FULL
    tiles whole, PARTIAL tiles with a bitmask (``page >= 0``) through it, other PARTIAL tiles
    through the rows' intervals in slots ``[jlo, jhi)``, untouched tiles hidden (the kernel's
    rule, for tests). O(Nq * Nk * K)."""
    bm, bn = low.block_m, low.block_n
    dense = torch.zeros(q_len, kv_len, dtype=torch.bool)
    counts = {(e[3], e[2]): (e[4], e[5], e[6]) for e in low.work.tolist()}
    rows = low.tiles.cpu().view(-1, 4)  # as the kernel reads them: row list0 + i
    lo, hi, bits = (t.cpu() for t in (low.row_lo, low.row_hi, low.bits))
    key = torch.arange(kv_len)
    for qt in range(low.tiles.shape[1]):
        r0, r1 = qt * bm, min(q_len, qt * bm + bm)
        n, nf, list0 = counts[(m, qt)]
        for i in range(n):
            kt, j0, j1, page = rows[list0 + i].tolist()
            c0, c1 = kt * bn, min(kv_len, kt * bn + bn)
            if i < nf:
                dense[r0:r1, c0:c1] = True
                continue
            if page >= 0:
                vis = unpack_bits(bits[page])[: r1 - r0, : c1 - c0]
                dense[r0:r1, c0:c1] = vis
                continue
            for r in range(r0, r1):
                for j in range(j0, j1):
                    l_, h_ = int(lo[m, r, j]), int(hi[m, r, j])
                    sel = (key[c0:c1] >= l_) & (key[c0:c1] < h_)
                    dense[r, c0:c1] |= sel
    return dense


__all__ = [
    "BLOCK_M", "BLOCK_N", "FULL", "CuteLowered", "bitmask_pages", "columns_below", "l2_kv_group",
    "lower", "schedule_for_kernel", "seen_from_word", "tile_entries", "work_entries", "work_order",
]  # fmt: skip
