"""The per-plan dispatch cache of ``compilemask.attention`` with ``score_mod`` and ``sinks``.

A warm call with a modifier or sinks skips validation, backend resolution and ``prepare``
(counted here through ``registry.resolve`` and the backend's ``prepare``); every change the
checks or the resolution read (stage kinds and order, plain parameters, a tensor's shape,
dtype, device, requires_grad or strides, sinks given or not, a custom stage's functions,
grad mode) runs them again; tensor values are read on every call (a table changed in place
is used at once, CPU sinks are checked for finite values on every call).

Most tests run a registered spy backend that keeps its dispatch (``dispatch_token``) and
computes with the reference; one runs the Triton kernels (interpreter on the CPU).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import compilemask as cm
from compilemask import score_mods as sm
from compilemask.errors import InputError
from compilemask.kernels import registry
from compilemask.kernels.reference import reference_attention

triton = pytest.importorskip("triton", reason="custom modifiers take @triton.jit functions")
import triton.language as tl  # noqa: E402

N, B, HQ, HKV, D = 24, 2, 2, 1, 32


@triton.jit
def _scaled(score, b, h, q_idx, kv_idx, aux):
    return score * tl.load(aux)


@triton.jit
def _scaled_grad(score, b, h, q_idx, kv_idx, aux):
    return tl.load(aux) + 0.0 * score


@triton.jit
def _shifted(score, b, h, q_idx, kv_idx, aux):
    return score + tl.load(aux)


def _scaled_torch(score, b, h, q_idx, kv_idx, aux):
    return score * aux[0].to(score.dtype)


class _Spy:
    """A backend that keeps its dispatch and computes with the reference; it records what
    each call hands it."""

    name = "dispatch-spy"

    def __init__(self):
        self.prepared, self.seen = 0, []

    def available(self):
        return True, ""

    def supports(self, plan, call):
        return True, ""

    def dispatch_token(self):
        return ()

    def prepare(self, plan, call):
        self.prepared += 1
        return plan.in_permuted_order()

    def attend(self, q, k, v, plan, prepared, scale, call, *, score_mod=None, sinks=None):
        self.seen.append((call, score_mod, sinks))
        out, lse = reference_attention(q, k, v, prepared, scale, score_mod=score_mod, sinks=sinks)
        return out.to(q.dtype), lse.to(torch.float32)

    def forward(self, *args, **kwargs):
        raise AssertionError("attend runs every call")

    backward = forward


@pytest.fixture
def spy(monkeypatch):
    backend = _Spy()
    registry.register(backend)
    resolved = []
    real = registry.resolve

    def counting(name, plan, call):
        if name == backend.name:  # not the reference calls that give the expected outputs
            resolved.append(name)
        return real(name, plan, call)

    monkeypatch.setattr(registry, "resolve", counting)
    backend.resolved = resolved
    yield backend
    registry._BACKENDS.pop(backend.name, None)


def _qkv(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) for s in ((B, HQ, N, D), (B, HKV, N, D))] + [
        torch.randn(B, HKV, N, D, generator=g).to(dtype)
    ]


def _plan():
    return cm.compile(cm.masks.causal(), N, cache=False)  # a dispatch cache of its own


def _table(nb=8, seed=1):
    return torch.randn(HQ, nb, generator=torch.Generator().manual_seed(seed))


def _bias(shape=(1, HQ, N, N)):
    return torch.randn(shape, generator=torch.Generator().manual_seed(2))


def _custom(triton_fn=_scaled, grad_fn=_scaled_grad, aux=None, torch_fn=_scaled_torch):
    aux = torch.tensor([0.5]) if aux is None else aux
    return sm.custom(torch_fn, triton_fn, grad_fn, aux=aux)


def _expect(q, k, v, plan, **kw):
    return cm.attention(q, k, v, plan, backend="reference", **kw)


# each: the keyword arguments of a call with a modifier and / or sinks (made fresh per call,
# as a training loop rebuilding its modifier each step does; the tensors are the same)
TABLE, BIAS, SINKS, SLOPES = _table(), _bias(), torch.tensor([0.5, -1.0]), sm.alibi_slopes(HQ)
WARM = {
    "softcap": lambda: {"score_mod": sm.softcap(2.0)},
    "alibi": lambda: {"score_mod": sm.alibi(SLOPES)},
    "relative_bias": lambda: {"score_mod": sm.relative_bias(TABLE, 8, 16, True)},
    "bias": lambda: {"score_mod": sm.bias(BIAS)},
    "custom": lambda: {"score_mod": _custom()},
    "compose": lambda: {"score_mod": sm.compose(sm.alibi(SLOPES), sm.softcap(2.0))},
    "list": lambda: {"score_mod": [sm.relative_bias(TABLE, 8, 16, True), sm.softcap(1.5)]},
    "sinks": lambda: {"sinks": SINKS},
    "softcap_sinks": lambda: {"score_mod": sm.softcap(2.0), "sinks": SINKS},
}


@pytest.mark.parametrize("case", list(WARM))
def test_a_warm_call_with_a_modifier_skips_the_checks(spy, case):
    plan, (q, k, v) = _plan(), _qkv()
    for _ in range(4):
        kw = WARM[case]()
        out = cm.attention(q, k, v, plan, backend=spy.name, **kw)
        torch.testing.assert_close(out, _expect(q, k, v, plan, **kw))
    assert spy.resolved == [spy.name] and spy.prepared == 1
    # every call hands the backend its own modifier and sinks, in the call's record too
    call, mod, sinks = spy.seen[-1]
    if "score_mod" in kw:
        given = kw["score_mod"]
        stages = given if isinstance(given, list) else given.stages()
        assert call.score_mod is mod and all(a is b for a, b in zip(mod.stages(), stages))
    else:
        assert mod is None and call.score_mod is None
    assert sinks is kw.get("sinks") and call.has_sinks == ("sinks" in kw)


def test_the_hit_hands_over_this_calls_modifier_objects(spy):
    plan, (q, k, v) = _plan(), _qkv()
    for _ in range(2):
        mod = sm.compose(sm.softcap(2.0))
        cm.attention(q, k, v, plan, backend=spy.name, score_mod=mod)
        call, seen, _ = spy.seen[-1]
        assert seen is mod and call.score_mod is mod
    assert spy.prepared == 1


# each: (first call, changed call) that must both resolve
T64 = TABLE.double()
CHANGES = {
    "stage kinds": (lambda: sm.softcap(2.0), lambda: sm.alibi(SLOPES)),
    "stage order": (
        lambda: [sm.alibi(SLOPES), sm.softcap(2.0)],
        lambda: [sm.softcap(2.0), sm.alibi(SLOPES)],
    ),
    "a stage more": (lambda: sm.softcap(2.0), lambda: [sm.softcap(2.0), sm.softcap(3.0)]),
    "cap": (lambda: sm.softcap(2.0), lambda: sm.softcap(3.0)),
    "table shape": (
        lambda: sm.relative_bias(TABLE, 8, 16, True),
        lambda: sm.relative_bias(_table(16), 16, 16, True),
    ),
    "max_distance": (
        lambda: sm.relative_bias(TABLE, 8, 16, True),
        lambda: sm.relative_bias(TABLE, 8, 20, True),
    ),
    "bidirectional": (
        lambda: sm.relative_bias(TABLE, 8, 16, True),
        lambda: sm.relative_bias(TABLE, 8, 16, False),
    ),
    "table dtype": (
        lambda: sm.relative_bias(TABLE, 8, 16, True),
        lambda: sm.relative_bias(T64, 8, 16, True),
    ),
    "table requires_grad": (
        lambda: sm.relative_bias(TABLE, 8, 16, True),
        lambda: sm.relative_bias(TABLE.clone().requires_grad_(), 8, 16, True),
    ),
    "bias shape": (lambda: sm.bias(BIAS), lambda: sm.bias(_bias((B, HQ, N, N)))),
    "bias strides": (
        lambda: sm.bias(BIAS),
        lambda: sm.bias(BIAS.transpose(2, 3).contiguous().transpose(2, 3)),
    ),
    "slopes dtype": (lambda: sm.alibi(SLOPES), lambda: sm.alibi(SLOPES.double())),
    "custom triton_fn": (lambda: _custom(), lambda: _custom(triton_fn=_shifted)),
    "custom grad_fn": (lambda: _custom(), lambda: _custom(grad_fn=None)),
    "custom aux shape": (lambda: _custom(), lambda: _custom(aux=torch.tensor([0.5, 1.0]))),
}


@pytest.mark.parametrize("case", list(CHANGES))
def test_a_change_the_checks_read_dispatches_again(spy, case):
    plan, (q, k, v) = _plan(), _qkv()
    first, changed = CHANGES[case]
    for make, resolves in ((first, 1), (first, 1), (changed, 2), (changed, 2), (first, 2)):
        mod = make()
        out = cm.attention(q, k, v, plan, backend=spy.name, score_mod=mod)
        torch.testing.assert_close(out, _expect(q, k, v, plan, score_mod=mod))
        assert len(spy.resolved) == resolves


SINK_CHANGES = {
    "sinks added": (None, SINKS),
    "sinks removed": (SINKS, None),
    "sinks dtype": (SINKS, SINKS.double()),
    "sinks requires_grad": (SINKS, SINKS.clone().requires_grad_()),
}


@pytest.mark.parametrize("case", list(SINK_CHANGES))
def test_a_change_of_the_sinks_dispatches_again(spy, case):
    plan, (q, k, v) = _plan(), _qkv()
    first, changed = SINK_CHANGES[case]
    for sinks, resolves in ((first, 1), (first, 1), (changed, 2), (changed, 2)):
        mod = sm.softcap(2.0)
        out = cm.attention(q, k, v, plan, backend=spy.name, score_mod=mod, sinks=sinks)
        torch.testing.assert_close(out, _expect(q, k, v, plan, score_mod=mod, sinks=sinks))
        assert len(spy.resolved) == resolves


def test_a_tensor_on_another_device_or_of_another_shape_is_refused_after_a_hit(spy):
    """What the checks refuse is refused on a warm plan too: the key differs, the checks run."""
    plan, (q, k, v) = _plan(), _qkv()
    for _ in range(2):
        cm.attention(q, k, v, plan, backend=spy.name, score_mod=sm.bias(BIAS), sinks=SINKS)
    with pytest.raises(InputError, match="bias tensor is on meta"):
        cm.attention(q, k, v, plan, backend=spy.name, score_mod=sm.bias(BIAS.to("meta")))
    with pytest.raises(InputError, match="sinks are on meta"):
        cm.attention(q, k, v, plan, backend=spy.name, sinks=SINKS.to("meta"))
    with pytest.raises(InputError, match="sinks must have shape"):
        cm.attention(q, k, v, plan, backend=spy.name, sinks=torch.zeros(HQ + 1))
    with pytest.raises(InputError, match="bias: tensor must have shape"):
        cm.attention(q, k, v, plan, backend=spy.name, score_mod=sm.bias(_bias((1, HQ, N, 3))))
    slopes = torch.ones(HQ + 1)
    with pytest.raises(InputError, match="alibi slopes must have shape"):
        cm.attention(q, k, v, plan, backend=spy.name, score_mod=sm.alibi(slopes))


def test_grad_mode_decides_a_backward_for_a_learnable_table(spy):
    """q, k, v without grad and a table that requires it: the call asks for a backward in
    grad mode only, whichever came first."""
    plan, (q, k, v) = _plan(), _qkv()
    table = TABLE.clone().requires_grad_()
    for grad in (True, False, True, False):
        with torch.set_grad_enabled(grad):
            cm.attention(q, k, v, plan, backend=spy.name, score_mod=sm.relative_bias(table, 8))
        assert spy.seen[-1][0].requires_grad is grad
    assert len(spy.resolved) == 2


def test_values_changed_in_place_are_used_on_the_next_call(spy):
    plan, (q, k, v) = _plan(), _qkv()
    table, bias, sinks, aux = TABLE.clone(), BIAS.clone(), SINKS.clone(), torch.tensor([0.5])
    mod = [sm.relative_bias(table, 8, 16, True), sm.bias(bias), _custom(aux=aux)]
    outs = []
    for _ in range(2):
        out = cm.attention(q, k, v, plan, backend=spy.name, score_mod=mod, sinks=sinks)
        torch.testing.assert_close(out, _expect(q, k, v, plan, score_mod=mod, sinks=sinks))
        outs.append(out)
        for t in (table, bias, sinks, aux):
            t.mul_(3.0)
    assert not torch.allclose(outs[0], outs[1])
    assert len(spy.resolved) == 1


def test_a_new_torch_fn_of_a_custom_is_the_one_that_runs(spy):
    """No check reads a custom's torch_fn: a new one hits, and is the one the call runs."""
    plan, (q, k, v) = _plan(), _qkv()
    first = _custom()
    second = _custom(torch_fn=lambda s, b, h, i, j, aux: s * 2.0)
    a = cm.attention(q, k, v, plan, backend=spy.name, score_mod=first)
    b = cm.attention(q, k, v, plan, backend=spy.name, score_mod=second)
    torch.testing.assert_close(b, _expect(q, k, v, plan, score_mod=second))
    assert not torch.allclose(a, b) and len(spy.resolved) == 1


