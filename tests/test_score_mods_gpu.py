"""GPU checks of score modifiers, sinks and v's own head_dim at bf16 and real-ish sizes
(``pytest -m gpu -q tests/test_score_mods_gpu.py``; each test skips without CUDA).

The Triton backend with its default launch configurations (TMA, the dS-buffer dQ path at
head_dim 128) against the float64 reference by the measure of docs/design.md: out and the
gradients of q, k, v, the sinks and the learnable tables.
"""

from __future__ import annotations

import pytest
import torch

import compilemask as cm
from compilemask import score_mods as sm
from compilemask.kernels.reference import reference_attention
from compilemask.testing import check_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DT = torch.bfloat16
N, H = 2048, 4


def _check(plan, make, learn, sinks=None, D=128, Dv=128, backend="triton", B=1):
    g = torch.Generator(device="cuda").manual_seed(0)
    nq, nk = plan.q_len, plan.kv_len
    q = torch.randn(B, H, nq, D, device="cuda", dtype=DT, generator=g)
    k = torch.randn(B, H, nk, D, device="cuda", dtype=DT, generator=g)
    v = torch.randn(B, H, nk, Dv, device="cuda", dtype=DT, generator=g)
    do = torch.randn(B, H, nq, Dv, device="cuda", generator=g)
    extra = ([] if sinks is None else [sinks]) + learn

    def run(kind):
        ins = [t.detach().clone() for t in (q, k, v)]
        ex = [t.detach().clone().float().cuda() for t in extra]
        if kind == "ref64":
            ins, ex = [t.double() for t in ins], [t.double() for t in ex]
        ins = [t.requires_grad_() for t in ins + ex]
        snk = ins[3] if sinks is not None else None
        mod = make(ins[3 + (sinks is not None) :])
        mod = None if mod is None else sm.as_score_mod(mod)
        if kind == "kernel":
            out = cm.attention(*ins[:3], plan, backend=backend, score_mod=mod, sinks=snk)
        else:
            cd, mm = (torch.float64, None) if kind == "ref64" else (torch.float32, DT)
            out, _ = reference_attention(
                *ins[:3], plan, compute_dtype=cd, matmul_dtype=mm, score_mod=mod, sinks=snk
            )
        grads = torch.autograd.grad(out, ins, do.to(out.dtype))
        return (out, *grads)

    tri, r64, rdt = run("kernel"), run("ref64"), run("refdt")
    for i, (a, b, c) in enumerate(zip(tri, r64, rdt)):
        ok, err, bound = check_close(a, b, c, DT)
        assert ok, f"tensor {i}: err {err:.3g} > bound {bound:.3g}"


def test_softcap_alibi_and_sinks_causal():
    plan = cm.compile(cm.masks.causal(), N, device="cuda")
    slopes = sm.alibi_slopes(H, "cuda")
    _check(plan, lambda t: [sm.alibi(slopes), sm.softcap(50.0)], [], sinks=torch.randn(H))


def test_softcap_alone_causal():
    """A lone softcap: the folded tanh (``score_mods.softcap_alone``)."""
    plan = cm.compile(cm.masks.causal(), N, device="cuda")
    _check(plan, lambda t: sm.softcap(50.0), [])
    _check(plan, lambda t: sm.softcap(5.0), [], sinks=torch.randn(H))


@pytest.mark.parametrize("mod", ["softcap", "alibi"])
def test_cute_forward_with_the_triton_backward(mod):
    """``cute+triton``: the cute kernel's forward (lse of the modified scores) with the Triton
    backward's gradients, on hstu's short rows and causal's long ones."""
    ok, why = cm.kernels.registry.get("cute+triton").available()
    if not ok:
        pytest.skip(why)
    slopes = sm.alibi_slopes(H, "cuda")
    make = (lambda t: sm.softcap(20.0)) if mod == "softcap" else (lambda t: sm.alibi(slopes))
    for mask, n in ((cm.masks.causal(), N), (cm.masks.hstu([1000, 600, 448], [40, 30, 20]), None)):
        _check(cm.compile(mask, n, device="cuda"), make, [], backend="cute+triton")


def test_learnable_relative_bias_and_bias_sliding_window():
    plan = cm.compile(cm.masks.sliding_window(256), N, device="cuda")
    table = torch.randn(H, 32) * 0.5
    bias = torch.randn(1, H, N, N, device="cuda") * 0.5
    _check(plan, lambda t: [sm.relative_bias(t[0], 32, 128, False), sm.bias(t[1])], [table, bias])


@pytest.mark.parametrize("D, Dv", [(192, 128), (128, 64)])
def test_value_head_dim_of_its_own(D, Dv):
    plan = cm.compile(cm.masks.document([700, 900, 448]), N, device="cuda")
    _check(plan, lambda t: None, [], D=D, Dv=Dv)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_fa4_softcap_and_sinks(with_sinks):
    """FlashAttention-4's softcap and learnable sinks under a plan with PARTIAL tiles and rows
    that see no key (q_len > kv_len: the last rows of a sliding window see nothing)."""
    from compilemask.kernels import registry

    ok, why = registry.get("fa4").available()
    if not ok:
        pytest.skip(f"fa4: {why}")
    plan = cm.compile(cm.masks.hstu([700, 900, 448], [30, 60, 20]), device="cuda")
    sinks = torch.randn(H) if with_sinks else None
    _check(plan, lambda t: sm.softcap(20.0), [], sinks=sinks, backend="fa4", B=2)
    empty = cm.compile(cm.masks.sliding_window(64), 1100, 900, device="cuda")
    _check(empty, lambda t: sm.softcap(20.0), [], sinks=sinks, backend="fa4")
