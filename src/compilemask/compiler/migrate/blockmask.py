"""FlexAttention ``BlockMask`` interop, both ways: ``from_block_mask`` and ``plan.to_block_mask``.

A ``BlockMask`` lets a pair (q, k) through when its block is a full block, or a partial block
where ``mask_mod(b, h, q, k)`` holds. ``from_block_mask`` builds exactly that: the mask_mod's
plan (``from_mask_mod``) intersected with the block list, united with the full blocks, all as
row intervals. ``to_block_mask`` lists the plan's FULL and PARTIAL tiles as Flex's full and
partial blocks and gives a mask_mod that reads the plan's intervals (an unrolled OR over the K
slots: element-wise, as FlexAttention's compiled kernels need).
"""

from __future__ import annotations

import torch

from ...errors import CompileMaskError
from .. import intervals as iv
from ..plan import MaskPlan
from ..tiles import EMPTY, FULL, PARTIAL_BITS, build_tiles


def _block_intervals(num, idx, q_len, kv_len, bm, bn):
    """Row intervals ``[B, H, Nq, K]`` of the blocks listed by ``num [B, H, Tq]`` /
    ``idx [B, H, Tq, Tk]`` (Flex's layout), as canonical ``(lo, hi)``."""
    b, h, tq = num.shape
    tk = -(-kv_len // bn)
    listed = torch.zeros((b, h, tq, tk + 1), dtype=torch.bool, device=num.device)
    slot = torch.arange(idx.shape[-1], device=num.device)
    used = slot < num[..., None]
    listed.scatter_(-1, torch.where(used, idx.long().clamp(0, tk - 1), tk), True)
    listed = listed[..., :tk]
    lo, hi, _ = iv.from_dense_rows(listed, tk)
    lo = (lo.long() * bn).clamp(max=kv_len)
    hi = (hi.long() * bn).clamp(max=kv_len)
    lo = lo.repeat_interleave(bm, dim=2)[:, :, :q_len]
    hi = hi.repeat_interleave(bm, dim=2)[:, :, :q_len]
    return lo.to(torch.int32), hi.to(torch.int32)


def from_block_mask(block_mask, *, batch=None, heads=None, block_m=None, block_n=None, device=None):
    """Build a plan with exactly the mask of a FlexAttention ``BlockMask``: its full blocks,
    and its partial blocks where its ``mask_mod`` holds (``mask_mod`` None: the whole block).

    Args:
        block_mask: a ``torch.nn.attention.flex_attention.BlockMask`` ``[B, H, Tq, Tk]``.
        batch, heads: evaluate the mask_mod per batch row / head (default: the BlockMask's B
            and H when above 1, else the plan broadcasts, as the BlockMask does).
        block_m, block_n: the plan's tiling (default: the BlockMask's block size).
        device: where the plan lives (default: the BlockMask's device).

    Raises:
        CompileMaskError: not a BlockMask, or batch/heads that contradict its B/H.
    """
    from torch.nn.attention.flex_attention import BlockMask

    from . import from_mask_mod

    if not isinstance(block_mask, BlockMask):
        raise CompileMaskError(
            f"block_mask must be a FlexAttention BlockMask, got {type(block_mask).__name__}"
        )
    q_len, kv_len = block_mask.seq_lengths
    bm, bn = block_mask.BLOCK_SIZE
    b0, h0 = block_mask.kv_num_blocks.shape[:2]
    for given, own, name in ((batch, b0, "batch"), (heads, h0, "heads")):
        if given is not None and own > 1 and given != own:
            raise CompileMaskError(f"{name}={given}, but the BlockMask has {own}")
    batch = batch if batch is not None else (b0 if b0 > 1 else None)
    heads = heads if heads is not None else (h0 if h0 > 1 else None)
    device = torch.device(device) if device is not None else block_mask.kv_num_blocks.device
    block_m = bm if block_m is None else block_m  # 0 and other bad sizes: refused by the build
    block_n = bn if block_n is None else block_n
    mm = block_mask.mask_mod
    if mm is None:
        mm = _noop
    plan = from_mask_mod(
        mm, q_len, kv_len, batch=batch, heads=heads, block_m=block_m, block_n=block_n,
        device=device,
    )  # fmt: skip
    m_b, m_h = batch or 1, heads or 1

    def per_mask(lo, hi):  # [B0, H0, Nq, K] -> [M, Nq, K] matching the plan's masks
        lo = lo.to(device).expand(m_b, m_h, *lo.shape[2:]).reshape(m_b * m_h, q_len, -1)
        hi = hi.to(device).expand(m_b, m_h, *hi.shape[2:]).reshape(m_b * m_h, q_len, -1)
        return lo, hi

    def listed(num, idx):
        return per_mask(*_block_intervals(num, idx, q_len, kv_len, bm, bn))

    part = listed(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = None
    if block_mask.full_kv_num_blocks is not None:
        full = listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    if plan.encoding == "bits":
        dense = plan.to_dense().reshape(m_b * m_h, q_len, kv_len)
        lo, hi, _ = iv.from_dense_rows(dense, kv_len)
    else:
        lo, hi = plan.row_lo, plan.row_hi
    lo, hi, _ = iv.intersection((lo, hi), part, kv_len)
    if full is not None:
        lo, hi, _ = iv.union([(lo, hi), full], kv_len)
    lo, hi, count = iv.finish_compact(lo, hi, kv_len)
    lo, hi = lo.contiguous(), hi.contiguous()
    schedule = build_tiles(lo, hi, count, q_len, kv_len, block_m, block_n, use_bits=True)
    source = plan.source.replace("from_mask_mod", "from_block_mask")
    return MaskPlan(q_len, kv_len, batch, heads, lo, hi, count.contiguous(), schedule,
                    source=source)  # fmt: skip


def _noop(b, h, q_idx, kv_idx):
    return q_idx >= 0


def _lists(mask: torch.Tensor):
    """Flex's ``(num [.., Tq], indices [.., Tq, Tk])``: listed blocks first, ascending."""
    num = mask.sum(-1, dtype=torch.int32)
    idx = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return num, idx


def to_block_mask(plan: MaskPlan):
    """A FlexAttention ``BlockMask`` with the plan's mask (see :meth:`MaskPlan.to_block_mask`)."""
    from torch.nn.attention.flex_attention import BlockMask

    if plan.permutation is not None:
        raise CompileMaskError(
            "to_block_mask: this plan reorders tokens (tile_grid); FlexAttention does not "
            "permute q, k, v -- use plan.in_permuted_order().to_block_mask() with tokens kept "
            "in tiled order"
        )
    s = plan.schedule
    b, h = plan.batch or 1, plan.heads or 1
    kind = s.kind.view(b, h, s.num_q_tiles, s.num_kv_tiles)
    num, idx = _lists((kind != EMPTY) & (kind != FULL))
    full_num, full_idx = _lists(kind == FULL)
    return BlockMask.from_kv_blocks(
        num,
        idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(s.block_m, s.block_n),
        mask_mod=plan_mask_mod(plan),
        seq_lengths=(plan.q_len, plan.kv_len),
    )


def plan_mask_mod(plan: MaskPlan):
    """A FlexAttention ``mask_mod`` that reads the plan (element-wise gathers and compares)."""
    by_b, by_h = plan.batch is not None, plan.heads is not None
    heads = plan.heads or 1

    def mask_index(b, h):
        m = b * heads if by_b else 0
        return m + h if by_h else m

    if plan.encoding == "bits":
        s = plan.schedule
        bits, where = s.bits, s.bits_index
        kind = s.kind
        bm_, bn_ = s.block_m, s.block_n

        def bits_mask_mod(b, h, q_idx, kv_idx):
            m = mask_index(b, h)
            tq, tk = q_idx // bm_, kv_idx // bn_
            k_in = kv_idx % bn_
            slot = where[m, tq, tk].clamp(min=0)
            word = bits[slot, q_idx % bm_, k_in // 32]
            bit = ((word >> (k_in % 32)) & 1) == 1
            return (kind[m, tq, tk] == FULL) | ((kind[m, tq, tk] == PARTIAL_BITS) & bit)

        return bits_mask_mod
    lo, hi = plan.row_lo, plan.row_hi
    k = lo.shape[-1]

    def intervals_mask_mod(b, h, q_idx, kv_idx):
        m = mask_index(b, h)
        vis = (lo[m, q_idx, 0] <= kv_idx) & (kv_idx < hi[m, q_idx, 0])
        for j in range(1, k):
            vis = vis | ((lo[m, q_idx, j] <= kv_idx) & (kv_idx < hi[m, q_idx, j]))
        return vis

    return intervals_mask_mod
