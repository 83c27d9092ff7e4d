"""Plans are data under ``torch.compile``: a new plan of the same shapes, dtypes and shape class
reuses the compiled graph (no guard on the plan's identity), and the reference backend traces
one graph for every sequence length with ``dynamic=True``.

Graphs are counted with ``torch._dynamo.testing.CompileCounter``, imported inside the tests:
imported while pytest collects, Triton-interpreter tests of later modules failed ("Cannot
call @triton.jit'd outside of the scope of a kernel"). In the many-plan tests the
Triton kernels are replaced by stubs of the right shapes (what is counted is tracing, not
kernel work); ``test_attention_forward.py`` runs the real kernels of a compiled fresh plan.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="the Triton backend needs triton installed")

import compilemask as cm  # noqa: E402
from compilemask.kernels.triton import backend as triton_backend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _qkv(n, d, dtype, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, d, generator=g).to(DEVICE, dtype) for _ in range(3))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _documents(rng: random.Random, n: int) -> list[int]:
    """A random packing of documents into n tokens."""
    cuts = sorted(rng.sample(range(1, n), rng.randint(1, 6)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, n])]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Compiled graphs of these tests (stub kernels, counting backends) are dropped after
    each one, so no later test runs them."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def stub_kernels(monkeypatch):
    """Kernels replaced by stubs of the right shapes and dtypes; records the configs used."""
    seen = []

    def fwd(q, k, v, row_lo, row_hi, schedule, scale, msb, msh, config):
        seen.append(("fwd", tuple(config)))
        B, H, N, _ = q.shape
        return q * 0.5, q.new_zeros((B, H, N), dtype=torch.float32)

    def bwd(q, k, v, out, lse, dout, dlse, row_lo, row_hi, sched, scale, msb, msh, config):
        seen.append(("bwd", tuple(config)))
        return dout * 0.5, torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(triton_backend, "_attention_fwd_impl", fwd)
    monkeypatch.setattr(triton_backend, "_attention_bwd_impl", bwd)
    return seen


def test_fifty_fresh_document_plans_compile_once(stub_kernels):
    """Repacking documents every step (fixed length, head_dim 128 fp16: the plan-dependent
    tilings) with fullgraph=True: one graph for all 50 plans, forward and backward (before,
    each plan recompiled and the 9th hit the recompile limit)."""
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def step(q, k, v, plan):
        return cm.attention(q, k, v, plan, backend="triton").float().square().sum()

    f = torch.compile(step, fullgraph=True, backend=counter)
    rng = random.Random(0)
    q, k, v = _qkv(128, 128, torch.float16, grad=True)
    for _ in range(50):
        plan = cm.compile(cm.masks.document(_documents(rng, 128)), 128, device=DEVICE, cache=False)
        f(q, k, v, plan).backward()
    assert counter.frame_count == 1
    assert {c for c in stub_kernels if c[0] == "bwd"}  # the backward ran


def test_classified_plans_compile_once_per_class(stub_kernels):
    """Plans an eager call has classified (their shape class recorded): one graph per class,
    whatever the number of plans, and the compiled call runs the eager call's configs."""
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    f = torch.compile(
        lambda q, k, v, plan: cm.attention(q, k, v, plan, backend="triton"),
        fullgraph=True,
        backend=counter,
    )
    q, k, v = _qkv(128, 128, torch.float16)
    rng = random.Random(1)
    classes = set()
    for i in range(12):
        mask = cm.masks.prefix_lm(128) if i % 3 == 0 else cm.masks.document(_documents(rng, 128))
        plan = cm.compile(mask, 128, device=DEVICE, cache=False)
        cm.attention(q, k, v, plan, backend="triton")  # eager: classifies the plan
        eager_cfg = stub_kernels[-1]
        f(q, k, v, plan)
        assert stub_kernels[-1] == eager_cfg
        classes.add(plan.shape_class)
    assert len(classes) >= 2  # the dense tiling (all visible) and the masked one
    assert counter.frame_count == len(classes)


def test_reference_traces_one_graph_for_every_length():
    """12 lengths with dynamic=True on the reference backend: no graph per length."""
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def f(q, k, v, plan):
        return cm.attention(q, k, v, plan, backend="reference", return_lse=True)

    cf = torch.compile(f, fullgraph=True, backend=counter, dynamic=True)
    for n in range(40, 40 + 12 * 7, 7):
        plan = cm.compile(cm.masks.sliding_window(9), n, device=DEVICE, cache=False)
        q, k, v = _qkv(n, 32, torch.float32, seed=n)
        out, lse = cf(q, k, v, plan)
        want, want_lse = f(q, k, v, plan)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(lse, want_lse)
    assert counter.frame_count == 1


def test_reference_backward_traces_one_graph_for_every_length():
    """The training step (forward with per-chunk checkpointing, then backward) with
    dynamic=True on the reference backend: one graph for 4 lengths, the gradients of eager."""
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def f(q, k, v, plan):
        return cm.attention(q, k, v, plan, backend="reference").square().sum()

    cf = torch.compile(f, fullgraph=True, backend=counter, dynamic=True)
    for n in (40, 47, 54, 61):
        plan = cm.compile(cm.masks.sliding_window(9), n, device=DEVICE, cache=False)
        q, k, v = _qkv(n, 32, torch.float32, grad=True, seed=n)
        cf(q, k, v, plan).backward()
        want = torch.autograd.grad(f(q, k, v, plan), (q, k, v))
        for got, w in zip((q.grad, k.grad, v.grad), want):
            torch.testing.assert_close(got, w)
    assert counter.frame_count == 1
