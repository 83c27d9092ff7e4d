"""Score modifiers, sinks and a value head_dim of its own (``compilemask.score_mods``,
``attention(..., score_mod=, sinks=)``, v [B, Hkv, Nk, Dv]).

The Triton kernels (interpreter on the CPU, fp16 and fp32) against the float64 reference by
the measure of docs/design.md (``compilemask.testing.check_close``): out, lse and the
gradients of q, k, v, the sinks and the modifiers' learnable tensors, each against the float64
reference and bounded by the same-dtype reference. The reference's torch twins are checked
against a dense float64 formula written out here. Sizes stay tiny: the interpreter is slow.
"""

from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton", reason="the Triton kernels need triton installed")
import triton.language as tl  # noqa: E402

import compilemask as cm  # noqa: E402
from compilemask import score_mods as sm  # noqa: E402
from compilemask.errors import InputError  # noqa: E402
from compilemask.kernels.interface import call_of  # noqa: E402
from compilemask.kernels.reference import reference_attention  # noqa: E402
from compilemask.kernels.triton.configs import (  # noqa: E402
    BwdConfig,
    FwdConfig,
    override_backward_config,
    override_forward_config,
)
from compilemask.testing import check_close  # noqa: E402
from conftest import DEVICE  # noqa: E402

pytestmark = pytest.mark.kernel
N, B, HQ, HKV = 40, 2, 2, 1
FWD = FwdConfig(16, 32, 4, 1)
BWD = BwdConfig(16, 32, 4, 1, 32, 32, 4, 1)
BWD_DS = BwdConfig(16, 32, 4, 1, 16, 32, 4, 1, ds_dq=1)


@triton.jit
def _halve_plus_head(score, b, h, q_idx, kv_idx, aux):
    """A custom modifier: score * aux[0] + 0.25 * h."""
    return score * tl.load(aux) + 0.25 * h.to(tl.float32)


@triton.jit
def _halve_plus_head_grad(score, b, h, q_idx, kv_idx, aux):
    return tl.load(aux) + 0.0 * score


def _halve_plus_head_torch(score, b, h, q_idx, kv_idx, aux):
    return score * aux[0].to(score.dtype) + 0.25 * h.to(score.dtype)


def _inputs(dtype, D=32, Dv=32, hq=HQ, hkv=HKV, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, hq, N, D), (B, hkv, N, D), (B, hkv, N, Dv), (B, hq, N, Dv), (B, hq, N)]
    q, k, v, do, dlse = (torch.randn(s, generator=g) for s in shapes)
    return [t.to(dtype=dtype, device=DEVICE) for t in (q, k, v)], do, dlse * 0.5


# each case: (make(learnables) -> score_mod, learnables as float32 tensors)
def _table(nb=8):
    return torch.randn(HQ, nb, generator=torch.Generator().manual_seed(3))


def _bias(shape=(1, HQ, N, N)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(4))


CASES = {
    "softcap": (lambda t: sm.softcap(1.5), []),
    "alibi": (lambda t: sm.alibi(sm.alibi_slopes(HQ, DEVICE)), []),
    "relative_bias": (lambda t: sm.relative_bias(t[0], 8, 16, True), [_table()]),
    "relative_bias_causal": (lambda t: sm.relative_bias(t[0], 8, 12, False), [_table()]),
    "bias_heads": (lambda t: sm.bias(t[0]), [_bias()]),
    "bias_batch": (lambda t: sm.bias(t[0]), [_bias((B, 1, N, N))]),
    "custom": (
        lambda t: sm.custom(
            _halve_plus_head_torch,
            _halve_plus_head,
            _halve_plus_head_grad,
            aux=torch.tensor([0.5], device=DEVICE),
        ),  # fmt: skip
        [],
    ),
    "alibi_softcap": (
        lambda t: sm.compose(sm.alibi(sm.alibi_slopes(HQ, DEVICE)), sm.softcap(2.0)),
        [],
    ),
    "rel_softcap_bias": (
        lambda t: [sm.relative_bias(t[0], 8, 16, True), sm.softcap(1.5), sm.bias(t[1])],
        [_table(), _bias()],
    ),
}


