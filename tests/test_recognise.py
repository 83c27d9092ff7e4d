"""Recognised mask_mod forms (``migrate/recognise.py``) against FlexAttention's ``create_mask``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm
from compilemask.compiler.migrate import lift
from compilemask.compiler.migrate.recognise import recognise


def recognised(mm, nq, nk):
    return recognise(lift.traced(mm), nq, nk)


def check(mm, nq, nk, *, expect_recognised=True):
    """The plan equals FlexAttention's mask exactly; the form is recognised (or not; an empty
    mask may be either: an empty band is left to the general lifting)."""
    plan = cm.from_mask_mod(mm, nq, nk, block_m=16, block_n=16)
    plan.verify()
    want = create_mask(mm, None, None, nq, nk, device="cpu")[0, 0]
    assert torch.equal(plan.to_dense(), want)
    assert plan.source == "from_mask_mod:lifted"
    if want.any() or not expect_recognised:
        assert (recognised(mm, nq, nk) is not None) == expect_recognised


def band_mods(w: int, c: int):
    """Comparisons of kv - q: strict and non-strict, both orientations, windows with and
    without the diagonal."""
    return [
        lambda b, h, q, k: k <= q,
        lambda b, h, q, k: q >= k,
        lambda b, h, q, k: k < q,
        lambda b, h, q, k: k >= q,
        lambda b, h, q, k: k > q,
        lambda b, h, q, k: k == q,
        lambda b, h, q, k: ~(k > q),
        lambda b, h, q, k: (k <= q) & (q - k < w),
        lambda b, h, q, k: (q - k <= w) & (k <= q),
        lambda b, h, q, k: (k < q) & (q - k < w),
        lambda b, h, q, k: (k - q < w) & (k >= q),
        lambda b, h, q, k: (q - w <= k) & (k <= q + c),
        lambda b, h, q, k: (k + w > q) & (q >= k) & (k + 1 > q - c),
    ]


@settings(max_examples=40, deadline=None)
@given(nq=st.integers(1, 70), nk=st.integers(1, 70), w=st.integers(1, 80), c=st.integers(0, 9))
def test_bands(nq, nk, w, c):
    for mm in band_mods(w, c):
        check(mm, nq, nk)


@settings(max_examples=40, deadline=None)
@given(nq=st.integers(1, 70), nk=st.integers(1, 70), p=st.integers(-3, 90))
def test_prefix_lm(nq, nk, p):
    for mm in (
        lambda b, h, q, k: (k <= q) | (k < p),
        lambda b, h, q, k: (k < p) | (q >= k),
        lambda b, h, q, k: (k <= q) | (k <= p),
        lambda b, h, q, k: (p > k) | (k <= q),
    ):
        check(mm, nq, nk)


@settings(max_examples=40, deadline=None)
@given(nq=st.integers(1, 70), nk=st.integers(1, 70), c=st.integers(1, 40), w=st.integers(1, 20))
def test_chunks(nq, nk, c, w):
    for mm in (
        lambda b, h, q, k: (q // c == k // c) & (k <= q),
        lambda b, h, q, k: (k <= q) & (k // c == q // c),
        lambda b, h, q, k: q // c == k // c,
        lambda b, h, q, k: k // c <= q // c,
        lambda b, h, q, k: q // c >= k // c,
        lambda b, h, q, k: (q // c == k // c) & (q - k < w) & (k <= q),
    ):
        check(mm, nq, nk)


def doc_ids(lengths, extra: int = 0) -> torch.Tensor:
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return torch.cat([ids, ids.new_full((extra,), len(lengths))])


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    extra=st.integers(0, 5),
    w=st.integers(1, 10),
    dtype=st.sampled_from([torch.int64, torch.int32]),
)
def test_documents(lengths, extra, w, dtype):
    """doc[q] == doc[kv] (& causal, & a window) of non-decreasing ids, the tensor longer than
    the plan or not."""
    doc = doc_ids(lengths, extra).to(dtype) * 3  # ids need not be consecutive
    n = sum(lengths)
    for mm in (
        lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q),
        lambda b, h, q, k: (q >= k) & (doc[k] == doc[q]),
        lambda b, h, q, k: doc[q] == doc[k],
        lambda b, h, q, k: (doc[q] == doc[k]) & (q - k < w) & (k <= q),
    ):
        check(mm, n, n)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=2, max_size=8), seed=st.integers(0, 999))
def test_unsorted_documents_fall_back(lengths, seed):
    doc = doc_ids(lengths)
    g = torch.Generator().manual_seed(seed)
    doc = doc[torch.randperm(len(doc), generator=g)]
    n = len(doc)
    mm = lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q)  # noqa: E731
    sorted_ = bool((doc[1:] >= doc[:-1]).all())
    check(mm, n, n, expect_recognised=sorted_)


def test_documents_q_len_not_kv_len_fall_back():
    doc = doc_ids([3, 4, 5])
    mm = lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q)  # noqa: E731
    check(mm, 7, 12, expect_recognised=False)
    check(mm, 12, 7, expect_recognised=False)


@pytest.mark.parametrize(
    "mm",
    [
        lambda b, h, q, k: (k <= q) & (h == 0),  # uses h
        lambda b, h, q, k: (k <= q) | (b > 0),  # uses b
        lambda b, h, q, k: k != q,  # ne: not a band
        lambda b, h, q, k: 2 * k <= q,  # a coefficient other than +-1
        lambda b, h, q, k: (k <= q) & (q < 30),  # a bound on q
        lambda b, h, q, k: k < 5,  # a bound on kv outside a union with causal
        lambda b, h, q, k: (q - k) % 2 == 0,
        lambda b, h, q, k: (k - q < 2.5) & (k <= q),  # a float constant
        lambda b, h, q, k: (k <= q) & (k > q),  # empty
    ],
)
def test_other_forms_not_recognised(mm):
    assert recognised(mm, 40, 40) is None
    plan = cm.from_mask_mod(mm, 40, 40, heads=2)
    want = create_mask(mm, None, 2, 40, 40, device="cpu")
    d = plan.to_dense()
    assert torch.equal(d.expand_as(want) if d.dim() == 4 else d[None, None].expand_as(want), want)


def test_gathers_of_two_tensors_not_a_document():
    a, b_ = doc_ids([3, 5]), doc_ids([4, 4])
    assert recognised(lambda b, h, q, k: a[q] == b_[k], 8, 8) is None


def test_batch_or_heads_take_the_general_lifting():
    """A plan that depends on batch or heads is built per (b, h), never from the catalogue."""
    mm = lambda b, h, q, k: k <= q  # noqa: E731
    plan = cm.from_mask_mod(mm, 24, heads=2)
    assert plan.heads == 2 and plan.source == "from_mask_mod:lifted"
    assert torch.equal(plan.to_dense()[0, 1], torch.ones(24, 24, dtype=torch.bool).tril())


def test_recognised_plan_equals_compile():
    """The same lowering as compile: identical row intervals."""
    n = 300
    for mm, mask in (
        (lambda b, h, q, k: (k <= q) & (q - k < 64), cm.masks.sliding_window(64)),
        (lambda b, h, q, k: (k <= q) | (k < 40), cm.masks.prefix_lm(40)),
        (lambda b, h, q, k: (q // 32 == k // 32) & (k <= q), cm.masks.chunked(32)),
    ):
        got = cm.from_mask_mod(mm, n)
        want = cm.compile(mask, n, cache=False)
        assert torch.equal(got.row_lo, want.row_lo) and torch.equal(got.row_hi, want.row_hi)


def clear_mods(t: int, w: int, r: int):
    """CLEAR as FlexAttention users write it: offsets, either sign order, ``* `` or ``**``,
    ``<`` a square or ``<=`` one less, the text terms in any order and nesting."""
    r2 = r * r

    def standard(b, h, q, k):
        qi, ki = q - t, k - t
        dy, dx = qi // w - ki // w, qi % w - ki % w
        return (q < t) | (k < t) | (dy * dy + dx * dx < r2)

    def reversed_(b, h, q, k):
        qi, ki = q - t, k - t
        dy, dx = ki // w - qi // w, qi % w - ki % w
        return ((dx**2 + dy**2 <= r2 - 1) | (t > k)) | (q <= t - 1)

    def nested(b, h, q, k):
        dy = (k - t) // w - (q - t) // w
        dx = (k - t) % w - (q - t) % w
        return (k < t) | ((r2 > torch.square(dy) + dx * dx) | ~(q >= t))

    return [standard, reversed_, nested]


def grid_only_mod(w: int, r: int):
    """T == 0 without offsets and text terms."""
    return lambda b, h, q, k: (q // w - k // w) ** 2 + (q % w - k % w) ** 2 < r * r


@settings(max_examples=40, deadline=None)
@given(t=st.integers(0, 12), gh=st.integers(1, 7), gw=st.integers(1, 9), r=st.integers(1, 12))
def test_clear(t, gh, gw, r):
    """The disc forms at every (T, grid, r): T == 0, r == 1, r beyond the grid, 1-wide grids."""
    n = t + gh * gw
    for mm in clear_mods(t, gw, r):
        check(mm, n, n)
    if t == 0:
        check(grid_only_mod(gw, r), n, n)


@pytest.mark.parametrize(
    ("t", "gh", "gw", "r"),
    [(0, 4, 4, 1), (3, 1, 9, 2), (7, 5, 3, 20), (16, 6, 11, 4), (1, 9, 1, 3), (8, 8, 8, 3)],
)
def test_clear_recognised_as_the_catalogue_mask(t, gh, gw, r):
    n = t + gh * gw
    from compilemask.tools.peers import flex_mask_mod

    mask = cm.masks.clear((gh, gw), r, t)
    for mm in (flex_mask_mod(mask, "cpu"), *clear_mods(t, gw, r)):
        assert recognised(mm, n, n) == mask
        check(mm, n, n)
    standard = clear_mods(t, gw, r)[0]
    lifted = cm.from_mask_mod(standard, n, heads=2, block_m=16, block_n=16)  # not recognised
    assert lifted.source == "from_mask_mod:lifted"
    assert torch.equal(lifted.to_dense()[0, 1], cm.dense(mask, n))
    causal = lambda b, h, q, k: standard(b, h, q, k) & (k <= q)  # noqa: E731
    assert recognised(causal, n, n) in (mask & cm.masks.causal(), cm.masks.causal() & mask)
    check(causal, n, n)


def test_clear_plan_equals_compile():
    from compilemask.tools.peers import flex_mask_mod

    for (gh, gw), r, t in (((16, 32), 16, 512), ((12, 20), 5, 0), ((3, 40), 7, 9)):
        mask = cm.masks.clear((gh, gw), r, t)
        n = t + gh * gw
        got = cm.from_mask_mod(flex_mask_mod(mask, "cpu"), n)
        want = cm.compile(mask, n, cache=False)
        assert torch.equal(got.row_lo, want.row_lo) and torch.equal(got.row_hi, want.row_hi)
        assert torch.equal(got.row_count, want.row_count)


def _disc_mod(t, w, r2, *, tq=None, tk=None, oq=None, ok=None, wm=None, texts=("q", "k")):
    """A CLEAR-like mask_mod with one part changed: the text bounds ``tq`` / ``tk``, the image
    offsets ``oq`` / ``ok``, the ``%`` divisor ``wm`` or the text terms present."""
    tq, tk = t if tq is None else tq, t if tk is None else tk
    oq, ok = t if oq is None else oq, t if ok is None else ok
    wm = w if wm is None else wm

    def mm(b, h, q, k):
        qi, ki = q - oq, k - ok
        out = (qi // w - ki // w) ** 2 + (qi % wm - ki % wm) ** 2 < r2
        if "q" in texts:
            out = out | (q < tq)
        if "k" in texts:
            out = out | (k < tk)
        return out

    return mm


@pytest.mark.parametrize(
    ("mm", "n"),
    [
        (_disc_mod(4, 5, 9, ok=5), 44),  # different offsets on q and kv
        (_disc_mod(4, 5, 9, oq=3, ok=3), 44),  # the text terms and the offset differ
        (_disc_mod(4, 5, 9, tk=5), 44),  # the text terms differ
        (_disc_mod(4, 5, 9, wm=6), 44),  # another divisor for % than for //
        (_disc_mod(4, 5, 9, texts=("q",)), 44),  # a missing text term
        (_disc_mod(4, 5, 9, texts=("k",)), 44),
        (_disc_mod(4, 5, 9, texts=()), 44),
        (_disc_mod(4, 5, 10), 44),  # < a non-square
        (_disc_mod(4, 5, 0), 44),  # < 0: empty disc
        (_disc_mod(4, 5, 9), 43),  # the image is not whole grid rows
        (_disc_mod(4, 5, 9), 4),  # no image
        (_disc_mod(0, 5, 9, oq=-2, ok=-2, texts=()), 40),  # an image before token 0
        (lambda b, h, q, k: (q < 4) | (k < 4) | ((q - 4) // 5 - (k - 4) // 5 <= 2), 44),
        (lambda b, h, q, k: (q // 5 - k // 5) ** 2 + (q % 5 - k % 5) ** 2 <= 9, 40),  # <= square
        (lambda b, h, q, k: (q // 5 - k // 5) ** 2 + (q // 5 - k // 5) ** 2 < 9, 40),  # dy, dy
        (lambda b, h, q, k: (q // 5 - k // 5) * (q % 5 - k % 5) < 9, 40),  # dy * dx
        (lambda b, h, q, k: (q // 5 - k // 5) ** 3 + (q % 5 - k % 5) ** 2 < 9, 40),
        (lambda b, h, q, k: (q // 5 - k // 5) ** 2 + (q % 5 - k % 5) ** 2 > 9, 40),
        (lambda b, h, q, k: (q // 5 - q // 5) ** 2 + (q % 5 - k % 5) ** 2 < 9, 40),  # q, q
        (lambda b, h, q, k: (q // 5 - k // 5) ** 2 + (q % 5 - k % 5) ** 2 + 1 < 9, 40),
        (lambda b, h, q, k: (q > 3) | _disc_mod(4, 5, 9, texts=("k",))(b, h, q, k), 44),
        (lambda b, h, q, k: (q < 4) & _disc_mod(4, 5, 9, texts=("k",))(b, h, q, k), 44),
        (lambda b, h, q, k: (q < 4) | (k < 4) | ((q - 4) % 5 - (k - 4) % 5 < 1), 44),
        (lambda b, h, q, k: (q < 4) | (q < 4) | _disc_mod(4, 5, 9, texts=("k",))(b, h, q, k), 44),
        (lambda b, h, q, k: (b < 1) & _disc_mod(0, 5, 9)(b, h, q, k), 40),  # uses b
        (lambda b, h, q, k: (h > 0) | _disc_mod(4, 5, 9)(b, h, q, k), 44),  # uses h
    ],
)
def test_other_disc_forms_not_recognised(mm, n):
    """Not CLEAR (or not at this length): left to the general lifting or the evaluation, exact."""
    check_not_recognised(mm, n, n)


def test_clear_q_len_not_kv_len_not_recognised():
    mm = clear_mods(4, 5, 3)[0]
    check_not_recognised(mm, 44, 39)
    check_not_recognised(mm, 39, 44)


def check_not_recognised(mm, nq, nk):
    assert recognised(mm, nq, nk) is None
    plan = cm.from_mask_mod(mm, nq, nk, block_m=16, block_n=16)
    plan.verify()
    assert torch.equal(plan.to_dense(), create_mask(mm, None, None, nq, nk, device="cpu")[0, 0])
