"""The Triton kernels on random compiled masks (property tests, Triton's interpreter on the CPU).

Random masks, lengths and tilings from the compiler's strategy (``test_compiler.cases``) run
through the forward and backward kernels with small tiles, and every output and gradient must
pass the DESIGN.md section 3 measure against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton installed")

from hypothesis import HealthCheck, given, settings  # noqa: E402

import compilemask as cm  # noqa: E402
from compilemask.errors import LayoutError  # noqa: E402
from compilemask.kernels.reference import reference_attention_backward  # noqa: E402
from compilemask.kernels.triton.configs import (  # noqa: E402
    BwdConfig,
    FwdConfig,
    override_backward_config,
    override_forward_config,
)
from compilemask.language.semantics import dense  # noqa: E402
from compilemask.testing import check_attention, check_close  # noqa: E402
from conftest import DEVICE, cases  # noqa: E402

pytestmark = pytest.mark.kernel
DTYPE = torch.float32


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases())
def test_kernels_on_random_masks(case):
    mask, n, kv, _, _ = case
    try:
        dense(mask, n, kv)
    except LayoutError:
        return
    heads = mask.head_count or 2
    batch = mask.batch_count or 1
    plan = cm.compile(mask, n, kv, batch=batch, heads=heads, device=DEVICE, cache=False)
    g = torch.Generator().manual_seed(0)
    shape_q = (batch, heads, plan.q_len, 32)
    shape_kv = (batch, heads, plan.kv_len, 32)
    q = torch.randn(shape_q, generator=g, dtype=DTYPE).to(DEVICE).requires_grad_(True)
    k = torch.randn(shape_kv, generator=g, dtype=DTYPE).to(DEVICE).requires_grad_(True)
    v = torch.randn(shape_kv, generator=g, dtype=DTYPE).to(DEVICE).requires_grad_(True)
    do = torch.randn(shape_q, generator=g, dtype=DTYPE).to(DEVICE)
    with (
        override_forward_config(FwdConfig(16, 32, 4, 1)),
        override_backward_config(BwdConfig(16, 32, 4, 1, 16, 32, 4, 1, fused=n % 2)),
    ):
        out = cm.attention(q, k, v, plan, backend="triton")
        out.backward(do)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    ok, err, bound = check_attention(out.detach(), qd, kd, vd, plan)
    assert ok, f"out {err:.3g} > {bound:.3g}"
    g64 = reference_attention_backward(qd, kd, vd, plan, do, None, compute_dtype=torch.float64)
    g32 = reference_attention_backward(qd, kd, vd, plan, do, None, compute_dtype=torch.float32)
    for name, got, a, b in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), g64, g32):
        ok, err, bound = check_close(got, a, b, DTYPE)
        assert ok, f"{name} {err:.3g} > {bound:.3g}"
