"""Documents per batch row and head, ``doc[b, h, q] == doc[b, h, kv]``
(``migrate/recognise_bh.py``): recognised as ``per_batch`` / ``per_head`` documents and exact
against ``create_mask``; lookalikes left to the lifting (and still exact)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm
import flex_masks as fm
from compilemask.compiler.migrate import lift, plan_cache
from compilemask.compiler.migrate.recognise_bh import recognise_parts


def check(mm, n, batch, heads, expect: bool):
    plan = cm.from_mask_mod(mm, n, batch=batch, heads=heads, block_m=8, block_n=8)
    plan.verify()
    assert (plan.batch, plan.heads) == (batch, heads)
    want = create_mask(mm, batch or 1, heads or 1, n, n, device="cpu")
    assert torch.equal(plan.to_dense().reshape(want.shape), want)
    got = recognise_parts(lift.traced(mm), n, n, batch, heads)
    assert (got is not None) == expect
    return got


def _docs(draw_ids, shape):
    return torch.sort(torch.tensor(draw_ids).view(shape), dim=-1).values


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 40),
    batch=st.sampled_from([None, 1, 2, 3]),
    heads=st.sampled_from([None, 1, 2]),
    extra=st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 5)),
    data=st.data(),
)
def test_fa4_document_exact(n, batch, heads, extra, data):
    shape = ((batch or 1) + extra[0], (heads or 1) + extra[1], n + extra[2])
    count = shape[0] * shape[1] * shape[2]
    ids = data.draw(st.lists(st.integers(-3, 6), min_size=count, max_size=count))
    dtype = data.draw(st.sampled_from([torch.int64, torch.int32, torch.int16]))
    doc = _docs(ids, shape).to(dtype)
    causal = data.draw(st.booleans())
    if causal:

        def mm(b, h, q, k):
            return (doc[b, h, q] == doc[b, h, k]) & (k <= q)
    else:
        mm = fm.fa4_document(doc)
    plan_cache.clear()
    check(mm, n, batch, heads, True)


def test_per_batch_and_head_structure():
    doc = torch.tensor([[[0, 0, 1, 1, 1, 2]] * 2, [[0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]]])
    got = check(fm.fa4_document(doc), 6, 2, 2, True)
    assert str(got).startswith("per_batch(")
    got = check(fm.fa4_document(doc), 6, None, None, True)
    assert str(got) == str(cm.masks.document([2, 3, 1], causal=False))


@pytest.mark.parametrize(
    "mm",
    [
        lambda d: lambda b, h, q, k: d[h, b, q] == d[h, b, k],  # b and h swapped
        lambda d: lambda b, h, q, k: d[b, h, q] == d[b, h, q],  # q twice
        lambda d: lambda b, h, q, k: d[b, h, q] <= d[b, h, k],  # not ==
        lambda d: lambda b, h, q, k: d[b, h, q] + 1 == d[b, h, k],  # arithmetic on it
        lambda d: lambda b, h, q, k: d[b, 0, q] == d[b, 0, k],  # a constant head
    ],
)
def test_lookalikes_not_recognised(mm):
    doc = torch.tensor([[[0, 0, 1, 1, 2, 2, 2, 3]] * 2] * 2)
    check(mm(doc), 8, 2, 2, False)


def test_unsorted_or_float_or_short_tables_not_recognised():
    unsorted = torch.tensor([[[1, 0, 1, 1, 0, 2]]])
    check(fm.fa4_document(unsorted), 6, 1, 1, False)
    floats = torch.tensor([[[0.0, 0.0, 1.0, 1.0, 2.0, 2.0]]])
    check(fm.fa4_document(floats), 6, None, None, False)
    short = torch.tensor([[[0, 0, 1, 1]]])
    assert recognise_parts(lift.traced(fm.fa4_document(short)), 6, 6, None, None) is None
    assert recognise_parts(lift.traced(fm.fa4_document(short)), 4, 4, 2, None) is None
    assert recognise_parts(lift.traced(fm.fa4_document(short)), 4, 6, None, None) is None


def test_new_values_in_place_give_a_new_plan():
    doc = torch.tensor([[[0, 0, 1, 1, 1, 2]], [[0, 1, 1, 1, 1, 1]]])
    mm = fm.fa4_document(doc)
    first = check(mm, 6, 2, None, True)
    doc[1, 0] = torch.tensor([0, 0, 0, 0, 3, 3])
    again = check(mm, 6, 2, None, True)
    assert str(first) != str(again)


def test_a_3d_table_indexed_otherwise_not_read_per_head():
    doc = torch.tensor([[[0, 0, 1, 1, 2, 2]] * 2] * 2)
    plain = lift.traced(lambda b, h, q, k: doc[q] == doc[k])  # rows of the table, not ids
    assert recognise_parts(plain, 2, 2, None, None) is None
    assert recognise_parts(plain, 2, 2, 2, 2) is None

    def mixed(b, h, q, k):
        return (doc[b, h, q] == doc[b, h, k]) & (doc[q] == doc[k])

    assert recognise_parts(lift.traced(mixed), 2, 2, 2, 2) is None
