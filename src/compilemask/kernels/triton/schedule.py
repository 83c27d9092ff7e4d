"""The schedule tensors the Triton kernels read, derived from a plan's :class:`TileSchedule`.

Pure tensor operations with static shapes on the plan's device (no Triton, no host
synchronisation), so they run anywhere and trace under ``torch.compile``. Where the Triton
tile builder serves (CUDA plans by default, any device after ``tile_builder.enable()``), the
FULL-first lists come from one ``_tile_lists`` launch instead, in eager calls.
"""

from __future__ import annotations

import torch

from ...compiler import tiles as tiles_mod
from ...compiler.tiles import FULL

#: Order of the forward schedule tensors (the ``schedule`` argument of the custom op).
FWD_SCHEDULE_FIELDS = (
    "kind", "jlo", "jhi", "bits_index", "bits", "q_count", "q_full_count", "q_list", "q_order",
    "q_work",
)  # fmt: skip

#: Ints per entry of a :func:`work_list` (padded to 32 bytes: one sector per program).
WORK_FIELDS = 8


def split_full_first(
    kind: torch.Tensor, lists: torch.Tensor, counts: torch.Tensor, *, transposed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reorder tile lists so that FULL tiles come first (ascending within each group).

    Args:
        kind: int32 [M, Tq, Tk], the tile kinds.
        lists: int32 [M, T, L], per tile the touched tiles of the other axis (``q_list``
            [M, Tq, Tk] or, with ``transposed=True``, ``kv_list`` [M, Tk, Tq]); the first
            ``counts`` entries are valid.
        counts: int32 [M, T].

    Returns:
        (lists, full_counts): int32 [M, T, L] reordered contiguous lists (entries past
        ``counts`` are 0) and int32 [M, T], how many leading entries are FULL tiles.

    Pure tensor operations with static shapes on the plan's device: no host synchronisation,
    traceable by ``torch.compile``.
    """
    length = lists.shape[-1]
    valid = torch.arange(length, device=lists.device) < counts[..., None]
    idx = torch.where(valid, lists, 0).long()
    if length == 0:
        return lists.contiguous(), torch.zeros_like(counts)
    kinds = kind.transpose(1, 2) if transposed else kind
    tile_kind = kinds.gather(-1, idx)
    is_full = valid & (tile_kind == FULL)
    key = torch.where(is_full, 0, torch.where(valid, 1, 2))
    order = torch.sort(key, dim=-1, stable=True).indices
    reordered = torch.where(valid, lists, 0).gather(-1, order)
    return reordered.to(torch.int32).contiguous(), is_full.sum(-1).to(torch.int32)


def work_list(
    order: torch.Tensor, counts: torch.Tensor, full_counts: torch.Tensor, lists: torch.Tensor
) -> torch.Tensor:
    """What a program of launch rank r needs first, in one 32-byte entry: int32 [M, T, 8],
    entry ``[m, r] = (t, count, full_count, list[0], list[full_count], 0, 0, 0)`` for the tile
    ``t = order[m, r]`` (heaviest first), with ``lists`` FULL first (``split_full_first``);
    ``list[0]`` is 0 when the tile touches nothing, ``list[full_count]`` 0 when it has no
    PARTIAL tile.

    The kernels that launch in the plan's order (``GRID_ORDER`` 0 and 3) read it with one
    load instead of the chain order -> counts -> list -> first K/V tile, and get the first
    tile of their second loop before the first loop runs (one memory latency fewer per
    loop). Pure tensor operations with static shapes, no host synchronisation.
    """
    M, T = order.shape
    length = lists.shape[-1]
    o = order.long()
    if length == 0 or T == 0:
        first = part = torch.zeros_like(counts)
    else:
        first = lists[..., 0]
        part = lists.gather(-1, full_counts.clamp(max=length - 1).long()[..., None])[..., 0]
        first = torch.where(counts > 0, first, 0)
        part = torch.where(full_counts < counts, part, 0)
    cols = [order, counts.gather(1, o), full_counts.gather(1, o), first.gather(1, o),
            part.gather(1, o)]  # fmt: skip
    zero = torch.zeros_like(order)
    cols += [zero] * (WORK_FIELDS - len(cols))
    return torch.stack([c.to(torch.int32) for c in cols], -1).contiguous()


def _full_first(kind, lists, counts, order, transposed: bool):
    """``(lists FULL first, full_count, work)``: :func:`split_full_first` and
    :func:`work_list`, or what the Triton tile builder made with this schedule (one launch
    each for the lists and, with the order, for the work entries) when the registered tile
    builder serves the schedule's device (``compiler.tiles.register_device_tile_builder``)."""
    builder = tiles_mod.device_tile_builder()
    serves = getattr(builder, "serves", None)
    if serves is not None and not torch.compiler.is_compiling() and serves(kind):
        made = _tile_builder().full_first_lists(kind, transposed)  # made with this schedule
        if made is not None:
            full_first, full_count, work = made
        else:
            lists = _tile_builder().tile_lists(kind.contiguous(), transposed=transposed)
            full_first, full_count, work = lists[2], lists[3], None
    else:
        full_first, full_count = split_full_first(kind, lists, counts, transposed=transposed)
        work = None
    if work is None:
        work = work_list(order, counts, full_count, full_first)
    return full_first, full_count, work


_TILE_BUILDER = []  # kernels/triton/tile_builder, imported on first use (it imports Triton)


def _tile_builder():
    if not _TILE_BUILDER:
        from . import tile_builder

        _TILE_BUILDER.append(tile_builder)
    return _TILE_BUILDER[0]


_DUMMY_BITS: dict[torch.device, torch.Tensor] = {}


def _bits_or_dummy(sched, plan) -> tuple[torch.Tensor, bool]:
    """``(words, is_bits)``: the schedule's bitmasks, or a 1x1x1 dummy when it has none
    (kernels need a pointer; never read). One dummy per device in eager calls: no operation
    per schedule.

    Under ``torch.compile`` the number of bitmask tiles of a schedule built while tracing is
    data-dependent (nothing may branch on it): a plan that can have bitmask tiles (a
    ``from_dense`` plan, or more than ``BITS_MIN_SLOTS`` interval slots per row: static) gets
    its bitmasks with one zero tile appended (never indexed), so the tensor is never empty;
    any other plan has none and gets the dummy."""
    dev = sched.kind.device
    if torch.compiler.is_compiling():
        from ...compiler.tiles import BITS_MIN_SLOTS

        may_have_bits = plan.encoding == "bits" or plan.row_lo.shape[-1] > BITS_MIN_SLOTS
        if may_have_bits and sched.bits.shape[-1] != 0:
            pad = sched.bits.new_zeros((1, *sched.bits.shape[1:]))
            return torch.cat([sched.bits, pad]), True
        return torch.zeros((1, 1, 1), dtype=torch.int32, device=dev), False
    if sched.bits.shape[0] and sched.bits.shape[-1]:
        return sched.bits, True
    dummy = _DUMMY_BITS.get(dev)
    if dummy is None:
        with torch.inference_mode(False):
            dummy = _DUMMY_BITS[dev] = torch.zeros((1, 1, 1), dtype=torch.int32, device=dev)
    return dummy, False


_BITS_T: dict[int, tuple[object, torch.Tensor]] = {}


def transposed_bits(bits: torch.Tensor, block_m: int, block_n: int) -> torch.Tensor:
    """``bits`` ``[P, block_m, ceil(block_n / 32)]`` re-packed along the queries:
    ``[P, block_n, ceil(block_m / 32)]``, bit ``r % 32`` of word ``r // 32`` of row ``c`` says
    key ``c`` of the tile is visible to its query ``r`` (what the dK/dV kernel reads: its
    scores are keys x queries). Tensor operations, no host synchronisation; cached while
    ``bits`` lives (in eager calls)."""
    import weakref

    from ...compiler.tiles import pack_bits, unpack_bits

    hit = None if torch.compiler.is_compiling() else _BITS_T.get(id(bits))
    if hit is not None and hit[0]() is bits:
        return hit[1]
    dense = unpack_bits(bits)[..., :block_n]  # [P, block_m, block_n]
    out = pack_bits(dense.transpose(1, 2)).contiguous()
    if not torch.compiler.is_compiling():
        key = id(bits)
        _BITS_T[key] = (weakref.ref(bits, lambda _, key=key: _BITS_T.pop(key, None)), out)
    return out


def forward_schedule(
    plan, block_m: int, block_n: int, *, bits: bool = False
) -> dict[str, torch.Tensor]:
    """The forward kernel's schedule for ``plan`` tiled ``block_m x block_n`` (``bits``: with
    bitmask tiles also at the plan's own tiling, see ``MaskPlan.tiles``; the attention calls
    ask for them).

    Returns:
        int32 tensors on the plan's device, keyed by :data:`FWD_SCHEDULE_FIELDS`: the tile
        schedule's ``kind, jlo, jhi, bits_index, q_count, q_order``; ``bits`` (a 1x1x1 dummy
        when the tiling has no bitmask tiles); ``q_list`` reordered FULL tiles first and
        ``q_full_count`` (see :func:`split_full_first`); ``q_work``, the q-tiles' entries
        in launch order (:func:`work_list`).
    """
    sched = plan.tiles(block_m, block_n, bits=bits)
    q_list, q_full_count, q_work = _full_first(
        sched.kind, sched.q_list, sched.q_count, sched.q_order, False
    )
    words, _ = _bits_or_dummy(sched, plan)  # the bitmask tensor (``bits`` is the keyword)
    return {
        "kind": sched.kind,
        "jlo": sched.jlo,
        "jhi": sched.jhi,
        "bits_index": sched.bits_index,
        "bits": words,
        "q_count": sched.q_count,
        "q_full_count": q_full_count,
        "q_list": q_list,
        "q_order": sched.q_order,
        "q_work": q_work,
    }


#: Order of the dK/dV schedule tensors (the first half of the backward's ``bwd_schedule``; the
#: dQ kernel's half is a :func:`forward_schedule` at the dQ tiling, :data:`FWD_SCHEDULE_FIELDS`).
DKDV_SCHEDULE_FIELDS = (
    "kind", "jlo", "jhi", "bits_index", "bits", "kv_count", "kv_full_count", "kv_list", "kv_order",
    "kv_work",
)  # fmt: skip


def dkdv_schedule(
    plan, block_m: int, block_n: int, *, bits: bool = False
) -> dict[str, torch.Tensor]:
    """The dK/dV kernel's schedule for ``plan`` tiled ``block_m x block_n`` (``bits``: as in
    :func:`forward_schedule`).

    Returns:
        int32 tensors keyed by :data:`DKDV_SCHEDULE_FIELDS`: the tile schedule's ``kind, jlo,
        jhi, bits_index, kv_count, kv_order``; ``bits`` transposed (:func:`transposed_bits`,
        ``[P, block_n, ceil(block_m / 32)]``; a 1x1x1 dummy without bitmask tiles);
        ``kv_list`` (q-tiles per kv-tile) reordered FULL tiles first and ``kv_full_count``;
        ``kv_work``, the kv-tiles' entries in launch order (:func:`work_list`).
    """
    sched = plan.tiles(block_m, block_n, bits=bits)
    kv_list, kv_full_count, kv_work = _full_first(
        sched.kind, sched.kv_list, sched.kv_count, sched.kv_order, True
    )
    words, is_bits = _bits_or_dummy(sched, plan)  # the bitmask tensor (``bits`` is the keyword)
    if is_bits:
        words = transposed_bits(words, block_m, block_n)
    return {
        "kind": sched.kind,
        "jlo": sched.jlo,
        "jhi": sched.jhi,
        "bits_index": sched.bits_index,
        "bits": words,
        "kv_count": sched.kv_count,
        "kv_full_count": kv_full_count,
        "kv_list": kv_list,
        "kv_order": sched.kv_order,
        "kv_work": kv_work,
    }


def ds_slots(kind: torch.Tensor) -> torch.Tensor:
    """The dS buffer slot of every tile (``BwdConfig.ds_dq``): int32 [M, Tq, Tk], touched
    tiles numbered 0, 1, ... in row-major (q-tile, kv-tile) order per mask, -1 for EMPTY
    tiles. A few tensor operations, no host synchronisation."""
    touched = kind.ne(0)
    slots = (torch.cumsum(touched.flatten(1), 1, dtype=torch.int32) - 1).view(kind.shape)
    return torch.where(touched, slots, -1)
