"""The correctness measure of docs/design.md, shared by tests, the demo and benchmarks.

err(x) = max over (b, h) of ||x - ref64|| / ||ref64||, where ref64 is the reference in float64
on the same (dtype-rounded) inputs. A kernel passes when

    err(kernel) <= max(2 * err(ref_dtype), floor)

where ref_dtype is the reference with its matmuls in the kernel's dtype and its softmax in
float32; floor = 1e-3 for bf16, 2e-4 for fp16, 1e-5 for fp32. NaN never passes. A head whose
ref64 is all zeros (every row sees nothing) must be exactly zero: otherwise its error is inf.
The same rule holds for dq, dk and dv.

Example::

    >>> ref64, _ = reference_attention(q, k, v, plan, compute_dtype=torch.float64)
    >>> ref16, _ = reference_attention(q, k, v, plan, matmul_dtype=q.dtype)
    >>> ok, err, bound = check_close(out, ref64, ref16, q.dtype)
"""

from __future__ import annotations

import math

import torch

#: Error floor per kernel dtype.
ERROR_FLOOR: dict[torch.dtype, float] = {
    torch.bfloat16: 1e-3,
    torch.float16: 2e-4,
    torch.float32: 1e-5,
}


def relative_error(x: torch.Tensor, ref64: torch.Tensor) -> float:
    """max over (b, h) of ||x - ref64|| / ||ref64|| (Frobenius norms, in float64).

    Tensors of 3 or more dims are split into heads over their first two dims ([B, H, ...]);
    smaller ones count as one head. The measure is undefined for a head whose reference is
    exactly zero (e.g. dq when every row sees a single key, where the exact gradient is 0 but
    any finite-precision computation leaves rounding residue): such a head is measured against
    the norm of the whole reference instead, and when the whole reference is zero the error is
    absolute, ``||x - ref64||``, so that it meets the dtype's floor. Any NaN or inf in x gives
    nan.
    """
    if x.shape != ref64.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs reference {tuple(ref64.shape)}")
    x64 = x.detach().to(torch.float64)
    r64 = ref64.detach().to(torch.float64)
    if not bool(torch.isfinite(x64).all()):
        return math.nan
    if x.numel() == 0:
        return 0.0
    if x64.dim() >= 3:
        x64 = x64.flatten(2).flatten(0, 1)
        r64 = r64.flatten(2).flatten(0, 1)
    else:
        x64, r64 = x64.reshape(1, -1), r64.reshape(1, -1)
    diff = torch.linalg.vector_norm(x64 - r64, dim=-1)
    norm = torch.linalg.vector_norm(r64, dim=-1)
    whole = float(torch.linalg.vector_norm(r64))
    fallback = whole if whole > 0 else 1.0
    return float((diff / torch.where(norm == 0, torch.full_like(norm, fallback), norm)).max())


def check_close(
    out: torch.Tensor, ref64: torch.Tensor, ref_dtype: torch.Tensor, dtype: torch.dtype
) -> tuple[bool, float, float]:
    """Apply the rule of docs/design.md ("Correctness measure") to a kernel output.

    Args:
        out: the kernel's result (e.g. [B, H, N, D]).
        ref64: the float64 reference on the same inputs.
        ref_dtype: the same-dtype reference (matmuls in ``dtype``, softmax in float32).
        dtype: the kernel's dtype (selects the floor).

    Returns:
        (ok, err, bound): err = err(out); bound = max(2 * err(ref_dtype), floor);
        ok = err <= bound (False for NaN).
    """
    if dtype not in ERROR_FLOOR:
        raise ValueError(f"no error floor for dtype {dtype}")
    err = relative_error(out, ref64)
    ref_err = relative_error(ref_dtype, ref64)
    floor = ERROR_FLOOR[dtype]
    bound = max(2.0 * ref_err, floor) if math.isfinite(ref_err) else floor
    ok = not math.isnan(err) and err <= bound
    return ok, err, bound


def check_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan,
    scale: float | None = None,
) -> tuple[bool, float, float]:
    """Compute both references for (q, k, v, plan) and apply :func:`check_close` to ``out``."""
    from .kernels.reference import reference_attention

    ref64, _ = reference_attention(q, k, v, plan, scale, compute_dtype=torch.float64)
    ref_dt, _ = reference_attention(
        q, k, v, plan, scale, compute_dtype=torch.float32, matmul_dtype=q.dtype
    )
    return check_close(out, ref64, ref_dt, q.dtype)
