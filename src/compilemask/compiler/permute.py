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


def tiled_natten_fits(grid, kernel, tile, q_len: int, kv_len: int) -> bool:
    """Whether :func:`tiled_natten_rows` builds ``tile_grid(natten2d(grid, kernel), tile)``:
    the grid is the whole axis, whole tiles cover it, and the window is smaller than a tile
    along each axis (``kh < th``, ``kw < tw``), so no two of a row's pieces touch."""
    (h, w), (kh, kw), (th, tw) = grid, kernel, tile
    return q_len == kv_len == h * w and h % th == 0 and w % tw == 0 and kh < th and kw < tw


def tiled_natten_rows(grid, kernel, tile, device, *, trim: bool):
    """Canonical ``(lo, hi, count)`` ``[1, N, K]`` of ``tile_grid(natten2d(grid, kernel),
    tile)`` in its tiled order, in closed form (about 40 operations, no host read; what
    :func:`permute_rows` makes of the row-major rows, where :func:`tiled_natten_fits`).

    Query ``i`` is cell ``(y, x)`` of tile ``(i // T) // A, (i // T) % A`` (``T = th tw``
    tokens a tile, ``A = w / tw`` tiles a tile row); its window is rows ``y0 .. y0 + kh - 1``
    and columns ``x0 .. x0 + kw - 1`` (shifted inward at the borders). The window meets at
    most two tile rows (``kh < th``) and two tile columns (``kw < tw``); each window row
    gives one piece per tile column it meets, contiguous in the tiled order. In key order
    the pieces are: the first tile row's rows in its first tile column, then in its second,
    then the second tile row's likewise, so slot ``s`` of a row is found from the number of
    window rows in the first tile row (``n0``) and of tile columns (``nc``)."""
    (h, w), (kh, kw), (th, tw) = grid, kernel, tile
    n, t, a = h * w, th * tw, w // tw
    i = torch.arange(n, device=device, dtype=torch.int32)
    tile_id, off = i // t, i % t
    y = (tile_id // a) * th + off // tw
    x = (tile_id % a) * tw + off % tw
    y0 = y.clamp(kh // 2, h - 1 - kh // 2) - kh // 2
    x0 = x.clamp(kw // 2, w - 1 - kw // 2) - kw // 2
    ya, xa = y0 // th, x0 // tw
    n0 = torch.clamp((ya + 1) * th - y0, max=kh)  # window rows in the first tile row
    nc = 1 + (x0 % tw + kw > tw).int()  # tile columns met
    if trim:  # the largest count, on the host: kh times the most tile columns of a window
        xs = range(0, w - kw + 1)
        k = kh * (2 if any(x % tw + kw > tw for x in xs) else 1)
    else:
        k = 2 * kh
    s = torch.arange(k, device=device, dtype=torch.int32)[None, :]
    n0c, ncc, x0c, y0c = n0[:, None], nc[:, None], x0[:, None], y0[:, None]
    first = s < n0c * ncc
    rest = s - n0c * ncc
    n1 = (kh - n0c).clamp(min=1)
    dy = (~first).int()
    dx = torch.where(first, s // n0c, rest // n1)
    r = torch.where(first, s % n0c, n0c + rest % n1)
    tx = xa[:, None] + dx
    xs_ = torch.maximum(x0c, tx * tw)
    xe = torch.minimum(x0c + kw, (tx + 1) * tw)
    yr = y0c + r
    lo = ((ya[:, None] + dy) * a + tx) * t + (yr % th) * tw + (xs_ - tx * tw)
    hi = lo + (xe - xs_)
    used = s < kh * ncc
    pad = torch.full((), n, dtype=torch.int32, device=device)
    lo = torch.where(used, lo, pad)
    hi = torch.where(used, hi, pad)
    return lo[None], hi[None], (kh * nc).to(torch.int32)[None]
