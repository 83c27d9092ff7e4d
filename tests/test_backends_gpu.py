"""The correctness suite every GPU backend passes (``-m gpu``; a backend that is not available
here is skipped with its reason): out, lse, dq, dk, dv against the float64 reference by the
measure of ``compilemask.testing.check_close``, rows that see no key (out 0, lse -inf, dq 0),
GQA, per-head plans, q_len != kv_len, tile_grid plans, head_dim 64 and 128, bf16."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import compilemask as cm
from compilemask.errors import InputError
from compilemask.kernels import registry
from compilemask.kernels.interface import AttentionCall

M = cm.masks
DT = torch.bfloat16
BACKENDS = [n for n in registry.names() if n != "reference"]
PER_HEAD_4 = M.per_head([M.causal(), M.sliding_window(100), M.chunked(256), M.prefix_lm(300)])


def _cases():
    """name -> (mask, Nq, Nk, plan heads, Hq, Hkv)."""
    return {
        "causal": (M.causal(), 1024, 1024, None, 4, 4),
        "hstu": (M.hstu([300, 500, 224], [20, 40, 10]), None, None, None, 4, 4),
        "shared_prompt": (M.shared_prompt(256, [256, 256, 256]), None, None, None, 4, 4),
        "clear": (M.clear((24, 40), 8, 64), None, None, None, 4, 4),
        "clear_tile_grid": (M.tile_grid(M.clear((24, 40), 8, 64)), None, None, None, 4, 4),
        "per_head": (PER_HEAD_4, 1024, 1024, 4, 4, 4),
        "gqa": (M.causal(), 1024, 1024, None, 4, 1),
        "empty_rows": (M.sliding_window(64), 1100, 900, None, 4, 2),
        "sliding_window": (M.sliding_window(100), 1024, 1024, None, 4, 2),
    }


def _backend(name):
    be = registry.get(name)
    ok, why = be.available()
    if not ok:
        pytest.skip(f"{name}: {why}")
    return be


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_the_reference(backend, name, head_dim):
    from compilemask.kernels.reference import reference_attention, reference_attention_backward
    from compilemask.testing import check_close

    be = _backend(backend)
    mask, nq, nk, heads, hq, hkv = _cases()[name]
    plan = cm.compile(mask, nq, nk, heads=heads, device="cuda").in_permuted_order()
    b = 2
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, plan.q_len, head_dim, device="cuda", dtype=DT, generator=g)
    k, v = (
        torch.randn(b, hkv, plan.kv_len, head_dim, device="cuda", dtype=DT, generator=g)
        for _ in range(2)
    )
    do = torch.randn_like(q)
    scale = head_dim**-0.5
    call = AttentionCall(b, hq, hkv, plan.q_len, plan.kv_len, head_dim, DT, q.device, True, False)
    backward = be.supports(plan, call)[0]
    if not backward:
        call = dataclasses.replace(call, requires_grad=False)
        ok, why = be.supports(plan, call)
        if not ok:
            pytest.skip(f"{backend}: {why}")
    prepared = be.prepare(plan, call)
    out, lse = be.forward(q, k, v, plan, prepared, scale)
    assert out.shape == q.shape and lse.shape == (b, hq, plan.q_len)
    assert lse.dtype == torch.float32
    ref64, lse64 = reference_attention(q, k, v, plan, scale, compute_dtype=torch.float64)
    refdt, _ = reference_attention(
        q, k, v, plan, scale, compute_dtype=torch.float32, matmul_dtype=DT
    )
    ok, err, bound = check_close(out, ref64, refdt, DT)
    assert ok, f"out: {err:.3g} > {bound:.3g}"
    seen = torch.isfinite(lse64)
    assert torch.equal(torch.isneginf(lse), ~seen)  # -inf exactly on the rows that see nothing
    torch.testing.assert_close(lse[seen], lse64[seen].float(), rtol=0, atol=2e-2)
    assert bool((out[~seen] == 0).all())
    if name == "empty_rows":
        assert bool((~seen).any())
    if not backward:
        return
    dq, dk, dv = be.backward(q, k, v, out, lse, do, plan, prepared, scale)
    g64 = reference_attention_backward(q, k, v, plan, do, scale, compute_dtype=torch.float64)
    gdt = reference_attention_backward(
        q, k, v, plan, do, scale, compute_dtype=torch.float32, matmul_dtype=DT
    )
    for nm, got, a, c in zip(("dq", "dk", "dv"), (dq, dk, dv), g64, gdt):
        assert got.shape == a.shape
        ok, err, bound = check_close(got, a, c, DT)
        assert ok, f"{nm}: {err:.3g} > {bound:.3g}"
    assert bool((dq[~seen] == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_public_call_on_a_tile_grid_plan_equals_the_reference_backend(backend):
    """Through ``compilemask.attention``: the plan's permutation applied around the backend,
    gradients through the api's autograd."""
    _backend(backend)
    plan = cm.compile(M.tile_grid(M.clear((24, 40), 8, 64)), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (
        torch.randn(2, 4, plan.q_len, 128, device="cuda", dtype=DT, generator=g) for _ in range(3)
    )
    be = registry.get(backend)
    call = AttentionCall(2, 4, 4, plan.q_len, plan.kv_len, 128, DT, q.device, True, False)
    with_grad = be.supports(plan, call)[0]
    results = {}
    for name in (backend, "reference"):
        leaves = [t.detach().requires_grad_(with_grad) for t in (q, k, v)]
        out = cm.attention(*leaves, plan, backend=name)
        if with_grad:
            out.float().square().sum().backward()
        results[name] = [out, *(t.grad for t in leaves if with_grad)]
    if not with_grad:  # a forward-only backend refuses a call that will need a backward
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        with pytest.raises(InputError, match=backend):
            cm.attention(*leaves, plan, backend=backend)
    for got, want in zip(results[backend], results["reference"]):
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=4e-2)