def test_cpu_sinks_are_checked_for_finite_values_on_a_hit(spy):
    plan, (q, k, v) = _plan(), _qkv()
    sinks = SINKS.clone()
    for _ in range(2):
        cm.attention(q, k, v, plan, backend=spy.name, sinks=sinks)
    sinks[1] = float("nan")
    with pytest.raises(InputError, match="sinks must be finite"):
        cm.attention(q, k, v, plan, backend=spy.name, sinks=sinks)
    assert len(spy.resolved) == 1


def test_a_list_and_its_composition_share_an_entry(spy):
    plan, (q, k, v) = _plan(), _qkv()
    cm.attention(q, k, v, plan, backend=spy.name, score_mod=[sm.alibi(SLOPES), sm.softcap(2.0)])
    cm.attention(
        q, k, v, plan, backend=spy.name, score_mod=sm.compose(sm.alibi(SLOPES), sm.softcap(2.0))
    )
    assert len(spy.resolved) == 1


class _MyCap(sm.Softcap):
    """A subclass of a built-in: it may check or compute otherwise, so it is not keyed."""


def test_unkeyed_modifiers_run_every_check(spy):
    plan, (q, k, v) = _plan(), _qkv()
    assert sm.dispatch_key(_MyCap(2.0)) is None
    assert sm.dispatch_key([sm.softcap(2.0), _MyCap(2.0)]) is None
    for _ in range(3):
        cm.attention(q, k, v, plan, backend=spy.name, score_mod=_MyCap(2.0))
    assert len(spy.resolved) == 3