def _grads(out, lse, ins, do, dlse):
    loss = (out.double() * do.double()).sum() + (lse.double() * dlse.double()).sum()
    return torch.autograd.grad(loss, ins, allow_unused=True)


def _check(dtype, plan, make, learn, *, sinks=None, D=32, Dv=32, hq=HQ, hkv=HKV, bwd=BWD):
    """Triton vs the float64 reference: out, lse and every gradient."""
    (q, k, v), do, dlse = _inputs(dtype, D, Dv, hq, hkv)
    extra = ([] if sinks is None else [sinks]) + learn

    def run(kind):
        qq = [t.detach().clone() for t in (q, k, v)]
        ex = [t.detach().clone() for t in extra]
        if kind == "ref64":
            qq = [t.double() for t in qq]
            ex = [t.double() for t in ex]
        else:
            ex = [t.float().to(DEVICE) for t in ex]
        ins = [t.requires_grad_() for t in qq + ex]
        snk = ins[3] if sinks is not None else None
        mod = make(ins[3 + (sinks is not None) :]) if make is not None else None
        mod = sm.as_score_mod(mod) if mod is not None else None
        if kind == "triton":
            with override_forward_config(FWD), override_backward_config(bwd):
                out, lse = cm.attention(
                    *ins[:3], plan, backend="triton", return_lse=True, score_mod=mod, sinks=snk
                )
        else:
            mm = None if kind == "ref64" else dtype
            cd = torch.float64 if kind == "ref64" else torch.float32
            out, lse = reference_attention(
                *ins[:3], plan, compute_dtype=cd, matmul_dtype=mm, score_mod=mod, sinks=snk
            )
        return (out, lse, *_grads(out, lse, ins, do, dlse))

    tri, r64, rdt = run("triton"), run("ref64"), run("refdt")
    names = ["out", "lse", "dq", "dk", "dv"] + (["dsinks"] if sinks is not None else [])
    names += [f"d{type(t).__name__}{i}" for i, t in enumerate(learn)]
    assert tri[0].shape == (B, hq, N, Dv)
    for name, a, b, c in zip(names, tri, r64, rdt):
        ok, err, bound = check_close(a, b, c, dtype)
        assert ok, f"{name}: err {err:.3g} > bound {bound:.3g}"


def _plan(mask=None):
    return cm.compile(mask or cm.masks.causal(), N, block_m=16, block_n=16, device=DEVICE)


def _empty_rows_plan():
    """A plan whose rows 0-5 and 20-23 see no key (the others: a random half of the keys)."""
    dense = torch.rand(N, N, generator=torch.Generator().manual_seed(7)) < 0.5
    dense[:6] = False
    dense[20:24] = False
    return cm.from_dense(dense, block_m=16, block_n=16, device=DEVICE)


# ------------------------------------------------------------------------ the built-ins
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_score_mod_matches_the_float64_reference(case, dtype):
    make, learn = CASES[case]
    _check(dtype, _plan(), make, learn)


@pytest.mark.parametrize("case", ["relative_bias", "rel_softcap_bias"])
def test_score_mod_with_gqa_sinks_and_the_ds_dq_path(case):
    make, learn = CASES[case]
    sinks = torch.tensor([0.3, -1.0, 2.0, 0.0])
    _check(
        torch.float16, _plan(cm.masks.sliding_window(7)), make, learn, sinks=sinks[:HQ],
        bwd=BWD_DS,
    )  # fmt: skip


