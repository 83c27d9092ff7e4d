"""The cute softcap kernel's FMA-pipe 2^x (``kernels/cute/exp2.py``) as a float32 twin of its
PTX: relative error over the softmax's range, +0.0 below -127 and at -inf, 1 at 0, NaN kept;
and the PTX carries the twin's constants."""

from __future__ import annotations

import numpy as np

from compilemask.kernels.cute import exp2 as ex

BIG = np.float32(ex.ROUND)


def exp2_fma_twin(x: np.ndarray) -> np.ndarray:
    """float32 twin of :func:`~compilemask.kernels.cute.exp2.exp2_fma_ptx`: every step rounded
    to float32 as the PTX rounds (``fma.rn`` fused: product and sum in float64, one
    rounding)."""
    x = np.asarray(x, dtype=np.float32)
    xc = np.where(np.isnan(x), x, np.maximum(x, np.float32(-127.0))).astype(np.float32)
    xr = (xc + BIG).astype(np.float32)
    f = (xc - (xr - BIG).astype(np.float32)).astype(np.float32)
    c1, c2, c3 = (np.float32(c) for c in ex.EXP2_POLY)

    def fma(a, b, c):
        return (a.astype(np.float64) * np.float64(b) + np.float64(c)).astype(np.float32)

    p = fma(f, c3, c2)
    p = (p.astype(np.float64) * f + np.float64(c1)).astype(np.float32)
    p = (p.astype(np.float64) * f + 1.0).astype(np.float32)
    bits = p.view(np.uint32) + (xr.view(np.uint32) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def test_relative_error_over_the_softmax_range():
    x = np.linspace(-126.0, 0.0, 2_000_001, dtype=np.float32)
    x = np.concatenate([x, -(np.float32(2.0) ** -np.arange(1, 40, dtype=np.float32)), [0.0]])
    got = exp2_fma_twin(x).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1.0)
    assert rel.max() <= 2.0**-13.0, rel.max()
    assert exp2_fma_twin(np.float32([0.0]))[0] == 1.0  # the row's max gives exactly 1


def test_masked_scores_give_exactly_zero():
    got = exp2_fma_twin(np.float32([-127.0, -128.0, -150.5, -1e30, -np.inf]))
    assert np.all(got == 0.0) and not np.any(np.signbit(got))
    mid = exp2_fma_twin(np.linspace(-127.0, -126.0, 1001, dtype=np.float32))
    assert np.all(np.isfinite(mid)) and np.all(mid >= 0.0) and mid.max() <= 2.0**-125


def test_nan_stays_nan():
    assert np.isnan(exp2_fma_twin(np.float32([np.nan]))[0])


def test_the_ptx_holds_the_twins_constants():
    ptx = ex.exp2_fma_ptx()
    for c in (*ex.EXP2_POLY, ex.ROUND, -127.0, 1.0):
        assert ex.f32_hex(c) in ptx
    assert ptx.count("fma.rn.f32") == 3 and "max.NaN.f32" in ptx and "shl.b32 e, e, 23" in ptx