def test_check_plan_runs_every_check(spy):
    plan, (q, k, v) = _plan(), _qkv()
    for _ in range(2):
        cm.attention(q, k, v, plan, backend=spy.name, score_mod=sm.softcap(2.0), check_plan=True)
    assert len(spy.resolved) == 2


def test_the_cache_keeps_no_modifier_tensor_alive(spy):
    plan, (q, k, v) = _plan(), _qkv()
    bias = _bias((B, HQ, N, N))
    cm.attention(q, k, v, plan, backend=spy.name, score_mod=sm.bias(bias))
    entries = [e for key, e in plan._cache.items() if key[:1] == ("api.dispatch",)]
    assert len(entries) == 1 and entries[0][2].score_mod is None
    alive = weakref.ref(bias)
    spy.seen.clear()
    del bias
    gc.collect()
    assert alive() is None


def test_dispatch_key_reads_no_values():
    table = TABLE.clone()
    key = sm.dispatch_key(sm.relative_bias(table, 8, 16, True))
    table.add_(1.0)
    assert sm.dispatch_key(sm.relative_bias(table, 8, 16, True)) == key
    assert sm.dispatch_key(sm.softcap(2.0)) != sm.dispatch_key(sm.softcap(2.5))
    assert sm.dispatch_key(torch.zeros(3)) is None and sm.dispatch_key([sm.softcap(2.0), 1]) is None


@pytest.mark.kernel
def test_triton_reads_a_table_changed_in_place_on_a_hit(monkeypatch):
    """The Triton kernels with a cached dispatch: the relative_bias table, the bias and the
    sinks changed in place between two calls give the modified reference's output."""
    resolved = []
    real = registry.resolve

    def counting(name, plan, call):
        if name == "triton":
            resolved.append(name)
        return real(name, plan, call)

    monkeypatch.setattr(registry, "resolve", counting)
    plan = cm.compile(cm.masks.causal(), N, block_m=16, block_n=16, cache=False)
    q, k, v = _qkv(torch.float32)
    table, bias, sinks = TABLE.clone(), BIAS.clone(), SINKS.clone()
    for _ in range(2):
        mod = [sm.relative_bias(table, 8, 16, True), sm.bias(bias)]
        out = cm.attention(q, k, v, plan, backend="triton", score_mod=mod, sinks=sinks)
        torch.testing.assert_close(
            out, _expect(q, k, v, plan, score_mod=mod, sinks=sinks), atol=2e-3, rtol=2e-3
        )
        for t in (table, bias, sinks):
            t.mul_(-2.0)
    assert resolved == ["triton"]
