"""The Triton kernels on random compiled masks (property tests, Triton's interpreter on the CPU).

Random masks, lengths and tilings from the compiler's strategy (``test_compiler.cases``) run
through the forward and backward kernels with small tiles, and every output and gradient must
pass the correctness measure of docs/design.md against the float64 reference.
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
        override_backward_config(BwdConfig(16, 32, 4, 1, 16, 32, 4, 1)),
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


# ------------------------------------------------------------------ malformed plans
def _nan_padded(t: torch.Tensor, extra: int = 48) -> torch.Tensor:
    """``t`` as a view into a larger buffer whose rows past ``t``'s length are NaN."""
    big = torch.full((*t.shape[:2], t.shape[2] + extra, t.shape[3]), float("nan"), dtype=t.dtype)
    big[:, :, : t.shape[2]] = t
    return big.to(DEVICE)[:, :, : t.shape[2]]


def _corrupt(how: str, row_lo, row_hi, schedules) -> None:
    """Break plan tensors in place the ways validation would refuse."""
    far = 1000
    if how == "ends_past_nk":
        row_hi += far
    elif how == "negative_starts":
        row_lo -= far
    elif how == "start_after_end":
        lo = row_lo.clone()
        row_lo.copy_(row_hi + 3)
        row_hi.copy_(lo)
    for s in schedules:
        for name, t in s.items():
            if how == "counts_too_large" and name.endswith("count"):
                t += far
            elif how == "tiles_out_of_range":
                if name in ("q_list", "kv_list", "q_order", "kv_order", "bits_index", "slots"):
                    t[..., ::2] += far
                    t[..., 1::2] = -7
                elif name == "q_work":
                    t[..., :5] += far
                elif name == "jlo":
                    t.fill_(-3)
                elif name == "jhi":
                    t += far
            elif how == "kinds_full":
                if name == "kind":
                    t.fill_(1)
                elif name in ("q_full_count", "kv_full_count"):
                    t.copy_(s[name.replace("_full", "")])


@pytest.mark.parametrize(
    "how",
    [
        "counts_too_large",
        "tiles_out_of_range",
        "ends_past_nk",
        "negative_starts",
        "start_after_end",
        "kinds_full",
    ],
)
@pytest.mark.parametrize(
    "mask_name, dtype",
    [("window", torch.float32), ("window", torch.float16), ("bits", torch.float16)],
    ids=["window-fp32", "window-fp16", "bits-fp16"],
)
def test_malformed_plans_never_read_out_of_bounds(how, mask_name, dtype, monkeypatch):
    """The internal launchers (no validation) on corrupted plans: every index taken from plan
    data is clamped or masked in the kernels, so inputs that are views into NaN-padded buffers
    give no error and no NaN (wrong numbers at worst). Outputs and scratch buffers start
    zeroed: a corrupted launch order or tile list may leave tiles (and dS slots) unwritten,
    which is wrong numbers, not an access out of bounds."""
    from dataclasses import replace

    from compilemask.kernels.triton.backward import attention_backward
    from compilemask.kernels.triton.forward import attention_forward
    from compilemask.kernels.triton.schedule import dkdv_schedule, ds_slots, forward_schedule

    Nq, Nk, D = 70, 90, 32
    if mask_name == "window":  # intervals (preloaded slots in the forward and dQ kernels)
        mask = cm.masks.sliding_window(20) | cm.masks.prefix_lm(5)
    else:  # bitmask tiles
        mask = cm.masks.dilated(40, 3)
    plan = cm.compile(mask, Nq, Nk, device=DEVICE, cache=False)
    half = dtype == torch.float16
    fwd = FwdConfig(16, 32, 4, 1, grid_order=3, tma=int(half), prefetch=1)
    bwd = BwdConfig(16, 32, 4, 1, 16, 32, 4, 1, 3, 3, tma=int(half), ds_dq=int(half))
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (
        _nan_padded(torch.randn(1, 2, n, D, generator=g).to(dtype)) for n in (Nq, Nk, Nk, Nq)
    )
    row_lo, row_hi = plan.row_lo.clone(), plan.row_hi.clone()
    sf = {n: t.clone() for n, t in forward_schedule(plan, 16, 32).items()}
    s1 = {n: t.clone() for n, t in dkdv_schedule(plan, 16, 32).items()}
    s2 = {n: t.clone() for n, t in forward_schedule(plan, 16, 32).items()}
    slots = {"slots": ds_slots(s1["kind"])}
    _corrupt(how, row_lo, row_hi, [sf, s1, s2, slots])
    if half:
        bwd = replace(bwd, ds_dq=int((s2["kind"] != 0).flatten(1).sum(1).max()))
    strides = dict(mask_stride_b=0, mask_stride_h=0)
    monkeypatch.setattr(torch, "empty", torch.zeros)  # the dS buffer: no stale NaN
    out, lse = attention_forward(
        q, k, v, row_lo, row_hi, sf, scale=0.2, cfg=fwd, **strides,
        out=torch.zeros_like(q), lse=torch.zeros(1, 2, Nq, device=DEVICE),
    )  # fmt: skip
    grads = attention_backward(
        q, k, v, out, lse, do, row_lo, row_hi, s1, s2, scale=0.2, cfg=bwd,
        ds_slots=slots["slots"] if half else None, **strides,
        dq=torch.zeros_like(q), dk=torch.zeros_like(k), dv=torch.zeros_like(v),
    )  # fmt: skip
    for name, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
        assert not bool(torch.isnan(t).any()), name


def test_bitmask_kinds_without_bitmask_tiles_are_refused():
    """Tiles marked PARTIAL_BITS in a schedule whose bitmask tensor cannot hold them (an
    interval plan's 1x1x1 placeholder): the launcher refuses them before any kernel reads."""
    from compilemask.kernels.triton.forward import attention_forward
    from compilemask.kernels.triton.schedule import forward_schedule

    plan = cm.compile(cm.masks.sliding_window(20), 70, device=DEVICE, cache=False)
    sched = {n: t.clone() for n, t in forward_schedule(plan, 16, 32).items()}
    sched["kind"].fill_(3)
    q = torch.randn(1, 2, 70, 32, device=DEVICE)
    with pytest.raises(ValueError, match=r"schedule\['bits'\]"):
        attention_forward(
            q, q, q, plan.row_lo, plan.row_hi, sched, scale=0.2, mask_stride_b=0,
            mask_stride_h=0, cfg=FwdConfig(16, 32, 4, 1),
        )  # fmt: skip