def test_learnable_gradients_are_deterministic():
    (q, k, v), do, _ = _inputs(torch.float16)
    plan = _plan()

    def grads():
        table = _table().to(DEVICE).requires_grad_()
        bias = _bias().to(DEVICE).requires_grad_()
        sinks = torch.zeros(HQ, device=DEVICE, requires_grad=True)
        mod = [sm.relative_bias(table, 8, 16, True), sm.bias(bias)]
        with override_forward_config(FWD), override_backward_config(BWD):
            out = cm.attention(q, k, v, plan, backend="triton", score_mod=mod, sinks=sinks)
        return torch.autograd.grad((out.float() * do).sum(), [table, bias, sinks])

    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------ sinks
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_sinks_match_the_float64_reference(dtype):
    _check(dtype, _plan(), None, [], sinks=torch.tensor([0.5, -2.0]))


def test_sinks_on_rows_that_see_no_key():
    """Out 0, lse = sink_h; the sink's gradient there is dlse (P_sink = 1, O = 0)."""
    plan = _empty_rows_plan()
    sinks = torch.tensor([1.5, -0.5])
    _check(torch.float32, plan, None, [], sinks=sinks)
    _check(torch.float16, plan, CASES["softcap"][0], [], sinks=sinks)
    (q, k, v), _, _ = _inputs(torch.float32)
    for backend in ("triton", "reference"):
        with override_forward_config(FWD):
            out, lse = cm.attention(
                q, k, v, plan, backend=backend, return_lse=True, sinks=sinks.to(DEVICE)
            )
        assert torch.equal(out[:, :, :6], torch.zeros_like(out[:, :, :6]))
        expect = sinks.to(DEVICE).view(1, HQ, 1).expand(B, HQ, 6)
        assert torch.allclose(lse[:, :, :6], expect)


def test_an_empty_modifier_list_is_no_modifier():
    plan = _empty_rows_plan()
    (q, k, v), _, _ = _inputs(torch.float32)
    for backend in ("triton", "reference"):
        with override_forward_config(FWD):
            want = cm.attention(q, k, v, plan, backend=backend)
            for empty in ([], ()):
                assert torch.equal(
                    cm.attention(q, k, v, plan, backend=backend, score_mod=empty), want
                )


def test_sink_gradient_formula_against_autograd():
    """The reference's autograd gradient of the sinks equals the closed form the Triton
    backward uses: d sink_h = sum_rows P_sink (dlse - dO.O) (lse is returned in float32)."""
    (q, k, v), do, dlse = _inputs(torch.float64)
    plan = _empty_rows_plan()
    sinks = torch.tensor([0.7, -0.3], dtype=torch.float64, requires_grad=True)
    out, lse = cm.attention(q, k, v, plan, backend="reference", return_lse=True, sinks=sinks)
    (g,) = torch.autograd.grad((out * do).sum() + (lse * dlse).sum(), [sinks])
    p_sink = torch.exp(sinks.detach().view(1, HQ, 1) - lse.detach())
    dot = (do * out.detach()).sum(-1)
    manual = (p_sink * (dlse - dot)).sum((0, 2))
    assert torch.allclose(g, manual, rtol=1e-6, atol=1e-9)


# --------------------------------------------------------------- v's own head_dim
@pytest.mark.parametrize("D, Dv", [(192, 128), (128, 64), (256, 128), (64, 128)])
def test_value_head_dim_of_its_own(D, Dv):
    _check(torch.float16, _plan(cm.masks.sliding_window(9)), None, [], D=D, Dv=Dv, hq=2, hkv=1)


def test_value_head_dim_with_fp32_sinks_and_a_modifier():
    _check(
        torch.float32, _plan(), CASES["alibi_softcap"][0], [], sinks=torch.tensor([0.1, 1.0]),
        D=64, Dv=32,
    )  # fmt: skip


