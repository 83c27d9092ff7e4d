"""The token-permutation pass (DESIGN.md section 4): the intervals of a mask whose grid tokens
are reordered into 2-D tiles (``tile_grid``).

With ``perm`` (tiled position -> original position), row ``i`` of the tiled mask sees key
``j`` when row ``perm[i]`` of the original mask sees key ``perm[j]``. The rows are rebuilt in
chunks: gather the original rows' intervals, expand them to boolean rows, reorder the columns
by ``perm`` and take the maximal runs again. That is O(Nq * Nk) element work in chunks of
``_CHUNK_ELEMS`` (never N x N memory at once) and one host read of the number of intervals
per chunk; the tiled mask usually needs fewer intervals per row than the row-major one.
"""

from __future__ import annotations

import torch

from . import intervals as iv

_CHUNK_ELEMS = 1 << 24


def permute_rows(lo: torch.Tensor, hi: torch.Tensor, perm: torch.Tensor, kv_len: int):
    """Canonical ``(lo, hi, count)`` ``[M, Nq, K']`` of the permuted mask of canonical
    intervals ``[M, Nq, K]`` (``perm``: int64 ``[Nq]``, with ``Nq == kv_len``)."""
    m, n, _ = lo.shape
    rows = max(1, _CHUNK_ELEMS // kv_len)
    parts = []
    for start in range(0, n, rows):
        src = perm[start : start + rows]
        dense = iv.dense_rows(lo[:, src], hi[:, src], kv_len)  # [M, r, Nk], original key order
        parts.append(iv.from_dense_rows(dense[..., perm], kv_len))
    k = max(p[0].shape[-1] for p in parts)
    padded = [iv.pad_k(p[0], p[1], k, kv_len) for p in parts]
    return (
        torch.cat([p[0] for p in padded], 1).contiguous(),
        torch.cat([p[1] for p in padded], 1).contiguous(),
        torch.cat([p[2] for p in parts], 1).contiguous(),
    )
