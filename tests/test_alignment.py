"""Query alignment: ``q_offset`` puts query row i at key position ``q_offset + i`` (dense
evaluator, compiler, kernels)."""

from __future__ import annotations

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.errors import CompileMaskError
from conftest import DEVICE, qkv
from conftest import assert_attention_close as assert_close

CATALOGUE = [
    masks.causal(),
    masks.sliding_window(3),
    masks.prefix_lm(4),
    masks.chunked(4),
    masks.block_causal(3),
    masks.dilated(4, 2),
    cm.parse("{ layout p:4 rest:*; p -> p : full; rest -> p : full; rest -> rest : causal }"),
]


def test_default_is_top_left():
    assert cm.dense(masks.causal(), 1, 13).int().tolist() == [[1] + [0] * 12]
    assert torch.equal(
        cm.compile(masks.causal(), 1, 13).to_dense(), cm.dense(masks.causal(), 1, 13)
    )


def test_bottom_right_single_query_sees_everything():
    plan = cm.compile(masks.causal(), 1, 13, q_offset=12)
    assert plan.to_dense().all()


@pytest.mark.parametrize("mask", CATALOGUE, ids=str)
@pytest.mark.parametrize("offset", [0, 1, 5, 12])
def test_offset_is_a_slice_of_the_full_mask(mask, offset):
    q_len, kv_len = 13 - offset, 13
    want = cm.dense(mask, offset + q_len, kv_len)[offset:]
    assert torch.equal(cm.dense(mask, q_len, kv_len, q_offset=offset), want)
    plan = cm.compile(mask, q_len, kv_len, q_offset=offset, block_m=4, block_n=4)
    assert torch.equal(plan.to_dense(), want)
    plan.verify()


@pytest.mark.parametrize("mask", CATALOGUE, ids=str)
def test_per_row_offsets(mask):
    offsets = torch.tensor([3, 10, 0, 7])
    plan = cm.compile(mask, 3, 13, q_offset=offsets, block_m=4, block_n=8)
    assert plan.batch == 4
    want = cm.dense(mask, 3, 13, q_offset=offsets)
    assert want.shape == (4, 1, 3, 13)
    assert torch.equal(plan.to_dense(), want)
    for b, o in enumerate(offsets.tolist()):
        assert torch.equal(want[b, 0], cm.dense(mask, 3, 13, q_offset=o))


def test_fixed_length_mask_bottom_right():
    doc = masks.document([5, 4, 4])
    plan = cm.compile(doc, 2, q_offset=11)
    assert plan.kv_len == 13
    assert torch.equal(plan.to_dense(), cm.dense(doc, 13)[11:])
    with pytest.raises(CompileMaskError, match="document fixes the length"):
        cm.compile(doc, 2, q_offset=3)


@pytest.mark.parametrize("bad", [-1, 1.5, True, torch.tensor([[1]]), torch.tensor([0.5]), []])
def test_bad_offsets_are_refused(bad):
    with pytest.raises(CompileMaskError, match="q_offset"):
        cm.compile(masks.causal(), 2, 8, q_offset=bad)
    with pytest.raises(CompileMaskError, match="q_offset"):
        cm.dense(masks.causal(), 2, 8, q_offset=bad)


def test_offset_with_per_batch_mask():
    m = masks.per_batch([masks.causal(), masks.sliding_window(2)])
    plan = cm.compile(m, 2, 9, q_offset=torch.tensor([7, 3]))
    assert torch.equal(plan.to_dense(), cm.dense(m, 2, 9, q_offset=[7, 3]))
    with pytest.raises(CompileMaskError, match="per_batch with 2"):
        cm.compile(m, 2, 9, q_offset=[1, 2, 3])


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_kernels_run_offset_plans_unchanged(backend):
    pytest.importorskip("triton")
    offsets = torch.tensor([40, 3, 0])
    plan = cm.compile(masks.sliding_window(20), 5, 45, q_offset=offsets, block_m=16, block_n=16)
    plan = plan.to(DEVICE)
    q, k, v = qkv(3, 4, 2, 5, 45, 32, torch.float16)
    out = cm.attention(q, k, v, plan, backend=backend)
    assert_close(out, q, k, v, plan)
