"""Plans of every kind the backends' lowerings meet (shared by the lowering tests)."""

from __future__ import annotations

import torch

import compilemask as cm

M = cm.masks


def catalogue():
    """(id, plan, B, Hq) for every kind of plan the lowering meets."""
    g = torch.Generator().manual_seed(0)
    random_dense = torch.rand(3, 2, 40, 56, generator=g) < 0.5
    random_dense[:, :, 7] = False  # some rows see nothing
    out = [
        ("causal", cm.compile(M.causal(), 37, block_m=16, block_n=16), 2, 3),
        ("sliding_window", cm.compile(M.sliding_window(5), 41, block_m=16, block_n=16), 2, 1),
        ("document", cm.compile(M.document([7, 12, 20]), block_m=16, block_n=16), 3, 2),
        ("shared_prompt", cm.compile(M.shared_prompt(9, [5, 7, 4]), block_m=16, block_n=16), 2, 2),
        ("hstu", cm.compile(M.hstu([20, 14], [3, 2], contextual=2), block_m=16, block_n=16), 2, 2),
        ("clear", cm.compile(M.clear((6, 8), 3, 5), block_m=16, block_n=16), 1, 2),
        (
            "clear_tile_grid",
            cm.compile(M.tile_grid(M.clear((8, 8), 3, 4), (4, 4)), block_m=16, block_n=16),
            2,
            1,
        ),
        ("tree", cm.compile(M.tree([-1, 0, 0, 1, 3, -1, 5], 11), block_m=16, block_n=16), 2, 2),
        (
            "per_head",
            cm.compile(
                M.per_head([M.causal(), M.sliding_window(3), M.chunked(8)]),
                30,
                heads=3,
                block_m=16,
                block_n=16,
            ),
            2,
            3,
        ),
        (
            "per_batch",
            cm.compile(
                M.per_batch([M.causal(), M.prefix_lm(9)]), 29, batch=2, block_m=16, block_n=16
            ),
            2,
            4,
        ),
        # q_len > kv_len + window: the last rows see no key
        ("empty_rows", cm.compile(M.sliding_window(4), 50, 30, block_m=16, block_n=16), 2, 2),
        ("from_dense", cm.from_dense(random_dense, block_m=16, block_n=16), 3, 2),
        ("from_dense_2d", cm.from_dense(random_dense[0, 0], block_m=16, block_n=16), 2, 3),
    ]
    return out


def plan_dense(plan, batch, heads_q):
    """plan.to_dense() broadcast to [B, Hq, Nq, Nk]."""
    d = plan.to_dense()
    if d.dim() == 2:
        d = d[None, None]
    return d.expand(batch, heads_q, plan.q_len, plan.kv_len)