# ------------------------------------------------------------------ the torch twins
def test_twins_against_a_dense_formula():
    """The reference (with each twin) equals a dense float64 softmax written out here."""
    (q, k, v), _, _ = _inputs(torch.float64)
    plan = _plan()
    table, bias = _table().double(), _bias().double()
    slopes = sm.alibi_slopes(HQ).double()
    i = torch.arange(N).view(N, 1)
    j = torch.arange(N).view(1, N)
    rel = sm.relative_buckets(j - i, 8, 16, True)
    visible = plan.to_dense().bool()
    scale = 32**-0.5
    s = torch.einsum("bhqd,bhkd->bhqk", q, k.expand(B, HQ, N, 32)) * scale
    formulas = {
        "softcap": (sm.softcap(1.5), 1.5 * torch.tanh(s / 1.5)),
        "alibi": (sm.alibi(slopes), s + slopes.view(1, HQ, 1, 1) * (j - i)),
        "relative_bias": (
            sm.relative_bias(table, 8, 16, True),
            s + table[:, rel].unsqueeze(0),
        ),
        "bias": (sm.bias(bias), s + bias),
    }
    for name, (mod, scores) in formulas.items():
        scores = scores.masked_fill(~visible, -math.inf)
        want = torch.softmax(scores, -1) @ v.expand(B, HQ, N, 32)
        got, _ = cm.attention(q, k, v, plan, backend="reference", score_mod=mod, return_lse=True)
        assert torch.allclose(got, want, atol=1e-12), name


def test_relative_buckets_t5():
    """T5's bucketing (HuggingFace ``_relative_position_bucket``) at a few distances."""
    rel = torch.tensor([-200, -20, -3, -1, 0, 1, 3, 20, 200])
    # bidirectional, 32 buckets, max 128: exact below 8, then 8 + log(d / 8) / log(16) * 8;
    # rel > 0 offset by 16 (by hand: d = 20 -> 10, d = 200 -> 15)
    assert sm.relative_buckets(rel, 32, 128, True).tolist() == [15, 10, 3, 1, 0, 17, 19, 26, 31]
    # causal: rel > 0 shares bucket 0
    assert sm.relative_buckets(rel, 32, 128, False).tolist() == [31, 17, 3, 1, 0, 0, 0, 0, 0]


# ------------------------------------------------------------------------- validation
def test_validation_names_the_argument():
    (q, k, v), _, _ = _inputs(torch.float32)
    plan = _plan()
    with pytest.raises(InputError, match="sinks must have shape"):
        cm.attention(q, k, v, plan, sinks=torch.zeros(3))
    if q.device.type == "cpu":
        with pytest.raises(InputError, match="sinks must be finite"):
            cm.attention(q, k, v, plan, sinks=torch.full((q.shape[1],), float("inf")))
    with pytest.raises(InputError, match="bias: tensor must have shape"):
        cm.attention(q, k, v, plan, score_mod=sm.bias(torch.zeros(1, 1, N, N + 1)))
    with pytest.raises(InputError, match="relative_bias table must have shape"):
        cm.attention(q, k, v, plan, score_mod=sm.relative_bias(torch.zeros(5, 8), 8, 16))
    with pytest.raises(InputError, match="score_mod must be"):
        cm.attention(q, k, v, plan, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(InputError, match="softcap: cap"):
        sm.softcap(-1.0)
    with pytest.raises(InputError, match="at most 4 stages"):
        sm.compose(*[sm.softcap(1.0)] * 5)
    with pytest.raises(InputError, match="v's head_dim may differ"):
        cm.attention(q, k, v[:, :, :-1], plan)
    with pytest.raises(InputError, match="head_dim=48 of v"):
        cm.attention(q, k, torch.zeros(B, HKV, N, 48), plan)
    grid = cm.compile(cm.tile_grid(cm.masks.clear((4, 8), 3, 5), (2, 4)), device=DEVICE)
    n = grid.q_len
    with pytest.raises(InputError, match="tile_grid"):
        cm.attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], grid, score_mod=sm.softcap(1.0))


