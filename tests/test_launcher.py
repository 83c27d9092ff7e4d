"""``kernels/triton/launcher.py``: the launch key is at least as strict as Triton's own
specialization (CPU: Triton's binder built for an sm_90 target, compared over a matrix of
inputs), and launches through the compiled launcher equal launches through
``JITFunction.run`` bit for bit (GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import CUDABackend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import compilemask as cm  # noqa: E402
from compilemask.kernels.triton import launcher  # noqa: E402


def _probe(X, Y, n, m, s, scale, flag, N_ALIGN, BLOCK: tl.constexpr, MODE: tl.constexpr):
    pass


def _kernel(fn, **kw) -> tuple[JITFunction, object]:
    """A real JITFunction of ``fn`` (even under TRITON_INTERPRET=1) and Triton's binder for
    it, built for sm_90 as ``JITFunction.create_binder`` does on an H100/H200."""
    jit = JITFunction(fn, **kw)
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    jit.device_caches[0] = ({}, {}, backend.target, backend, binder)
    return jit, binder


def _triton_key(jit, binder, args, kwargs):
    """What ``JITFunction.run`` looks its compiled kernel up by (before hashing it)."""
    kw = dict(kwargs)
    kw["debug"] = kw.get("debug", jit.debug) or triton.knobs.runtime.debug
    kw["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
    _, spec, options = binder(*args, **kw)
    return tuple(spec), str(options)


def _check_sound(jit, binder, calls) -> dict:
    """Equal launch keys imply equal Triton keys over ``calls``; returns key -> Triton key."""
    seen: dict = {}
    for args, kwargs in calls:
        key = launcher.launch_key(jit, args, kwargs)
        assert key is not None
        want = _triton_key(jit, binder, args, kwargs)
        assert seen.setdefault(key, want) == want, (args, kwargs)
    return seen


def _tensors():
    base = torch.empty(256, dtype=torch.float32)
    return [
        base,  # aligned
        base[1:],  # 4 bytes off: not 16-byte aligned
        base[4:],  # 16 bytes off: aligned again
        torch.empty(64, dtype=torch.bfloat16)[1:],
        torch.empty(64, dtype=torch.bfloat16),
        torch.empty(64, dtype=torch.float16),
        base.view(16, 16).t(),  # strides are not specialized
    ]


INTS = [1, 0, 16, 17, 32, -16, -1, 2**31 - 16, 2**31, 2**40 + 1, 2**63]


def test_launch_key_is_as_strict_as_tritons_specialization():
    jit, binder = _kernel(_probe)
    tensors = _tensors()
    calls = []
    for x, y in itertools.product(tensors, tensors[:3]):
        calls.append(((x, y, 16, 17, 1, 0.5, True, None), {"BLOCK": 64, "MODE": "a"}))
    for n, m in itertools.product(INTS, INTS[:6]):
        calls.append(((tensors[0], None, n, m, 3, 2.0, False, None), {"BLOCK": 64, "MODE": "a"}))
    for block, mode, warps in itertools.product((16, 64), ("a", "b"), (4, 8)):
        calls.append(
            ((tensors[0], tensors[1], 1, 1, 1, 1.0, 1, 16),
             {"BLOCK": block, "MODE": mode, "num_warps": warps})
        )  # fmt: skip
    keys = _check_sound(jit, binder, calls)
    # every distinction Triton makes is one the key makes: aligned / misaligned pointers,
    # dtypes, value == 1, multiples of 16, widths, bool against int, constexprs, options
    assert len(set(keys.values())) > 20


def test_tensors_passed_by_keyword_are_keyed_by_dtype_and_alignment():
    jit, binder = _kernel(_probe)
    tensors = _tensors()
    calls = [
        ((x,), {"Y": y, "n": 16, "m": 3, "s": 1, "scale": 0.5, "flag": True, "N_ALIGN": None,
                "BLOCK": 16, "MODE": "a"})
        for x in tensors[:3]
        for y in tensors
    ]  # fmt: skip
    keys = _check_sound(jit, binder, calls)
    assert len(set(keys.values())) >= 6


def test_launch_key_follows_do_not_specialize():
    jit, binder = _kernel(_probe, do_not_specialize=["n"], do_not_specialize_on_alignment=["X"])
    tensors = _tensors()
    calls = [
        ((x, None, n, 5, 1, 0.5, True, None), {"BLOCK": 16, "MODE": "a"})
        for x in tensors
        for n in INTS
    ]
    _check_sound(jit, binder, calls)


def test_launch_key_refuses_unkeyed_arguments():
    jit, _ = _kernel(_probe)
    x = torch.empty(16)
    assert launcher.launch_key(jit, (x, x, 1, 1, 1, 1.0, True, None), {"BLOCK": [16]}) is None
    assert launcher.launch_key(jit, (x, object(), 1, 1, 1, 1.0, True, None), {}) is None


def test_host_tma_descriptors_take_tritons_own_specialization():
    from triton.tools.tensor_descriptor import TensorDescriptor

    jit, binder = _kernel(_probe)
    calls = []
    for dtype, block in itertools.product((torch.float16, torch.bfloat16), (32, 64)):
        k = torch.empty(1, 2, 128, 64, dtype=dtype)
        desc = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, block, 64])
        calls.append(((k, desc, 16, 16, 1, 1.0, True, None), {"BLOCK": 16, "MODE": "a"}))
        kw = {"Y": desc, "n": 16, "m": 16, "s": 1, "scale": 1.0, "flag": True, "N_ALIGN": None}
        calls.append(((k,), {**kw, "BLOCK": 16, "MODE": "a"}))  # a descriptor by keyword
    keys = _check_sound(jit, binder, calls)
    assert len(keys) == 8 and len(set(keys.values())) == 4


def _forward_launch(q, k, v, plan):
    """``(args, kwargs)`` of the forward kernel's launch for these inputs (not run)."""
    from compilemask.kernels.triton import forward

    seen = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((a, kw))

    real, forward._attn_fwd = forward._attn_fwd, Spy()
    try:
        with torch.no_grad():
            cm.attention(q, k, v, plan, backend="triton")
    finally:
        forward._attn_fwd = real
    return seen[-1]


