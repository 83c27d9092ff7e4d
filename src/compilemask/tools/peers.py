"""Peers for side-by-side benchmarks: FlexAttention mask_mods written as a Flex user would, and
the optional peer libraries (imported lazily; a peer that does not import is reported skipped).

``flex_mask_mod(mask, device)`` turns the seed workloads' catalogue masks (causal, hstu,
shared_prompt, clear, document, sliding_window) into the natural FlexAttention ``mask_mod``:
per-token lookup tensors and a few compares -- not our intervals, so Flex runs its best form.
"""

from __future__ import annotations

import torch

from ..errors import CompileMaskError
from ..language.ast import Builtin, Mask


def _ids(lengths, device) -> torch.Tensor:
    return torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )


def flex_mask_mod(mask: Mask, device):
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` for a catalogue mask."""
    if not isinstance(mask, Builtin):
        raise CompileMaskError(f"no hand-written Flex mask_mod for {mask}")
    name, args = mask.name, mask.args
    if name == "causal":
        return lambda b, h, q, k: k <= q
    if name == "sliding_window":
        (w,) = args
        return lambda b, h, q, k: (k <= q) & (q - k < w)
    if name == "document":
        lengths, causal = args
        doc = _ids(lengths, device)
        if causal:
            return lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q)
        return lambda b, h, q, k: doc[q] == doc[k]
    if name == "hstu":
        lengths, targets, contextual = args
        user = _ids(lengths, device)
        starts = torch.cumsum(torch.tensor([0, *lengths[:-1]], device=device), 0)
        hist_end = (
            starts + torch.tensor(lengths, device=device) - torch.tensor(targets, device=device)
        )
        ctx_end = starts + torch.minimum(torch.full_like(hist_end, contextual), hist_end - starts)
        he, ce = hist_end[user], ctx_end[user]

        def hstu_mod(b, h, q, k):
            same = user[q] == user[k]
            hist_key = k < he[q]
            sees_hist = (k <= q) | (q < ce[q]) | (q >= he[q])
            return same & ((hist_key & sees_hist) | (k == q))

        return hstu_mod
    if name == "shared_prompt":
        prompts, responses = args
        group, resp, pend = [], [], []
        rid = 0
        pos = 0
        for gi, (p, rs) in enumerate(zip(prompts, responses)):
            group += [gi] * (p + sum(rs))
            resp += [-1] * p
            pend += [pos + p] * (p + sum(rs))
            for n in rs:
                resp += [rid] * n
                rid += 1
            pos += p + sum(rs)
        g_t = torch.tensor(group, device=device)
        r_t = torch.tensor(resp, device=device)
        p_t = torch.tensor(pend, device=device)

        def shared_mod(b, h, q, k):
            return (k <= q) & (g_t[q] == g_t[k]) & ((k < p_t[q]) | (r_t[k] == r_t[q]))

        return shared_mod
    if name == "clear":
        (gh, gw), r, text = args
        r2 = r * r

        def clear_mod(b, h, q, k):
            qi, ki = q - text, k - text
            dy, dx = qi // gw - ki // gw, qi % gw - ki % gw
            return (q < text) | (k < text) | (dy * dy + dx * dx < r2)

        return clear_mod
    raise CompileMaskError(f"no hand-written Flex mask_mod for {name}")
