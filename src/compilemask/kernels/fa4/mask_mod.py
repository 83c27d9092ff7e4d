"""The CuTe ``mask_mod`` FlashAttention-4 calls on the elements of PARTIAL tiles: a lookup in
the tile bitmasks of :mod:`.lower` (``aux_tensors = [tile_index, bits]``). Imports
``cutlass`` and ``flash_attn`` on first use."""

from __future__ import annotations

import functools

from .lower import BLOCK


@functools.cache
def plan_bits_mask_mod():
    """The ``mask_mod(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors)`` of a lowered plan:
    key ``kv_idx`` is visible to query ``q_idx`` when bit ``c % 32`` of word ``c // 32`` of row
    ``q_idx % BLOCK`` of ``bits[tile_index[batch, head, q_idx // BLOCK, kv_idx // BLOCK]]`` is
    set (``c = kv_idx % BLOCK``). One object per process, so FlashAttention's compile cache,
    keyed by the callable, compiles it once per kernel configuration."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    block = BLOCK

    @cute.jit
    def plan_bits(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        tile_index, bits = aux_tensors[0], aux_tensors[1]
        q = q_idx[0]
        k = kv_idx[0]
        tile = tile_index[batch[0], head[0], q // block, k // block]
        col = k % block
        word = bits[tile, q % block, col // 32]
        bit = (word >> (col % 32)) & 1
        return utils.scalar_to_ssa(bit, cutlass.Int32) == utils.scalar_to_ssa(1, cutlass.Int32)

    return plan_bits