def test_fa4_takes_a_lone_softcap_and_sinks_and_names_the_rest():
    """fa4 runs softcap(cap) alone and sinks (FlashAttention's softcap / learnable_sink); other
    modifiers and compositions are refused with the reason."""
    from compilemask.kernels.fa4.backend import Fa4Backend
    from compilemask.kernels.interface import plain_attention_reason

    (q, k, v), _, _ = _inputs(torch.float32, D=64, Dv=64)
    fa4 = Fa4Backend()
    assert (
        plain_attention_reason(call_of(q, k, v, False, score_mod=sm.softcap(3.0)), "fa4", True)
        == ""
    )
    assert plain_attention_reason(call_of(q, k, v, False, sinks=torch.zeros(HQ)), "fa4", True) == ""
    both = sm.compose(sm.softcap(3.0), sm.alibi(sm.alibi_slopes(HQ)))
    for mod in (both, sm.alibi(sm.alibi_slopes(HQ))):
        ok, why = fa4.supports(_plan(), call_of(q, k, v, False, score_mod=mod))
        assert not ok and "softcap(cap) alone" in why
    (q, k, v), _, _ = _inputs(torch.float32, D=64, Dv=32)
    ok, why = fa4.supports(_plan(), call_of(q, k, v, False, score_mod=sm.softcap(3.0)))
    assert not ok and "head_dim equal" in why


def test_cudnn_and_auto_refuse_what_they_lack():
    """cudnn refuses score_mod, sinks and Dv != D with a reason (auto then skips it);
    Triton refuses a custom modifier without its gradient when a backward is needed."""
    from compilemask.kernels.cudnn.backend import CudnnBackend

    (q, k, v), _, _ = _inputs(torch.float32, D=64, Dv=32)
    plan = _plan()
    cudnn = CudnnBackend()
    ok, why = cudnn.supports(plan, call_of(q, k, v, False, score_mod=sm.softcap(1.0)))
    assert not ok and "score modifiers" in why
    ok, why = cudnn.supports(plan, call_of(q, k, v, False, sinks=torch.zeros(HQ)))
    assert not ok and "sinks" in why
    ok, why = cudnn.supports(plan, call_of(q, k, v, False))
    assert not ok and "head_dim equal" in why
    q.requires_grad_()
    fwd_only = sm.custom(_halve_plus_head_torch, _halve_plus_head, aux=torch.ones(1, device=DEVICE))
    with pytest.raises(InputError, match="triton_grad_fn"):
        cm.attention(q, k, v, plan, backend="triton", score_mod=fwd_only)
    info = cm.explain(plan, q, k, v, score_mod=fwd_only)
    assert info["backend"] == "reference"
    assert any("triton_grad_fn" in why for name, why in info["skipped"] if name == "triton")
    with torch.no_grad(), override_forward_config(FWD):
        out = cm.attention(q, k, v, plan, backend="triton", score_mod=fwd_only)
    ref, _ = reference_attention(
        q.detach().double(), k.double(), v.double(), plan, score_mod=fwd_only
    )
    assert torch.allclose(out.double(), ref, atol=1e-5)


# ------------------------------------------------------------------------------ bench
def test_bench_checks_a_score_mod_system_against_the_modified_reference(monkeypatch):
    """A system with ``score_mod`` is checked against the reference with that modifier: the
    reference's own softcap row passes, an unmodified output fails."""
    from compilemask.tools import bench
    from compilemask.workloads import Workload

    monkeypatch.setattr(bench, "time_ms", lambda runner, bwd: 1.0)
    mask = cm.masks.causal()
    plan = cm.compile(mask, 64)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(4))
    case = bench.Case(Workload("causal", 64, 64, 1, mask), plan, q, k, v, do, 64 * 65 / 2)
    env = {"date": "d", "gpu": "cpu", "torch": "t", "triton": "t", "commit": "c"}
    always = lambda: (True, "")  # noqa: E731
    for mod in ("softcap", "alibi"):
        good = bench.System("ref-mod", always, bench._compilemask("reference", mod), score_mod=mod)
        bad = bench.System("ref-plain", always, bench._compilemask("reference"), score_mod=mod)
        for mode in ("fwd", "fwd+bwd"):
            assert bench.measure(good, case, mode, env)["status"] == "ok"
        assert bench.measure(bad, case, "fwd", env)["status"] == "failed"


