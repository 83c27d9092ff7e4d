"""The balancer: token chunks to ranks by visible pairs, and the shard map it returns.

A plan knows the visible pairs of every (q-tile, kv-tile) (``schedule.pairs``). Cutting the
sequence into chunks of ``chunk`` tokens (the plan's tiles, or a tiling of chunk-sized tiles
derived from its intervals) gives the work of every query chunk exactly: its visible pairs,
summed over the plan's masks (the forward and the backward both cost about that many pairs,
and in the distributed call both run on the rank that holds the query rows).

:func:`balance` gives every rank the same number of chunks (so the shards of q, k, v have one
length, like the rest of the model's activations) and about the same number of visible pairs,
keeping runs of chunks together where the balance allows (a rank needs fewer keys of others
when its rows are contiguous):

1. for ``s`` = 1, 2, 4, ... segments per rank (up to one chunk per segment), the sequence is
   cut into ``s * R`` contiguous segments of equal length and the segments are assigned:
   longest processing time first (by decreasing work, each to the least loaded rank that
   still has room), then swaps (while the most and the least loaded ranks hold a pair of
   segments whose exchange narrows their gap, the best such pair is swapped), then swaps of
   single chunks the same way (a few heavy chunks, e.g. rows that see the whole sequence,
   leave their segment);
2. of these assignments, the one whose ranks receive the fewest key chunks (the largest
   count over ranks, then the total) among those with max / mean work within
   ``tolerance``; when none is within it, the best balanced one.

Legend: ``R`` ranks, ``C`` chunk tokens, ``Nc = N / C`` chunks, ``n = N / R`` tokens per rank.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch

from ..compiler.plan import MaskPlan
from ..errors import InputError


@dataclass(eq=False)
class ShardMap:
    """Which rank holds which token chunks, and what each rank needs from the others.

    Token positions are the plan's tiled order (the identity but for ``tile_grid`` plans);
    :meth:`token_index` maps them to the caller's order.

    Attributes:
        plan: the plan balanced (q_len == kv_len == ``N``).
        world_size: ``R``.
        chunk: ``C``, tokens per chunk.
        owner: int64 ``[Nc]``: the rank holding chunk ``c`` (query rows and keys alike).
        chunks: per rank, its chunk indices ascending (``N / (R * C)`` each); a rank's shard is
            the concatenation of its chunks in this order.
        work: int64 ``[R]``: visible pairs of each rank's query rows, over all the plan's masks.
        needed: bool ``[R, Nc]``: key chunks holding a key that a query row of the rank sees.
    """

    plan: MaskPlan
    world_size: int
    chunk: int
    owner: torch.Tensor
    chunks: list[list[int]]
    work: torch.Tensor
    needed: torch.Tensor
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def local_len(self) -> int:
        """Tokens per rank, ``n = N / R``."""
        return self.plan.q_len // self.world_size

    @property
    def imbalance(self) -> float:
        """max / mean visible pairs per rank (1.0 is perfect; 1.0 for a mask with no pair)."""
        mean = float(self.work.double().mean())
        return float(self.work.max()) / mean if mean > 0 else 1.0

    def positions(self, rank: int) -> torch.Tensor:
        """int64 ``[n]``: the tiled-order positions of ``rank``'s tokens, in shard order."""
        self._check_rank(rank)
        key = ("positions", rank)
        if key not in self._cache:
            c = torch.tensor(self.chunks[rank], dtype=torch.int64)
            pos = (c[:, None] * self.chunk + torch.arange(self.chunk)).reshape(-1)
            self._cache[key] = pos
        return self._cache[key]

    def token_index(self, rank: int) -> torch.Tensor:
        """int64 ``[n]``: the caller's token positions of ``rank``'s shard, in shard order
        (for a ``tile_grid`` plan, its permutation applied)."""
        pos = self.positions(rank)
        perm = self.plan.permutation
        return pos if perm is None else perm.cpu()[pos]

    def shard(self, x: torch.Tensor, rank: int, dim: int = 2) -> torch.Tensor:
        """``rank``'s shard of ``x`` (the full sequence along ``dim``, e.g. q, k, v
        ``[B, H, N, D]``): ``[..., n, ...]``, a copy (differentiable).

        Raises:
            InputError: ``x`` does not hold ``N`` tokens along ``dim``.
        """
        if not isinstance(x, torch.Tensor) or x.dim() <= dim or x.shape[dim] != self.plan.q_len:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise InputError(
                f"x must hold the plan's {self.plan.q_len} tokens along dim {dim}, got {shape}"
            )
        return x.index_select(dim, self.token_index(rank).to(x.device))

    def unshard(self, parts, dim: int = 2) -> torch.Tensor:
        """The full sequence, in the caller's order, from every rank's shard (a list of
        ``R`` tensors of ``n`` tokens along ``dim``, rank order)."""
        if len(parts) != self.world_size:
            raise InputError(f"parts must hold {self.world_size} shards, got {len(parts)}")
        for r, p in enumerate(parts):
            if p.dim() <= dim or p.shape[dim] != self.local_len:
                raise InputError(
                    f"parts[{r}] must hold {self.local_len} tokens along dim {dim}, "
                    f"got shape {tuple(p.shape)}"
                )
        full = torch.cat(list(parts), dim)
        order = torch.cat([self.token_index(r) for r in range(self.world_size)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return full.index_select(dim, inverse.to(full.device))

    def report(self, bytes_per_token: int = 0) -> dict:
        """Balance and traffic: visible pairs per rank, ``imbalance`` (max / mean), and with
        ``bytes_per_token`` (of k and v together, all heads and batch rows) the bytes each rank
        receives in the forward beside ring attention's (``(R - 1) * n`` tokens per rank; the
        backward sends as many back)."""
        chunks_in = [
            int((self.needed[r] & (self.owner != r)).sum()) for r in range(self.world_size)
        ]
        out = {
            "world_size": self.world_size,
            "chunk": self.chunk,
            "tokens": self.plan.q_len,
            "work": [int(w) for w in self.work],
            "imbalance": round(self.imbalance, 4),
            "recv_tokens": [c * self.chunk for c in chunks_in],
            "ring_recv_tokens": (self.world_size - 1) * self.local_len,
        }
        if bytes_per_token:
            out["recv_bytes"] = [t * bytes_per_token for t in out["recv_tokens"]]
            out["ring_recv_bytes"] = out["ring_recv_tokens"] * bytes_per_token
        return out

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise InputError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")


def default_chunk(plan: MaskPlan) -> int:
    """The smallest chunk of whole tiles of the plan: ``lcm(block_m, block_n)`` tokens."""
    return math.lcm(plan.block_m, plan.block_n)


def balance(
    plan: MaskPlan, world_size: int, *, chunk: int | None = None, tolerance: float = 1.02
) -> ShardMap:
    """Assign the plan's token chunks to ``world_size`` ranks, balanced by visible pairs.

    Args:
        plan: a plan with ``q_len == kv_len`` (self-attention over one sequence) and
            interval encoding (a plan of ``compile``; ``from_dense`` plans stored as bitmasks
            are refused). Batch- and head-dependent plans are balanced over all their masks.
        world_size: ranks ``R`` (int >= 1).
        chunk: tokens per chunk; default :func:`default_chunk`. A multiple of the plan's
            tiles reads the plan's pair counts; another size derives a ``chunk x chunk``
            tiling from the intervals first (``plan.tiles``, cached on the plan): finer chunks
            balance masks with a few very heavy rows. ``q_len`` must be a multiple of
            ``R * chunk``.
        tolerance: the max / mean pairs per rank accepted in exchange for less traffic:
            of the segmentations tried (see the module docstring), the one whose ranks
            receive the fewest key chunks among those within ``tolerance``, else the best
            balanced one.

    Returns:
        A :class:`ShardMap` (``shard_map.imbalance``: max / mean pairs per rank). The same
        inputs give the same map on every rank (no communication).

    Raises:
        InputError: ``q_len != kv_len``, a bitmask-encoded plan, a bad ``world_size`` or
            ``chunk``, or a length that is not a multiple of ``world_size * chunk``.

    Example::

        >>> plan = cm.compile(cm.masks.causal(), 4096, block_m=64, block_n=64)
        >>> balance(plan, 4).imbalance < 1.01
        True
    """
    if not isinstance(plan, MaskPlan):
        raise InputError(f"plan must be a MaskPlan, got {type(plan).__name__}")
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not (1.0 <= tolerance < float("inf"))
    ):
        raise InputError(f"tolerance must be a finite number >= 1, got {tolerance!r}")
    if plan.q_len != plan.kv_len:
        raise InputError(
            f"context parallelism shards one sequence for queries and keys alike: the plan "
            f"needs q_len == kv_len, got q_len={plan.q_len}, kv_len={plan.kv_len}"
        )
    if plan.encoding != "intervals":
        raise InputError(
            "plan: context parallelism derives the ranks' plans from row intervals; this plan "
            f"stores its rows as bitmasks (encoding={plan.encoding!r}); compile the mask with "
            "compilemask.compile instead"
        )
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size must be a positive int, got {world_size!r}")
    tile = default_chunk(plan)
    if chunk is None:
        chunk = tile
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InputError(f"chunk must be a positive int (tokens), got {chunk!r}")
    if plan.q_len % (world_size * chunk):
        raise InputError(
            f"q_len={plan.q_len} must be a multiple of world_size * chunk = {world_size} * "
            f"{chunk} (pad the sequence, or pass a smaller chunk)"
        )
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or tolerance < 1:
        raise InputError(f"tolerance must be a number >= 1, got {tolerance!r}")
    # visible pairs per (q-tile, kv-tile): the plan's own tiling when the chunk is a multiple of
    # it, else the chunk-sized tiling derived from its intervals (cached on the plan)
    schedule = plan.schedule if chunk % tile == 0 else plan.tiles(chunk, chunk)
    pairs = schedule.pairs.to("cpu", torch.int64).sum(0)  # [Tq, Tk]
    per_m, per_n = chunk // schedule.block_m, chunk // schedule.block_n
    nc = plan.q_len // chunk
    work = pairs.view(nc, per_m, -1).sum((1, 2))  # [Nc] visible pairs per query chunk
    per_rank = nc // world_size
    best = None
    for s in _segment_counts(per_rank):
        seg = nc // (s * world_size)
        owner = _assign(work, world_size, seg, (1 + tolerance) / 2)
        rank_work = torch.zeros(world_size, dtype=torch.int64).index_add_(0, owner, work)
        needed = _needed(pairs, owner, world_size, per_m, per_n)
        mean = float(rank_work.double().mean())
        ratio = float(rank_work.max()) / mean if mean > 0 else 1.0
        moved = (needed & (owner[None, :] != torch.arange(world_size)[:, None])).sum(1)
        traffic = (int(moved.max()), int(moved.sum()))
        key = (ratio > tolerance, traffic if ratio <= tolerance else ratio, ratio)
        if best is None or key < best[0]:
            best = (key, owner, rank_work, needed)
    _, owner, rank_work, needed = best
    chunks = [torch.nonzero(owner == r).flatten().tolist() for r in range(world_size)]
    return ShardMap(plan, world_size, chunk, owner, chunks, rank_work, needed)


def _segment_counts(per_rank: int) -> list[int]:
    """Segments per rank tried: the powers of two dividing ``per_rank``, and ``per_rank``."""
    out, s = [], 1
    while s <= per_rank and per_rank % s == 0:
        out.append(s)
        s *= 2
    return out if out[-1] == per_rank else [*out, per_rank]


def _needed(pairs: torch.Tensor, owner: torch.Tensor, ranks: int, per_m: int, per_n: int):
    """bool ``[R, Nc]``: key chunks holding a key that a query row of the rank sees."""
    seen = torch.zeros(ranks, pairs.shape[1], dtype=torch.int64)
    seen.index_add_(0, owner.repeat_interleave(per_m), pairs)
    return seen.view(ranks, -1, per_n).sum(-1) > 0


def _assign(work: torch.Tensor, ranks: int, seg: int, slack: float) -> torch.Tensor:
    """int64 ``[Nc]`` chunk -> rank: equal chunk counts, work balanced. Segments of ``seg``
    chunks are assigned whole (LPT, then swaps of segments), then single chunks are swapped
    while that narrows the gap between the most and the least loaded ranks and the most
    loaded one holds more than ``slack`` times the mean."""
    seg_work = work.view(-1, seg).sum(1).tolist()
    ns = len(seg_work)
    cap = ns // ranks
    order = sorted(range(ns), key=lambda c: (-seg_work[c], c))
    heap = [(0, r) for r in range(ranks)]
    owned: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for c in order:
        while True:
            _, r = heapq.heappop(heap)
            if len(owned[r]) < cap:
                break
        owned[r].append(c)
        load[r] += seg_work[c]
        if len(owned[r]) < cap:
            heapq.heappush(heap, (load[r], r))
    _swaps(owned, load, seg_work, 4 * ns, 0)
    if seg > 1:
        owned = [[c * seg + i for c in cs for i in range(seg)] for cs in owned]
        _swaps(owned, load, work.tolist(), 4 * len(work), slack * sum(load) / ranks)
    owner = torch.empty(len(work), dtype=torch.int64)
    for r, cs in enumerate(owned):
        owner[cs] = r
    return owner


def _swaps(owned: list[list[int]], load: list[int], w: list[int], limit: int, enough) -> None:
    """Swap items between the most and the least loaded ranks while that narrows their gap
    and the most loaded one holds more than ``enough`` (in place; at most ``limit`` swaps)."""
    ranks = len(owned)
    for _ in range(limit):
        hi = max(range(ranks), key=lambda r: (load[r], -r))
        if load[hi] <= enough:
            break
        lo = min(range(ranks), key=lambda r: (load[r], r))
        best = _best_swap(owned[hi], owned[lo], w, load[hi] - load[lo])
        if best is None:
            break
        i, j, d = best
        owned[hi][i], owned[lo][j] = owned[lo][j], owned[hi][i]
        load[hi] -= d
        load[lo] += d


def _best_swap(a: list[int], b: list[int], w: list[int], gap: int):
    """``(i, j, d)``: swapping ``a[i]`` and ``b[j]`` moves ``d = w[a[i]] - w[b[j]]`` of work from
    a to b, with ``0 < d < gap`` and ``|gap - 2d|`` smallest; None when no swap narrows the gap."""
    if gap <= 1:
        return None
    wb = torch.tensor([w[c] for c in b], dtype=torch.int64)
    sb, ib = torch.sort(wb)
    wa = torch.tensor([w[c] for c in a], dtype=torch.int64)
    # for each chunk of a, the chunk of b whose weight is closest to w_a - gap / 2
    target = wa * 2 - gap  # want 2 * w_b close to this
    k = torch.searchsorted(sb * 2, target).clamp(0, len(sb) - 1)
    best = None
    for cand in (k - 1, k):
        cand = cand.clamp(0, len(sb) - 1)
        d = wa - sb[cand]
        ok = (d > 0) & (d < gap)
        score = torch.where(ok, (gap - 2 * d).abs(), torch.full_like(d, gap))
        i = int(torch.argmin(score))
        s = int(score[i])
        if s < gap and (best is None or s < best[0]):
            best = (s, i, int(ib[cand[i]]), int(d[i]))
    return None if best is None else best[1:]
