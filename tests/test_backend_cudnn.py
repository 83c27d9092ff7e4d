"""``backend="cudnn"``: the lowering of plans to cuDNN endpoints (CPU) and the backend against
a stand-in cuDNN (CPU); the GPU suite of every backend is ``test_backends_gpu.py``."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import compilemask as cm
from compilemask.errors import CompileMaskError
from compilemask.kernels.cudnn import CudnnBackend, endpoints
from compilemask.kernels.cudnn.lower import expand_endpoints
from plan_catalogue import catalogue, plan_dense

M = cm.masks


CATALOGUE = catalogue()


@pytest.mark.parametrize("name,plan,batch,heads", CATALOGUE, ids=[c[0] for c in CATALOGUE])
@pytest.mark.parametrize("trim", [False, True], ids=["nfunc=2K+1", "trimmed"])
def test_endpoints_expand_to_the_plan(name, plan, batch, heads, trim):
    f = endpoints(plan, batch, heads, trim=trim)
    nfunc = f.shape[1]
    h_mask = heads if plan.heads else 1
    assert f.dtype == torch.int32 and f.is_contiguous()
    assert f.shape[0] == h_mask and f.shape[2] == batch * plan.q_len
    assert f.shape[1] % 2 == 1
    if plan.encoding != "bits":
        assert nfunc <= 2 * plan.row_lo.shape[-1] + 1
    assert bool((f[:, 1:] >= f[:, :-1]).all()), "endpoints must be non-decreasing"
    assert bool((f >= 0).all() and (f <= plan.kv_len).all())
    got = expand_endpoints(f, batch, plan.kv_len)  # [B, Hmask, Nq, Nk]
    want = plan_dense(plan, batch, heads)
    assert torch.equal(got.expand_as(want), want)
    if plan.heads is None:  # the one mask head broadcasts to every query head
        assert got.shape[1] == 1
    if trim and nfunc > 1:  # the smallest: two endpoints fewer lose some row's last interval
        short = expand_endpoints(f[:, : nfunc - 2].contiguous(), batch, plan.kv_len)
        assert not torch.equal(short.expand_as(want), want)


def test_rows_starting_at_key_zero_use_one_endpoint_less():
    plan = cm.compile(M.causal(), 6)
    f = endpoints(plan, 1, 1, trim=True)
    assert f.shape == (1, 1, 6)
    assert f[0, 0].tolist() == [1, 2, 3, 4, 5, 6]
    # two intervals, the first at key 0: [0, 2) U [4, 6) -> F = [2, 4, 6]
    dense = torch.zeros(1, 8, dtype=torch.bool)
    dense[0, 0:2] = dense[0, 4:6] = True
    f = endpoints(cm.from_dense(dense), 1, 1)
    assert f[0, :3, 0].tolist() == [2, 4, 6]
    assert bool((f[0, 3:, 0] == 6).all())  # padding repeats the last endpoint


def test_rows_not_starting_at_zero_and_empty_rows():
    dense = torch.zeros(3, 10, dtype=torch.bool)
    dense[0, 3:5] = True  # [3, 5): F = [0, 3, 5]
    dense[2, 1:2] = dense[2, 7:10] = True  # F = [0, 1, 2, 7, 10]
    f = endpoints(cm.from_dense(dense), 1, 1, trim=True)[0]
    assert f[:, 0].tolist() == [0, 3, 5, 5, 5]
    assert f[:, 1].tolist() == [0, 0, 0, 0, 0]  # row 1 sees nothing
    assert f[:, 2].tolist() == [0, 1, 2, 7, 10]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(batch=0, heads_q=1), "batch must be a positive int"),
        (dict(batch=1, heads_q=True), "heads_q must be a positive int"),
        (dict(batch=3, heads_q=2), "per-batch for 2"),
        (dict(batch=2, heads_q=3), "per-head for 2"),
    ],
)
def test_endpoints_reject_bad_arguments(kwargs, match):
    plan = cm.compile(M.per_batch([M.per_head([M.causal(), M.causal()])] * 2), 8, batch=2, heads=2)
    with pytest.raises(CompileMaskError, match=match):
        endpoints(plan, **kwargs)


def _call(**over):
    base = dict(
        batch=2, heads_q=4, heads_kv=2, q_len=64, kv_len=64, head_dim=128,
        dtype=torch.bfloat16, device=torch.device("cuda", 0), requires_grad=True,
        return_lse=False,
    )  # fmt: skip
    base.update(over)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    "over,reason",
    [
        (dict(device=torch.device("cpu")), "CUDA tensors"),
        (dict(dtype=torch.float32), "float16 / bfloat16"),
        (dict(head_dim=100), "head_dim 100"),
        (dict(head_dim=192), "head_dim 192"),
        (dict(heads_kv=3), "not a multiple"),
        (dict(q_len=65), "q_len 64"),
        (dict(return_lse=True), "no gradient through lse"),
    ],
)
def test_supports_names_the_reason(over, reason):
    plan = cm.compile(M.causal(), 64)
    ok, why = CudnnBackend().supports(plan, _call(**over))
    assert not ok and reason in why


def test_refused_under_torch_compile(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    plan = cm.compile(M.causal(), 64)
    for ok, why in (CudnnBackend().available(), CudnnBackend().supports(plan, _call())):
        assert not ok and "torch.compile" in why


def test_supports_checks_per_head_and_per_batch_plans():
    be = CudnnBackend()
    per_head = cm.compile(M.per_head([M.causal()] * 4), 64, heads=4)
    ok, why = be.supports(per_head, _call(heads_q=8))
    assert not ok and "per-head for 4" in why
    per_batch = cm.compile(M.per_batch([M.causal()] * 3), 64, batch=3)
    ok, why = be.supports(per_batch, _call())
    assert not ok and "per-batch for 3" in why


def test_supports_head_dims_gqa_and_q_len_other_than_kv_len():
    if torch.cuda.is_available():
        pytest.skip("with a GPU, supports() also checks its arch (the GPU tests cover it)")
    be = CudnnBackend()
    plan = cm.compile(M.tree([-1, 0, 1], 5))  # q_len 3, kv_len 8
    for d in (8, 64, 128, 256):
        ok, why = be.supports(plan, _call(q_len=3, kv_len=8, head_dim=d))
        assert ok, why


def test_available_names_the_install_extra_without_cudnn():
    try:
        import cudnn.flex_attention  # noqa: F401
    except Exception:
        ok, why = CudnnBackend().available()
        assert not ok and "compilemask[cudnn]" in why
    else:
        pytest.skip("cudnn.flex_attention is installed here")


# ------------------------------------------------ the backend's plumbing, on a stand-in cuDNN
class _FakePlan:
    def __init__(self, mask_func, q, k, build_backward):
        self.mask_func, self.build_backward = mask_func, build_backward
        self.shape = (q.shape, k.shape)


def _fake_attention(q, k, v, plan, scale):
    """cuDNN's documented semantics on BSHD tensors: the mask from the endpoints, GQA by head
    groups, lse natural log [B, Hq, Sq] (-inf and out 0 where a row sees nothing)."""
    b, sq, hq, _ = q.shape
    hkv = k.shape[2]
    visible = expand_endpoints(plan.mask_func, b, k.shape[1])  # [B, Hmask, Sq, Sk]
    qh = q.transpose(1, 2).double()
    kh, vh = (t.transpose(1, 2).double().repeat_interleave(hq // hkv, 1) for t in (k, v))
    s = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return (p @ vh).to(q.dtype).transpose(1, 2), lse.float()


@pytest.fixture
def fake_cudnn(monkeypatch):
    import sys
    import types

    calls = {"create": 0}

    def create_mask_plan(mask_func, q, k, v, *, build_backward=None):
        assert mask_func.dtype == torch.int32 and mask_func.is_contiguous()
        assert q.stride(-1) == 1 and k.shape[:3] == v.shape[:3]
        calls["create"] += 1
        return _FakePlan(mask_func, q, k, build_backward)

    def flex_attn_func(q, k, v, *, mask_plan, softmax_scale=None, return_lse=False):
        assert q.shape[:2] == mask_plan.shape[0][:2] and k.shape == mask_plan.shape[1]
        out, lse = _fake_attention(q, k, v, mask_plan, softmax_scale)
        return (out, lse) if return_lse else out

    def _flex_attention_backward(q, k, v, o, do, lse, *, mask_plan, softmax_scale=None):
        assert mask_plan.build_backward
        assert all(t.stride(-1) == 1 for t in (q, k, v, o, do, lse))  # layouts cuDNN takes
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            out, _ = _fake_attention(*leaves, mask_plan, softmax_scale)
            grads = torch.autograd.grad(out.double(), leaves, do.double())
        return tuple(g.to(q.dtype) for g in grads)

    root = types.ModuleType("cudnn")
    flex = types.ModuleType("cudnn.flex_attention")
    execution = types.ModuleType("cudnn.flex_attention.execution")
    flex.create_mask_plan, flex.flex_attn_func = create_mask_plan, flex_attn_func
    execution._flex_attention_backward = _flex_attention_backward
    root.flex_attention, flex.execution = flex, execution
    for name, mod in (
        ("cudnn", root),
        ("cudnn.flex_attention", flex),
        ("cudnn.flex_attention.execution", execution),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


@pytest.mark.parametrize("name", ["tree", "per_head", "per_batch", "empty_rows", "from_dense"])
def test_backend_plumbing_matches_the_reference(fake_cudnn, name):
    """Layouts (BHSD <-> BSHD views), GQA, caching and the backward's inputs, with a stand-in
    that computes cuDNN's documented semantics from the endpoints."""
    from compilemask.kernels.reference import reference_attention, reference_attention_backward

    plan, b, hq = next((p, b, h) for n, p, b, h in CATALOGUE if n == name)
    plan = dataclasses.replace(plan.in_permuted_order(), _cache={})  # a cache of its own
    hkv = 1 if hq % 2 else hq // 2  # grouped heads
    d = 8
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, hq, plan.q_len, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, plan.kv_len, d, generator=g, dtype=torch.float64) for _ in "kv")
    do = torch.full((1,), 0.7, dtype=q.dtype).expand_as(q)  # as from out.sum(): stride 0
    call = SimpleNamespace(
        batch=b, heads_q=hq, heads_kv=hkv, q_len=plan.q_len, kv_len=plan.kv_len, head_dim=d,
        dtype=q.dtype, device=q.device, requires_grad=True, return_lse=True,
    )  # fmt: skip
    be = CudnnBackend()
    prepared = be.prepare(plan, call)
    assert be.prepare(plan, call) is prepared
    assert be.prepare(plan, SimpleNamespace(**{**vars(call), "requires_grad": False})) is prepared
    assert fake_cudnn["create"] == 1
    out, lse = be.forward(q, k, v, plan, prepared, 0.3)
    ref, ref_lse = reference_attention(q, k, v, plan, 0.3, compute_dtype=torch.float64)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse.float())
    grads = be.backward(q, k, v, out, lse, do, plan, prepared, 0.3)
    refs = reference_attention_backward(q, k, v, plan, do, 0.3, compute_dtype=torch.float64)
    for got, want in zip(grads, refs):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)


