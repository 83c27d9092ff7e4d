"""Reference decode attention over a paged KV cache: gather the pages, then compute by the
definition (the oracle of the paged kernels)."""

from __future__ import annotations

import torch

from ...compiler.intervals import dense_rows
from .kernel import _precision


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, P * page_size, D]``: each batch row's keys (or values) in key order, from a
    ``[num_pages, page_size, Hkv, D]`` cache and an int ``[B, P]`` page table (indices clamped
    to the pages that exist)."""
    pages = block_table.long().clamp(0, cache.shape[0] - 1)
    rows = cache[pages]  # [B, P, page_size, Hkv, D]
    B, P, S, H, D = rows.shape
    return rows.reshape(B, P * S, H, D).transpose(1, 2)


def paged_reference_attention(
    q, k_cache, v_cache, row_lo, row_hi, block_table, cache_seqlens, scale=None, *,
    compute_dtype=None, matmul_dtype=None,
):  # fmt: skip
    """Masked attention of ``q`` [B, Hq, Nq, D] over paged caches, by the definition.

    Args:
        k_cache, v_cache: [num_pages, page_size, Hkv, D].
        row_lo, row_hi: int32 [Mb, Nq, K] (Mb = 1 or B), absolute key positions.
        block_table: int [B, P]; cache_seqlens: int [B] (keys at or past it are hidden).
        scale, compute_dtype, matmul_dtype: as :func:`.kernel.reference_attention`.

    Returns:
        (out [B, Hq, Nq, D], lse [B, Hq, Nq]) as :func:`.kernel.reference_attention`: rows that
        see no key give out 0 and lse -inf.
    """
    B, Hq, Nq, D = q.shape
    k, v = gather_pages(k_cache, block_table), gather_pages(v_cache, block_table)
    Hkv, Nk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    compute_dtype, matmul_dtype, out_dtype, scale = _precision(
        q.dtype, D, compute_dtype, matmul_dtype, scale
    )
    keys = torch.arange(Nk, device=q.device)
    visible = dense_rows(row_lo, row_hi, Nk) & (keys < cache_seqlens.long()[:, None, None])
    visible = visible.expand(B, Nq, Nk)[:, None, None]  # [B, 1, 1, Nq, Nk]
    qg = q.reshape(B, Hkv, G, Nq, D).to(matmul_dtype)
    s = torch.matmul(qg, k[:, :, None].to(matmul_dtype).transpose(-1, -2)).to(compute_dtype)
    s = torch.where(visible, s * scale, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    seen = torch.isfinite(lse)
    p = torch.exp(s - torch.where(seen, lse, 0.0)[..., None])
    out = torch.matmul(p.to(matmul_dtype), v[:, :, None].to(matmul_dtype)).to(compute_dtype)
    out = torch.where(seen[..., None], out, 0.0)
    lse = torch.where(seen, lse, float("-inf"))
    return out.reshape(B, Hq, Nq, D).to(out_dtype), lse.reshape(B, Hq, Nq).to(compute_dtype)
