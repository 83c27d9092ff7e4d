"""Analytic lifting of FlexAttention mask_mods to row intervals."""

from __future__ import annotations


def try_lift(mask_mod, q_len, kv_len, batch, heads, bh, block_m, block_n, device):
    return None
