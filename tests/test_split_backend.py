"""One backend's forward with another's backward (kernels/split.py): the halves meet through
the contract's out and lse, so the gradients equal the float64 reference's, rows that see no
key included; what each half refuses is refused by name."""

from __future__ import annotations

import os

import pytest
import torch

import compilemask as cm
from compilemask.errors import InputError
from compilemask.kernels import registry
from compilemask.kernels.interface import AttentionCall, Backend
from compilemask.kernels.reference import reference_attention, reference_attention_backward
from compilemask.kernels.split import SplitBackend
from compilemask.testing import check_close

M = cm.masks


class _ReferenceForward:
    """The reference's forward alone (the float32 oracle standing in for another kernel)."""

    name = "refwd"

    def available(self):
        return True, ""

    def supports(self, plan, call):
        if call.requires_grad:
            return False, "forward only"
        return True, ""

    def prepare(self, plan, call):
        return None

    def forward(self, q, k, v, plan, prepared, scale, need_lse=True):
        out, lse = reference_attention(q, k, v, plan, scale, compute_dtype=torch.float32)
        return out.to(q.dtype), lse.float()

    def backward(self, *args):
        raise AssertionError("the split backend must not call the forward half's backward")


def _registered(forward_half):
    """A split backend of ``forward_half`` and the Triton backward, registered while in use."""
    backend = SplitBackend(forward_half, registry.get("triton"))
    registry.register(backend)
    yield backend
    registry._BACKENDS.pop(backend.name, None)


@pytest.fixture
def split():
    yield from _registered(_ReferenceForward())


def test_split_follows_the_protocol_and_names_both_halves(split):
    assert isinstance(split, Backend)
    assert split.name == "refwd+triton"
    assert isinstance(registry.get("cudnn+triton"), SplitBackend)


@pytest.mark.parametrize(
    "mask,nq,nk",
    [
        (M.hstu([40, 30, 26], [6, 4, 2]), None, None),
        (M.sliding_window(8), 90, 70),  # rows past the keys' end see nothing
    ],
)
def test_split_gradients_equal_the_float64_reference(split, mask, nq, nk):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    plan = cm.compile(mask, nq, nk)
    g = torch.Generator().manual_seed(0)
    dt = torch.float16
    q = torch.randn(2, 4, plan.q_len, 32, generator=g).to(dt)
    k, v = (torch.randn(2, 2, plan.kv_len, 32, generator=g).to(dt) for _ in range(2))
    do = torch.randn(q.shape, generator=g).to(dt)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cm.attention(*leaves, plan, backend="refwd+triton")
    out.backward(do)
    ref64, lse64 = reference_attention(q, k, v, plan, compute_dtype=torch.float64)
    refdt, _ = reference_attention(q, k, v, plan, compute_dtype=torch.float32, matmul_dtype=dt)
    ok, err, bound = check_close(out.detach(), ref64, refdt, dt)
    assert ok, f"out: {err:.3g} > {bound:.3g}"
    g64 = reference_attention_backward(q, k, v, plan, do, compute_dtype=torch.float64)
    gdt = reference_attention_backward(
        q, k, v, plan, do, compute_dtype=torch.float32, matmul_dtype=dt
    )
    seen = torch.isfinite(lse64)
    for name, got, a, c in zip(("dq", "dk", "dv"), (t.grad for t in leaves), g64, gdt):
        ok, err, bound = check_close(got, a, c, dt)
        assert ok, f"{name}: {err:.3g} > {bound:.3g}"
    assert bool((leaves[0].grad[~seen] == 0).all())
    if nq == 90:
        assert bool((~seen).any())


def test_split_refuses_a_gradient_through_lse(split):
    plan = cm.compile(M.causal(), 16)
    call = AttentionCall(1, 2, 2, 16, 16, 32, torch.float16, torch.device("cpu"), True, True)
    ok, why = split.supports(plan, call)
    assert not ok and "lse" in why


