"""attention-gym / FlashAttention-4 spellings of catalogue masks recognised by
``migrate/recognise.py`` (``and_masks`` / ``or_masks`` constants, ``noop_mask``, masks of
positions inside a chunk or a document), exact against FlexAttention's ``create_mask``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import and_masks, create_mask, noop_mask, or_masks

import compilemask as cm
import flex_masks as fm
from compilemask.compiler.migrate import lift
from compilemask.compiler.migrate.recognise import recognise


def recognised(mm, nq, nk):
    return recognise(lift.traced(mm), nq, nk)


def check(mm, nq, nk, expect: bool | None = True):
    """The plan equals FlexAttention's mask; recognised (or not) as ``expect`` says (None, or
    an empty mask: either; an empty band is left to the general lifting)."""
    plan = cm.from_mask_mod(mm, nq, nk, block_m=16, block_n=16)
    plan.verify()
    want = create_mask(mm, None, None, nq, nk, device="cpu")[0, 0]
    assert torch.equal(plan.to_dense(), want)
    if expect is not None and (want.any() or not expect):
        assert (recognised(mm, nq, nk) is not None) == expect


@settings(max_examples=25, deadline=None)
@given(nq=st.integers(1, 70), nk=st.integers(1, 70), w=st.integers(0, 80), c=st.integers(1, 30))
def test_gym_bands_and_chunks(nq, nk, w, c):
    for mm in (
        noop_mask,
        fm.sliding_window(w),
        fm.prefix_lm(w),
        fm.batchify(fm.causal, c),
        fm.batchify(noop_mask, c),
        and_masks(noop_mask, fm.causal),
        or_masks(fm.causal),
        fm.fa4_prefix_lm,
        lambda b, h, q, k: (q // c == k // c) & (k % c <= q % c),
        lambda b, h, q, k: (q // c == k // c) & (k % c < q % c) & (q - k <= w),
        lambda b, h, q, k: (k % c >= q % c) & (k // c == q // c),
        lambda b, h, q, k: ((q <= w) & (k <= w - 1)) | (k <= q),  # FA4's prefix box, a == b
        lambda b, h, q, k: ((q < w) & (k < w + 1)) | (k <= q),  # a == b - 1
    ):
        check(mm, nq, nk)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=8), w=st.integers(0, 10))
def test_gym_documents(lengths, w):
    off = fm.lengths_to_offsets(lengths)
    n = sum(lengths)
    for mm in (
        fm.packed_causal_document(off),
        fm.document(fm.causal, off),
        fm.document(noop_mask, off),
        fm.document(fm.sliding_window(w), off),
    ):
        check(mm, n, n)


@pytest.mark.parametrize(
    "mm",
    [
        lambda b, h, q, k: (b.new_zeros(()) == 0) & (k <= q),  # not a bool constant
        lambda b, h, q, k: b.new_zeros((), dtype=torch.bool) & (k <= q),  # always false
        lambda b, h, q, k: (q % 8) >= (k % 8),  # no chunk around it
        lambda b, h, q, k: (q // 8 == k // 8) & ((q % 4) >= (k % 4)),  # another divisor
        lambda b, h, q, k: ((q < 30) & (k < 32)) | (k <= q),  # a box wider than the causal part
        lambda b, h, q, k: ((q < 30) & (k < 30)) | (k < q - 2),  # not with kv <= q
    ],
)
def test_gym_lookalikes_not_recognised(mm):
    check(mm, 40, 40, expect=False)


def test_unused_in_place_update_not_skipped():
    """An unused value may still be written in place: such a trace is not recognised."""

    def mm(b, h, q, k):
        t = q + 0
        t.add_(1)
        return q >= k

    assert recognised(mm, 16, 16) is None


def test_document_terms_that_do_not_cancel():
    off = fm.lengths_to_offsets([3, 5, 4])
    doc = fm.doc_ids(off)
    for mm in (
        lambda b, h, q, k: (doc[q] == doc[k]) & (q - off[doc[q]] >= k),  # one side only
        lambda b, h, q, k: (doc[q] == doc[k]) & (q - off[doc[q]] >= k - off[doc[k] + 1]),
        lambda b, h, q, k: q - off[doc[q]] >= k - off[doc[k]],  # no same-document term
    ):
        check(mm, 12, 12, expect=False)


def test_document_table_shorter_than_the_ids_not_recognised():
    """``off[doc[q]]`` with ids past the end of ``off`` is not a document offset."""
    doc = torch.tensor([0, 0, 1, 1, 2, 2])
    off = torch.tensor([0, 2])  # no entry for id 2

    def mm(b, h, q, k):
        return (doc[q] == doc[k]) & (q - off[doc[q]] >= k - off[doc[k]])

    assert recognised(mm, 6, 6) is None
    assert recognised(fm.document(fm.causal, fm.lengths_to_offsets([2, 2, 2])), 6, 6) is not None


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=2, max_size=8), seed=st.integers(0, 999))
def test_row_start_tables_perturbed_exact(lengths, seed):
    """``kv >= off[doc[q]]`` with ``kv <= q``: a document's causal rows only when the offsets
    are the documents' starts; one offset moved gives another mask, lifted, exact either way."""
    off = fm.lengths_to_offsets(lengths)
    doc = fm.doc_ids(off)
    g = torch.Generator().manual_seed(seed)
    moved = off.clone()
    moved[int(torch.randint(len(lengths), (1,), generator=g))] += int(
        torch.randint(-2, 3, (1,), generator=g)
    )
    n = sum(lengths)

    def row_start(t, strict):
        if strict:
            return lambda b, h, q, k: (k > t[doc[q]]) & (k <= q)
        return lambda b, h, q, k: (q >= k) & (t[doc[q]] <= k)

    for t, strict in ((moved, False), (off - 1, True), (off, True)):
        mm = row_start(t, strict)
        check(mm, n, n, expect=True if torch.equal(t + strict, off) else None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gym_spellings_on_cuda_tables():
    """The tables on the GPU (as a FlexAttention user has them): recognised, and the CUDA plan
    holds the CPU plan's rows."""
    off = fm.lengths_to_offsets([5, 9, 2, 16])
    for make in (
        lambda o: fm.document(fm.causal, o),
        lambda o: fm.packed_causal_document(o),
        lambda o: fm.document(noop_mask, o),
    ):
        cpu = cm.from_mask_mod(make(off), 32, block_m=16, block_n=16)
        mm = make(off.cuda())
        assert recognised(mm, 32, 32) is not None
        gpu = cm.from_mask_mod(mm, 32, block_m=16, block_n=16, device="cuda")
        assert torch.equal(gpu.to_dense().cpu(), cpu.to_dense())
