"""FlexAttention mask_mods as users write them, for the migration tests: PyTorch twins of the
masks of attention-gym (``attn_gym/masks``) and of FlashAttention-4's flex mask tests, written
here as short functions. ``CASES`` lists ``(name, mask_mod, q_len, kv_len, batch, heads)``."""

from __future__ import annotations

from math import floor

import torch
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


# ---------------------------------------------------------------- attention-gym
def batchify(mask_mod, size):
    def fn(b, h, q_idx, kv_idx):
        same = q_idx // size == kv_idx // size
        return same & mask_mod(b, h, q_idx % size, kv_idx % size)

    return fn


def block_diffusion(seq_len, block_size):
    def fn(b, h, q_idx, kv_idx):
        q_noised, kv_noised = q_idx < seq_len, kv_idx < seq_len
        q_block = (q_idx % seq_len) // block_size
        kv_block = (kv_idx % seq_len) // block_size
        diag = (q_block == kv_block) & (q_noised == kv_noised)
        offset_causal = (q_block > kv_block) & q_noised & ~kv_noised
        block_causal = (q_block >= kv_block) & ~q_noised & ~kv_noised
        return diag | offset_causal | block_causal

    return fn


def dilated_sliding_window(window, dilation):
    def fn(b, h, q_idx, kv_idx):
        diff = torch.abs(q_idx - kv_idx)
        return (diff <= window) & (diff % dilation == 0)

    return fn


def lengths_to_offsets(lengths):
    return torch.cumsum(torch.tensor([0, *lengths], dtype=torch.int32), 0).to(torch.int32)


def doc_ids(offsets):
    counts = offsets[1:] - offsets[:-1]
    ids = torch.arange(len(counts), dtype=torch.int32, device=offsets.device)
    return torch.repeat_interleave(ids, counts)


