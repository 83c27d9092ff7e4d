"""``model.generate()`` through the transformers integration: a mask given with ``use_mask`` (or
as ``compilemask_plan``) is compiled per call, bottom-right aligned, so decoding with
transformers' KV cache runs the decode path (Triton's split-KV kernel in the interpreter on the
CPU)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (hf)")

from compilemask import masks  # noqa: E402
from compilemask.integrations import huggingface as cm_hf  # noqa: E402

pytestmark = pytest.mark.kernel
PROMPT = [[5, 17, 33, 2, 8, 60, 1, 9]]
NEW = 4


def _model(attn):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=128, attn_implementation=attn,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def test_generate_with_a_causal_mask_equals_eager():
    ids = torch.tensor(PROMPT)
    want = _model("eager").generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    model = _model(cm_hf.register())
    cm_hf.use_mask(model, masks.causal())
    assert model.config.to_dict()[cm_hf.MASK_ATTR] == "causal()"
    got = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert got.tolist() == want.tolist()


def test_generate_with_a_window_equals_recomputing_without_cache():
    model = _model(cm_hf.register())
    mask = masks.sliding_window(3)
    ids = torch.tensor(PROMPT)
    cm_hf.use_mask(model, mask)
    got = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    seq = ids
    with torch.no_grad():
        for _ in range(NEW):  # no cache: the whole sequence each step, a square plan
            logits = model(seq, use_cache=False, compilemask_plan=mask).logits
            seq = torch.cat([seq, logits[:, -1:].argmax(-1)], 1)
    assert got.tolist() == seq.tolist()
