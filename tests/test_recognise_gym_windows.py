"""attention-gym's NATTEN and global-token windows recognised by ``migrate/recognise_gym.py``
(``natten2d``, ``global_local``, ``|kv - q + c| <= t`` bands), exact against FlexAttention's
``create_mask``; lookalikes fall back to the lifting (still exact)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask, or_masks

import compilemask as cm
import flex_masks as fm
from compilemask.compiler.migrate import lift
from compilemask.compiler.migrate.recognise import recognise


def recognised(mm, nq, nk):
    return recognise(lift.traced(mm), nq, nk)


def check(mm, nq, nk, expect: bool | None = True):
    """The plan equals FlexAttention's mask; recognised (or not) as ``expect`` says."""
    plan = cm.from_mask_mod(mm, nq, nk, block_m=16, block_n=16)
    plan.verify()
    want = create_mask(mm, None, None, nq, nk, device="cpu")[0, 0]
    assert torch.equal(plan.to_dense(), want)
    if expect is not None:
        assert (recognised(mm, nq, nk) is not None) == expect


def natten_rows(h, w, kh, kw, lo_shift=0, hi_shift=0):
    """NATTEN on a row-major ``h x w`` grid (clamp bounds shifted for lookalikes)."""

    def fn(b, hh, q_idx, kv_idx):
        qr, qc, kr, kc = q_idx // w, q_idx % w, kv_idx // w, kv_idx % w
        cr = qr.clamp(kh // 2 + lo_shift, (h - 1) - kh // 2 + hi_shift)
        cc = qc.clamp(kw // 2, (w - 1) - kw // 2)
        return ((kr - cr).abs() <= kh // 2) & ((cc - kc).abs() < kw // 2 + 1)

    return fn


@settings(max_examples=25, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 9), kh=st.integers(0, 4), kw=st.integers(0, 4))
def test_natten_grids(h, w, kh, kw):
    kh, kw = min(2 * kh + 1, h - 1 + h % 2), min(2 * kw + 1, w - 1 + w % 2)
    check(natten_rows(h, w, kh, kw), h * w, h * w)
    side = max(h, w)
    k = min(kh, kw)
    check(fm.natten(side, side, k, k), side * side, side * side)


@pytest.mark.parametrize(
    "mm, n",
    [
        (natten_rows(6, 5, 3, 3, lo_shift=1), 30),  # clamp bounds other than NATTEN's
        (natten_rows(6, 5, 3, 3, hi_shift=-1), 30),
        (fm.natten(5, 7, 3, 3), 35),  # gym's clamps mix the axes on a non-square grid
        (natten_rows(6, 5, 3, 3), 36),  # width 5 does not divide the length
        (lambda b, h, q, k: ((q // 4).clamp(1, 2) - k // 4).abs() <= 1, 16),  # one axis
        (lambda b, h, q, k: ((k // 4).clamp(1, 2) - q // 4).abs() <= 1, 16),  # kv clamped
    ],
)
def test_natten_lookalikes_not_recognised(mm, n):
    check(mm, n, n, expect=False)


@settings(max_examples=25, deadline=None)
@given(
    nq=st.integers(1, 60),
    nk=st.integers(1, 60),
    w=st.integers(0, 70),
    c=st.integers(-5, 5),
    seed=st.integers(0, 2**16),
)
def test_abs_bands_and_global_tokens(nq, nk, w, c, seed):
    g = torch.Generator().manual_seed(seed)
    is_global = torch.rand(max(nq, nk) + 3, generator=g) < 0.1
    check(fm.global_sliding_window(w, is_global), nq, nk, expect=nq == nk or None)
    check(lambda b, h, q, k: (q - k + c).abs() <= w, nq, nk, expect=None)
    check(lambda b, h, q, k: torch.abs(k - q) < w + 1, nq, nk, expect=None)


def test_global_sliding_window_recognised():
    is_global = torch.zeros(64, dtype=torch.bool)
    is_global[[0, 9, 10, 40, 63]] = True
    m = recognised(fm.global_sliding_window(3, is_global), 64, 64)
    assert str(m) == "global_local(3, [0, 9, 10, 40, 63])"
    check(fm.global_sliding_window(3, is_global), 64, 64)
    check(fm.global_sliding_window(3, is_global), 40, 64)  # tokens past q_len still columns


def _lookalikes():
    g = torch.zeros(40, dtype=torch.bool)
    g[[3, 17, 30]] = True
    g2 = g.clone()
    g2[5] = True

    def local(b, h, q, k):
        return (q - k).abs() <= 4

    return [
        or_masks(local, lambda b, h, q, k: g[q]),  # global rows only
        or_masks(local, lambda b, h, q, k: g[q] | g2[k]),  # two tables
        or_masks(lambda b, h, q, k: (q - k + 1).abs() <= 4, lambda b, h, q, k: g[q] | g[k]),
        or_masks(lambda b, h, q, k: (q - k).abs() >= 4, lambda b, h, q, k: g[q] | g[k]),
        lambda b, h, q, k: local(b, h, q, k) & (g[q] | g[k]),
        lambda b, h, q, k: (q + k).abs() <= 30,
    ]


@pytest.mark.parametrize("mm", _lookalikes())
def test_global_lookalikes_not_recognised(mm):
    check(mm, 40, 40, expect=False)


def test_in_place_operation_not_recognised():
    def mm(b, h, q, k):
        d = q - k
        near = d.abs_() <= 3
        return near & (d >= 0)  # d is |q - k| here: always >= 0

    # reading the later ``d`` as ``q - k`` would give the lower half of the band only
    assert recognised(mm, 20, 20) is None
    check(mm, 20, 20, expect=False)


def test_abs_band_recognised():
    m = recognised(lambda b, h, q, k: abs(q - k) <= 3, 40, 40)  # Python's abs
    assert "band(-3, 3)" in str(m)
    m = recognised(lambda b, h, q, k: (k - q - 2).abs() < 3, 40, 40)  # kv - q in [0, 4]
    assert "band(0, 4)" in str(m)
    check(lambda b, h, q, k: (k - q - 2).abs() < 3, 40, 40)
