"""The token-permutation pass (docs/design.md): the intervals of a mask whose grid tokens
are reordered into 2-D tiles (``tile_grid``).

With ``perm`` (tiled position -> original position) and ``inv`` its inverse, row ``i`` of the
tiled mask is row ``perm[i]`` of the original mask with every key ``k`` moved to ``inv[k]``.
The original axis splits into *atoms*: maximal runs of positions that ``inv`` maps to
consecutive positions (outside the grids one run; inside a grid one run per grid row and tile
column). An interval ``[a, b)`` meets the atoms ``atom[a] .. atom[b - 1]`` and maps to one
contiguous piece per atom; the pieces of a row, sorted and with touching pieces merged, are the
tiled row's intervals. Work O(pieces) (about intervals x atoms met), vectorised, with host reads
of the number of pieces and of intervals per row.
"""

from __future__ import annotations

import torch


def permute_rows(lo: torch.Tensor, hi: torch.Tensor, perm: torch.Tensor, kv_len: int):
    """Canonical ``(lo, hi, count)`` ``[M, Nq, K']`` of the permuted mask of canonical
    intervals ``[M, Nq, K]`` (``perm``: int64 ``[Nq]``, with ``Nq == kv_len``)."""
    dev = lo.device
    m, n, k = lo.shape
    perm = perm.to(dev)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(n, device=dev)
    # atoms of the original axis
    is_start = torch.ones(n, dtype=torch.bool, device=dev)
    is_start[1:] = inv[1:] != inv[:-1] + 1
    atom_of = torch.cumsum(is_start, 0) - 1  # [N]
    atom_old = is_start.nonzero().flatten()  # first original position of each atom
    atom_new = inv[atom_old]  # where it lands
    atom_end = torch.cat([atom_old[1:], torch.tensor([n], device=dev)])
    # rows in the tiled order, intervals as pieces
    a = lo[:, perm].reshape(-1).long()
    b = hi[:, perm].reshape(-1).long()
    live = a < b
    first = atom_of[a.clamp(max=n - 1)]
    last = atom_of[(b - 1).clamp(min=0, max=n - 1)]
    pieces = torch.where(live, last - first + 1, 0)
    total = int(pieces.sum())
    src = torch.repeat_interleave(torch.arange(a.numel(), device=dev), pieces, output_size=total)
    offset = torch.cumsum(pieces, 0) - pieces
    atom = first[src] + (torch.arange(total, device=dev) - offset[src])
    start = torch.maximum(a[src], atom_old[atom])
    stop = torch.minimum(b[src], atom_end[atom])
    new_lo = atom_new[atom] + (start - atom_old[atom])
    new_hi = new_lo + (stop - start)
    row = src // k  # row index in [M * Nq]
    # sort by (row, new_lo), merge touching pieces
    order = torch.argsort(row * (kv_len + 1) + new_lo)
    row, new_lo, new_hi = row[order], new_lo[order], new_hi[order]
    begins = torch.ones(total, dtype=torch.bool, device=dev)
    if total > 1:
        begins[1:] = (row[1:] != row[:-1]) | (new_lo[1:] != new_hi[:-1])
    run = torch.cumsum(begins, 0) - 1
    n_runs = int(run[-1]) + 1 if total else 0
    out_lo = new_lo[begins]
    out_hi = torch.zeros(n_runs, dtype=torch.long, device=dev)
    out_hi.scatter_reduce_(0, run, new_hi, reduce="amax", include_self=False)
    out_row = row[begins]
    count = torch.bincount(out_row, minlength=m * n)
    k_out = max(1, int(count.max()) if count.numel() else 1)
    first_run = torch.cumsum(count, 0) - count
    slot = torch.arange(n_runs, device=dev) - first_run[out_row]
    res_lo = torch.full((m * n, k_out), kv_len, dtype=torch.int32, device=dev)
    res_hi = res_lo.clone()
    res_lo[out_row, slot] = out_lo.to(torch.int32)
    res_hi[out_row, slot] = out_hi.to(torch.int32)
    return (
        res_lo.view(m, n, k_out),
        res_hi.view(m, n, k_out),
        count.to(torch.int32).view(m, n),
    )
