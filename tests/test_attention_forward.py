"""Forward attention over compiled plans: Triton kernel (interpreter on the CPU) vs reference.

On a machine without CUDA conftest.py sets TRITON_INTERPRET=1 before Triton is imported, so the
kernels run in Triton's interpreter on CPU tensors (fp16 and fp32: the interpreter computes bf16
dots wrongly). With CUDA the same tests run compiled on the GPU, bf16 included. Correctness is
the measure of docs/design.md (``compilemask.testing.check_close``).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import forward_ad

triton = pytest.importorskip("triton", reason="the Triton kernels need triton installed")

import compilemask as cm  # noqa: E402
from compilemask.errors import CompileMaskError, InputError  # noqa: E402
from compilemask.kernels.reference import kernel as reference_mod  # noqa: E402
from compilemask.kernels.reference import reference_attention  # noqa: E402
from compilemask.kernels.triton.configs import (  # noqa: E402
    FwdConfig,
    forward_config,
    override_forward_config,
)
from compilemask.kernels.triton.schedule import forward_schedule, split_full_first  # noqa: E402
from compilemask.testing import check_close, relative_error  # noqa: E402
from conftest import DEVICE, DTYPES, kernel_masks  # noqa: E402
from conftest import assert_attention_close as _assert_matches  # noqa: E402
from conftest import assert_lse_close as _assert_lse  # noqa: E402
from conftest import qkv as _inputs  # noqa: E402

pytestmark = pytest.mark.kernel
HEAD_DIMS = [32, 64, 96, 128, 256]
# Small tiles so that small lengths give many tiles (and bitmask tiles need BLOCK_N % 32 == 0).
# (BLOCK_M, BLOCK_N, grid_order): every launch order is exercised somewhere
TILES = [(16, 32, 2), (32, 16, 0)]

MASKS = {**kernel_masks(150), "chunked": lambda: cm.masks.chunked(24)}


def _run_triton(q, k, v, plan, tiles, **kwargs):
    order = tiles[2] if len(tiles) > 2 else 2
    cfg = FwdConfig(tiles[0], tiles[1], num_warps=4, num_stages=1, grid_order=order)
    with override_forward_config(cfg):
        return cm.attention(q, k, v, plan, backend="triton", **kwargs)


# ---------------------------------------------------------------- kernel vs reference


@pytest.mark.parametrize("tiles", TILES, ids=lambda t: f"{t[0]}x{t[1]}-order{t[2]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_masks(mask_name, dtype, tiles):
    Nq, Nk = 150, 150
    plan = cm.compile(MASKS[mask_name](), Nq, Nk, device=DEVICE)
    q, k, v = _inputs(1, 2, 1, Nq, Nk, 32, dtype)
    out, lse = _run_triton(q, k, v, plan, tiles, return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape
    _assert_matches(out, q, k, v, plan)
    _assert_lse(lse, q, k, v, plan)


def test_bitmask_tiles_are_exercised():
    plan = cm.compile(MASKS["dilated_bits"](), 150, device=DEVICE)
    kinds = plan.tiles(16, 32).kind
    if DEVICE == "cpu":
        assert bool((kinds == 3).any()), "expected PARTIAL_BITS tiles"
    assert bool((kinds == 2).any() | (kinds == 3).any())


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_head_dims(head_dim):
    Nq, Nk = 40, 56
    plan = cm.compile(cm.masks.sliding_window(17), Nq, Nk, device=DEVICE)
    q, k, v = _inputs(1, 2, 2, Nq, Nk, head_dim, torch.float16, seed=head_dim)
    out = _run_triton(q, k, v, plan, (16, 16, 1))
    _assert_matches(out, q, k, v, plan)


@pytest.mark.parametrize("hkv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("lengths", [(70, 130), (130, 70)], ids=["q<kv", "q>kv"])
def test_gqa_and_unequal_lengths(hkv, lengths):
    Nq, Nk = lengths
    plan = cm.compile(cm.masks.prefix_lm(9) | cm.masks.sliding_window(33), Nq, Nk, device=DEVICE)
    q, k, v = _inputs(2, 4, hkv, Nq, Nk, 64, torch.float16, seed=hkv)
    out = _run_triton(q, k, v, plan, (16, 32), scale=0.3)
    _assert_matches(out, q, k, v, plan, scale=0.3)


def test_per_batch_plan():
    mask = cm.masks.per_batch([cm.masks.causal(), cm.masks.sliding_window(9), cm.masks.chunked(16)])
    plan = cm.compile(mask, 60, 60, batch=3, device=DEVICE)
    q, k, v = _inputs(3, 2, 1, 60, 60, 32, torch.float16)
    out = _run_triton(q, k, v, plan, (16, 16, 3))
    _assert_matches(out, q, k, v, plan)
    with pytest.raises(InputError, match="batch=3"):
        cm.attention(q[:2], k[:2], v[:2], plan)


def test_per_head_plan():
    masks = [
        cm.masks.causal(),
        cm.masks.sliding_window(5),
        cm.masks.document([20, 40]),
        cm.masks.dilated(12, 2),
    ]
    plan = cm.compile(cm.masks.per_head(masks), 60, 60, heads=4, device=DEVICE)
    q, k, v = _inputs(2, 4, 2, 60, 60, 32, torch.float32)
    out = _run_triton(q, k, v, plan, (16, 32))
    _assert_matches(out, q, k, v, plan)
    with pytest.raises(InputError, match="heads=4"):
        cm.attention(q[:, :2], k[:, :1], v[:, :1], plan)


def _clear_small(tiled: bool):
    mask = cm.masks.clear((8, 16), 5, 20)
    return cm.tile_grid(mask, (4, 8)) if tiled else mask


@pytest.mark.parametrize("tiled, tiles, mode", [(False, (16, 32, 2), 1), (True, (32, 64, 1), 2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_bitmask_modes(tiled, tiles, mode, dtype):
    """Both masking modes of a schedule with bitmask tiles: HAS_BITS 1 (interval and bitmask
    tiles, a branch per tile) and 2 (every masked tile a bitmask, no branch)."""
    from compilemask.kernels.triton.common import mask_constants

    plan = cm.compile(_clear_small(tiled), 148, device=DEVICE)
    s = plan.tiles(tiles[0], tiles[1])
    assert mask_constants(s.kind, s.jlo, s.jhi, plan.row_lo.shape[-1])[2] == mode
    q, k, v = _inputs(1, 2, 2, 148, 148, 32, dtype)
    out, lse = _run_triton(q, k, v, plan, tiles, return_lse=True)
    _assert_matches(out, q, k, v, plan)
    _assert_lse(lse, q, k, v, plan)


def _dense_with_empty_rows(Nq, Nk, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(Nq, Nk, generator=g) < 0.3
    dense[::7] = False  # rows that see nothing
    dense[20:40] = False  # a whole q-tile that sees nothing
    return dense


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_random_dense_mask_with_empty_rows(dtype):
    dense = _dense_with_empty_rows(77, 99)
    plan = cm.from_dense(dense.to(DEVICE), block_m=16, block_n=32)
    q, k, v = _inputs(1, 2, 2, 77, 99, 64, dtype)
    out, lse = _run_triton(q, k, v, plan, (16, 32), return_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    empty = ~dense.any(-1).to(DEVICE)
    assert bool((out[:, :, empty] == 0).all())
    assert bool((lse[:, :, empty] == -math.inf).all())
    _assert_matches(out, q, k, v, plan)
    _assert_lse(lse, q, k, v, plan)


def test_mask_that_sees_nothing():
    plan = cm.from_dense(torch.zeros(33, 45, dtype=torch.bool, device=DEVICE))
    q, k, v = _inputs(1, 1, 1, 33, 45, 32, torch.float16)
    for backend in ("triton", "reference"):
        out, lse = cm.attention(q, k, v, plan, return_lse=True, backend=backend)
        assert bool((out == 0).all()) and bool((lse == -math.inf).all())


def test_poisoned_buffers_are_fully_written():
    from compilemask.kernels.triton.forward import attention_forward

    Nq, Nk, D = 70, 90, 96  # D padded to 128 inside the kernel
    plan = cm.compile(cm.masks.chunked(24) | cm.masks.prefix_lm(3), Nq, Nk, device=DEVICE)
    q, k, v = _inputs(2, 2, 1, Nq, Nk, D, torch.float16)
    cfg = FwdConfig(32, 32, num_warps=4, num_stages=1)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((2, 2, Nq), float("nan"), device=DEVICE)
    attention_forward(
        q, k, v, plan.row_lo, plan.row_hi, forward_schedule(plan, 32, 32), scale=D**-0.5,
        mask_stride_b=0, mask_stride_h=0, cfg=cfg, out=out, lse=lse,
    )  # fmt: skip
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    _assert_matches(out, q, k, v, plan)


def test_strided_inputs():
    Nq = 50
    plan = cm.compile(cm.masks.causal(), Nq, device=DEVICE)
    base = torch.randn(1, Nq, 3, 2, 64, device=DEVICE, dtype=torch.float16)  # BSHD, packed qkv
    q, k, v = (base[:, :, i].transpose(1, 2) for i in range(3))
    out = _run_triton(q, k, v, plan, (16, 16))
    _assert_matches(out, q.contiguous(), k.contiguous(), v.contiguous(), plan)


def test_auto_backend_uses_triton_here():
    plan = cm.compile(cm.masks.causal(), 40, device=DEVICE)
    q, k, v = _inputs(1, 2, 2, 40, 40, 32, torch.float16)
    out_auto = cm.attention(q, k, v, plan)
    out_triton = cm.attention(q, k, v, plan, backend="triton")
    assert torch.equal(out_auto, out_triton)


# ---------------------------------------------------------------- reference


@pytest.mark.parametrize("hkv", [1, 2])
def test_reference_matches_dense_softmax(monkeypatch, hkv):
    monkeypatch.setattr(reference_mod, "_CHUNK_ELEMENTS", 4 * 4 * 50)  # force many chunks
    dense = _dense_with_empty_rows(45, 50, seed=3)
    plan = cm.from_dense(dense)
    q, k, v = (t.double().cpu() for t in _inputs(2, 4, hkv, 45, 50, 32, torch.float32))
    out, lse = reference_attention(q, k, v, plan, 0.2, compute_dtype=torch.float64)
    kk, vv = (t.repeat_interleave(4 // hkv, dim=1) for t in (k, v))
    s = (q @ kk.transpose(-1, -2) * 0.2).masked_fill(~dense, -math.inf)
    want_lse = torch.logsumexp(s, -1)
    want = torch.nan_to_num(torch.softmax(s, -1), nan=0.0) @ vv
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)


def test_reference_is_differentiable():
    plan = cm.compile(cm.masks.sliding_window(3) | cm.masks.prefix_lm(1), 6, 7)
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64, requires_grad=True)
        for n in (6, 7, 7)
    )
    assert torch.autograd.gradcheck(lambda *t: reference_attention(*t, plan)[0], (q, k, v))


# ---------------------------------------------------------------- torch.compile


def test_torch_compile_fullgraph_reference():
    plan = cm.compile(cm.masks.document([10, 30]), 40, device=DEVICE)
    q, k, v = _inputs(1, 2, 1, 40, 40, 32, torch.float32)

    @torch.compile(fullgraph=True, backend="eager")
    def f(q, k, v):
        return cm.attention(q, k, v, plan, backend="reference", return_lse=True)

    out, lse = f(q, k, v)
    ref, ref_lse = cm.attention(q, k, v, plan, backend="reference", return_lse=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)


def test_torch_compile_fullgraph_triton_op():
    plan = cm.compile(cm.masks.causal(), 40, device=DEVICE)
    q, k, v = _inputs(1, 2, 1, 40, 40, 32, torch.float16)
    with override_forward_config(FwdConfig(16, 16, 4, 1)):
        plan.tiles(16, 16)  # schedules are built eagerly, outside the graph

        @torch.compile(fullgraph=True, backend="aot_eager")
        def f(q, k, v):
            return cm.attention(q, k, v, plan, backend="triton") * 2

        out = f(q, k, v)
        ref = cm.attention(q, k, v, plan, backend="triton") * 2
    assert torch.equal(out, ref)


def test_custom_op_fake_impl():
    from compilemask.kernels.triton.backend import attention_fwd

    plan = cm.compile(cm.masks.causal(), 40, device=DEVICE)
    q, k, v = _inputs(1, 2, 1, 40, 40, 32, torch.float16)
    cfg = forward_config(32, q.dtype)
    sched = list(forward_schedule(plan, cfg.block_m, cfg.block_n).values())
    args = (
        q,
        k,
        v,
        plan.row_lo,
        plan.row_hi,
        sched,
        [],
        0.1,
        0,
        0,
        [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages],
        [],
    )
    torch.library.opcheck(attention_fwd, args, test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------- validation


@pytest.fixture
def small():
    plan = cm.compile(cm.masks.causal(), 40, 48, device=DEVICE)
    q, k, v = _inputs(1, 4, 2, 40, 48, 64, torch.float16)
    return q, k, v, plan


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda q, k, v, p: (q[0], k, v, p), "q must have 4 dims"),
        (lambda q, k, v, p: (q, k, v[:, :, :10], p), "k and v must have the same shape"),
        (lambda q, k, v, p: (q, k[:, :1], v[:, :1], p), None),  # MQA: valid
        (lambda q, k, v, p: (q[:, :3], k, v, p), "multiple of key/value heads"),
        (lambda q, k, v, p: (q[:, :0], k, v, p), "at least one head"),
        (lambda q, k, v, p: (q, k[:, :0], v[:, :0], p), "at least one head"),
        (lambda q, k, v, p: (q, k.float(), v.float(), p), "same dtype"),
        (lambda q, k, v, p: (q[..., :48], k[..., :48], v[..., :48], p), "head_dim=48"),
        (lambda q, k, v, p: (q[:, :, :30], k, v, p), "q_len=40, kv_len=48"),
        (lambda q, k, v, p: (q, k[:, :, :40], v[:, :, :40], p), "kv_len=48"),
        (lambda q, k, v, p: (q, k, v, "causal"), "compilemask.MaskPlan"),
        (lambda q, k, v, p: (q, k, v, cm.masks.causal()), r"compile the mask first"),
        (lambda q, k, v, p: (q.to(torch.int32), k.to(torch.int32), v.to(torch.int32), p), "int32"),
    ],
)
def test_input_errors(small, change, match):
    args = change(*small)
    if match is None:
        cm.attention(*args, backend="reference")
        return
    with pytest.raises(InputError, match=match):
        cm.attention(*args)


def test_head_dim_error_is_a_compilemask_error(small):
    q, k, v, plan = small
    with pytest.raises(CompileMaskError, match="head_dim"):
        cm.attention(q[..., :40], k[..., :40], v[..., :40], plan)


def test_option_errors(small):
    q, k, v, plan = small
    with pytest.raises(InputError, match="backend"):
        cm.attention(q, k, v, plan, backend="cuda")
    with pytest.raises(InputError, match="scale"):
        cm.attention(q, k, v, plan, scale=float("nan"))
    with pytest.raises(InputError, match="same device"):
        cm.attention(q, k.to("meta"), v.to("meta"), plan)


def test_plan_on_other_device_names_plan_to(small):
    q, k, v, plan = small
    with pytest.raises(InputError, match=r"plan\.to\(q\.device\)"):
        cm.attention(q.to("meta"), k.to("meta"), v.to("meta"), plan)


def test_triton_backend_unavailable_without_interpreter(small, monkeypatch):
    if DEVICE == "cuda":
        pytest.skip("on CUDA the Triton backend is always available")
    q, k, v, plan = small
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(InputError, match="TRITON_INTERPRET=1"):
        cm.attention(q, k, v, plan, backend="triton")
    assert cm.attention(q, k, v, plan).shape == q.shape  # auto falls back to the reference


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("duals", ["q", "kv", "qkv"])
def test_triton_refuses_forward_mode_ad(small, duals, requires_grad):
    """Dual tensors (forward-mode AD) on the Triton backend (any backend but the reference: the
    check is in ``attention``): an InputError naming the inputs that carry a tangent and the
    reference backend (before, inputs without grad gave an output with no tangent, silently,
    and inputs with grad torch's generic "implement the jvp" error); "auto" runs the
    reference."""
    q, k, v, plan = small
    args = {"q": q, "k": k, "v": v}
    match = rf"forward-mode AD.*: {', '.join(duals)} carr.*backend=\"reference\""
    with forward_ad.dual_level():
        for name in duals:
            x = args[name].clone().requires_grad_(requires_grad)
            args[name] = forward_ad.make_dual(x, torch.randn_like(x))
        with pytest.raises(InputError, match=match):
            cm.attention(args["q"], args["k"], args["v"], plan, backend="triton")
        # "auto" runs the reference, the one backend that propagates tangents
        out = cm.attention(args["q"], args["k"], args["v"], plan)
        assert forward_ad.unpack_dual(out).tangent is not None


def test_triton_runs_plain_inputs_inside_a_dual_level(small):
    q, k, v, plan = small
    want = cm.attention(q, k, v, plan, backend="triton")
    with forward_ad.dual_level():
        out = cm.attention(q, k, v, plan, backend="triton")
    assert torch.equal(out, want)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("tiled", [False, True])
def test_reference_backend_forward_mode_ad(requires_grad, tiled):
    """Dual tensors on the reference backend (plain torch ops) carry tangents through out and
    lse: those of ``torch.func.jvp`` of the reference."""
    mask = cm.tile_grid(cm.masks.clear((6, 8), 2, 5), (2, 4)) if tiled else cm.masks.causal()
    plan = cm.compile(mask, 53, device=DEVICE)  # a 6 x 8 token grid plus 5 text tokens
    g = torch.Generator().manual_seed(3)
    primals, tangents = (
        [torch.randn(1, 2, 53, 32, generator=g, dtype=torch.float64).to(DEVICE) for _ in "qkv"]
        for _ in range(2)
    )

    def f(q, k, v):
        return cm.attention(q, k, v, plan, backend="reference", return_lse=True)

    (out, lse), (want_out_t, want_lse_t) = torch.func.jvp(f, tuple(primals), tuple(tangents))
    with forward_ad.dual_level():
        duals = [
            forward_ad.make_dual(x.clone().requires_grad_(requires_grad), t)
            for x, t in zip(primals, tangents)
        ]
        got_out, got_lse = (forward_ad.unpack_dual(y) for y in f(*duals))
    torch.testing.assert_close(got_out.primal, out)
    torch.testing.assert_close(got_out.tangent, want_out_t)
    torch.testing.assert_close(got_lse.tangent, want_lse_t)


# ---------------------------------------------------------------- helpers


def test_check_close_rule():
    ref = torch.randn(2, 3, 8, 4, dtype=torch.float64)
    ref[1, 2] = 0  # a head whose rows see nothing
    noisy = ref + 1e-3 * torch.randn_like(ref) * (ref != 0)
    ok, err, bound = check_close(noisy.half(), ref, noisy, torch.float16)
    assert ok and err <= bound
    bad = noisy.clone()
    bad[1, 2, 0, 0] = 0.1  # non-zero where the reference is all zeros: measured on the whole
    assert relative_error(bad, ref) >= 0.1 / float(ref.norm())
    assert not check_close(bad, ref, noisy, torch.float16)[0]
    residue = noisy.clone()
    residue[1, 2, 0, 0] = 1e-9  # rounding residue where the exact answer is zero
    assert check_close(residue, ref, noisy, torch.float16)[0]
    zero = torch.zeros(2, 2, 3, 4, dtype=torch.float64)  # an all-zero reference: absolute error
    assert relative_error(zero + 1e-7, zero) == pytest.approx(1e-7 * math.sqrt(12))
    nan = noisy.clone()
    nan[0, 0, 0, 0] = math.nan
    assert not check_close(nan, ref, noisy, torch.float32)[0]
    assert check_close(ref, ref, ref, torch.float32) == (True, 0.0, 1e-5)


def test_split_full_first():
    kind = torch.tensor([[[1, 2, 0, 1, 3]]], dtype=torch.int32)  # [M=1, Tq=1, Tk=5]
    q_list = torch.tensor([[[0, 1, 3, 4, -1]]], dtype=torch.int32)
    q_count = torch.tensor([[4]], dtype=torch.int32)
    lists, full = split_full_first(kind, q_list, q_count)
    assert lists.tolist() == [[[0, 3, 1, 4, 0]]]
    assert full.tolist() == [[2]]


def test_forward_config_table():
    for d in HEAD_DIMS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            cfg = forward_config(d, dtype)
            assert cfg.block_m >= 16 and cfg.block_n >= 16
    with pytest.raises(CompileMaskError, match="head_dim=80"):
        forward_config(80, torch.float16)


@pytest.mark.parametrize("host_sync", [True, False], ids=["cpu-build", "device-build"])
def test_static_and_dynamic_span_paths(host_sync):
    """Interval tiles are masked by an unrolled loop of MAX_SPAN slots; a device-style build
    (no bitmasks) of a dilated mask has wider tiles and takes the loop of run-time length."""
    from compilemask.compiler.pipeline import build_plan
    from compilemask.kernels.triton.common import mask_constants

    mask = cm.masks.dilated(40, 3) | cm.masks.clear((6, 20), 3, 30)
    plan = build_plan(mask, 150, 150, None, None, 16, 32, DEVICE, host_sync=host_sync, source="")
    s = plan.tiles(16, 32)
    span, slots, has_bits = mask_constants(s.kind, s.jlo, s.jhi, plan.row_lo.shape[-1])
    assert slots == 0  # many slots per row: masked from the tiles' slot ranges
    if host_sync:
        assert 1 < span <= 8 and has_bits
    else:
        assert span == -1
    q, k, v = _inputs(1, 2, 2, 150, 150, 32, torch.float16)
    _assert_matches(_run_triton(q, k, v, plan, (16, 32)), q, k, v, plan)


def test_tile_grid_plan_through_the_kernel():
    """A tile_grid plan: the kernel runs in tiled order, the answer comes in the original one."""
    mask = cm.masks.clear((6, 8), 3, 16)
    plan = cm.compile(mask, 64, device=DEVICE)
    tiled = cm.compile(cm.masks.tile_grid(mask, (2, 4)), 64, device=DEVICE)
    q, k, v = _inputs(1, 2, 2, 64, 64, 32, torch.float16)
    out, lse = _run_triton(q, k, v, tiled, (16, 32), return_lse=True)
    _assert_matches(out, q, k, v, plan)
    _assert_lse(lse, q, k, v, plan)


def test_bits_plan_with_a_16_key_tiling():
    """A bits-only plan (from_dense) through the kernel at BLOCK_N = 16 (half a bit word)."""
    d = torch.ones(64, 64, dtype=torch.bool).tril()
    d[:, ::2] = False
    plan = cm.from_dense(d, device=DEVICE)
    assert plan.encoding == "bits"
    q, k, v = _inputs(1, 1, 1, 64, 64, 32, torch.float16)
    _assert_matches(_run_triton(q, k, v, plan, (16, 16)), q, k, v, plan)


@pytest.mark.parametrize(
    "name, mask, n, slots",
    [
        ("causal", cm.masks.causal(), 70, 1),
        ("window_globals", cm.masks.global_local(9, [0, 33]), 70, None),
        ("hstu", cm.masks.hstu([30, 25, 15], [3, 2, 4], contextual=2), 70, None),
        ("bits", None, 70, 0),
    ],
)
def test_preloaded_slots_path(name, mask, n, slots):
    """Plans with at most 4 slots per row (and no bitmask tile) are masked from intervals
    loaded once per q-tile (SLOTS > 0); from_dense bits plans never take that path."""
    from compilemask.kernels.triton.common import MAX_PRELOAD_SLOTS, mask_constants

    if mask is None:  # a bits plan: every PARTIAL tile is a bitmask tile
        g = torch.Generator().manual_seed(3)
        plan = cm.from_dense(torch.rand(n, n, generator=g) < 0.5)
    else:
        plan = cm.compile(mask, n)
    s = plan.tiles(16, 32)
    k = plan.row_lo.shape[-1]
    got = mask_constants(s.kind, s.jlo, s.jhi, k)[1]
    assert got == (slots if slots is not None else (k if k <= MAX_PRELOAD_SLOTS else 0))
    if mask is not None:
        assert got > 0
    plan = plan.to(DEVICE)
    q, k_, v = _inputs(1, 2, 2, n, n, 32, torch.float16)
    _assert_matches(_run_triton(q, k_, v, plan, (16, 32)), q, k_, v, plan)


def test_plan_dependent_configs():
    """D=128 16-bit: dense plans (tile efficiency >= 0.94 at 128x128) get 128x128 forward
    tiles; plans of bitmask tiles at least half visible 128x64; the rest 64x64 (sweeps in
    configs.py)."""
    from compilemask.kernels.triton.configs import (
        backward_config,
        forward_config,
        has_bitmask_tiles,
        tile_efficiency_128,
    )

    clear = cm.masks.clear((32, 32), 16, 64)
    tiled = cm.compile(cm.tile_grid(clear, (8, 16)), 1088)
    eff_t = tile_efficiency_128(tiled)
    assert has_bitmask_tiles(tiled) and eff_t >= 0.5
    assert not has_bitmask_tiles(cm.compile(cm.masks.causal(), 64))

    def tiles(*args):
        cfg = forward_config(128, torch.bfloat16, None, *args)
        return cfg.block_m, cfg.block_n

    assert tiles(eff_t, True) == (64, 64)  # bitmask plans: the masked tiling at every size
    assert tiles(eff_t, False) == (64, 64)
    assert tiles(0.3, True) == (64, 64)
    assert tiles(0.995, True) == (64, 64)  # never the dense tiling with bitmask tiles
    assert tiles(0.995, False) == (128, 128)
    assert tiles(0.945, False) == (128, 128)  # shared_prompt at 16K and 32K
    assert tiles(0.9, False) == (64, 64)

    causal = cm.compile(cm.masks.causal(), 8192)
    sparse = cm.compile(cm.masks.clear((16, 16), 3, 8), 264)
    eff_c, eff_s = tile_efficiency_128(causal), tile_efficiency_128(sparse)
    assert eff_c > 0.98 and eff_s < 0.5
    assert tile_efficiency_128(causal) == eff_c  # cached
    assert forward_config(128, torch.bfloat16, None, eff_c).block_m == 128
    assert forward_config(128, torch.bfloat16, None, eff_s).block_m == 64
    assert forward_config(128, torch.float32, None, eff_c).block_m == 64
    assert forward_config(64, torch.bfloat16, None, eff_c) == forward_config(64, torch.bfloat16)
    # the backward takes one tiling whatever the plan; dQ at the dK/dV tiling, so that dQ can
    # come from the stored dS tiles
    want = backward_config(128, torch.bfloat16)
    assert (want.dkdv_block_m, want.dkdv_block_n, want.dq_block_m, want.dq_block_n) == (
        64, 64, 64, 64,
    ) and want.ds_dq == 1  # fmt: skip


def test_compiled_before_eager_reads_nothing_back():
    """A compiled call on a fresh plan reads nothing back while tracing (no plan-dependent
    constant enters the graph: it runs the class-free configuration); after an eager call
    has recorded the plan's shape class, compiled calls run what eager runs."""
    torch._dynamo.reset()
    plan = cm.compile(cm.masks.prefix_lm(256), 256, device=DEVICE, cache=False)  # all visible
    q, k, v = _inputs(1, 1, 1, 256, 256, 128, torch.float16)
    f = torch.compile(lambda q, k, v: cm.attention(q, k, v, plan, backend="triton"),
                      fullgraph=True, backend="aot_eager")  # fmt: skip
    _assert_matches(f(q, k, v), q, k, v, plan)
    assert "tile_efficiency_128" not in plan._cache and plan.shape_class == ()
    eager = cm.attention(q, k, v, plan, backend="triton")
    assert plan._cache["tile_efficiency_128"] == 1.0
    assert torch.equal(f(q, k, v), eager)


def test_compiled_calls_do_not_consult_the_dispatch_cache(monkeypatch):
    """Under torch.compile the per-plan dispatch cache is neither read nor written, and the
    registry state it keys on is not traced (torch 2.11's Dynamo cannot trace ``id()`` of the
    registry's dict)."""
    from compilemask.kernels import registry

    def not_while_compiling(impl, _state=registry.dispatch_state):
        assert not torch.compiler.is_compiling(), "dispatch_state traced under torch.compile"
        return _state(impl)

    monkeypatch.setattr(registry, "dispatch_state", not_while_compiling)
    torch._dynamo.reset()
    plan = cm.compile(cm.masks.causal(), 128, device=DEVICE, cache=False)
    q, k, v = _inputs(1, 1, 1, 128, 128, 64, torch.float16)
    f = torch.compile(lambda q, k, v: cm.attention(q, k, v, plan, backend="triton"),
                      fullgraph=True, backend="aot_eager")  # fmt: skip
    _assert_matches(f(q, k, v), q, k, v, plan)
    assert not any(isinstance(key, tuple) and key[:1] == ("api.dispatch",) for key in plan._cache)


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("order,tma", [(3, 1), (0, 0), (1, 1)])
def test_prefetched_work_entries(mask_name, order, tma):
    """``FwdConfig.prefetch`` (the q-tile, counts and first tile of each loop read from the
    schedule's work list): same results as the reference, LSE included, in both launch orders
    that read it, and ignored in natural order (1)."""
    Nq, Nk = 150, 150 if mask_name in ("document", "shared_prompt") else 130  # fixed lengths
    plan = cm.compile(MASKS[mask_name](), Nq, Nk, device=DEVICE)
    q, k, v = _inputs(1, 2, 1, Nq, Nk, 32, torch.float16, seed=6)
    cfg = FwdConfig(16, 32, 4, 2, order, tma=tma, prefetch=1)
    with override_forward_config(cfg):
        out, lse = cm.attention(q, k, v, plan, backend="triton", return_lse=True)
    _assert_matches(out, q, k, v, plan)
    _assert_lse(lse, q, k, v, plan)


@pytest.mark.parametrize(
    "mask",
    [
        cm.masks.shared_prompt(24, [40, 40, 26]),  # 2 slots
        cm.masks.shared_prompt(4, [3, 40, 40, 43]),  # prompt and a response in one tile
        cm.masks.sliding_window(20) | cm.masks.prefix_lm(5),
        cm.masks.hstu([60, 70], [5, 9], contextual=3),
        cm.masks.global_local(6, [0, 70]),  # 3 slots: global, local window, global
    ],
    ids=["shared_prompt", "shared_prompt_tight", "window_prefix", "hstu", "global_local"],
)
@pytest.mark.parametrize("block_n", [16, 32])
def test_one_slot_mask(mask, block_n):
    """``FwdConfig.one_slot``: where no row has two intervals in one kv-tile
    (``one_interval_per_tile``, checked here against the dense mask) the PARTIAL tiles are
    masked from one slot per row; elsewhere the flag is ignored. Same results as the reference
    either way, LSE included."""
    from compilemask.kernels.triton.common import one_interval_per_tile

    N = 130
    plan = cm.compile(mask, N, device=DEVICE)
    dense = plan.to_dense().cpu()  # [N, N] bool
    lo, hi = plan.row_lo.cpu(), plan.row_hi.cpu()
    tiles = -(-N // block_n)
    runs = 0  # rows with two intervals in one tile, counted from the dense mask
    for t in range(tiles):
        block = dense[:, t * block_n : (t + 1) * block_n].to(torch.int8)
        starts = (block[:, 1:] > block[:, :-1]).sum(1) + block[:, 0]
        runs += int((starts > 1).sum())
    assert one_interval_per_tile(lo, hi, block_n) == (runs == 0)
    q, k, v = _inputs(1, 2, 1, N, N, 32, torch.float16, seed=7)
    with override_forward_config(FwdConfig(16, block_n, 4, 2, 3, tma=1, prefetch=1, one_slot=1)):
        out, lse = cm.attention(q, k, v, plan, backend="triton", return_lse=True)
    _assert_matches(out, q, k, v, plan)
    _assert_lse(lse, q, k, v, plan)


def test_work_list_entries():
    """``schedule.work_list``: entry r is (t, count, full_count, list[0], list[full_count])
    of the tile t = order[r], zeros where a tile touches nothing or has no PARTIAL tile."""
    from compilemask.kernels.triton.schedule import forward_schedule

    plan = cm.compile(cm.masks.shared_prompt(20, [30, 27]), 77, device=DEVICE)
    s = forward_schedule(plan, 16, 16, bits=True)
    work = s["q_work"]
    M, Tq = s["q_order"].shape
    assert work.shape == (M, Tq, 8) and work.dtype == torch.int32
    for m in range(M):
        for r in range(Tq):
            t = int(s["q_order"][m, r])
            count, full = int(s["q_count"][m, t]), int(s["q_full_count"][m, t])
            first = int(s["q_list"][m, t, 0]) if count else 0
            part = int(s["q_list"][m, t, full]) if full < count else 0
            assert work[m, r].tolist() == [t, count, full, first, part, 0, 0, 0]
    assert (s["q_count"] > s["q_full_count"]).any() and (s["q_full_count"] > 0).any()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_fullgraph_compile_of_a_fresh_bitmask_plan(head_dim):
    """A ``from_dense`` plan (bitmask tiles) compiles with fullgraph=True on its first use,
    forward and backward: the number of its bitmask tiles, data-dependent while tracing, is
    never branched on (GuardOnDataDependentSymNode in the schedule)."""
    torch._dynamo.reset()
    dense = torch.rand(150, 150, generator=torch.Generator().manual_seed(1)) < 0.3
    plan = cm.from_dense(dense.to(DEVICE))
    q, k, v = _inputs(1, 2, 1, 150, 150, head_dim, torch.float16, seed=8)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    f = torch.compile(
        lambda q, k, v: cm.attention(q, k, v, plan, backend="triton"),
        fullgraph=True,
        backend="aot_eager",
    )
    out = f(q, k, v)
    _assert_matches(out.detach(), q.detach(), k.detach(), v.detach(), plan)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(cm.attention(q, k, v, plan, backend="triton"), (q, k, v), do)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("tile_builder_on", [False, True], ids=["tensor-builder", "triton-builder"])
@pytest.mark.parametrize("mask", [cm.masks.natten2d((8, 8), (5, 5)), cm.masks.causal()], ids=str)
def test_fullgraph_compile_of_a_fresh_plan(mask, tile_builder_on):
    """A fresh plan compiles with fullgraph=True on its first use, also with the Triton tile
    builder registered (the CUDA default): while tracing, schedules come from tensor
    operations, and plans with 5 intervals per row keep interval tiles (no host read)."""
    from compilemask.kernels.triton import tile_builder

    torch._dynamo.reset()
    with tile_builder.using(tile_builder_on):
        plan = cm.compile(mask, 64, device=DEVICE, cache=False)
        q, k, v = _inputs(1, 2, 2, 64, 64, 32, torch.float16, seed=4)
        f = torch.compile(
            lambda q, k, v: cm.attention(q, k, v, plan, backend="triton"),
            fullgraph=True,
            backend="aot_eager",
        )
        _assert_matches(f(q, k, v), q, k, v, plan)


@pytest.mark.parametrize(
    "head_dim, dynamic", [(128, False), (32, True)], ids=["d128-16bit", "dynamic-shapes"]
)
def test_fullgraph_compile_of_a_fresh_tile_grid_plan(head_dim, dynamic):
    """A fresh tile_grid plan under fullgraph torch.compile: at D=128 in 16 bits the tile
    efficiency is read while tracing (once from a plan copy made inside the trace: Dynamo gave
    the constant function an object without fields), and with dynamic shapes the default scale
    is symbolic (once checked twice: ``math.isfinite`` of a SymFloat)."""
    torch._dynamo.reset()
    mask = cm.tile_grid(cm.masks.clear((8, 8), 3, 16), (4, 4))
    plan = cm.compile(mask, 80, device=DEVICE, cache=False)
    q, k, v = _inputs(1, 2, 2, 80, 80, head_dim, torch.float16, seed=6)
    f = torch.compile(
        lambda q, k, v: cm.attention(q, k, v, plan, backend="triton"),
        fullgraph=True,
        backend="aot_eager",
        dynamic=dynamic,
    )
    _assert_matches(f(q, k, v), q, k, v, plan)


@pytest.mark.skipif(DEVICE != "cpu", reason="Triton's interpreter runs on the CPU only")
def test_bfloat16_in_the_interpreter_uses_the_reference_or_is_refused():
    """The interpreter computes bfloat16 dots wrongly (errors ~1e9): "auto" runs the reference
    for bf16 on the CPU, "triton" refuses it with a clear error."""
    plan = cm.compile(cm.masks.causal(), 40)
    q, k, v = _inputs(1, 2, 2, 40, 40, 32, torch.bfloat16)
    want = cm.attention(q, k, v, plan, backend="reference")
    assert torch.equal(cm.attention(q, k, v, plan), want)
    with pytest.raises(cm.CompileMaskError, match="bfloat16"):
        cm.attention(q, k, v, plan, backend="triton")


def test_kernels_get_bitmask_tiles_at_the_plans_own_tiling():
    """A GPU-style build (no bitmask tiles, nothing read back) run at its own tiling: the
    attention call asks for bitmask tiles (else wide interval tiles take the slow loop over
    all their intervals: 97-150 ms against 3.4 for clear through tile_grid at 32K on an H200)."""
    from compilemask.compiler.pipeline import build_plan
    from compilemask.kernels.triton.common import mask_constants

    mask = cm.tile_grid(cm.masks.clear((8, 16), 5, 20), (4, 8))
    plan = build_plan(
        mask, 148, 148, None, None, 32, 64, torch.device(DEVICE), host_sync=False, source="t"
    )
    own = plan.schedule
    assert own.bits.shape[0] == 0
    assert mask_constants(own.kind, own.jlo, own.jhi, plan.row_lo.shape[-1])[0] != 0
    q, k, v = _inputs(1, 2, 2, 148, 148, 32, torch.float16)
    out = _run_triton(q, k, v, plan, (32, 64, 1))
    _assert_matches(out, q, k, v, plan)
    got = plan._cache[("tiles", 32, 64)]  # built by the attention call
    assert got.bits.shape[0] > 0 and torch.equal(got.pairs, own.pairs)
    assert plan.tiles(32, 64) is own and plan.tiles(32, 64, bits=True) is got


def _gpu_style_plan(mask, n, bm, bn):
    from compilemask.compiler.pipeline import build_plan

    dev = torch.device(DEVICE)
    return build_plan(mask, n, n, None, None, bm, bn, dev, host_sync=False, source="t")


@pytest.mark.parametrize("first", ["eager", "compiled"])
def test_bitmask_schedules_with_torch_compile(monkeypatch, first):
    """Tracing cannot read back, so a compiled first call runs interval tiles and keeps no
    schedule; an eager call then builds the bitmask schedule, which later compiled calls use
    (at the plan's own tiling 32x64 and at a derived one, 64x32)."""
    import compilemask.kernels.triton.forward as forward_mod
    from compilemask.kernels.triton.common import mask_constants

    seen = []
    launch = forward_mod.attention_forward

    def spy(q, k, v, lo, hi, s, **kw):
        seen.append(mask_constants(s["kind"], s["jlo"], s["jhi"], lo.shape[-1])[2])
        return launch(q, k, v, lo, hi, s, **kw)

    monkeypatch.setattr(forward_mod, "attention_forward", spy)
    mask = cm.tile_grid(cm.masks.clear((8, 16), 5, 20), (4, 8))
    q, k, v = _inputs(1, 2, 1, 148, 148, 32, torch.float16)
    for tiling in ((32, 64), (64, 32)):
        torch._dynamo.reset()
        seen.clear()
        plan = _gpu_style_plan(mask, 148, 32, 64)

        def run(q, k, v, plan=plan):
            return cm.attention(q, k, v, plan, backend="triton")

        compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
        with override_forward_config(FwdConfig(*tiling, 4, 1)):
            calls = [run, compiled] if first == "eager" else [compiled, run, compiled]
            for f in calls:
                _assert_matches(f(q, k, v), q, k, v, plan)
        # HAS_BITS: 0 = interval tiles only; the eager call and every call after it: bitmasks
        assert seen[0 if first == "eager" else 1] > 0, (tiling, seen)
        assert seen[-1] > 0, (tiling, seen)


def test_gpu_build_slot_bound_is_not_the_row_count():
    """A GPU build keeps the static bound of intervals per row (6 here); after the kernels'
    first read of the plan the configuration uses the largest row's count (1)."""
    from compilemask.kernels.triton.configs import has_bitmask_tiles, tile_efficiency_128

    causal, prefix = cm.masks.causal(), cm.masks.prefix_lm
    m = (causal | prefix(3)) | (causal | prefix(5)) | (causal | prefix(7))
    plan = _gpu_style_plan(m, 512, 128, 128)
    assert plan.row_lo.shape[-1] > 4 and int(plan.row_count.max()) == 1
    tile_efficiency_128(plan)
    assert not has_bitmask_tiles(plan)
    assert plan.tiles(128, 128, bits=True) is plan.schedule  # no rebuild


def test_return_lse_must_be_a_bool(small):
    q, k, v, plan = small
    with pytest.raises(InputError, match="return_lse must be True or False"):
        cm.attention(q, k, v, plan, return_lse="yes")


def test_check_plan_must_be_a_bool(small):
    """A truthy string or 1 was taken as True, and "no" as well."""
    q, k, v, plan = small
    for bad in ("no", 1, None):
        with pytest.raises(InputError, match="check_plan must be True or False"):
            cm.attention(q, k, v, plan, check_plan=bad, backend="reference")


def test_explain_names_the_reference_for_dual_inputs(small):
    q, k, v, plan = small
    with forward_ad.dual_level():
        qd = forward_ad.make_dual(q, torch.randn_like(q))
        info = cm.explain(plan, qd, k, v)
    assert info["backend"] == "reference" and "tangent" in info["reason"]
