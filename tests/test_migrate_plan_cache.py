"""The plans ``from_mask_mod`` keeps (``compiler/migrate/plan_cache.py``): reused only where
provably the same plan -- a mask_mod that captures no tensor (by its structural key), or a
recognised one whose tables hold the same values -- and every returned plan exact against
``create_mask``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm
import flex_masks as fm
from compilemask.compiler.migrate import plan_cache, trace
from compilemask.errors import CompileMaskError


def flex_dense(mask_mod, nq, nk=None):
    return create_mask(mask_mod, None, None, nq, nk or nq, device="cpu")[0, 0]


@pytest.fixture(autouse=True)
def empty_caches():
    trace.clear()
    plan_cache.clear()
    yield
    trace.clear()
    plan_cache.clear()


def _window(w):
    return lambda b, h, q, k: (q - k).abs() <= w


@pytest.mark.parametrize(
    "mm, nq, nk",
    [
        (fm.causal, 40, 40),  # recognised
        (fm.jetspec_training(24, 5), 24, 48),  # lifted
        (fm.fa4_mini_causal, 48, 48),  # evaluated
        (fm.block_diffusion(24, 5), 48, 48),
    ],
)
def test_pure_mask_mod_plan_reused(mm, nq, nk):
    first = cm.from_mask_mod(mm, nq, nk, block_m=16, block_n=16)
    again = cm.from_mask_mod(mm, nq, nk, block_m=16, block_n=16)
    assert again is first
    assert torch.equal(first.to_dense(), flex_dense(mm, nq, nk))
    fresh = cm.from_mask_mod(mm, nq, nk, block_m=16, block_n=16, cache=False)
    assert fresh is not first and torch.equal(fresh.to_dense(), first.to_dense())
    other = cm.from_mask_mod(mm, nq, nk, block_m=16, block_n=32)  # other tiles: another plan
    assert other is not first and torch.equal(other.to_dense(), first.to_dense())


@settings(max_examples=25, deadline=None)
@given(ws=st.lists(st.integers(0, 12), min_size=2, max_size=5), n=st.integers(1, 40))
def test_pure_key_holds_the_captured_scalars(ws, n):
    for w in ws:  # a new closure per call, windows repeating: each plan is its own window's
        got = cm.from_mask_mod(_window(w), n, block_m=8, block_n=8)
        assert torch.equal(got.to_dense(), flex_dense(_window(w), n))


def test_other_lengths_batch_heads_not_shared():
    a = cm.from_mask_mod(fm.causal, 32, block_m=16, block_n=16)
    b = cm.from_mask_mod(fm.causal, 48, block_m=16, block_n=16)
    c = cm.from_mask_mod(fm.causal, 32, 40, block_m=16, block_n=16)
    d = cm.from_mask_mod(fm.causal, 32, heads=2, block_m=16, block_n=16)
    assert len({id(a), id(b), id(c), id(d)}) == 4
    assert (a.q_len, b.q_len, c.kv_len, d.heads) == (32, 48, 40, 2)
    assert torch.equal(c.to_dense(), flex_dense(fm.causal, 32, 40))


def test_captured_tensor_plan_follows_its_values():
    intervals = torch.tensor([[0, 7], [1, 7], [7, 12]])
    mm = fm.flamingo(intervals, 3)  # lifted, captures tensors
    first = cm.from_mask_mod(mm, 12, 9, block_m=4, block_n=4)
    assert torch.equal(first.to_dense(), flex_dense(mm, 12, 9))
    intervals[1] = torch.tensor([3, 12])  # in place: the next plan must see it
    again = cm.from_mask_mod(mm, 12, 9, block_m=4, block_n=4)
    assert again is not first
    assert torch.equal(again.to_dense(), flex_dense(mm, 12, 9))
    assert not torch.equal(again.to_dense(), first.to_dense())


@settings(max_examples=20, deadline=None)
@given(runs=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=5), min_size=2, max_size=4))
def test_recognised_documents_keyed_by_values(runs):
    n = 12
    plans = []
    for lengths in runs:
        lengths = lengths + [n + 40]
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:n]

        def mm(b, h, q, k, doc=doc):
            return (doc[q] == doc[k]) & (k <= q)

        got = cm.from_mask_mod(mm, n, block_m=4, block_n=4)
        assert got.source == "from_mask_mod:lifted"
        assert torch.equal(got.to_dense(), flex_dense(mm, n))
        plans.append((tuple(doc.tolist()), got))
    for (da, pa), (db, pb) in zip(plans, plans[1:]):
        assert (pa is pb) == (da == db)


def test_plan_written_in_place_is_rebuilt():
    first = cm.from_mask_mod(fm.causal, 32, block_m=16, block_n=16)
    with torch.no_grad():
        first.row_hi.zero_()
    again = cm.from_mask_mod(fm.causal, 32, block_m=16, block_n=16)
    assert again is not first
    assert torch.equal(again.to_dense(), flex_dense(fm.causal, 32))


def test_not_kept_without_lifting_or_with_cache_off():
    a = cm.from_mask_mod(fm.causal, 32, block_m=16, block_n=16, lifting=False)
    b = cm.from_mask_mod(fm.causal, 32, block_m=16, block_n=16, lifting=False)
    assert a is not b
    c = cm.from_mask_mod(fm.causal, 32, block_m=16, block_n=16, cache=False)
    d = cm.from_mask_mod(fm.causal, 32, block_m=16, block_n=16, cache=False)
    assert c is not d and not plan_cache._PURE and not plan_cache._RECOGNISED


def test_keyless_mask_mod_not_kept():
    cfg = {"w": 3}  # a dict has no structural key: what the trace reads from it could change

    def mm(b, h, q, k):
        return (q - k).abs() <= cfg["w"]

    first = cm.from_mask_mod(mm, 16, block_m=8, block_n=8)
    cfg["w"] = 5
    again = cm.from_mask_mod(mm, 16, block_m=8, block_n=8)
    assert again is not first and not plan_cache._PURE
    assert torch.equal(again.to_dense(), flex_dense(mm, 16))


def test_lru_bound():
    for w in range(plan_cache.MAX_ENTRIES + 5):
        cm.from_mask_mod(_window(w), 8, block_m=8, block_n=8, lifting=True)
    assert len(plan_cache._PURE) + len(plan_cache._RECOGNISED) <= 2 * plan_cache.MAX_ENTRIES
    assert len(plan_cache._RECOGNISED) <= plan_cache.MAX_ENTRIES


def test_cache_must_be_a_bool():
    with pytest.raises(CompileMaskError, match="cache"):
        cm.from_mask_mod(fm.causal, 8, cache=1)
