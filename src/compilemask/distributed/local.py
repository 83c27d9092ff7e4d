"""A rank's share of the work: its query rows against each owner's key chunks, as exact plans.

For query rows ``rows`` (tiled-order positions, a rank's shard) and a set ``S`` of key chunks
laid out one after the other in ascending order, the plan of ``rows`` against those keys is
derived from the plan's row intervals: with ``f(x)`` = the number of keys of ``S`` left of
``x``, an interval ``[lo, hi)`` holds exactly the keys ``[f(lo), f(hi))`` of the local buffer
(keys of ``S`` inside it are consecutive there). Empty images are dropped and images that touch
(their gap was made of keys outside ``S``) are merged, so the sub-plan has the invariants of
every plan and its mask is exactly the plan's mask restricted to ``rows x S``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..compiler.plan import MaskPlan, built_plans, outside_inference_mode
from ..compiler.tiles import build_tiles
from .balance import ShardMap


@dataclass(frozen=True)
class Piece:
    """The rank's query rows against the key chunks of one owner.

    Attributes:
        owner: the rank holding these keys.
        chunks: their chunk indices, ascending.
        positions: int64 ``[len(chunks) * C]``: where those keys sit in the owner's shard.
        plan: the sub-plan, ``q_len = n`` (the rank's rows), ``kv_len = len(chunks) * C``.
    """

    owner: int
    chunks: list[int]
    positions: torch.Tensor
    plan: MaskPlan


@dataclass(frozen=True)
class RankWork:
    """What one rank computes and exchanges under a :class:`ShardMap`.

    Attributes:
        rank: this rank.
        pieces: the local piece first (keys it holds), then one per other owner it needs keys
            from, in rank order; owners it needs nothing from have no piece.
        sends: ``(peer, positions)`` for every other rank that needs keys of this rank:
            int64 positions in this rank's shard, ascending (what ``peer``'s piece of this
            owner holds, in its order).
    """

    rank: int
    pieces: list[Piece]
    sends: list[tuple[int, torch.Tensor]]


def rank_work(shard: ShardMap, rank: int) -> RankWork:
    """The :class:`RankWork` of ``rank`` (cached on the shard map, one per rank)."""
    shard._check_rank(rank)
    key = ("work", rank)
    if key not in shard._cache:
        shard._cache[key] = _build(shard, rank)
    return shard._cache[key]


def _positions_in_owner(shard: ShardMap, owner: int, chunks: list[int]) -> torch.Tensor:
    mine = {c: i for i, c in enumerate(shard.chunks[owner])}
    idx = torch.tensor([mine[c] for c in chunks], dtype=torch.int64)
    return (idx[:, None] * shard.chunk + torch.arange(shard.chunk)).reshape(-1)


@outside_inference_mode
def _build(shard: ShardMap, rank: int) -> RankWork:
    plan = shard.plan.in_permuted_order()
    rows = shard.positions(rank).to(plan.device)
    owners = [rank] + [o for o in range(shard.world_size) if o != rank]
    pieces = []
    for o in owners:
        sel = shard.needed[rank] & (shard.owner == o)
        chunks = torch.nonzero(sel).flatten().tolist()
        if not chunks:
            continue
        sub = sub_plan(plan, rows, sel, shard.chunk)
        pieces.append(Piece(o, chunks, _positions_in_owner(shard, o, chunks), sub))
    sends = []
    for peer in range(shard.world_size):
        if peer == rank:
            continue
        chunks = torch.nonzero(shard.needed[peer] & (shard.owner == rank)).flatten().tolist()
        if chunks:
            sends.append((peer, _positions_in_owner(shard, rank, chunks)))
    return RankWork(rank, pieces, sends)


def sub_plan(plan: MaskPlan, rows: torch.Tensor, keys: torch.Tensor, chunk: int) -> MaskPlan:
    """The exact plan of query rows ``rows`` against the key chunks ``keys``.

    Args:
        plan: an interval-encoded plan without permutation (tiled order).
        rows: int64 ``[n]`` query positions (any order: row ``i`` of the sub-plan is
            ``rows[i]``), ``n`` a multiple of ``plan.block_m``.
        keys: bool ``[N / chunk]``: the key chunks kept, laid out ascending.
        chunk: tokens per chunk (a multiple of ``plan.block_n``).

    Returns:
        A :class:`MaskPlan` with ``q_len = n``, ``kv_len = chunk * keys.sum()``, the plan's
        batch / heads and tiling; ``visible[m, i, j]`` of it equals the plan's
        ``visible[m, rows[i], key j of the kept chunks]``.
    """
    dev = plan.device
    member = keys.to(dev).repeat_interleave(chunk).to(torch.int32)
    f = torch.zeros(plan.kv_len + 1, dtype=torch.int32, device=dev)
    torch.cumsum(member, 0, out=f[1:])
    kv_len = int(f[-1])
    lo = f[plan.row_lo[:, rows].long()]
    hi = f[plan.row_hi[:, rows].long()]
    m, n, k = lo.shape
    slot = torch.arange(k, device=dev, dtype=torch.int32)
    valid = slot < plan.row_count[:, rows, None]
    nonempty = valid & (lo < hi)
    # an image starts a new interval unless it touches the last non-empty image before it
    last_hi = torch.cummax(torch.where(nonempty, hi, -1), -1).values
    prev_hi = torch.cat([torch.full_like(last_hi[..., :1], -1), last_hi[..., :-1]], -1)
    start = nonempty & (prev_hi < lo)
    index = torch.cumsum(start.to(torch.int32), -1) - 1
    count = start.sum(-1, dtype=torch.int32)
    slots = max(1, int(count.max()) if count.numel() else 1)
    dummy = torch.full_like(index, slots)
    new_lo = torch.full((m, n, slots + 1), kv_len, dtype=torch.int32, device=dev)
    new_lo.scatter_(-1, torch.where(start, index, dummy).long(), lo)
    new_hi = torch.zeros((m, n, slots + 1), dtype=torch.int32, device=dev)
    new_hi.scatter_reduce_(-1, torch.where(nonempty, index, dummy).long(), hi, "amax")
    new_lo = new_lo[..., :slots].contiguous()
    used = torch.arange(slots, device=dev, dtype=torch.int32) < count[..., None]
    new_hi = torch.where(used, new_hi[..., :slots], kv_len).contiguous()
    schedule = build_tiles(
        new_lo, new_hi, count, n, kv_len, plan.block_m, plan.block_n, use_bits=dev.type == "cpu"
    )
    with built_plans():  # exact by construction (tests verify them)
        return MaskPlan(
            n, kv_len, plan.batch, plan.heads, new_lo, new_hi, count, schedule,
            source=f"{plan.source} (rows of one rank against {kv_len} keys)",
        )  # fmt: skip
