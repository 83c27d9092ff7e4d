"""Greedy generation with a small Llama over a paged KV cache, and a tree-draft verification.

A Llama-style decoder (RMSNorm, rotary positions, grouped-query attention, SwiGLU) is built
from a config with random weights (no download). Its attention runs through
``compilemask.attention`` over a paged KV cache ``[num_pages, page_size, Hkv, D]``:

1. prefill: each prompt (ragged lengths) is written into its pages and attended with a causal
   ``step_plan`` of all its tokens;
2. greedy decoding: each step writes one token's keys into the cache and attends with
   ``step_plan(causal(), cache_seqlens, 1)``, built on the device without host reads;
3. a speculative step: a draft tree of tokens is appended after each sequence and verified in
   one forward with ``step_plan(tree(parents, 0), ...)``; every node's logits equal those of
   running its branch alone.

The generated tokens are checked against recomputing the whole sequence without a cache
(``torch.nn.functional.scaled_dot_product_attention`` with a causal mask). With transformers
installed, the same weights are loaded into ``transformers.LlamaForCausalLM`` and its
``generate(do_sample=False)`` must give the same tokens.

Usage: ``PYTHONPATH=src python examples/generate_paged.py [--device cuda] [--steps 12]``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import compilemask as cm  # noqa: E402


@dataclass
class Config:
    vocab_size: int = 97
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6


class RMSNorm(torch.nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rotary(x, pos, theta):
    """Rotate ``x [B, H, N, D]`` by positions ``pos [B, N]`` (Llama's half-split rotation)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos[:, None, :, None].float() * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return (x * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class Layer(torch.nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        h, hd = c.hidden_size, c.head_dim
        self.c = c
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.q_proj = torch.nn.Linear(h, c.num_attention_heads * hd, bias=False)
        self.k_proj = torch.nn.Linear(h, c.num_key_value_heads * hd, bias=False)
        self.v_proj = torch.nn.Linear(h, c.num_key_value_heads * hd, bias=False)
        self.o_proj = torch.nn.Linear(c.num_attention_heads * hd, h, bias=False)
        self.gate_proj = torch.nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(c.intermediate_size, h, bias=False)

    def forward(self, x, pos, attend):
        B, N, _ = x.shape
        c = self.c
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(B, N, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(y).view(B, N, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(y).view(B, N, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = rotary(q, pos, c.rope_theta), rotary(k, pos, c.rope_theta)
        o = attend(q, k, v).transpose(1, 2).reshape(B, N, -1)
        x = x + self.o_proj(o)
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class TinyLlama(torch.nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed_tokens = torch.nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = torch.nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, ids, pos, attend_for_layer):
        x = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, attend_for_layer(i))
        return self.lm_head(self.norm(x))


class PagedCache:
    """Per layer a key and a value cache ``[num_pages, page_size, Hkv, D]``; batch row ``b``
    owns the pages ``block_table[b]`` (given out in shuffled order, as an allocator would)."""

    def __init__(self, c: Config, batch, capacity, page_size, device, dtype, seed=0):
        per_row = math.ceil(capacity / page_size)
        g = torch.Generator().manual_seed(seed)
        pages = torch.randperm(batch * per_row + 3, generator=g)[: batch * per_row]
        self.block_table = pages.view(batch, per_row).to(torch.int32).to(device)
        shape = (batch * per_row + 3, page_size, c.num_key_value_heads, c.head_dim)
        self.k = [
            torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.num_hidden_layers)
        ]
        self.v = [
            torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.num_hidden_layers)
        ]
        self.page_size = page_size
        self.capacity = per_row * page_size
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)

    def write(self, layer, k, v, pos):
        """Store ``k, v [B, Hkv, N, D]`` at key positions ``pos [B, N]`` (negative: skipped)."""
        ok = pos >= 0
        p = pos.clamp(min=0).long()
        page = self.block_table.long().gather(1, p // self.page_size)[ok]
        slot = (p % self.page_size)[ok]
        self.k[layer][page, slot] = k.transpose(1, 2)[ok]
        self.v[layer][page, slot] = v.transpose(1, 2)[ok]


def step(model, cache, ids, pos, plan):
    """One forward of ``ids [B, N]`` at positions ``pos``: keys written, then attention over
    the cache with ``plan``."""

    def attend_for_layer(i):
        def attend(q, k, v):
            cache.write(i, k, v, pos)
            return cm.attention(q, cache.k[i], cache.v[i], plan, block_table=cache.block_table)

        return attend

    return model(ids, pos, attend_for_layer)


def full_recompute(model, tokens):
    """Logits of one sequence ``[N]`` without a cache (causal SDPA): the check."""

    def attend_for_layer(i):
        def attend(q, k, v):
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return attend

    ids = tokens[None]
    pos = torch.arange(len(tokens), device=tokens.device)[None]
    return model(ids, pos, attend_for_layer)[0]


@torch.no_grad()
def generate(model, prompts, steps, cache):
    """Greedy generation for ragged prompts; returns the token lists."""
    dev = cache.seqlens.device
    B = len(prompts)
    n = max(len(p) for p in prompts)
    # prefill, right-aligned: row b's prompt sits at positions [0, len) with pad rows before
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=dev)
    ids = torch.zeros(B, n, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        ids[b, n - len(p) :] = torch.tensor(p)
    pos = lens[:, None] - n + torch.arange(n, device=dev)  # negative: padding, sees nothing
    plan = cm.step_plan(cm.masks.causal(), lens, n, kv_len=cache.capacity)
    logits = step(model, cache, ids, pos, plan)[:, -1]
    out = [list(p) for p in prompts]
    for _ in range(steps):
        nxt = logits.argmax(-1)
        for b in range(B):
            out[b].append(int(nxt[b]))
        lens = lens + 1
        plan = (
            plan.next(lens, q_len=1)
            if plan.q_len == 1
            else cm.step_plan(cm.masks.causal(), lens, 1, kv_len=cache.capacity)
        )
        logits = step(model, cache, nxt[:, None], (lens - 1)[:, None], plan)[:, -1]
    cache.seqlens = lens
    return out, logits


@torch.no_grad()
def verify_tree(model, cache, draft, parents):
    """Append the draft tree ``draft [B, n]`` after each cached sequence and score every node
    in one forward; returns the logits ``[B, n, vocab]``."""
    lens = cache.seqlens + len(parents)
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1 if p >= 0 else 0
    depth_t = torch.tensor(depth, device=lens.device)
    pos = (cache.seqlens[:, None] + depth_t).to(torch.long)  # rotary position: prefix + depth
    key_pos = cache.seqlens[:, None] + torch.arange(len(parents), device=lens.device)
    plan = cm.step_plan(cm.masks.tree(parents, 0), lens, len(parents), kv_len=cache.capacity)

    def attend_for_layer(i):
        def attend(q, k, v):
            cache.write(i, k, v, key_pos)
            return cm.attention(q, cache.k[i], cache.v[i], plan, block_table=cache.block_table)

        return attend

    return model(draft, pos, attend_for_layer)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.float32
    torch.manual_seed(0)
    config = Config()
    model = TinyLlama(config).to(dev, dtype).eval()
    prompts = [[5, 17, 33, 2, 8, 60, 1], [9, 4], [71, 3, 3, 40, 12]]
    cache = PagedCache(config, len(prompts), capacity=64, page_size=16, device=dev, dtype=dtype)
    tokens, _ = generate(model, prompts, args.steps, cache)
    for b, seq in enumerate(tokens):
        t = torch.tensor(seq, device=dev)
        want = full_recompute(model, t[:-1]).argmax(-1)[len(prompts[b]) - 1 :]
        assert want.tolist() == seq[len(prompts[b]) :], (b, want.tolist(), seq)
    print("greedy tokens (paged cache, checked against full recomputation):")
    for seq, p in zip(tokens, prompts):
        print(f"  prompt {p} -> {seq[len(p) :]}")

    # a draft tree after each sequence: root, two children, a grandchild of the first child
    parents = [-1, 0, 0, 1]
    draft = torch.tensor([[7, 8, 9, 10]] * len(prompts), device=dev)
    logits = verify_tree(model, cache, draft, parents)
    for b, seq in enumerate(tokens):
        for i in range(len(parents)):
            path, j = [], i
            while j >= 0:
                path.append(int(draft[b, j]))
                j = parents[j]
            branch = torch.tensor(seq + path[::-1], device=dev)
            want = full_recompute(model, branch)[-1]
            assert torch.allclose(logits[b, i], want, atol=1e-4), (b, i)
    print(f"tree draft {parents}: every node's logits match its branch run alone")

    try:
        import transformers
    except ImportError:
        print("transformers not installed: generate() comparison skipped")
        return 0
    hf = hf_model(model, config, transformers).to(dev, dtype).eval()
    for b, p in enumerate(prompts):
        ids = torch.tensor([p], device=dev)
        gen = hf.generate(ids, max_new_tokens=args.steps, do_sample=False, pad_token_id=0)
        assert gen[0].tolist() == tokens[b], (gen[0].tolist(), tokens[b])
    print("transformers LlamaForCausalLM.generate(do_sample=False) gives the same tokens")
    return 0


def hf_model(model: TinyLlama, c: Config, transformers):
    """``transformers.LlamaForCausalLM`` with ``model``'s weights (same parameter names)."""
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg)
    state = {}
    for name, t in model.state_dict().items():
        if name.startswith("layers."):
            head, rest = name.split(".", 2)[1], name.split(".", 2)[2]
            sub = (
                "self_attn."
                if rest.split(".")[0].endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                else ""
            )
            sub = sub or ("mlp." if rest.startswith(("gate", "up", "down")) else "")
            state[f"model.layers.{head}.{sub}{rest}"] = t
        elif name.startswith("lm_head"):
            state[name] = t
        else:
            state["model." + name] = t
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary" not in m]
    assert not missing and not unexpected, (missing, unexpected)
    return hf


if __name__ == "__main__":
    sys.exit(main())