def document(mask_mod, offsets):
    doc = doc_ids(offsets)

    def fn(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        q_logical = q_idx - offsets[doc[q_idx]]
        kv_logical = kv_idx - offsets[doc[kv_idx]]
        return same & mask_mod(b, h, q_logical, kv_logical)

    return fn


def packed_causal_document(offsets):
    doc = doc_ids(offsets)

    def fn(b, h, q_idx, kv_idx):
        return (kv_idx >= offsets[doc[q_idx]]) & causal(b, h, q_idx, kv_idx)

    return fn


def flamingo(intervals, image_token_length):
    bounds = torch.repeat_interleave(torch.arange(intervals.shape[0]), image_token_length)

    def fn(b, h, q_idx, kv_idx):
        interval = intervals[bounds[kv_idx]]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    return fn


def global_sliding_window(window, is_global):
    def local(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= window

    def glob(b, h, q_idx, kv_idx):
        return is_global[q_idx] | is_global[kv_idx]

    return or_masks(local, glob)


def jetspec_tree(prefix, parents):
    n = len(parents)
    anc = torch.eye(n, dtype=torch.bool)
    for node, parent in enumerate(parents[1:], start=1):
        anc[node] |= anc[parent]

    def fn(b, h, q_idx, kv_idx):
        tree_idx = (kv_idx - prefix).clamp(min=0, max=n - 1)
        tree_visible = (kv_idx >= prefix) & (kv_idx < prefix + n)
        return (kv_idx < prefix) | (tree_visible & anc[q_idx, tree_idx])

    return fn


def jetspec_training(prefix, block):
    def fn(b, h, q_idx, kv_idx):
        kv_rel = kv_idx - prefix
        same = (kv_idx >= prefix) & (q_idx // block == kv_rel // block)
        return (kv_idx < prefix) | (same & (kv_rel % block <= q_idx % block))

    return fn


def natten(cw, ch, kw, kh):
    def fn(b, h, q_idx, kv_idx):
        qx, qy = q_idx // cw, q_idx % cw
        kx, ky = kv_idx // cw, kv_idx % cw
        cx = qx.clamp(kw // 2, (cw - 1) - kw // 2)
        cy = qy.clamp(kh // 2, (ch - 1) - kh // 2)
        return ((cx - kx).abs() <= kw // 2) & ((cy - ky).abs() <= kh // 2)

    return fn


def tiled_xy(w, tw, th):
    """attention-gym's tiled_natten cell of a token: tiles of ``th x tw`` cells row-major over
    a grid ``w`` wide, cells row-major inside a tile."""

    def xy(idx):
        t_id = idx // (th * tw)
        t_y, t_x = t_id // (w // tw), t_id % (w // tw)
        off = idx % (th * tw)
        return t_x * tw + off % tw, t_y * th + off // tw

    return xy


def tiled_natten(w, hgt, kw, kh, tw, th):
    xy = tiled_xy(w, tw, th)

    def fn(b, h, q_idx, kv_idx):
        qx, qy = xy(q_idx)
        kx, ky = xy(kv_idx)
        cx = qx.clamp(kw // 2, (w - 1) - kw // 2)
        cy = qy.clamp(kh // 2, (hgt - 1) - kh // 2)
        return ((cx - kx).abs() <= kw // 2) & ((cy - ky).abs() <= kh // 2)

    return fn


def _deinterleave(code):
    code = code & 0x55555555
    code = (code | (code >> 1)) & 0x33333333
    code = (code | (code >> 2)) & 0x0F0F0F0F
    code = (code | (code >> 4)) & 0x00FF00FF
    return (code | (code >> 8)) & 0x0000FFFF


def morton_natten(cw, ch, kw, kh):
    def fn(b, h, q_idx, kv_idx):
        qx, qy = _deinterleave(q_idx), _deinterleave(q_idx >> 1)
        kx, ky = _deinterleave(kv_idx), _deinterleave(kv_idx >> 1)
        cx = qx.clamp(kw // 2, (cw - 1) - kw // 2)
        cy = qy.clamp(kh // 2, (ch - 1) - kh // 2)
        return ((cx - kx).abs() <= kw // 2) & ((cy - ky).abs() <= kh // 2)

    return fn


def prefix_lm(prefix):
    def pre(b, h, q_idx, kv_idx):
        return kv_idx < prefix

    return or_masks(pre, causal)


def shared_prefix(offsets, prefix_doc):
    doc = doc_ids(offsets)

    def fn(b, h, q_idx, kv_idx):
        q_doc = doc[q_idx]
        q_pre = prefix_doc[q_doc]
        own = (kv_idx >= offsets[q_doc]) & causal(b, h, q_idx, kv_idx)
        pre = (q_doc != q_pre) & (kv_idx >= offsets[q_pre]) & (kv_idx < offsets[q_pre + 1])
        return own | pre

    return fn


def sliding_window(window):
    def win(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window

    return and_masks(win, causal)


def sta_2d(canvas, kernel, tile, text):
    (ch, cw), (kh, kw), (th, tw) = canvas, kernel, tile
    ctw, kth, ktw = cw // tw, kh // th, kw // tw
    cth, vision = ch // th, ch * cw

    def fn(b, h, q_idx, kv_idx):
        qt, kt = q_idx // (th * tw), kv_idx // (th * tw)
        lh, rh = kth // 2, kth // 2 + (kth % 2 - 1)
        lw, rw = ktw // 2, ktw // 2 + (ktw % 2 - 1)
        c_h = (qt // ctw).clamp(lh, (cth - 1) - rh)
        c_w = (qt % ctw).clamp(lw, (ctw - 1) - rw)
        hm = (kt // ctw >= c_h - lh) & (kt // ctw <= c_h + rh)
        wm = (kt % ctw >= c_w - lw) & (kt % ctw <= c_w + rw)
        vis = (q_idx < vision) & (kv_idx < vision)
        v2t = (q_idx < vision) & (kv_idx >= vision) & (kv_idx < vision + text)
        t2a = (q_idx >= vision) & (kv_idx < vision + text)
        return (vis & hm & wm) | v2t | t2a

    return fn


def svg_spatial(prompt, frames, per_frame, width, sink, round_width):
    def fn(b, h, q_idx, kv_idx):
        first_col = kv_idx < (prompt + per_frame if sink else prompt)
        mask_width = floor(width * per_frame / round_width) * round_width
        return first_col | (q_idx < prompt) | (torch.abs(q_idx - kv_idx) < mask_width)

    return fn


def svg_temporal(prompt, frames, per_frame, width):
    def fn(b, h, q_idx, kv_idx):
        mask_width = (width * per_frame) // frames
        qt = (q_idx - prompt) % per_frame
        kt = (kv_idx - prompt) % per_frame
        return (kv_idx < prompt) | (q_idx < prompt) | (torch.abs(qt - kt) < mask_width)

    return fn


def vsa(topk, tile, sizes=None):
    def fn(b, h, q_idx, kv_idx):
        kv_tile = kv_idx // tile
        selected = (topk[b, h, q_idx // tile] == kv_tile.unsqueeze(-1)).any(dim=-1)
        if sizes is None:
            return selected
        return selected & (kv_idx % tile < sizes[kv_tile])

    return fn


# ---------------------------------------------------------------- FlashAttention-4 flex tests
def fa4_causal(offset):
    return lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + offset


def fa4_sliding_window(left, right, offset):
    def fn(b, h, q_idx, kv_idx):
        center = q_idx + offset
        return (kv_idx >= center - left) & (kv_idx <= center + right)

    return fn


def fa4_block_diagonal(b, h, q_idx, kv_idx):
    return (q_idx // 16) == (kv_idx // 16)


def fa4_mini_causal(b, h, q_idx, kv_idx):
    return (q_idx % 16) >= (kv_idx % 16)


def fa4_prefix_lm(b, h, q_idx, kv_idx):
    return ((q_idx < 24) & (kv_idx < 24)) | (q_idx >= kv_idx)


def fa4_dilated(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 20) & ((q_idx - kv_idx) % 2 == 0)


def fa4_document(doc):
    return lambda b, h, q_idx, kv_idx: doc[b, h, q_idx] == doc[b, h, kv_idx]


def fa4_ima(bias):
    return lambda b, h, q_idx, kv_idx: kv_idx >= bias[kv_idx]


def _cases():
    g = torch.Generator().manual_seed(0)
    off = lengths_to_offsets([7, 20, 1, 13, 19])  # 60 tokens
    is_global = torch.zeros(64, dtype=torch.bool)
    is_global[[0, 17, 40]] = True
    docs = torch.sort(torch.randint(0, 5, (2, 3, 70), generator=g), dim=-1).values
    topk = torch.randint(0, 6, (2, 2, 6, 3), generator=g)  # 6 tiles of 8 -> 48 tokens
    return [
        ("causal", causal, 50, 50, None, None),
        ("noop", noop_mask, 40, 33, None, None),
        ("batchify_causal", batchify(causal, 8), 50, 50, None, None),
        ("batchify_noop", batchify(noop_mask, 8), 50, 43, None, None),
        ("block_diffusion", block_diffusion(24, 5), 48, 48, None, None),
        ("dilated_sliding_window", dilated_sliding_window(6, 3), 50, 50, None, None),
        ("document_causal", document(causal, off), 60, 60, None, None),
        ("document_noop", document(noop_mask, off), 60, 60, None, None),
        ("packed_causal_document", packed_causal_document(off), 60, 60, None, None),
        ("flamingo", flamingo(torch.tensor([[0, 7], [1, 7], [7, 12]]), 3), 12, 9, None, None),
        ("global_sliding_window", global_sliding_window(3, is_global), 64, 64, None, None),
        ("jetspec_tree", jetspec_tree(10, [-1, 0, 0, 1, 1, 2, 5, 6]), 8, 18, None, None),
        ("jetspec_training", jetspec_training(12, 5), 30, 42, None, None),
        ("natten", natten(8, 8, 3, 3), 64, 64, None, None),
        ("tiled_natten", tiled_natten(8, 8, 3, 5, 4, 2), 64, 64, None, None),
        ("morton_natten", morton_natten(8, 8, 3, 3), 64, 64, None, None),
        ("prefix_lm", prefix_lm(13), 50, 50, None, None),
        ("shared_prefix", shared_prefix(off, torch.tensor([0, 0, 2, 2, 0])), 60, 60, None, None),
        ("sliding_window", sliding_window(9), 50, 50, None, None),
        ("sta_2d", sta_2d((8, 8), (4, 4), (2, 2), 10), 74, 74, None, None),
        ("svg_spatial", svg_spatial(10, 4, 12, 2, False, 8), 58, 58, None, None),
        ("svg_spatial_sink", svg_spatial(10, 4, 12, 2, True, 8), 58, 58, None, None),
        ("svg_temporal", svg_temporal(10, 4, 12, 2), 58, 58, None, None),
        ("vsa", vsa(topk, 8), 48, 48, 2, 2),
        ("vsa_sizes", vsa(topk, 8, torch.tensor([8, 8, 5, 8, 3, 8])), 48, 48, 2, 2),
        ("fa4_causal", fa4_causal(7), 40, 47, None, None),
        ("fa4_causal_neg", fa4_causal(-9), 47, 38, None, None),
        ("fa4_sliding_window", fa4_sliding_window(5, 3, 4), 45, 49, None, None),
        ("fa4_block_diagonal", fa4_block_diagonal, 70, 70, None, None),
        ("fa4_mini_causal", fa4_mini_causal, 70, 70, None, None),
        ("fa4_prefix_lm", fa4_prefix_lm, 70, 70, None, None),
        ("fa4_dilated", fa4_dilated, 70, 70, None, None),
        ("fa4_document", fa4_document(docs), 70, 70, 2, 3),
        ("fa4_ima", fa4_ima(torch.randint(0, 40, (70,), generator=g)), 70, 70, None, None),
    ]


CASES = _cases()
