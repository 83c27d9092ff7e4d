"""The kernels' segment path (``kernels/triton/bounds.py``): row bounds computed from the compact
descriptor's segments give the same out / lse / dq / dk / dv as the per-row tensors, and pass
the float64 reference, on every catalogue plan whose compact form chose segments."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import compilemask as cm  # noqa: E402
from compilemask.errors import CompileMaskError  # noqa: E402
from compilemask.kernels.triton import bounds  # noqa: E402
from compilemask.kernels.triton.backward import attention_backward  # noqa: E402
from compilemask.kernels.triton.bounds import (  # noqa: E402
    SEG_BWD,
    SEG_FWD,
    bwd_segments,
    fwd_segments,
    seg_steps,
    tile_segments,
)
from compilemask.kernels.triton.configs import BwdConfig, FwdConfig  # noqa: E402
from compilemask.kernels.triton.forward import attention_forward  # noqa: E402
from compilemask.kernels.triton.schedule import dkdv_schedule, forward_schedule  # noqa: E402
from conftest import (  # noqa: E402
    DEVICE,
    assert_attention_close,
    assert_grads_close,
    assert_lse_close,
    qkv,
)
from plan_catalogue import catalogue  # noqa: E402

pytestmark = pytest.mark.kernel

FWD = FwdConfig(16, 16, 4, 1)
# dK/dV tiles of 8 query rows (some straddle several segments), dQ of 32 (more still)
BWD = BwdConfig(8, 16, 4, 1, 32, 16, 4, 1)
PLANS = {name: (plan, b, h) for name, plan, b, h in catalogue()}
SEGMENT_PLANS = [n for n, (p, _, _) in PLANS.items() if p.compact().rows == "segments"]


def _strides(plan):
    heads = plan.heads or 1
    return (heads if plan.batch else 0), (1 if plan.heads else 0)


def _run(plan, q, k, v, do, segments: bool):
    msb, msh = _strides(plan)
    scale = q.shape[-1] ** -0.5
    out, lse = attention_forward(
        q, k, v, plan.row_lo, plan.row_hi, forward_schedule(plan, FWD.block_m, FWD.block_n),
        scale=scale, mask_stride_b=msb, mask_stride_h=msh, cfg=FWD,
        segments=fwd_segments(plan, FWD.block_m) if segments else None,
    )  # fmt: skip
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    attention_backward(
        q, k, v, out, lse, do, plan.row_lo, plan.row_hi,
        dkdv_schedule(plan, BWD.dkdv_block_m, BWD.dkdv_block_n),
        forward_schedule(plan, BWD.dq_block_m, BWD.dq_block_n), scale=scale,
        mask_stride_b=msb, mask_stride_h=msh, cfg=BWD, dq=dq, dk=dk, dv=dv,
        segments=bwd_segments(plan, BWD.dkdv_block_m, BWD.dq_block_m) if segments else None,
    )  # fmt: skip
    return out, lse, dq, dk, dv


def test_catalogue_has_segment_and_row_plans():
    assert {"causal", "document", "per_head", "per_batch", "empty_rows"} <= set(SEGMENT_PLANS)
    assert "from_dense" not in SEGMENT_PLANS and fwd_segments(PLANS["from_dense"][0], 16) == []


@pytest.mark.parametrize("name", SEGMENT_PLANS)
def test_segments_match_rows_and_reference(name, monkeypatch):
    # every kernel reads the segments, per program (preloaded slots) or per masked tile
    monkeypatch.setattr(bounds, "PER_TILE", True)
    plan, b, h = PLANS[name]
    dtype = torch.float16 if name in ("causal", "clear", "per_head") else torch.float32
    hkv = 1 if h > 1 else h  # GQA where there are several heads
    q, k, v, do = qkv(b, h, hkv, plan.q_len, plan.kv_len, 32, dtype, grad_output=True)
    rows = _run(plan, q, k, v, do, False)
    segs = _run(plan, q, k, v, do, True)
    for what, x, y in zip(("out", "lse", "dq", "dk", "dv"), rows, segs):
        assert torch.equal(x, y), what  # the same mask: the same bits
    out, lse, dq, dk, dv = segs
    # the launchers take tokens in the plan's (tiled) order
    ref = plan.in_permuted_order() if plan.permutation is not None else plan
    assert_attention_close(out, q, k, v, ref)
    assert_lse_close(lse, q, k, v, ref)
    assert_grads_close((dq, dk, dv), q, k, v, do, ref)


def test_tile_tables_find_every_rows_segment():
    plan = PLANS["document"][0]
    seg = plan.compact().segments
    for bm in (8, 32):
        table = tile_segments(plan, bm)
        first, n = table[:, 0].long(), table[:, 1].long()
        rows = torch.arange(plan.q_len)
        want = torch.searchsorted(seg.r0.long(), rows, right=True) - 1
        tile = rows // bm
        assert bool((want >= first[tile]).all()) and bool((want < first[tile] + n[tile]).all())
        assert seg_steps(table) == max(int(n.max()) - 1, 0).bit_length()
    assert seg_steps(tile_segments(PLANS["causal"][0], 16)) == 0  # one segment per tile


def test_backend_carries_segments_only_when_chosen():
    from compilemask.kernels.interface import call_of
    from compilemask.kernels.triton.backend import BACKEND
    from compilemask.kernels.triton.schedule import DKDV_SCHEDULE_FIELDS, FWD_SCHEDULE_FIELDS

    for name, extra in (("causal", True), ("from_dense", False)):
        plan, b, h = PLANS[name]
        q, k, v = qkv(b, h, h, plan.q_len, plan.kv_len, 32, torch.float16)
        p = BACKEND.prepare(plan, call_of(q.requires_grad_(True), k, v, False))
        assert len(p.schedule) == len(FWD_SCHEDULE_FIELDS) + (SEG_FWD if extra else 0)
        n_bwd = len(DKDV_SCHEDULE_FIELDS) + len(FWD_SCHEDULE_FIELDS)
        assert len(p.bwd_schedule) == n_bwd + (SEG_BWD if extra else 0)
        out = cm.attention(q, k, v, plan, backend="triton")
        assert_attention_close(out, q, k, v, plan)


def test_verify_checks_the_segments():
    plan = cm.compile(cm.masks.document([5, 9, 6]), device=DEVICE)
    seg = plan.compact().segments
    plan.verify()
    seg.base[0, 1] += 1  # a bound of the first template moves: rows no longer expand back
    with pytest.raises(CompileMaskError, match="segments"):
        plan.verify()
    seg.base[0, 1] -= 1
    seg.r0[1], seg.r0[2] = int(seg.r0[2]), int(seg.r0[1])  # out of order
    with pytest.raises(CompileMaskError, match="segments.r0"):
        plan.verify()