def test_split_reports_the_half_that_cannot_run(split):
    plan = cm.compile(M.causal(), 16)
    q, k, v = (torch.randn(1, 2, 16, 32, dtype=torch.float64) for _ in range(3))
    with pytest.raises(InputError, match=r"refwd\+triton.*triton \(backward\)"):
        cm.attention(*(t.requires_grad_() for t in (q, k, v)), plan, backend="refwd+triton")


def test_cudnn_triton_pair_is_refused_with_cudnn_s_reason_without_it():
    ok, why = registry.get("cudnn+triton").available()
    if ok:
        pytest.skip("cuDNN-frontend runs here")
    assert why.startswith("cudnn: ")
    plan = cm.compile(M.causal(), 16)
    q = torch.randn(1, 2, 16, 32)
    with pytest.raises(InputError, match=r"cudnn\+triton"):
        cm.attention(q, q, q, plan, backend="cudnn+triton")


class _ReferenceModdedForward(_ReferenceForward):
    """The reference's forward with score modifiers and sinks (``attend``, no backward)."""

    name = "refmod"

    def attend(self, q, k, v, plan, prepared, scale, call, *, score_mod=None, sinks=None):
        assert not call.requires_grad  # the split backend asks for a forward alone
        out, lse = reference_attention(
            q.detach(), k.detach(), v.detach(), plan, scale, compute_dtype=torch.float32,
            score_mod=score_mod, sinks=None if sinks is None else sinks.detach(),
        )  # fmt: skip
        return out.to(q.dtype), lse.float()


@pytest.fixture
def modded_split():
    yield from _registered(_ReferenceModdedForward())


@pytest.mark.parametrize("kind", ["softcap", "alibi", "relative_bias+sinks"])
def test_split_with_a_score_modifier_gives_the_reference_gradients(modded_split, kind):
    """The forward half's out and lse of the modified scores, the Triton backward's gradients
    of q, k, v, a learnable table and the sinks: the float64 reference's."""
    sm = cm.score_mods
    plan = cm.compile(M.hstu([40, 30, 26], [6, 4, 2]))
    g = torch.Generator().manual_seed(1)
    dt = torch.float16
    q = torch.randn(1, 4, plan.q_len, 32, generator=g).to(dt)
    k, v = (torch.randn(1, 2, plan.kv_len, 32, generator=g).to(dt) for _ in range(2))
    do = torch.randn(q.shape, generator=g).to(dt)
    table = (0.3 * torch.randn(4, 8, generator=g)).requires_grad_()
    sinks = torch.randn(4, generator=g).requires_grad_() if "sinks" in kind else None
    mod = {
        "softcap": lambda: sm.softcap(2.0),
        "alibi": lambda: sm.alibi(sm.alibi_slopes(4)),
        "relative_bias+sinks": lambda: sm.relative_bias(table, 8, 16, True),
    }[kind]()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cm.attention(*leaves, plan, backend="refmod+triton", score_mod=mod, sinks=sinks)
    out.backward(do)
    got = [t.grad for t in leaves] + ([table.grad] if "relative" in kind else [])
    got += [sinks.grad] if sinks is not None else []
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    table64 = table.detach().double().requires_grad_()
    sinks64 = None if sinks is None else sinks.detach().double().requires_grad_()
    mod64 = sm.relative_bias(table64, 8, 16, True) if "relative" in kind else mod
    out64 = cm.attention(*ref, plan, backend="reference", score_mod=mod64, sinks=sinks64)
    out64.backward(do.double())
    want = [t.grad for t in ref] + ([table64.grad] if "relative" in kind else [])
    want += [sinks64.grad] if sinks is not None else []
    torch.testing.assert_close(out.detach().double(), out64.detach(), rtol=0, atol=5e-3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=0, atol=3e-2 * max(1.0, b.abs().max()))


def test_cute_triton_pair_is_registered_and_names_cute_without_it():
    pair = registry.get("cute+triton")
    assert isinstance(pair, SplitBackend)
    ok, why = pair.available()
    if not ok:
        assert why.startswith("cute: ")
