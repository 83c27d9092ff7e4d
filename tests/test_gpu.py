"""GPU checks (``pytest -m gpu -q tests/test_gpu.py`` on a machine with a CUDA GPU; they need
no hypothesis).

Each test skips without CUDA. Correctness uses the measure of docs/design.md against the
float64 reference on 2 heads; the full-size runs and timings live in ``benchmarks/``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import compilemask as cm
from compilemask.kernels.reference import reference_attention, reference_attention_backward
from compilemask.testing import check_close
from compilemask.workloads import SEED_WORKLOADS, workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DT = torch.bfloat16


def _qkv(shape, seed=0, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = [torch.randn(shape, device="cuda", dtype=DT, generator=g) for _ in range(3)]
    return [t.requires_grad_(grad) for t in out]


@pytest.mark.parametrize("name", SEED_WORKLOADS)
def test_plan_build_reads_nothing_back(name):
    w = workload(name, 32768)
    cm.compile(w.mask, w.N, device="cuda", cache=False)  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = cm.compile(w.mask, w.N, device="cuda", cache=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = cm.compile(w.mask, w.N, cache=False)
    assert torch.equal(plan.schedule.pairs.cpu(), ref.schedule.pairs)


@pytest.mark.parametrize("tiled", [False, True], ids=["row-major", "tile_grid"])
@pytest.mark.parametrize("name", SEED_WORKLOADS)
def test_forward_and_backward_match_the_reference(name, tiled):
    if tiled and name != "clear":
        pytest.skip("tile_grid applies to grid masks")
    w = workload(name, 4096)
    mask = cm.masks.tile_grid(w.mask, (8, 16)) if tiled else w.mask
    plan = cm.compile(mask, w.N, device="cuda")
    q, k, v = _qkv((1, 2, w.N, 128), grad=True)
    do = torch.randn_like(q)
    out = cm.attention(q, k, v, plan, backend="triton")
    out.backward(do)
    grads = [t.grad.clone() for t in (q, k, v)]
    qd, kd, vd = (t.detach() for t in (q, k, v))
    # attention applies a tile_grid plan's permutation: the answer is in the original order
    ref_plan = cm.compile(w.mask, w.N, device="cuda") if tiled else plan
    ref64 = reference_attention(qd, kd, vd, ref_plan, compute_dtype=torch.float64)[0]
    refdt = reference_attention(qd, kd, vd, ref_plan, compute_dtype=torch.float32, matmul_dtype=DT)[
        0
    ]
    ok, err, bound = check_close(out.detach(), ref64, refdt, DT)
    assert ok, f"out: {err:.3g} > {bound:.3g}"
    plan = ref_plan
    g64 = reference_attention_backward(qd, kd, vd, plan, do, None, compute_dtype=torch.float64)
    gdt = reference_attention_backward(
        qd, kd, vd, plan, do, None, compute_dtype=torch.float32, matmul_dtype=DT
    )
    for nm, g, a, b in zip(("dq", "dk", "dv"), grads, g64, gdt):
        ok, err, bound = check_close(g, a, b, DT)
        assert ok, f"{nm}: {err:.3g} > {bound:.3g}"


def test_gradients_are_bit_identical_and_zero_where_nothing_is_seen():
    mask = cm.masks.sliding_window(64)
    plan = cm.compile(mask, 1500, 900, device="cuda")  # rows >= 963 see nothing; keys all seen
    q = _qkv((2, 4, 1500, 128), grad=True)[0]
    k, v = _qkv((2, 4, 900, 128), seed=1, grad=True)[1:]
    do = torch.randn_like(q)
    runs = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        out, lse = cm.attention(q, k, v, plan, return_lse=True, backend="triton")
        out.backward(do)
        runs.append([t.grad.clone() for t in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    empty = plan.row_count[0] == 0
    assert bool(empty.any())
    assert bool((out[:, :, empty] == 0).all()) and bool(torch.isneginf(lse[:, :, empty]).all())
    assert bool((runs[0][0][:, :, empty] == 0).all())
    assert not any(bool(torch.isnan(g).any()) for g in runs[0])


def test_attention_under_torch_compile():
    w = workload("hstu", 4096)
    plan = cm.compile(w.mask, w.N, device="cuda")
    q, k, v = _qkv((1, 4, w.N, 128), grad=True)
    cm.attention(q, k, v, plan).sum().backward()  # builds the kernels' tilings eagerly
    f = torch.compile(lambda q, k, v: cm.attention(q, k, v, plan), fullgraph=True)
    # under torch.compile "auto" runs Triton (cudnn refuses traced calls), while eager "auto"
    # may pick cudnn for a 4K call with gradients: compare with eager Triton, bit for bit
    torch.testing.assert_close(f(q, k, v), cm.attention(q, k, v, plan, backend="triton"))


def test_first_call_under_torch_compile():
    """A fresh plan whose first use is inside ``torch.compile`` (head_dim 128, bf16: nothing
    is read back while tracing, the plan's shape class is unknown and the class-free
    configuration runs; for this masked plan the same tilings as eager): forward and
    gradients equal eager Triton's."""
    plan = cm.compile(cm.masks.sliding_window(100), 1000, device="cuda")
    q, k, v = _qkv((2, 4, 1000, 128), grad=True)
    f = torch.compile(lambda q, k, v: cm.attention(q, k, v, plan), fullgraph=True)
    out = f(q, k, v)
    out.float().square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    # eager Triton: eager "auto" may run another backend's forward (cudnn+triton below 4K)
    ref = cm.attention(q, k, v, plan, backend="triton")
    ref.float().square().sum().backward()
    torch.testing.assert_close(out, ref)
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad)


