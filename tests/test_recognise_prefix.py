"""Documents sharing a prefix document (attention-gym's ``shared_prefix``,
``migrate/recognise_prefix.py``): recognised as ``shared_prompt`` when the tables form groups
led by their prefix document, exact against ``create_mask`` whether recognised or not."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm
import flex_masks as fm
from compilemask.compiler.migrate import lift, plan_cache
from compilemask.compiler.migrate.recognise import recognise


def check(mm, n, expect: bool | None):
    plan_cache.clear()
    plan = cm.from_mask_mod(mm, n, block_m=8, block_n=8)
    plan.verify()
    assert torch.equal(plan.to_dense(), create_mask(mm, None, None, n, n, device="cpu")[0, 0])
    if expect is not None:
        assert (recognise(lift.traced(mm), n, n) is not None) == expect


def _groups(lengths, starts):
    """``pd``: each document's prefix, a new group at every document whose flag is set (the
    first always)."""
    pd, head = [], 0
    for i, new in enumerate(starts):
        if new or i == 0:
            head = i
        pd.append(head)
    return torch.tensor(pd)


@settings(max_examples=40, deadline=None)
@given(
    docs=st.lists(st.tuples(st.integers(1, 6), st.booleans()), min_size=1, max_size=8),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_shared_prefix_exact(docs, dtype):
    lengths = [d[0] for d in docs]
    pd = _groups(lengths, [d[1] for d in docs]).to(dtype)
    off = fm.lengths_to_offsets(lengths).to(dtype)
    check(fm.shared_prefix(off, pd), sum(lengths), True)


def test_gym_layout_recognised():
    lengths = [3, 5, 2, 4, 1, 6, 2, 7, 3]
    off = fm.lengths_to_offsets(lengths)
    pd = torch.arange(len(lengths)) // 4 * 4
    check(fm.shared_prefix(off, pd), sum(lengths), True)
    got = recognise(lift.traced(fm.shared_prefix(off, pd)), sum(lengths), sum(lengths))
    want = cm.masks.shared_prompt([3, 1, 2], [[5, 2, 4], [6, 2, 7], [1]])  # a lone prefix: 2 + 1
    assert str(got) == str(want)


@pytest.mark.parametrize(
    "lengths, pd, n",
    [
        ([3, 2, 4], [0, 0, 2], 9),  # a prefix chained to a later group's head: fine (own head)
        ([3, 2, 4], [0, 2, 2], 9),  # a prefix after its document (not causal)
        ([3, 2, 4], [1, 1, 1], 9),  # a head that is not the group's first document
        ([3, 2, 4], [0, 0, 1], 9),  # a prefix that is not a head
        ([3, 2, 4], [0, 0, 0], 7),  # the length cuts a document: still a group
        ([3, 2, 4], [0, 0, 0], 2),  # the length cuts the prefix document
    ],
)
def test_tables_checked(lengths, pd, n):
    off = fm.lengths_to_offsets(lengths)
    check(fm.shared_prefix(off, torch.tensor(pd)), n, None)


def test_inconsistent_offsets_not_recognised():
    lengths = [3, 2, 4]
    off = fm.lengths_to_offsets(lengths)
    doc = fm.doc_ids(off)
    pd = torch.tensor([0, 0, 0])
    bad = off.clone()
    bad[1] = 2  # document 1's offset inside document 0

    def mm(b, h, q, k):
        q_doc = doc[q]
        q_pre = pd[q_doc]
        own = (k >= bad[q_doc]) & (k <= q)
        pre = (q_doc != q_pre) & (k >= bad[q_pre]) & (k < bad[q_pre + 1])
        return own | pre

    check(mm, 9, False)


def test_lookalikes_not_recognised():
    off = fm.lengths_to_offsets([3, 2, 4])
    doc = fm.doc_ids(off)
    pd = torch.tensor([0, 0, 0])

    def no_guard(b, h, q, k):  # the prefix part without doc[q] != pd[doc[q]]
        q_pre = pd[doc[q]]
        return ((k >= off[doc[q]]) & (k <= q)) | ((k >= off[q_pre]) & (k < off[q_pre + 1]))

    def wider(b, h, q, k):  # up to the end of the next document
        q_doc = doc[q]
        q_pre = pd[q_doc]
        own = (k >= off[q_doc]) & (k <= q)
        return own | ((q_doc != q_pre) & (k >= off[q_pre]) & (k < off[q_pre + 2]))

    check(no_guard, 9, False)
    check(wider, 9, False)
