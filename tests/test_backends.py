"""The backend seam (kernels/interface.py, kernels/registry.py): resolution, errors, auto's
table, explain, and a backend registered from outside the package."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import compilemask as cm
from compilemask.errors import InputError
from compilemask.kernels import registry
from compilemask.kernels.interface import AttentionCall, Backend
from compilemask.kernels.reference import reference_attention, reference_attention_backward


def _qkv(n=40, d=32, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, d, generator=g).to(dtype) for _ in range(3))
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


class _Counting:
    """A backend with forward / backward only (no ``attend``): the api wires its autograd."""

    name = "counting"

    def __init__(self, ok=(True, ""), supported=(True, "")):
        self.ok, self.supported, self.calls = ok, supported, []

    def available(self):
        return self.ok

    def supports(self, plan, call):
        return self.supported

    def prepare(self, plan, call):
        self.calls.append(("prepare", call))
        return plan.in_permuted_order()

    def forward(self, q, k, v, plan, prepared, scale, need_lse=True):
        self.calls.append(("forward",))
        out, lse = reference_attention(q, k, v, prepared, scale)
        return out.to(q.dtype), lse.float()

    def backward(self, q, k, v, out, lse, dout, plan, prepared, scale):
        self.calls.append(("backward",))
        return reference_attention_backward(q, k, v, prepared, dout, scale)


@pytest.fixture
def counting():
    backend = _Counting()
    registry.register(backend)
    yield backend
    registry._BACKENDS.pop("counting", None)


def test_builtin_backends_follow_the_protocol():
    for name in ("reference", "triton"):
        assert isinstance(registry.get(name), Backend)
    assert {"reference", "triton"} <= set(registry.names())


def test_registered_backend_runs_with_generic_autograd(counting):
    mask = cm.tile_grid(cm.masks.clear((8, 8), 3, 16), (4, 4))  # a permuted plan
    plan = cm.compile(mask, 80)
    assert plan.permutation is not None
    q, k, v = _qkv(80, grad=True)
    out = cm.attention(q, k, v, plan, backend="counting")
    want = cm.attention(q, k, v, plan, backend="reference")
    torch.testing.assert_close(out, want)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    ref = torch.autograd.grad(want, (q, k, v), do)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    kinds = [c[0] for c in counting.calls]
    assert kinds == ["prepare", "forward", "backward"]
    call = counting.calls[0][1]
    assert isinstance(call, AttentionCall) and call.requires_grad and not call.return_lse
    assert (call.batch, call.heads_q, call.heads_kv, call.q_len, call.head_dim) == (
        1, 2, 2, 80, 32,
    )  # fmt: skip


def test_explicit_backend_that_cannot_run_raises_its_reason(counting):
    plan = cm.compile(cm.masks.causal(), 40)
    q, k, v = _qkv()
    counting.ok = (False, "libcounting is not installed")
    with pytest.raises(InputError, match="'counting' is unavailable: libcounting"):
        cm.attention(q, k, v, plan, backend="counting")
    counting.ok, counting.supported = (True, ""), (False, "head_dim 32 is not built")
    with pytest.raises(InputError, match="'counting' does not support this call: head_dim 32"):
        cm.attention(q, k, v, plan, backend="counting")
    assert counting.calls == []  # nothing ran, nothing fell back


def test_unknown_backend_names_the_choices():
    plan = cm.compile(cm.masks.causal(), 40)
    q, k, v = _qkv()
    with pytest.raises(InputError, match="backend must be one of 'auto', 'reference'"):
        cm.attention(q, k, v, plan, backend="flash")
    with pytest.raises(InputError, match="backend must be a str"):
        cm.attention(q, k, v, plan, backend=3)


def test_auto_reads_the_table_in_order(counting, monkeypatch):
    plan = cm.compile(cm.masks.causal(), 40)
    q, k, v = _qkv()
    table = [
        registry.AutoRule("counting", device="cuda", why="never on the CPU"),
        registry.AutoRule("counting", head_dims=(32,), dtypes=(torch.float32,), why="measured"),
        registry.AutoRule("reference", why="fallback"),
    ]
    monkeypatch.setattr(registry, "AUTO_TABLE", table)
    cm.attention(q, k, v, plan)
    assert counting.calls and counting.calls[-1] == ("forward",)
    assert cm.explain(plan, q, k, v)["reason"] == "measured"
    counting.supported = (False, "no")
    counting.calls.clear()
    cm.attention(q, k, v, plan)  # the next matching row
    assert counting.calls == []
    info = cm.explain(plan, q, k, v)
    assert info["backend"] == "reference" and info["skipped"] == [("counting", "no")]


def test_explain_says_why_triton_is_passed_over(monkeypatch):
    plan = cm.compile(cm.masks.causal(), 40)
    q, k, v = _qkv(dtype=torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    info = cm.explain(plan, q, k, v)
    assert info["backend"] == "reference"
    assert info["skipped"][0][0] == "triton" and "bfloat16" in info["skipped"][0][1]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    info = cm.explain(plan, q.float(), k.float(), v.float())
    assert info["backend"] == "reference" and "TRITON_INTERPRET" in info["skipped"][0][1]
    with pytest.raises(InputError, match="'triton' does not support this call"):
        cm.attention(q.float(), k.float(), v.float(), plan, backend="triton")


def test_float64_is_refused_by_triton_and_run_by_auto(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    plan = cm.compile(cm.masks.causal(), 40)
    q, k, v = _qkv(dtype=torch.float64)
    with pytest.raises(InputError, match="float16, bfloat16 and float32"):
        cm.attention(q, k, v, plan, backend="triton")
    assert cm.explain(plan, q, k, v)["backend"] == "reference"
    assert cm.attention(q, k, v, plan).dtype == torch.float64


def test_register_rejects_an_incomplete_backend():
    class NoBackward:
        name = "broken"

        def available(self):
            return True, ""

    with pytest.raises(TypeError, match="supports"):
        registry.register(NoBackward())
    assert "broken" not in registry.names()


def test_auto_rules_match_on_length_and_backward():
    from compilemask.kernels.interface import AttentionCall
    from compilemask.kernels.registry import AutoRule

    def call(q_len, grad):
        return AttentionCall(
            batch=1, heads_q=2, heads_kv=2, q_len=q_len, kv_len=q_len, head_dim=64,
            dtype=torch.float16, device=torch.device("cpu"), requires_grad=grad,
            return_lse=False,
        )  # fmt: skip

    rule = AutoRule("x", min_q_len=4096, requires_grad=True)
    assert rule.matches(call(4096, True))
    assert not rule.matches(call(4095, True))
    assert not rule.matches(call(8192, False))
    assert AutoRule("x", min_q_len=4096).matches(call(8192, False))
    short = AutoRule("x", max_q_len=2048, requires_grad=False)
    assert short.matches(call(2048, False)) and short.matches(call(1, False))
    assert not short.matches(call(2049, False)) and not short.matches(call(1024, True))
    assert not AutoRule("x", device="cuda").matches(call(8192, False))
    from compilemask import score_mods as sm

    capped = dataclasses.replace(call(8192, False), score_mod=sm.as_score_mod(sm.softcap(30.0)))
    assert AutoRule("x", modifiers=True).matches(capped)
    assert not AutoRule("x", modifiers=True).matches(call(8192, False))
    assert AutoRule("x", modifiers=False).matches(call(8192, False))
    assert not AutoRule("x", modifiers=False).matches(capped)
    seen = []

    def causal_only(plan):
        seen.append(plan)
        return plan.source == "causal()"

    picky = AutoRule("x", min_q_len=4096, plans=causal_only)
    causal, window = cm.compile(cm.masks.causal(), 64), cm.compile(cm.masks.sliding_window(8), 64)
    assert picky.matches(call(4096, True), causal)
    assert not picky.matches(call(4096, True), window)
    assert not picky.matches(call(4096, True))  # a plan test needs the plan
    assert len(seen) == 2
    assert not picky.matches(call(1024, True), causal) and len(seen) == 2  # call fields first


def test_auto_fa4_causal_row_reads_no_plan_without_fa4(monkeypatch):
    """The plan test of the fa4 row (a host read, once per plan) runs only where fa4 runs."""
    from compilemask.kernels.fa4 import native

    calls = []
    monkeypatch.setattr(native, "native_form", lambda plan: calls.append(plan))
    fa4_rows = [r for r in registry.AUTO_TABLE if r.backend == "fa4" and r.plans is not None]
    assert fa4_rows and fa4_rows[0].requires_grad is True
    if not registry.get("fa4").available()[0]:
        assert fa4_rows[0].plans(cm.compile(cm.masks.causal(), 64)) is False
        assert calls == []


class _WithoutNeedLse(_Counting):
    """A backend written before ``need_lse`` joined the contract."""

    name = "counting-old"

    def forward(self, q, k, v, plan, prepared, scale):
        return super().forward(q, k, v, plan, prepared, scale)


def test_backends_whose_forward_takes_no_need_lse_still_run():
    backend = _WithoutNeedLse()
    registry.register(backend)
    try:
        plan = cm.compile(cm.masks.causal(), 32)
        q, k, v = _qkv(32)
        out = cm.attention(q, k, v, plan, backend="counting-old")
        torch.testing.assert_close(out, cm.attention(q, k, v, plan, backend="reference"))
        assert registry.forward_options(backend, False) == {}
        assert registry.forward_options(registry.get("reference"), False) == {"need_lse": False}
    finally:
        registry._BACKENDS.pop("counting-old", None)


def test_auto_forward_rows_take_no_backward_steps():
    """A row for forwards at every length must not catch calls that run a backward (at 1K
    cudnn's backward step measured 1.640 ms against Triton's 1.286 on the H200)."""
    from compilemask.kernels import registry

    for rule in registry.AUTO_TABLE:
        if rule.backend == "cudnn" and rule.min_q_len is None and rule.plans is None:
            assert rule.requires_grad is False
        if rule.backend == "cute":  # forward only; plain forwards only up to 2K (measured)
            assert rule.requires_grad is False
            assert rule.max_q_len is not None or rule.modifiers is True


def test_auto_many_interval_row_reads_only_the_plan_shape():
    """Below 4K, calls with a backward go to cudnn only on plans of many intervals per row
    (clear: cudnn measured faster; shared_prompt's 2 per row: Triton faster)."""
    from compilemask import workloads as wl

    rows = [r for r in registry.AUTO_TABLE if r.plans is registry._many_intervals]
    assert len(rows) == 1 and rows[0].backend == "cudnn" and rows[0].requires_grad is True
    many = {}
    for name in ("clear", "shared_prompt", "hstu", "causal"):
        w = wl.workload(name, 1024)
        many[name] = registry._many_intervals(cm.compile(w.mask, w.N))
    assert many == {"clear": True, "shared_prompt": False, "hstu": False, "causal": False}