def test_demo_runs_from_the_source_tree():
    env = {**os.environ, "PYTHONPATH": "src", "CM_NO_PROGRESS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "compilemask", "demo", "--size", "4096", "--no-pictures"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "triton" in done.stdout and "FAIL" not in done.stdout


@pytest.mark.parametrize("name", SEED_WORKLOADS)
def test_triton_tile_builder_equals_the_tensor_builder(name):
    """The Triton tile-schedule builder (kernels/triton/tile_builder.py, the default for CUDA
    plans), compiled for the GPU: every schedule field and both kernel schedules equal the
    tensor builder's, and a build with it does not synchronise."""
    from compilemask.kernels.triton import tile_builder
    from compilemask.kernels.triton.schedule import dkdv_schedule, forward_schedule

    w = workload(name, 32768)
    with tile_builder.using(False):  # the tensor builder as the reference
        ref = cm.compile(w.mask, w.N, device="cuda", cache=False)
        want = [forward_schedule(ref, 128, 128), dkdv_schedule(ref, 128, 128)]
    with tile_builder.using(True):
        cm.compile(w.mask, w.N, device="cuda", cache=False)  # warm: compiles the kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            plan = cm.compile(w.mask, w.N, device="cuda", cache=False)
            got = [forward_schedule(plan, 128, 128), dkdv_schedule(plan, 128, 128)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for field in ("kind", "pairs", "jlo", "jhi", "q_count", "q_list", "kv_count", "kv_list",
                  "q_order", "kv_order"):  # fmt: skip
        assert torch.equal(getattr(plan.schedule, field), getattr(ref.schedule, field)), field
    for field in ("row_lo", "row_hi", "row_count"):  # written by the launch from a piece table
        assert torch.equal(getattr(plan, field), getattr(ref, field)), field
    for a, b in zip(got, want):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_new_masks_build_through_the_kept_launcher_without_reading_back():
    """New masks (another hstu length set each build, their tables made afresh) launch
    ``_build_schedule`` through its kept compiled launcher after the first build: no host
    synchronisation, and rows and schedule equal the tensor builder's."""
    from compilemask.kernels.triton import build_host, tile_builder

    sets = ([3000, 5000, 800], [2000, 1000, 5800], [4096, 4096, 608], [6000, 2800])
    masks = [cm.masks.hstu(lengths, [64] * len(lengths), contextual=6) for lengths in sets]
    n = 8800
    cm.compile(masks[0], n, device="cuda", cache=False)  # compiles, keeps the launcher
    assert build_host._LAUNCHERS
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plans = [cm.compile(m, n, device="cuda", cache=False) for m in masks[1:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for mask, plan in zip(masks[1:], plans):
        with tile_builder.using(False):
            ref = cm.compile(mask, n, device="cuda", cache=False)
        for field in ("row_lo", "row_hi", "row_count"):
            assert torch.equal(getattr(plan, field), getattr(ref, field)), field
        for field in ("kind", "pairs", "jlo", "jhi", "q_count", "q_list", "kv_count",
                      "kv_list", "q_order", "kv_order"):  # fmt: skip
            assert torch.equal(getattr(plan.schedule, field), getattr(ref.schedule, field))