def test_custom_torch_fn_errors_name_the_modifier():
    (q, k, v), _, _ = _inputs(torch.float32)
    plan = _plan()

    def broken(score, b, h, i, j, aux):
        return 1 // 0

    def wrong_shape(score, b, h, i, j, aux):
        return torch.zeros(*score.shape[:-1], score.shape[-1] + 1)

    def one_column(score, b, h, i, j, aux):  # broadcasts to score's shape: still refused
        return score[..., :1] * aux[0] + 0.25 * h

    def a_bool(score, b, h, i, j, aux):
        return score > 0

    def a_scalar(score, b, h, i, j, aux):
        return torch.tensor(1.0)

    cases = (
        (broken, "raised ZeroDivisionError"),
        (wrong_shape, "score's shape"),
        (one_column, r"score's shape \(.*, 40\), got shape \(.*, 40, 1\)"),
        (a_bool, "floating-point tensor.*torch.bool"),
        (a_scalar, r"score's shape .*got shape \(\)"),
    )
    aux = torch.tensor([0.5], device=DEVICE)
    for fn, match in cases:
        mod = sm.custom(fn, _halve_plus_head, aux=aux, name="mine")
        with pytest.raises(InputError, match=f"'mine'.*torch_fn.*{match}"):
            cm.attention(q, k, v, plan, score_mod=mod, backend="reference")


def test_custom_refuses_a_plain_triton_fn_and_an_empty_aux():
    """At construction: triton_fn / triton_grad_fn must be @triton.jit functions, aux must
    hold an element (an empty one would be read out of bounds by the kernels)."""
    with pytest.raises(InputError, match="triton_fn must be a @triton.jit function"):
        sm.custom(_halve_plus_head_torch, _halve_plus_head_torch, aux=torch.ones(1))
    with pytest.raises(InputError, match="triton_grad_fn must be a @triton.jit function"):
        sm.custom(_halve_plus_head_torch, _halve_plus_head, _halve_plus_head_torch)
    with pytest.raises(InputError, match=r"aux must hold at least one element, got shape \[0\]"):
        sm.custom(_halve_plus_head_torch, _halve_plus_head, aux=torch.tensor([]))
    sm.custom(_halve_plus_head_torch, _halve_plus_head, _halve_plus_head_grad, torch.ones(1))


def test_alibi_refuses_non_finite_slopes_on_the_cpu():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(InputError, match="alibi: slopes must be finite"):
            sm.alibi(torch.tensor([0.5, bad]))
    sm.alibi(torch.tensor([0.5, 0.25]))


def test_softcap_runs_the_special_function_unit_on_cuda_only():
    """Compiled kernels take softcap's tanh from ``tanh.approx.f32``; the interpreter (no
    inline PTX) runs the exact formula. Both read (cap, 1 / cap)."""
    from compilemask.kernels.triton import score_mods as tsm

    mod = sm.as_score_mod([sm.alibi(sm.alibi_slopes(2)), sm.softcap(4.0)])
    assert pack_kinds(tsm.pack(mod, 8, 8, "cpu")) == (tsm.ALIBI, tsm.SOFTCAP, 0, 0)
    fast = tsm.pack(mod, 8, 8, "cpu", fast_tanh=True)
    assert pack_kinds(fast) == (tsm.ALIBI, tsm.SOFTCAP_FAST, 0, 0)
    assert fast.f[2:4].tolist() == [4.0, 0.25]