def test_backward_of_a_forward_only_preparation_is_refused(fake_cudnn):
    plan = cm.compile(M.causal(), 16, cache=False)
    call = SimpleNamespace(
        batch=1, heads_q=2, heads_kv=2, q_len=16, kv_len=16, head_dim=8,
        dtype=torch.float32, device=torch.device("cpu"), requires_grad=False, return_lse=False,
    )  # fmt: skip
    be = CudnnBackend()
    prepared = be.prepare(plan, call)
    q = torch.randn(1, 2, 16, 8)
    out, lse = be.forward(q, q, q, plan, prepared, 0.5)
    with pytest.raises(CompileMaskError, match="without a backward"):
        be.backward(q, q, q, out, lse, q, plan, prepared, 0.5)
    # a call that needs a backward builds the plan again, with the backward's payloads
    prepared_bwd = be.prepare(plan, SimpleNamespace(**{**vars(call), "requires_grad": True}))
    assert prepared_bwd.has_backward and fake_cudnn["create"] == 2


def test_native_layouts_pass_as_they_are_and_others_are_copied():
    from compilemask.kernels.cudnn.backend import _native

    x = torch.randn(2, 4, 32, 64, dtype=torch.bfloat16)
    view = x.transpose(1, 2)  # BSHD view of BHSD memory: cuDNN takes it
    assert _native(view) is view
    grad = torch.ones((), dtype=torch.bfloat16).expand(2, 32, 4, 64)
    copied = _native(grad)
    assert copied.is_contiguous() and torch.equal(copied, grad)
    odd = torch.randn(2, 32, 4, 66, dtype=torch.bfloat16)[..., 1:65]  # pointer off by 2 bytes
    assert _native(odd).is_contiguous() and torch.equal(_native(odd), odd)
