"""The attention-gym and FlashAttention-4 mask_mods of ``tests/flex_masks.py`` scaled to about
``n`` tokens, plus hstu written with ``he[q] - 1`` (not recognised): the mask_mods that
``from_mask_mod`` lowers by its general lifting (``bench_lift_ops.py --gym``).

``gym_mask_mod(name, n)`` returns ``(mask_mod, q_len, kv_len, batch, heads)``; tables are
drawn from a generator seeded 0.
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from torch.nn.attention.flex_attention import noop_mask  # noqa: E402

import flex_masks as fm  # noqa: E402
from compilemask.workloads import hstu_users  # noqa: E402

GYM = ("noop", "batchify_causal", "batchify_noop", "block_diffusion", "document_causal",
       "document_noop", "packed_causal_document", "flamingo", "global_sliding_window",
       "jetspec_training", "natten", "tiled_natten", "morton_natten", "prefix_lm",
       "shared_prefix", "sliding_window", "sta_2d", "svg_spatial", "svg_spatial_sink",
       "svg_temporal", "fa4_mini_causal", "fa4_prefix_lm", "fa4_document", "fa4_ima",
       "hstu_minus_one")  # fmt: skip


def _doc_lengths(n: int, g: torch.Generator, docs: int) -> list[int]:
    cuts = torch.randperm(n - 1, generator=g)[: docs - 1].sort().values + 1
    return torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])).tolist()


def _hstu(n: int, g: torch.Generator):
    lengths, targets = hstu_users(n, g)
    ls = torch.tensor(lengths)
    user = torch.repeat_interleave(torch.arange(len(lengths)), ls)
    starts = torch.cumsum(ls, 0) - ls
    hist_end = starts + ls - torch.tensor(targets)
    ctx_end = starts + torch.minimum(torch.full_like(hist_end, 6), hist_end - starts)
    u, he, ce = user * 5, hist_end[user], ctx_end[user]

    def fn(b, h, q, k):
        return (u[q] == u[k]) & (
            ((k <= he[q] - 1) & ((k <= q) | (q <= ce[q] - 1) | (q > he[q] - 1))) | (k == q)
        )

    return fn


def to_device(mask_mod, device):
    """``mask_mod`` with the tensors it captures (through closures, nested mask_mods included)
    moved to ``device`` in place, as a user builds them there for FlexAttention on a GPU."""
    seen = set()

    def walk(fn):
        if isinstance(fn, (tuple, list)):  # e.g. the mask_mods of or_masks / and_masks
            for item in fn:
                walk(item)
            return
        if id(fn) in seen or not callable(fn) or getattr(fn, "__closure__", None) is None:
            return
        seen.add(id(fn))
        for cell in fn.__closure__:
            value = cell.cell_contents
            if isinstance(value, torch.Tensor):
                cell.cell_contents = value.to(device)
            else:
                walk(value)

    walk(mask_mod)
    return mask_mod


def gym_mask_mod(name: str, n: int):
    """``(mask_mod, q_len, kv_len, batch, heads)`` of ``name`` at about ``n`` tokens."""
    g = torch.Generator().manual_seed(0)
    side = math.isqrt(n)
    if name == "noop":
        return noop_mask, n, n, None, None
    if name.startswith("batchify"):
        inner = fm.causal if name == "batchify_causal" else noop_mask
        return fm.batchify(inner, 64), n, n, None, None
    if name == "block_diffusion":
        return fm.block_diffusion(n // 2, 16), n, n, None, None
    if name.startswith("document") or name in ("packed_causal_document", "shared_prefix"):
        lengths = _doc_lengths(n, g, max(2, n // 256))
        off = fm.lengths_to_offsets(lengths)
        if name == "document_causal":
            return fm.document(fm.causal, off), n, n, None, None
        if name == "document_noop":
            return fm.document(noop_mask, off), n, n, None, None
        if name == "packed_causal_document":
            return fm.packed_causal_document(off), n, n, None, None
        prefix_doc = torch.arange(len(lengths)) // 4 * 4  # every 4th document a shared prefix
        return fm.shared_prefix(off, prefix_doc), n, n, None, None
    if name == "flamingo":
        images, tok = max(2, n // 256), 64
        starts = torch.arange(images) * (n // images)
        ends = torch.minimum(starts + 3 * (n // images), torch.tensor(n))
        return fm.flamingo(torch.stack([starts, ends], 1), tok), n, images * tok, None, None
    if name == "global_sliding_window":
        is_global = torch.zeros(n, dtype=torch.bool)
        is_global[torch.randperm(n, generator=g)[: max(1, n // 512)]] = True
        return fm.global_sliding_window(128, is_global), n, n, None, None
    if name == "jetspec_training":
        return fm.jetspec_training(n // 2, 16), n - n // 2, n, None, None
    if name == "natten":
        return fm.natten(side, side, 7, 7), side * side, side * side, None, None
    if name in ("tiled_natten", "morton_natten"):
        w = 1 << ((n.bit_length() - 1 + 1) // 2)  # w * hgt == n for a power of two
        hgt = n // w
        if name == "tiled_natten":
            return fm.tiled_natten(w, hgt, 7, 7, 8, 8), w * hgt, w * hgt, None, None
        return fm.morton_natten(w, hgt, 7, 7), w * hgt, w * hgt, None, None
    if name == "prefix_lm":
        return fm.prefix_lm(n // 4), n, n, None, None
    if name == "sliding_window":
        return fm.sliding_window(n // 8), n, n, None, None
    if name == "sta_2d":
        text = n // 8
        tiles = (n - text) // 64  # 8 x 8 tiles of the canvas
        a = max(d for d in range(1, math.isqrt(tiles) + 1) if tiles % d == 0)
        ch, cw = 8 * a, 8 * (tiles // a)
        total = ch * cw + text
        return fm.sta_2d((ch, cw), (16, 16), (8, 8), text), total, total, None, None
    if name.startswith("svg"):
        prompt, frames = n // 16, 8
        per = (n - prompt) // frames
        total = prompt + frames * per
        if name == "svg_temporal":
            return fm.svg_temporal(prompt, frames, per, 2), total, total, None, None
        sink = name == "svg_spatial_sink"
        return fm.svg_spatial(prompt, frames, per, 2, sink, 8), total, total, None, None
    if name == "fa4_mini_causal":
        return fm.fa4_mini_causal, n, n, None, None
    if name == "fa4_prefix_lm":
        return fm.fa4_prefix_lm, n, n, None, None
    if name == "fa4_document":
        docs = torch.sort(torch.randint(0, max(2, n // 256), (2, 3, n), generator=g), -1).values
        return fm.fa4_document(docs), n, n, 2, 3
    if name == "fa4_ima":
        return fm.fa4_ima(torch.randint(0, n * 3 // 5, (n,), generator=g)), n, n, None, None
    if name == "hstu_minus_one":
        return _hstu(n, g), n, n, None, None
    raise ValueError(f"unknown gym mask {name!r}")
