"""Comparisons lowered inside intervals that cross many monotone runs of their key term
(``lift.MAX_RUNS_PER_ROW``): Sparse VideoGen's temporal mask (9 runs of ``(kv - P) % F``, a
row's slots crossing up to 81 run pieces) is lifted; beyond the bound the mask_mod is
evaluated; both exact against ``create_mask``."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm
import flex_masks as fm
from compilemask.compiler.migrate import lift


def dense(mm, n):
    return create_mask(mm, None, None, n, n, device="cpu")[0, 0]


@settings(max_examples=20, deadline=None)
@given(
    prompt=st.integers(0, 12),
    frames=st.integers(1, 8),
    per=st.integers(1, 12),
    width=st.integers(1, 4),
)
def test_svg_temporal_exact(prompt, frames, per, width):
    mm = fm.svg_temporal(prompt, frames, per, width)
    n = prompt + frames * per
    plan = cm.from_mask_mod(mm, n, block_m=8, block_n=8, cache=False)
    plan.verify()
    assert torch.equal(plan.to_dense(), dense(mm, n))


def test_svg_temporal_lifted_at_scale():
    mm = fm.svg_temporal(128, 8, 240, 2)
    n = 128 + 8 * 240
    plan = cm.from_mask_mod(mm, n, cache=False)
    assert plan.source == "from_mask_mod:lifted"
    assert torch.equal(plan.to_dense(), dense(mm, n))


def test_beyond_the_bound_evaluated():
    period = 4
    n = period * (lift.MAX_RUNS_PER_ROW + 8)  # more runs of kv % 4 than the bound

    def mm(b, h, q, k):
        return (q % period) >= (k % period)

    plan = cm.from_mask_mod(mm, n, cache=False)
    assert plan.source != "from_mask_mod:lifted"
    assert torch.equal(plan.to_dense(), dense(mm, n))


def test_key_mask_under_causality_becomes_a_bitmask_plan(monkeypatch):
    """A random key mask under causality holds about Nk / 4 intervals per row: the lifting
    refuses to build that ``[Nq, K]`` table (it grows with ``Nq * Nk``) once it passes
    ``MAX_LIFTED_BYTES``, and the mask_mod is evaluated into a bitmask plan instead, exact and
    smaller than the table it replaces; below the bound it is still lifted."""
    n = 1024
    keep = torch.rand(n, generator=torch.Generator().manual_seed(0)) < 0.5

    def mm(b, h, q, k):
        return keep[k] & (k <= q)

    want = dense(mm, n)
    lifted = cm.from_mask_mod(mm, n, cache=False)
    assert lifted.source == "from_mask_mod:lifted" and torch.equal(lifted.to_dense(), want)
    table = lifted.row_lo.numel() * 8  # lo and hi, int32
    monkeypatch.setattr(lift, "MAX_LIFTED_BYTES", table // 4)
    plan = cm.from_mask_mod(mm, n, cache=False)
    assert plan.source != "from_mask_mod:lifted" and plan.encoding == "bits"
    plan.verify()
    assert torch.equal(plan.to_dense(), want)
    assert plan.stats()["bytes"] < table // 2


def test_key_only_mask_of_many_runs_becomes_a_bitmask_plan(monkeypatch):
    """FlashAttention-4's ``kv >= bias[kv]``: every row the same, with about Nk / 10 runs. Its
    lifted table repeats that row ``Nq`` times; past ``MAX_LIFTED_BYTES`` it is evaluated into
    a bitmask plan whose tiles share their pages down each kv-tile column."""
    n = 1024
    bias = torch.randint(0, n * 3 // 5, (n,), generator=torch.Generator().manual_seed(0))
    mm = fm.fa4_ima(bias)
    want = dense(mm, n)
    lifted = cm.from_mask_mod(mm, n, cache=False)
    assert lifted.source == "from_mask_mod:lifted" and torch.equal(lifted.to_dense(), want)
    table = lifted.row_lo.numel() * 8
    monkeypatch.setattr(lift, "MAX_LIFTED_BYTES", table // 4)
    plan = cm.from_mask_mod(mm, n, cache=False)
    assert plan.source != "from_mask_mod:lifted" and plan.encoding == "bits"
    plan.verify()
    assert torch.equal(plan.to_dense(), want)
    assert plan.schedule.bits.shape[0] <= plan.schedule.kind.shape[2]  # a page per kv-tile
    assert plan.stats()["bytes"] < table // 8