def test_forward_launch_keys_match_tritons_on_misaligned_and_odd_inputs():
    """The forward kernel's real argument list: aligned q, q one element off, odd lengths
    (not multiples of 16), a length-1 batch and head count; equal keys, equal Triton keys."""
    from compilemask.kernels.triton import forward

    jit, binder = _kernel(getattr(forward._attn_fwd, "fn", forward._attn_fwd))
    calls = []
    for n, b, h in ((64, 2, 2), (50, 1, 1), (64, 1, 2)):
        plan = cm.compile(cm.masks.causal(), n)
        buf = torch.randn(b * h * n * 32 + 8, dtype=torch.float16)
        for off in (0, 1, 8):
            q = buf[off : off + b * h * n * 32].view(b, h, n, 32)
            k = v = torch.randn(b, h, n, 32, dtype=torch.float16)
            calls.append(_forward_launch(q, k, v, plan))
    keys = _check_sound(jit, binder, calls)
    # 2 lengths (64: multiples of 16; 50: not) x (aligned, misaligned): no more, no fewer
    assert len(keys) == len(set(keys.values())) == 4


def test_install_leaves_interpreted_kernels_alone():
    from compilemask.kernels.triton import forward

    if isinstance(forward._attn_fwd, JITFunction):
        pytest.skip("Triton's interpreter is off here")
    assert launcher.install(forward._attn_fwd) is False


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_launches_equal_tritons_bit_for_bit():
    """Forward and backward through the launcher (second calls) equal the same calls through
    ``JITFunction.run``, on aligned inputs and on a q one element off (a misaligned pointer
    must not reuse the aligned kernel)."""
    from compilemask.kernels.triton import backend

    fwd, bwd = backend._kernels()
    kernels = [fwd._attn_fwd, bwd._attn_bwd_dkdv, bwd._attn_bwd_dq]
    assert all(type(kn) is launcher.CachedLaunchJIT for kn in kernels)
    plan = cm.compile(cm.masks.hstu([300, 500, 224], [20, 40, 10]), 1024, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 2 * 4 * 1024 * 128
    buf = torch.randn(n + 1, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v, do = (
        torch.randn(2, 4, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(3)
    )

    def step(q):
        q = q.detach().requires_grad_(True)
        kk, vv = k.detach().requires_grad_(True), v.detach().requires_grad_(True)
        out = cm.attention(q, kk, vv, plan, backend="triton")
        out.backward(do)
        return out, q.grad, kk.grad, vv.grad

    for q in (buf[:n].view(2, 4, 1024, 128), buf[1:].view(2, 4, 1024, 128)):
        step(q)  # fills the launch tables
        calls: list = []
        orig = JITFunction.run

        def spy(self, *a, calls=calls, orig=orig, **kw):
            calls.append(self)
            return orig(self, *a, **kw)

        JITFunction.run = spy
        try:
            fast = step(q)
        finally:
            JITFunction.run = orig
        assert not set(map(id, kernels)) & set(map(id, calls))  # no kernel went through run
        tables = [kn._launches for kn in kernels]
        for kn in kernels:
            kn._launches = None  # Triton's own path
        try:
            slow = step(q)
        finally:
            for kn, table in zip(kernels, tables):
                kn._launches = table
        for a, b in zip(fast, slow):
            assert torch.equal(a, b)
