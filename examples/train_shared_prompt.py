"""Train a small causal language model with the shared_prompt mask through transformers.

One prompt is followed by several responses packed in the same row; each response sees the
prompt and itself, never the other responses (``compilemask.masks.shared_prompt``), so the
prompt is encoded once for all of them. The model is a tiny Llama built from a config (no
download), the text is ``examples/data/sentences.txt`` read by a byte-level tokenizer, and the
attention runs through ``attn_implementation="compilemask"`` with the plan passed as
``compilemask_plan=``. The same steps are repeated with transformers' eager attention under the
dense mask ``plan.to_dense()``; the two loss curves must agree (float32, relative 1e-4).

Run from the repository root::

    .venv/bin/python examples/train_shared_prompt.py --steps 20

(``PYTHONPATH=src python3 examples/train_shared_prompt.py`` without installing.)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

import compilemask as cm
from compilemask.integrations import huggingface as cm_hf

TEXT = Path(__file__).resolve().parent / "data" / "sentences.txt"
BOS, SEP = 256, 257  # byte-level tokenizer: the 256 bytes, then two special tokens
VOCAB = 258
IGNORE = -100


def encode(text: str) -> list[int]:
    """Byte-level tokenizer: UTF-8 bytes as token ids 0..255."""
    return list(text.encode("utf-8"))


@dataclass(frozen=True)
class Row:
    """One packed training row: ``[prompt | response 1 | response 2 | ...]``, shape [1, N]."""

    input_ids: torch.Tensor  # int64 [1, N]
    position_ids: torch.Tensor  # int64 [1, N]: responses continue the prompt's positions
    labels: torch.Tensor  # int64 [1, N]: next token inside the same segment, else IGNORE
    plan: cm.MaskPlan  # shared_prompt(prompt_len, response_lens) for N


def build_rows(sentences: list[str], responses: int = 3) -> list[Row]:
    """Group the sentences: one prompt sentence, then ``responses`` response sentences."""
    rows = []
    group = 1 + responses
    for start in range(0, len(sentences) - group + 1, group):
        prompt = [BOS, *encode(sentences[start])]
        resps = [[SEP, *encode(s)] for s in sentences[start + 1 : start + group]]
        segments = [prompt, *resps]
        ids, pos, labels = [], [], []
        for i, seg in enumerate(segments):
            first = 0 if i == 0 else len(prompt)
            ids += seg
            pos += range(first, first + len(seg))
            labels += seg[1:] + [IGNORE]
        plan = cm.compile(
            cm.masks.shared_prompt(len(prompt), [len(r) for r in resps]), len(ids),
            block_m=64, block_n=64,
        )  # fmt: skip
        rows.append(Row(torch.tensor([ids]), torch.tensor([pos]), torch.tensor([labels]), plan))
    return rows


def make_model(seed: int = 0):
    """A tiny Llama (2 layers, 4 query heads, 2 key/value heads of head_dim 32), float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        attention_dropout=0.0, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def dense_float_mask(plan: cm.MaskPlan, dtype: torch.dtype) -> torch.Tensor:
    """``plan.to_dense()`` as the additive float mask [1, 1, N, N] that eager attention takes."""
    visible = plan.to_dense()
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def loss_of(model, row: Row, attn: str) -> torch.Tensor:
    """Mean next-token cross-entropy of one row under ``attn`` ("compilemask" or "dense")."""
    if attn == "compilemask":
        logits = model(
            input_ids=row.input_ids, position_ids=row.position_ids, compilemask_plan=row.plan,
            compilemask_backend="reference" if row.input_ids.device.type == "cpu" else "auto",
        ).logits  # fmt: skip
    else:
        logits = model(
            input_ids=row.input_ids, position_ids=row.position_ids,
            attention_mask=dense_float_mask(row.plan, torch.float32),
        ).logits  # fmt: skip
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), row.labels.flatten(), ignore_index=IGNORE
    )


def train(steps: int = 5, attn: str = "compilemask", seed: int = 0, lr: float = 3e-3):
    """``steps`` AdamW steps over the packed rows of the sentences; returns the losses.

    Args:
        steps: optimiser steps (one row per step, cycling over the rows).
        attn: "compilemask" (``attn_implementation="compilemask"`` with the row's plan) or
            "dense" (eager attention under ``plan.to_dense()``, the reference).
        seed: seeds the model's initial weights (the same for both ``attn``).
        lr: AdamW learning rate.

    Returns:
        list of ``steps`` float losses, one per step, before that step's update.
    """
    cm_hf.register()
    rows = build_rows(TEXT.read_text().splitlines())
    model = make_model(seed)
    model.set_attn_implementation("compilemask" if attn == "compilemask" else "eager")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = loss_of(model, rows[step % len(rows)], attn)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    rows = build_rows(TEXT.read_text().splitlines())
    row = rows[0]
    print(f"{len(rows)} rows; row 0: {row.input_ids.shape[1]} tokens, mask {row.plan.source}")
    print(f"density {row.plan.stats()['density']:.3f}")
    got = train(args.steps, "compilemask", lr=args.lr)
    ref = train(args.steps, "dense", lr=args.lr)
    print(f"{'step':>4}  {'compilemask':>12}  {'dense mask':>12}  {'rel diff':>9}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, ref)):
        rel = abs(a - b) / abs(b)
        worst = max(worst, rel)
        print(f"{i:>4}  {a:>12.6f}  {b:>12.6f}  {rel:>9.2e}")
    print(f"max relative difference {worst:.2e}; loss {got[0]:.4f} -> {got[-1]:.4f}")
    if worst > 1e-4:
        raise SystemExit("the compilemask and dense-mask losses differ by more than 1e-4")


if __name__ == "__main__":
    main()
