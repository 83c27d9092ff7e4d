"""The FMA-pipe 2^x of the softmax with a lone fast softcap (``score_mods.exp2_softmax``), as a
float32 twin of its PTX: relative error over a dense range, 0 below -127 and at -inf, NaN
kept, finite up to 127; and the PTX carries the twin's constants."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from compilemask.kernels.triton import score_mods as tsm

BIG = np.float32(12582912.0)


def exp2_fma_twin(x: np.ndarray) -> np.ndarray:
    """float32 twin of ``_exp2_fma_ptx``: every step rounded to float32 as the PTX rounds
    (``fma.rn`` fused: product and sum in float64, one rounding)."""
    x = np.asarray(x, dtype=np.float32)
    xc = np.where(np.isnan(x), x, np.maximum(x, np.float32(-127.0))).astype(np.float32)
    xr = (xc + BIG).astype(np.float32)
    f = (xc - (xr - BIG).astype(np.float32)).astype(np.float32)
    c1, c2, c3 = (np.float32(c) for c in tsm.EXP2_POLY)

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
    ref = np.exp2(x.astype(np.float64))
    rel = np.abs(got / ref - 1.0)
    assert rel.max() <= 2.0**-13.0, rel.max()
    assert exp2_fma_twin(np.float32([0.0]))[0] == 1.0  # the row's max gives exactly 1


def test_very_negative_and_minus_inf_give_zero():
    x = np.float32([-127.0, -128.0, -150.5, -1e30, -np.inf])
    got = exp2_fma_twin(x)
    assert np.all(got == 0.0) and not np.any(np.signbit(got))
    # between -127 and -126: tiny, non-negative, finite (far below a row sum >= 1)
    mid = exp2_fma_twin(np.linspace(-127.0, -126.0, 1001, dtype=np.float32))
    assert np.all(np.isfinite(mid)) and np.all(mid >= 0.0) and mid.max() <= 2.0**-125


def test_nan_stays_nan_and_large_inputs_are_finite():
    assert np.isnan(exp2_fma_twin(np.float32([np.nan]))[0])
    x = np.linspace(0.0, 127.0, 100_001, dtype=np.float32)
    got = exp2_fma_twin(x).astype(np.float64)
    assert np.all(np.isfinite(got))
    assert np.abs(got / np.exp2(x.astype(np.float64)) - 1.0).max() <= 2.0**-13.0


def _hex(v: float) -> str:
    return f"0f{struct.unpack('<I', struct.pack('<f', v))[0]:08X}"


@pytest.mark.parametrize("n_fma", [0, 1, 2, 4])
def test_ptx_carries_the_twins_constants(n_fma):
    asm = tsm._exp2_softmax_asm(n_fma)
    assert asm.count("ex2.approx.ftz.f32") == 4 - n_fma
    assert asm.count("max.NaN.f32") == n_fma
    for c in (*tsm.EXP2_POLY, 12582912.0, -127.0, 1.0):
        assert (_hex(c) in asm) == (n_fma > 0)