def pack_kinds(packed):
    return tuple(packed.kinds)


def test_softcap_refuses_every_cap_that_is_not_positive_and_finite():
    for bad in (0, 0.0, -1.0, float("nan"), float("inf"), -float("inf"), 3.5e38, 1e300):
        # above float32's largest value the kernels' cap would be inf: NaN scores
        with pytest.raises(InputError, match="softcap: cap must be a positive finite float"):
            sm.softcap(bad)
    import numpy as np

    assert sm.softcap(np.float32(5)).cap == 5.0 and sm.softcap(3.4e38).cap == 3.4e38
    for bad in ("5", True, torch.tensor(5.0), None):
        with pytest.raises(InputError, match="softcap: cap must be a float"):
            sm.softcap(bad)


def test_softcap_with_a_float_argument_under_fullgraph_compile():
    """Dynamo makes a float argument that changes between calls a SymFloat, which
    ``math.isfinite`` refuses: the cap's check must trace, and every cap must be honoured."""
    q, k, v = (torch.randn(1, 2, 24, 32) for _ in range(3))
    plan = cm.compile(cm.masks.causal(), 24)

    @torch.compile(backend="eager", fullgraph=True)
    def run(q, k, v, cap):
        return cm.attention(q, k, v, plan, score_mod=sm.softcap(cap), backend="reference")

    for cap in (3.0, 0.5, 7.0):
        want = cm.attention(q, k, v, plan, score_mod=sm.softcap(cap), backend="reference")
        torch.testing.assert_close(run(q, k, v, cap), want)


def test_a_tensor_of_the_wrong_dtype_is_named_with_its_dtype():
    q, k, v = (torch.randn(1, 2, 16, 32) for _ in range(3))
    plan = cm.compile(cm.masks.causal(), 16)
    with pytest.raises(InputError, match="got a torch.int64 tensor"):
        cm.attention(q, k, v, plan, score_mod=sm.alibi(torch.ones(2, dtype=torch.int64)))
    with pytest.raises(InputError, match="got a torch.int32 tensor"):
        cm.attention(q, k, v, plan, score_mod=sm.bias(torch.zeros(1, 2, 16, 16, dtype=torch.int32)))


@triton.jit
def _broken(score, b, h, q_idx, kv_idx, aux):
    return score + tl.load(aux) + undefined_name  # noqa: F821


def test_a_broken_triton_fn_is_reported_by_the_modifier_s_name():
    """An error inside the user's @triton.jit function (compile or interpreter) arrives as an
    InputError naming the custom stage and the innermost error, not Triton's nested wrappers."""
    plan = cm.compile(cm.masks.causal(), 32, device=DEVICE)
    dt = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    q = torch.randn(1, 2, 32, 32, device=DEVICE, dtype=dt)
    mod = sm.custom(_halve_plus_head_torch, _broken, aux=torch.ones(1, device=DEVICE), name="oops")
    with pytest.raises(InputError, match=r"custom score_mod 'oops': its Triton functions failed"):
        cm.attention(q, q, q, plan, score_mod=mod, backend="triton")


@pytest.mark.parametrize("heads", [0, -1, 2.5, True, "4"])
def test_alibi_slopes_refuses_a_head_count_that_is_not_a_positive_int(heads):
    with pytest.raises(InputError, match="alibi_slopes: heads"):
        sm.alibi_slopes(heads)


def test_relative_bias_takes_numpy_ints_and_refuses_a_truthy_non_bool_direction():
    import numpy as np

    table = torch.zeros(2, 32)
    mod = sm.relative_bias(table, np.int64(32), np.int32(128), True)
    assert (mod.num_buckets, mod.max_distance) == (32, 128)
    assert type(mod.num_buckets) is int
    for bad in ("no", 1, None):
        with pytest.raises(InputError, match="bidirectional must be True or False"):
            sm.relative_bias(table, 32, 128, bad)
