"""Which persistent CTA runs which work-list entry: greedy rounds over the entries' costs.

The kernel's ``num_ctas`` CTAs take one entry each per round: CTA ``c`` runs the entries at
positions ``r * num_ctas + c`` of the work list, ``r = 0, 1, ...``, while that is below the
list's length. :func:`cta_positions` chooses the positions: the entries are taken in their
given order (heaviest first, in L2 groups: :func:`.lower.work_order`) one round of
``num_ctas`` at a time, and within a round the heaviest entry goes to the CTA with the least
work so far (cost of an entry: :func:`entry_cost`). The CTAs that get an
entry in the last, partial round are renumbered to come first, so the last round fills
positions ``[R num_ctas, W)``. Entries of one round run at about the same time on every CTA,
so the order of the list (its L2 groups) is the order in time, and the greedy choice keeps
the CTAs' totals within one entry of each other on the seed workloads (a snake order over a
list in groups leaves up to 1.5x the mean on one CTA).

On CUDA the rounds run in one Triton program (``R`` steps of two 256-wide sorts; no host
synchronisation); on the CPU the same rounds in torch. Both break ties the same way (entries
by their place in the round, CTAs by their number), so they give the same positions.
"""

from __future__ import annotations

import torch

#: the cost of an entry in relative units: per FULL kv-tile, per PARTIAL kv-tile (its mask),
#: and once per entry (its Q load, pipeline start and epilogue)
COSTS = (2, 4, 3)


def entry_cost(work: torch.Tensor, costs: tuple[int, int, int] | None = None) -> torch.Tensor:
    """int64 ``[W]`` cost of each work entry ``(b, hq, qt, m, n, nf, ...)`` (``n`` kv-tiles,
    ``nf`` of them FULL) under ``costs`` (default :data:`COSTS`)."""
    full, partial, item = COSTS if costs is None else costs
    n, nf = work[:, 4].long(), work[:, 5].long()
    return full * nf + partial * (n - nf) + item


_LANE_BITS = 16  # lanes (CTAs, entries of a round) below 2**16
_MAX_CTAS = 1 << 10
_WMAX = 1 << 31


def cta_positions(cost: torch.Tensor, num_ctas: int) -> torch.Tensor:
    """int64 ``[W]``: the work-list position of each entry (see module).

    ``cost``: int ``[W]`` per entry, in list order, each in ``[0, 2**31)``; ``num_ctas`` in
    ``[1, 1024]``. Raises ValueError otherwise.
    """
    if cost.dim() != 1:
        raise ValueError(f"cost must be 1-D, got shape {tuple(cost.shape)}")
    if not 1 <= num_ctas <= _MAX_CTAS:
        raise ValueError(f"num_ctas must be in [1, {_MAX_CTAS}], got {num_ctas}")
    w = cost.numel()
    if w == 0:
        return torch.zeros(0, dtype=torch.int64, device=cost.device)
    if cost.device.type == "cuda":
        cta = _rounds_triton(cost, num_ctas)
    else:
        cta = _rounds_torch(cost, num_ctas)
    return _positions(cta, w, num_ctas)


def _rounds_torch(cost: torch.Tensor, c: int) -> torch.Tensor:
    w = cost.numel()
    cost = cost.to(torch.int64)
    load = torch.zeros(c, dtype=torch.int64, device=cost.device)
    cta = torch.empty(w, dtype=torch.int64, device=cost.device)
    for r0 in range(0, w, c):
        x = cost[r0 : r0 + c]
        items = torch.argsort(-x, stable=True)
        ctas = torch.argsort(load, stable=True)[: x.numel()]
        cta[r0 + items] = ctas
        load[ctas] += x[items]
    return cta


def _rounds_triton(cost: torch.Tensor, c: int) -> torch.Tensor:
    from ..triton.cta_rounds import rounds_kernel

    w = cost.numel()
    cta = torch.empty(w, dtype=torch.int64, device=cost.device)
    block = max(16, 1 << (c - 1).bit_length())
    rounds_kernel[(1,)](cost.contiguous(), cta, w, c, BLOCK=block, WMAX=_WMAX, num_warps=4)
    return cta


def _positions(cta: torch.Tensor, w: int, c: int) -> torch.Tensor:
    """Positions ``r * c + label[cta]``, the CTAs of the last round labelled first."""
    dev = cta.device
    rnd = torch.arange(w, device=dev) // c
    last0 = (w - 1) // c * c
    in_last = torch.zeros(c, dtype=torch.int64, device=dev)
    in_last[cta[last0:]] = 1
    # label: CTAs with an entry in the last round first, each side by CTA number
    order = torch.argsort(1 - in_last, stable=True)
    label = torch.empty(c, dtype=torch.int64, device=dev)
    label[order] = torch.arange(c, device=dev)
    return rnd * c + label[cta]


__all__ = ["COSTS", "cta_positions", "entry_cost"]
