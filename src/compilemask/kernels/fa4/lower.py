"""A :class:`~compilemask.MaskPlan` lowered to FlashAttention-4's block-sparse tensors and the
tile bitmasks its ``mask_mod`` reads (pure torch, no FlashAttention import).

FlashAttention-4 (``flash_attn.cute``) skips the tiles a ``BlockSparseTensorsTorch`` does not
list, runs the listed FULL tiles without a mask, and calls a ``mask_mod`` for every element of
the listed PARTIAL ("mask") tiles. Its sparse block is ``BLOCK x BLOCK`` tokens (``BLOCK =
128``: the forward tile of head_dim 64 and 128 on sm90; its backward runs 64-row tiles at
head_dim 128, two per sparse block, and 128-row tiles at 64). From the plan's schedule at
that tiling (``plan.tiles(BLOCK, BLOCK)``):

- forward, per q-block: the FULL and PARTIAL kv-blocks, counts ``[Bm, Hm, Tq]`` and ascending
  indices ``[Bm, Hm, Tq, Tk]``;
- backward, per kv-block: the FULL and PARTIAL q-blocks, ``[Bm, Hm, Tk]`` and
  ``[Bm, Hm, Tk, Tq]`` (the transposed classification);
- ``tile_index`` int32 ``[Bm, Hm, Tq, Tk]`` and ``bits`` int32 ``[P, BLOCK, BLOCK / 32]``: tile
  ``(qt, kt)`` of mask ``(b, h)`` is rebuilt as bit ``c % 32`` of word ``c // 32`` of row ``r``
  of ``bits[tile_index[b, h, qt, kt]]``. Entry 0 is all zeros (EMPTY tiles) and entry 1 all
  ones (FULL tiles), so the lookup is defined for every tile; PARTIAL tiles follow.

``Bm`` is the plan's batch (1 for a plan shared by the batch), ``Hm`` its heads (1 for a plan
shared by the heads): the backend expands them to the call's ``[B, Hq]`` with stride 0.
Padding of the index lists is 0 (FlashAttention reads only the first ``count`` entries).

Building it reads back from the device twice (the schedule's bitmask count at a derived tiling,
and the widest interval slot range of the PARTIAL tiles), once per plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...compiler.plan import MaskPlan
from ...compiler.tiles import FULL, PARTIAL, PARTIAL_BITS, tile_bits, unpack_bits
from ...compiler.tiles import _lists as touched_lists

#: FlashAttention-4's sparse block (query rows and keys) for head_dim 64 and 128 on sm90
BLOCK = 128
#: PARTIAL tiles whose bitmasks are built at once (bounds the builder's temporary memory:
#: about 70 KB per tile)
_BITS_CHUNK = 2048


@dataclass(frozen=True)
class BlockSparseLists:
    """Block lists of one direction: ``*_cnt [Bm, Hm, T]``, ``*_idx [Bm, Hm, T, T']`` int32."""

    mask_cnt: torch.Tensor
    mask_idx: torch.Tensor
    full_cnt: torch.Tensor
    full_idx: torch.Tensor


@dataclass(frozen=True)
class Fa4Blocks:
    """What :func:`lower` builds (see the module docstring)."""

    forward: BlockSparseLists
    backward: BlockSparseLists
    tile_index: torch.Tensor
    bits: torch.Tensor
    block: int


def _lists(kind: torch.Tensor, want: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Count and ascending indices (0-padded) of the entries ``== want`` along the last dim."""
    count, lists, _ = touched_lists(kind == want)
    return count, lists.clamp(min=0)


def _direction(kind: torch.Tensor) -> BlockSparseLists:
    partial = torch.where(kind == PARTIAL_BITS, PARTIAL, kind)
    mask_cnt, mask_idx = _lists(partial, PARTIAL)
    full_cnt, full_idx = _lists(partial, FULL)
    return BlockSparseLists(mask_cnt, mask_idx, full_cnt, full_idx)


def lower(plan: MaskPlan, block: int = BLOCK) -> Fa4Blocks:
    """FlashAttention-4's block lists and tile bitmasks of ``plan`` at ``block x block`` tiles.

    Args:
        plan: any plan (intervals or bitmask encoding), in its own token order.
        block: the sparse block size in tokens (a multiple of 32).

    Returns:
        :class:`Fa4Blocks`, every tensor int32 on the plan's device.
    """
    if block % 32:
        raise ValueError(f"block must be a multiple of 32, got {block}")
    s = plan.tiles(block, block)
    kind = s.kind  # [M, Tq, Tk]
    m, tq, tk = kind.shape
    dev = kind.device
    words = block // 32
    tile_index = torch.where(kind == FULL, 1, 0).to(torch.int32)
    fixed = torch.zeros((2, block, words), dtype=torch.int32, device=dev)
    fixed[1] = -1  # every bit set
    parts = [fixed]
    next_row = 2
    stored = kind == PARTIAL_BITS
    if bool(stored.any()):  # bitmask tiles of the schedule: reused as they are
        tile_index = torch.where(stored, s.bits_index + next_row, tile_index)
        parts.append(s.bits)
        next_row += s.bits.shape[0]
    tiles = (kind == PARTIAL).nonzero()  # [P, 3]: (m, qt, kt)
    if tiles.shape[0]:
        sel = tiles.unbind(1)
        tile_index[sel] = torch.arange(
            next_row, next_row + tiles.shape[0], device=dev, dtype=torch.int32
        )
        jlo, jhi = s.jlo[sel], s.jhi[sel]
        for start in range(0, tiles.shape[0], _BITS_CHUNK):
            end = start + _BITS_CHUNK
            parts.append(
                tile_bits(
                    plan.row_lo, plan.row_hi, tiles[start:end], jlo[start:end], jhi[start:end],
                    block, block, plan.q_len,
                )
            )  # fmt: skip
    bm, hm = plan.batch or 1, plan.heads or 1
    view = (bm, hm)
    fwd = _direction(kind)
    bwd = _direction(kind.transpose(1, 2))
    reshape = [
        BlockSparseLists(*(t.view(*view, *t.shape[1:]) for t in (d.mask_cnt, d.mask_idx)),
                         *(t.view(*view, *t.shape[1:]) for t in (d.full_cnt, d.full_idx)))
        for d in (fwd, bwd)
    ]  # fmt: skip
    return Fa4Blocks(
        reshape[0],
        reshape[1],
        tile_index.view(bm, hm, tq, tk).contiguous(),
        torch.cat(parts).contiguous(),
        block,
    )


def expand(blocks: Fa4Blocks, q_len: int, kv_len: int, backward: bool = False) -> torch.Tensor:
    """The dense mask ``[Bm, Hm, Nq, Nk]`` the block lists and bitmasks describe: what
    FlashAttention-4 computes with them (listed FULL tiles whole, listed PARTIAL tiles through
    the bitmask lookup, nothing else). ``backward=True`` reads the backward's lists. For tests.
    """
    b = blocks.block
    lists = blocks.backward if backward else blocks.forward
    bm, hm, tq, tk = blocks.tile_index.shape
    dense = torch.zeros((bm, hm, tq * b, tk * b), dtype=torch.bool, device=blocks.bits.device)
    rows = lists.mask_cnt.shape[-1]
    for bi in range(bm):
        for hi in range(hm):
            for r in range(rows):
                for cnt, idx, full in (
                    (lists.full_cnt, lists.full_idx, True),
                    (lists.mask_cnt, lists.mask_idx, False),
                ):
                    for j in idx[bi, hi, r, : int(cnt[bi, hi, r])].tolist():
                        qt, kt = (j, r) if backward else (r, j)
                        if full:
                            tile = torch.ones((b, b), dtype=torch.bool)
                        else:
                            tile = unpack_bits(blocks.bits[blocks.tile_index[bi, hi, qt, kt]])
                        dense[bi, hi, qt * b : (qt + 1) * b, kt * b : (kt + 1) * b] = tile
    return dense[..., :q_len, :kv_len]


__all__ = ["BLOCK", "BlockSparseLists", "Fa4Blocks", "expand", "lower"]
