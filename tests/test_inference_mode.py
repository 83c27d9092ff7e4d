"""An inference_mode call (an eval pass) must not leave inference tensors in a plan or its
caches: a later training step saves them for backward."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton installed")

import compilemask as cm  # noqa: E402
from conftest import DEVICE, qkv  # noqa: E402

pytestmark = pytest.mark.kernel


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_training_after_inference_mode_at_head_dim_128(dtype):
    # default configs (no override): D=128 16-bit forward 64x64 and dK/dV 64x64 share a tiling
    plan = cm.compile(cm.masks.document([100, 60, 96]), 256, device=DEVICE, cache=False)
    q, k, v = qkv(1, 2, 2, 256, 256, 128, dtype)
    with torch.inference_mode():
        cm.attention(q, k, v, plan, backend="triton")  # an eval pass first
    q.requires_grad_(True)
    out = cm.attention(q, k, v, plan, backend="triton")  # then a training step
    out.float().sum().backward()  # was: RuntimeError: Inference tensors cannot be saved ...
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())


def test_tile_grid_training_after_inference_mode():
    # (pre-existing, same cause) the cached inverse permutation built in inference mode
    m = cm.masks.tile_grid(cm.masks.clear((8, 12), 3, 10), (4, 4))
    plan = cm.compile(m, 106, device=DEVICE, cache=False)
    q, k, v = qkv(1, 2, 2, 106, 106, 32, torch.float32)
    with torch.inference_mode():
        cm.attention(q, k, v, plan, backend="triton")
    q.requires_grad_(True)
    cm.attention(q, k, v, plan, backend="triton").sum().backward()
    assert q.grad is not None


def test_plans_built_or_moved_under_inference_mode_still_train():
    # compile (and the plan cache) under inference_mode, then a training step
    with torch.inference_mode():
        plan = cm.compile(cm.masks.causal(), 64)
        dense_plan = cm.from_dense(torch.ones(64, 64, dtype=torch.bool).tril())
        window = cm.compile(cm.masks.sliding_window(9), 64)
        # with a GPU: a CPU plan moved to the GPU under inference_mode
        moved = window.to(DEVICE) if DEVICE != "cpu" else window
    assert cm.compile(cm.masks.causal(), 64) is plan  # the cached plan is handed out again
    g = torch.Generator().manual_seed(0)
    for p in (plan, dense_plan, moved):
        q, k, v = (torch.randn(1, 2, 64, 32, generator=g).to(DEVICE) for _ in range(3))
        q.requires_grad_(True)
        cm.attention(q, k, v, p, backend="triton").sum().backward()
        assert q.grad is not None and bool(torch.isfinite(q.grad).all())
