"""``2^x`` on the FMA pipe for the cute forward (imported without ``cutlass``, so that its
float32 twin in ``tests/test_cute_exp2_fma.py`` runs on any machine).

Cody-Waite: ``x`` clamped below at -127 (NaN stays NaN), ``j = rint(x)`` by adding
``1.5 * 2^23`` (the integer lands in the low mantissa bits), ``f = x - j`` in [-1/2, 1/2],
``p = 1 + f (c1 + f (c2 + f c3))`` (:data:`EXP2_POLY`, relative error below 2^-13) and
``2^x = bits(p) + (j << 23)``: ``x <= -127`` and ``-inf`` give +0.0 (``j = -127``, ``p = 1``),
``x = 0`` gives 1 exactly. Valid for ``x <= 127`` (the softmax feeds it ``x <= 0``).
"""

from __future__ import annotations

import struct

#: 2^f on [-1/2, 1/2] as ``1 + f (c1 + f (c2 + f c3))``
EXP2_POLY = (0.6932829022407532, 0.2422109991312027, 0.05500893294811249)
#: 1.5 * 2^23: adding it rounds a float32 to an integer, kept in the low mantissa bits
ROUND = 12582912.0


def f32_hex(v: float) -> str:
    """A float32 constant in PTX's hexadecimal form (``0f3F800000``)."""
    return f"0f{struct.unpack('<I', struct.pack('<f', v))[0]:08X}"


def exp2_fma_ptx() -> str:
    """PTX of ``$0 = 2^$1`` (both ``.f32``) on the FMA pipe, as the module docstring says."""
    c1, c2, c3 = (f32_hex(c) for c in EXP2_POLY)
    big = f32_hex(ROUND)
    return (
        "{ .reg .f32 xc, xr, j, f, p; .reg .b32 e, pb; "
        f"max.NaN.f32 xc, $1, {f32_hex(-127.0)}; add.rn.f32 xr, xc, {big}; "
        f"sub.rn.f32 j, xr, {big}; sub.rn.f32 f, xc, j; fma.rn.f32 p, f, {c3}, {c2}; "
        f"fma.rn.f32 p, p, f, {c1}; fma.rn.f32 p, p, f, {f32_hex(1.0)}; mov.b32 e, xr; "
        "shl.b32 e, e, 23; mov.b32 pb, p; add.s32 pb, pb, e; mov.b32 $0, pb; }"
    )
