"""Backward attention over compiled plans: Triton kernels (interpreter on the CPU) vs reference.

On a machine without CUDA conftest.py sets TRITON_INTERPRET=1 before Triton is imported, so the
kernels run in Triton's interpreter on CPU tensors (fp16 and fp32: the interpreter computes bf16
dots wrongly). With CUDA the same tests run compiled on the GPU, bf16 included. dq, dk and dv
must each pass the correctness measure of docs/design.md (``compilemask.testing.check_close``)
against the float64 reference backward; the reference backward itself is checked against torch
autograd of a dense float64 masked softmax.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import pytest
import torch

triton = pytest.importorskip("triton", reason="the Triton kernels need triton installed")

import compilemask as cm  # noqa: E402
from compilemask.errors import InputError  # noqa: E402
from compilemask.kernels.reference import kernel as reference_mod  # noqa: E402
from compilemask.kernels.reference import (  # noqa: E402
    reference_attention,
    reference_attention_backward,
)
from compilemask.kernels.triton.backward import attention_backward  # noqa: E402
from compilemask.kernels.triton.configs import (  # noqa: E402
    GRID_ORDERS,
    SUPPORTED_HEAD_DIMS,
    BwdConfig,
    FwdConfig,
    backward_config,
    override_backward_config,
    override_forward_config,
)
from compilemask.kernels.triton.forward import attention_forward  # noqa: E402
from compilemask.kernels.triton.schedule import (  # noqa: E402
    dkdv_schedule,
    ds_slots,
    forward_schedule,
)
from conftest import DEVICE, DTYPES, kernel_masks, qkv  # noqa: E402
from conftest import assert_grads_close as _assert_grads  # noqa: E402

pytestmark = pytest.mark.kernel
# Small tiles so that small lengths give many tiles; dK/dV and dQ use different tilings
# (BLOCK_N % 32 == 0: bitmask tiles, and bits-only plans, need it).
BWD_TILES = {
    "16x32/32x32": BwdConfig(16, 32, 4, 1, 32, 32, 4, 1),
    # the plan's heaviest-first orders: heads fastest (dK/dV), tiles fastest (dQ)
    "32x64/16x32": BwdConfig(32, 64, 4, 1, 16, 32, 4, 1, dkdv_order=0, dq_order=3),
    # dQ from the dS tiles stored by the dK/dV kernel (16-bit; fp32 runs the dQ kernel)
    "ds-16x32": BwdConfig(16, 32, 4, 1, 16, 32, 4, 1, dq_order=3, ds_dq=1),
}
SMALL = BWD_TILES["16x32/32x32"]
FWD_CFG = FwdConfig(16, 32, 4, 1)

MASKS = kernel_masks(100)
_inputs = functools.partial(qkv, grad_output=True)  # q, k, v, do


def _mask_strides(plan):
    heads = plan.heads or 1
    return (heads if plan.batch else 0), (1 if plan.heads else 0)


def _triton_grads(q, k, v, do, plan, cfg=SMALL, *, scale=None, dlse=None, edit=None):
    """Forward and backward kernels launched directly, into NaN-poisoned output buffers
    (``edit(s1, s2)``: a change to the dK/dV and dQ schedules before the backward)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    msb, msh = _mask_strides(plan)
    out, lse = attention_forward(
        q, k, v, plan.row_lo, plan.row_hi, forward_schedule(plan, FWD_CFG.block_m, FWD_CFG.block_n),
        scale=scale, mask_stride_b=msb, mask_stride_h=msh, cfg=FWD_CFG,
    )  # fmt: skip
    dq, dk, dv = (torch.full_like(t, math.nan) for t in (q, k, v))
    s1 = dkdv_schedule(plan, cfg.dkdv_block_m, cfg.dkdv_block_n)
    s2 = forward_schedule(plan, cfg.dq_block_m, cfg.dq_block_n)
    slots = None
    if cfg.ds_dq:  # the buffer's slots per head: the most touched dQ tiles of one mask
        slots = ds_slots(s1["kind"])
        cfg = replace(cfg, ds_dq=int((s2["kind"] != 0).flatten(1).sum(1).max()))
    if edit is not None:
        edit(s1, s2)
    attention_backward(
        q, k, v, out, lse, do, plan.row_lo, plan.row_hi, s1, s2,
        scale=scale, mask_stride_b=msb, mask_stride_h=msh, cfg=cfg, dlse=dlse,
        dq=dq, dk=dk, dv=dv, ds_slots=slots,
    )  # fmt: skip
    return dq, dk, dv


# ---------------------------------------------------------------- kernels vs reference


@pytest.mark.parametrize("tiles", list(BWD_TILES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_masks(mask_name, dtype, tiles):
    Nq, Nk = 100, 100
    plan = cm.compile(MASKS[mask_name](), Nq, Nk, device=DEVICE)
    q, k, v, do = _inputs(1, 2, 1, Nq, Nk, 32, dtype)
    grads = _triton_grads(q, k, v, do, plan, BWD_TILES[tiles])
    _assert_grads(grads, q, k, v, do, plan)


def test_bitmask_tiles_are_exercised():
    plan = cm.compile(MASKS["dilated_bits"](), 100, device=DEVICE)
    for bm, bn in ((SMALL.dkdv_block_m, SMALL.dkdv_block_n), (16, 32)):
        kinds = plan.tiles(bm, bn).kind
        if DEVICE == "cpu":
            assert bool((kinds == 3).any()), "expected PARTIAL_BITS tiles"


@pytest.mark.parametrize(
    "tiled, cfg, mode",
    [
        (False, SMALL, 1),
        (True, BwdConfig(32, 64, 4, 1, 32, 64, 4, 1), 2),
    ],
)
def test_bitmask_modes(tiled, cfg, mode):
    """Both masking modes with bitmask tiles (HAS_BITS 1: a branch per tile between intervals
    and bits; 2: bits only), in dK/dV (transposed bitmasks) and dQ."""
    from compilemask.kernels.triton.common import mask_constants

    mask = cm.masks.clear((8, 16), 5, 20)
    plan = cm.compile(cm.tile_grid(mask, (4, 8)) if tiled else mask, 148, device=DEVICE)
    for bm, bn in ((cfg.dkdv_block_m, cfg.dkdv_block_n), (cfg.dq_block_m, cfg.dq_block_n)):
        s = plan.tiles(bm, bn)
        assert mask_constants(s.kind, s.jlo, s.jhi, plan.row_lo.shape[-1])[2] == mode
    q, k, v, do = _inputs(1, 2, 1, 148, 148, 32, torch.float16)
    if not tiled:  # the kernels launched directly
        _assert_grads(_triton_grads(q, k, v, do, plan, cfg), q, k, v, do, plan)
        return
    # a tile_grid plan: through the autograd function, which permutes the tokens
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    with override_forward_config(FwdConfig(32, 64, 4, 1)), override_backward_config(cfg):
        out = cm.attention(q, k, v, plan, backend="triton")
        (out.float() * do.float()).sum().backward()
    _assert_grads((q.grad, k.grad, v.grad), q, k, v, do, plan)


def test_transposed_bits_are_the_transpose():
    from compilemask.compiler.tiles import unpack_bits
    from compilemask.kernels.triton.schedule import transposed_bits

    g = torch.Generator().manual_seed(5)
    for bm, bn in ((16, 32), (64, 64), (40, 48)):
        bits = torch.randint(-(2**31), 2**31 - 1, (3, bm, -(-bn // 32)), generator=g)
        bits = bits.to(torch.int32)
        if bn % 32:  # pack_bits leaves the padding bits of a last partial word zero
            bits[..., -1] &= (1 << (bn % 32)) - 1
        t = transposed_bits(bits, bm, bn)
        assert t.shape == (3, bn, -(-bm // 32))
        dense = unpack_bits(bits)[..., :bn]
        assert torch.equal(unpack_bits(t)[..., :bm], dense.transpose(1, 2))
        assert transposed_bits(bits, bm, bn) is t  # cached while bits lives


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_head_dims(head_dim):
    Nq, Nk = (40, 56) if head_dim <= 128 else (24, 40)
    plan = cm.compile(cm.masks.sliding_window(17), Nq, Nk, device=DEVICE)
    q, k, v, do = _inputs(1, 2, 1, Nq, Nk, head_dim, torch.float16, seed=head_dim)
    _assert_grads(_triton_grads(q, k, v, do, plan), q, k, v, do, plan)


@pytest.mark.parametrize("hkv", [2, 1], ids=["gqa", "mqa"])
@pytest.mark.parametrize("lengths", [(50, 90), (90, 50)], ids=["q<kv", "q>kv"])
def test_gqa_and_unequal_lengths(hkv, lengths):
    Nq, Nk = lengths
    plan = cm.compile(cm.masks.prefix_lm(9) | cm.masks.sliding_window(33), Nq, Nk, device=DEVICE)
    q, k, v, do = _inputs(2, 4, hkv, Nq, Nk, 64, torch.float16, seed=hkv)
    grads = _triton_grads(q, k, v, do, plan, SMALL, scale=0.3)
    _assert_grads(grads, q, k, v, do, plan, scale=0.3)


def test_per_batch_plan():
    mask = cm.masks.per_batch([cm.masks.causal(), cm.masks.sliding_window(9), cm.masks.chunked(16)])
    plan = cm.compile(mask, 60, 60, batch=3, device=DEVICE)
    q, k, v, do = _inputs(3, 2, 1, 60, 60, 32, torch.float16)
    _assert_grads(_triton_grads(q, k, v, do, plan), q, k, v, do, plan)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_per_head_plan_within_gqa_groups(dtype):
    # The heads of one GQA group have different masks: one dK/dV program walks all of them.
    masks = [
        cm.masks.causal(),
        cm.masks.sliding_window(5),
        cm.masks.document([20, 40]),
        cm.masks.dilated(12, 2),
    ]
    plan = cm.compile(cm.masks.per_head(masks), 60, 60, heads=4, device=DEVICE)
    q, k, v, do = _inputs(2, 4, 2, 60, 60, 32, dtype)
    _assert_grads(_triton_grads(q, k, v, do, plan), q, k, v, do, plan)


def _dense_with_empty_rows_and_cols(Nq, Nk, seed=0):
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(Nq, Nk, generator=g) < 0.3
    dense[::7] = False  # rows that see nothing
    dense[20:40] = False  # a whole q-tile that sees nothing
    dense[:, ::5] = False  # keys nobody sees
    dense[:, 64:96] = False  # a whole kv-tile nobody sees
    return dense


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_empty_rows_and_unseen_keys_get_exact_zeros(dtype):
    dense = _dense_with_empty_rows_and_cols(77, 99)
    plan = cm.from_dense(dense.to(DEVICE), block_m=16, block_n=32)
    q, k, v, do = _inputs(1, 2, 2, 77, 99, 64, dtype)
    dq, dk, dv = _triton_grads(q, k, v, do, plan)
    empty_rows = ~dense.any(-1).to(DEVICE)
    unseen_keys = ~dense.any(0).to(DEVICE)
    assert bool((dq[:, :, empty_rows] == 0).all())
    assert bool((dk[:, :, unseen_keys] == 0).all()) and bool((dv[:, :, unseen_keys] == 0).all())
    _assert_grads((dq, dk, dv), q, k, v, do, plan)


def test_mask_that_sees_nothing():
    plan = cm.from_dense(torch.zeros(33, 45, dtype=torch.bool, device=DEVICE))
    q, k, v, do = _inputs(1, 2, 1, 33, 45, 32, torch.float16)
    for grad in _triton_grads(q, k, v, do, plan):
        assert bool((grad == 0).all())


def test_lse_gradient():
    plan = cm.compile(cm.masks.document([30, 17, 43]), 90, 90, device=DEVICE)
    q, k, v, do = _inputs(1, 2, 1, 90, 90, 32, torch.float32, seed=5)
    dlse = torch.randn(1, 2, 90, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = _triton_grads(q, k, v, do, plan, dlse=dlse)
    _assert_grads(grads, q, k, v, do, plan, dlse=dlse)


def test_deterministic():
    plan = cm.compile(MASKS["window_prefix"](), 80, 80, device=DEVICE)
    q, k, v, do = _inputs(1, 4, 1, 80, 80, 32, torch.float16, seed=3)
    first = _triton_grads(q, k, v, do, plan)
    second = _triton_grads(q, k, v, do, plan)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_strided_inputs_and_grad_output():
    Nq = 50
    plan = cm.compile(cm.masks.causal(), Nq, device=DEVICE)
    base = torch.randn(1, Nq, 3, 2, 64, device=DEVICE, dtype=torch.float16)  # BSHD, packed qkv
    q, k, v = (base[:, :, i].transpose(1, 2) for i in range(3))
    do = torch.randn(1, Nq, 2, 64, device=DEVICE, dtype=torch.float16).transpose(1, 2)
    grads = _triton_grads(q, k, v, do, plan)
    q, k, v, do = (t.contiguous() for t in (q, k, v, do))
    _assert_grads(grads, q, k, v, do, plan)


def test_backward_config_table():
    for d in SUPPORTED_HEAD_DIMS:
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            cfg = backward_config(d, dtype)
            assert min(cfg.dkdv_block_m, cfg.dkdv_block_n, cfg.dq_block_m, cfg.dq_block_n) >= 16
            assert len(cfg.as_list()) == 13
            assert cfg.dkdv_order in GRID_ORDERS and cfg.dq_order in GRID_ORDERS


# ---------------------------------------------------------------- reference backward


def _dense_autograd(q, k, v, dense, scale, do, dlse):
    """Gradients of a dense float64 masked softmax by torch autograd (GQA by repetition)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    s = (q @ kk.transpose(-1, -2) * scale).masked_fill(~dense, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = p @ vv
    (out * do).sum().add_((torch.where(torch.isinf(lse), 0.0, lse) * dlse).sum()).backward()
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("hkv", [1, 2])
def test_reference_backward_matches_dense_autograd(monkeypatch, hkv):
    monkeypatch.setattr(reference_mod, "_CHUNK_ELEMENTS", 4 * 4 * 50)  # force many chunks
    dense = _dense_with_empty_rows_and_cols(45, 50, seed=3)
    plan = cm.from_dense(dense)
    q, k, v, do = (t.double().cpu() for t in _inputs(2, 4, hkv, 45, 50, 32, torch.float32))
    dlse = torch.randn(2, 4, 45, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    got = reference_attention_backward(q, k, v, plan, do, 0.2, dlse=dlse)
    want = _dense_autograd(q, k, v, dense, 0.2, do, dlse)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_reference_forward_autograd_agrees_with_reference_backward(monkeypatch):
    monkeypatch.setattr(reference_mod, "_CHUNK_ELEMENTS", 2 * 4 * 40)  # force many chunks
    plan = cm.compile(cm.masks.sliding_window(7) | cm.masks.prefix_lm(3), 40, 40)
    q, k, v, do = (t.double() for t in _inputs(1, 4, 2, 40, 40, 32, torch.float32))
    q, k, v = (t.cpu().requires_grad_(True) for t in (q, k, v))
    out, lse = reference_attention(q, k, v, plan, 0.3)
    dlse = torch.randn_like(lse)
    finite = torch.isfinite(lse)
    (out * do.cpu()).sum().add_((lse[finite] * dlse[finite]).sum()).backward()
    want = reference_attention_backward(
        q.detach(), k.detach(), v.detach(), plan, do.cpu(), 0.3, dlse=dlse * finite
    )
    for g, w in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(g, w)


# ---------------------------------------------------------------- autograd


def _autograd_grads(
    q, k, v, do, plan, *, backend="triton", dlse=None, compiled=False, bwd_cfg=SMALL
):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

    def f(q, k, v):
        return cm.attention(q, k, v, plan, backend=backend, return_lse=True)

    if compiled:
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    with override_forward_config(FWD_CFG), override_backward_config(bwd_cfg):
        out, lse = f(q, k, v)
        loss = (out.float() * do.float()).sum()
        if dlse is not None:
            loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * dlse).sum()
        loss.backward()
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_autograd_triton(dtype):
    plan = cm.compile(MASKS["window_prefix"](), 70, 90, device=DEVICE)
    q, k, v, do = _inputs(1, 4, 2, 70, 90, 32, dtype, seed=7)
    dlse = torch.randn(1, 4, 70, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    grads = _autograd_grads(q, k, v, do, plan, dlse=dlse)
    _assert_grads(grads, q, k, v, do, plan, dlse=dlse)


def test_autograd_triton_lse_only():
    """Only lse is used: the eager Function (gradients not materialised) gets dout = None and
    must still give the gradients of the lse term alone."""
    plan = cm.compile(MASKS["window_prefix"](), 70, 90, device=DEVICE)
    q, k, v, _ = _inputs(1, 4, 2, 70, 90, 32, torch.float16, seed=8)
    dlse = torch.randn(1, 4, 70, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    with override_forward_config(FWD_CFG), override_backward_config(SMALL):
        _, lse = cm.attention(qg, kg, vg, plan, backend="triton", return_lse=True)
        (torch.where(torch.isinf(lse), 0.0, lse) * dlse).sum().backward()
    do = torch.zeros_like(q)
    _assert_grads((qg.grad, kg.grad, vg.grad), q, k, v, do, plan, dlse=dlse)


def test_ds_dq_replaces_the_dq_kernel(monkeypatch):
    """With ``ds_dq`` the recomputing dQ kernel never runs: dQ comes from the stored dS."""
    from compilemask.kernels.triton import backward as bwd

    class _Refuse:
        def __getitem__(self, grid):
            raise AssertionError("the recomputing dQ kernel ran")

    plan = cm.compile(MASKS["document"](), 100, device=DEVICE)
    q, k, v, do = _inputs(2, 2, 1, 100, 100, 32, torch.float16, seed=11)
    monkeypatch.setattr(bwd, "_attn_bwd_dq", _Refuse())
    grads = _triton_grads(q, k, v, do, plan, BWD_TILES["ds-16x32"])
    _assert_grads(grads, q, k, v, do, plan)


@pytest.mark.parametrize("limit", [None, 0])
def test_ds_dq_through_autograd(monkeypatch, limit):
    """The public path: the buffer is sized from the plan (GQA, a batch of 2 sharing one mask,
    dlse); a limit of 0 bytes falls back to the dQ kernel, with the same gradients."""
    from compilemask.kernels.triton import configs
    from compilemask.kernels.triton.backend import backward_inputs

    monkeypatch.setattr(configs, "DS_BUFFER_MAX_BYTES", limit)
    cfg = BWD_TILES["ds-16x32"]
    plan = cm.compile(MASKS["shared_prompt"](), 100, device=DEVICE)
    q, k, v, do = _inputs(2, 4, 2, 100, 100, 32, torch.float16, seed=12)
    dlse = torch.randn(2, 4, 100, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    with override_backward_config(cfg):
        _, ints = backward_inputs(plan, q.clone().requires_grad_(True), k, v)
    kind = plan.tiles(cfg.dq_block_m, cfg.dq_block_n, bits=True).kind  # a slot per dQ tile
    want = int((kind != 0).flatten(1).sum(1).max()) if limit is None else 0
    assert BwdConfig(*ints).ds_dq == want and (want > 0 or limit == 0)
    grads = _autograd_grads(q, k, v, do, plan, dlse=dlse, bwd_cfg=cfg)
    _assert_grads(grads, q, k, v, do, plan, dlse=dlse)


@pytest.mark.parametrize("mask", ["document", "dilated_bits"])
def test_ds_tma_stores_through_the_descriptor(monkeypatch, mask):
    """``ds_tma`` (with ``tma``): the dK/dV kernel stores dS^T through the buffer's TMA
    descriptor (the same gradients pass the float64 check), and without ``tma`` it falls back
    to per-thread stores."""
    from compilemask.kernels.triton import backward as bwd

    real = bwd._attn_bwd_dkdv
    seen = []

    class _Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((kw["DS_TMA"], kw["DS_desc"] is not None))
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(bwd, "_attn_bwd_dkdv", _Spy())
    plan = cm.compile(MASKS[mask](), 100, device=DEVICE)
    q, k, v, do = _inputs(2, 2, 1, 100, 100, 32, torch.float16, seed=14)
    for tma in (1, 0):
        cfg = replace(BWD_TILES["ds-16x32"], tma=tma, ds_tma=1)
        grads = _triton_grads(q, k, v, do, plan, cfg)
        _assert_grads(grads, q, k, v, do, plan)
    assert seen == [(True, True), (False, False)]


def test_ds_dq_is_off_where_it_cannot_run():
    """fp32 and dQ tilings other than the dK/dV tiling turn it off."""
    base = BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, ds_dq=1)
    assert backward_config(128, torch.float16).ds_dq in (0, 1)
    cases = [
        (torch.float32, base),
        (torch.float16, replace(base, dq_block_m=32)),
        (torch.float16, replace(base, dq_block_n=128)),
        (torch.float16, replace(base, dq_block_m=128, dq_block_n=32)),
        (torch.float16, replace(base, dq_block_m=128)),  # pairs of q-tiles
    ]
    from compilemask.kernels.triton import configs

    for dtype, cfg in cases:
        old = dict(configs._BWD_16BIT), dict(configs._BWD_32BIT)
        try:
            configs._BWD_16BIT[128] = configs._BWD_32BIT[128] = cfg
            assert configs.backward_config(128, dtype, None).ds_dq == 0, (dtype, cfg)
        finally:
            configs._BWD_16BIT.update(old[0]), configs._BWD_32BIT.update(old[1])
    configs._BWD_16BIT[128], saved = base, configs._BWD_16BIT[128]
    try:
        assert configs.backward_config(128, torch.float16, None).ds_dq == 1
    finally:
        configs._BWD_16BIT[128] = saved


def test_autograd_triton_out_only_and_bit_identical_to_launcher():
    plan = cm.compile(cm.masks.causal(), 60, device=DEVICE)
    q, k, v, do = _inputs(1, 2, 1, 60, 60, 32, torch.float16, seed=2)
    grads = _autograd_grads(q, k, v, do, plan)
    for got, want in zip(grads, _triton_grads(q, k, v, do, plan)):
        assert torch.equal(got, want)


def test_autograd_torch_compile_fullgraph():
    plan = cm.compile(cm.masks.document([10, 30, 20]), 60, device=DEVICE)
    q, k, v, do = _inputs(1, 4, 2, 60, 60, 32, torch.float16, seed=4)
    dlse = torch.randn(1, 4, 60, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    eager = _autograd_grads(q, k, v, do, plan, dlse=dlse)
    torch._dynamo.reset()
    compiled = _autograd_grads(q, k, v, do, plan, dlse=dlse, compiled=True)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("made", ["compiled", "deepcopy"])
def test_torch_compile_first_call_head_dim_128(made):
    """head_dim 128 in 16 bits takes plan-dependent tilings (tile efficiency, dS buffer size):
    a fresh plan's first use inside torch.compile reads nothing back (the class-free
    configuration) and its gradients match the reference; a copy keeps the shape class an
    eager call recorded, and compiled calls then equal eager ones."""
    import copy

    plan = cm.compile(cm.masks.sliding_window(20), 64, device=DEVICE)
    if made == "deepcopy":
        cm.attention(*_inputs(1, 2, 2, 64, 64, 128, torch.float16)[:3], plan, backend="triton")
        assert plan.shape_class
        plan = copy.deepcopy(plan)
        assert plan.shape_class
    q, k, v, do = _inputs(1, 2, 2, 64, 64, 128, torch.float16, seed=6)

    def grads(f):
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out = f(qg, kg, vg)
        (out.float() * do.float()).sum().backward()
        return out.detach(), qg.grad, kg.grad, vg.grad

    def f(q, k, v):
        return cm.attention(q, k, v, plan, backend="triton")

    torch._dynamo.reset()
    compiled = grads(torch.compile(f, fullgraph=True, backend="aot_eager"))
    if made == "compiled":
        assert plan.shape_class == ()
        _assert_grads(compiled[1:], q, k, v, do, plan)
    else:
        for a, b in zip(grads(f), compiled):
            assert torch.equal(a, b)


def test_torch_compile_plan_as_argument_head_dim_128():
    """A compiled function taking the plan as an argument, called with one fresh plan after
    another (head_dim 128, 16 bits, each classified by an eager call first): each matches
    eager mode (plans of one shape class share a graph: test_compile_graphs.py)."""
    q, k, v, _ = _inputs(1, 2, 2, 64, 64, 128, torch.float16, seed=7)

    def f(q, k, v, plan):
        return cm.attention(q, k, v, plan, backend="triton")

    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    for mask in (cm.masks.document([32, 32]), cm.masks.causal(), cm.masks.sliding_window(9)):
        plan = cm.compile(mask, 64, device=DEVICE)
        want = f(q, k, v, plan)
        assert torch.equal(cf(q, k, v, plan), want)


def test_backward_without_grad_at_forward_time_builds_nothing():
    from compilemask.kernels.triton.backend import backward_inputs
    from compilemask.kernels.triton.schedule import DKDV_SCHEDULE_FIELDS, FWD_SCHEDULE_FIELDS

    plan = cm.compile(cm.masks.causal(), 40, device=DEVICE)
    q, k, v, _ = _inputs(1, 2, 1, 40, 40, 32, torch.float16)
    assert backward_inputs(plan, q, k, v) == ([], [])
    tensors, ints = backward_inputs(plan, q.requires_grad_(True), k, v)
    n_tensors = len(DKDV_SCHEDULE_FIELDS) + len(FWD_SCHEDULE_FIELDS)  # no dS slots here
    assert len(ints) == len(BwdConfig(*ints).as_list()) == 13 and len(tensors) == n_tensors
    with torch.no_grad():
        assert backward_inputs(plan, q, k, v) == ([], [])


def test_backward_custom_op_fake_impl():
    from compilemask.kernels.triton.backend import attention_bwd, backward_inputs

    plan = cm.compile(cm.masks.causal(), 40, device=DEVICE)
    q, k, v, do = _inputs(1, 2, 1, 40, 40, 32, torch.float16)
    out, lse = cm.attention(q, k, v, plan, backend="triton", return_lse=True)
    with override_backward_config(SMALL):
        sched, ints = backward_inputs(plan, q.clone().requires_grad_(True), k, v)
    args = (q, k, v, out, lse, do, None, plan.row_lo, plan.row_hi, sched, 0.1, 0, 0, ints)
    torch.library.opcheck(attention_bwd, args, test_utils=("test_schema", "test_faketensor"))


def test_autograd_reference_backend_with_empty_rows():
    dense = _dense_with_empty_rows_and_cols(45, 50, seed=1)
    plan = cm.from_dense(dense.to(DEVICE))
    q, k, v, do = (t.double() for t in _inputs(1, 4, 2, 45, 50, 32, torch.float32))
    dlse = torch.randn(1, 4, 45, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    dlse = dlse.to(DEVICE)
    got = _autograd_grads(q, k, v, do, plan, backend="reference", dlse=dlse)
    want = reference_attention_backward(q, k, v, plan, do, dlse=dlse)
    for g, w in zip(got, want):
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g, w)


def test_reference_autograd_keeps_no_dense_mask(monkeypatch):
    # The reference forward recomputes each chunk in the backward: no chunk's dense mask (nor
    # its scores) may stay alive between forward and backward, or memory grows like Nq * Nk.
    import gc
    import weakref

    monkeypatch.setattr(reference_mod, "_CHUNK_ELEMENTS", 2 * 4 * 16 * 64)  # 4 chunks
    built = []
    mask_for_chunk = reference_mod._mask_for_chunk

    def tracked(*args, **kwargs):
        rows = mask_for_chunk(*args, **kwargs)
        built.append(weakref.ref(rows))
        return rows

    monkeypatch.setattr(reference_mod, "_mask_for_chunk", tracked)
    plan = cm.compile(cm.masks.sliding_window(9), 64, 64)
    q, k, v, _ = (t.cpu().requires_grad_(True) for t in _inputs(2, 4, 2, 64, 64, 32, torch.float32))
    out, _ = reference_attention(q, k, v, plan)
    gc.collect()
    assert len(built) == 4 and all(r() is None for r in built)
    out.sum().backward()
    assert q.grad is not None and len(built) == 8  # masks rebuilt in the backward


# ---------------------------------------------------------------- TMA descriptors (opt-in)


@pytest.mark.parametrize(
    "mask, nq, nk, d, hq, hkv",
    [
        (cm.masks.causal(), 100, 100, 64, 2, 2),
        (cm.masks.document([30, 45, 25]), 100, 100, 32, 4, 2),
        (cm.masks.sliding_window(20), 70, 90, 96, 2, 1),
    ],
    ids=["causal", "document-gqa", "window-q!=kv-d96"],
)
def test_tma_descriptors_give_the_same_gradients(monkeypatch, mask, nq, nk, d, hq, hkv):
    """``tma=1`` (forward K/V, dK/dV Q/dO, dQ K/V through tensor descriptors): outputs and
    gradients pass the float64 check, rows past the length read as zeros, and the descriptor
    path is really taken (16-bit inputs with aligned strides)."""
    import dataclasses

    from compilemask.kernels.triton import backward as bwd_mod
    from compilemask.kernels.triton import forward as fwd_mod

    made = []
    real = fwd_mod.tma_descriptors

    def counting(*args):
        got = real(*args)
        made.append(got is not None)
        return got

    monkeypatch.setattr(fwd_mod, "tma_descriptors", counting)
    monkeypatch.setattr(bwd_mod, "tma_descriptors", counting)
    monkeypatch.setitem(globals(), "FWD_CFG", dataclasses.replace(FWD_CFG, tma=1))
    plan = cm.compile(mask, nq, nk, device=DEVICE)
    g = torch.Generator(device=DEVICE).manual_seed(3)
    q = torch.randn(1, hq, nq, d, device=DEVICE, dtype=torch.float16, generator=g)
    k, v = (
        torch.randn(1, hkv, nk, d, device=DEVICE, dtype=torch.float16, generator=g)
        for _ in range(2)
    )
    do = torch.randn(1, hq, nq, d, device=DEVICE, dtype=torch.float16, generator=g)
    grads = _triton_grads(q, k, v, do, plan, dataclasses.replace(SMALL, tma=1))
    _assert_grads(grads, q, k, v, do, plan)
    assert made == [True, True, True]  # forward K/V, dK/dV Q/dO, dQ K/V


def test_tma_descriptors_refuse_what_tma_cannot_address():
    from compilemask.kernels.triton.forward import tma_descriptors

    k = torch.randn(2, 3, 40, 64, dtype=torch.float16)
    assert tma_descriptors(k, k, 32, 64) is not None
    assert tma_descriptors(k.float(), k.float(), 32, 64) is None  # 32-bit
    grad = torch.randn(1, 1, 40, 64, dtype=torch.float16).expand(2, 3, 40, 64)
    assert tma_descriptors(grad, grad, 32, 64) is None  # stride 0 on B and H
    odd = torch.randn(2, 3, 40, 68, dtype=torch.float16)[..., :64]  # row stride 136 bytes
    assert tma_descriptors(odd, odd, 32, 64) is None
    one = torch.randn(1, 3, 40, 64, dtype=torch.float16).transpose(0, 1)  # size-1 dim, any stride
    assert tma_descriptors(one, one, 32, 64) is not None
    assert tma_descriptors(k, k, 32, 256) is None  # head_dim > 128


@pytest.mark.parametrize("tiled", [False, True], ids=["causal", "tile_grid-clear"])
def test_compile_under_inference_mode_then_train(tiled):
    """A compiled call under inference_mode on a fresh plan leaves no inference tensor in the
    plan's caches (schedules and the inverse permutation built while tracing are not kept), so
    an eager training step afterwards works."""
    torch._dynamo.reset()
    mask = cm.masks.causal()
    if tiled:
        mask = cm.tile_grid(cm.masks.clear((8, 16), 5, 20), (4, 8))
    plan = cm.compile(mask, 148, device=DEVICE, cache=False)
    q, k, v, do = _inputs(1, 2, 1, 148, 148, 32, torch.float16)
    f = torch.compile(
        lambda q, k, v: cm.attention(q, k, v, plan, backend="triton"),
        fullgraph=True,
        backend="aot_eager",
    )
    with override_forward_config(FWD_CFG), override_backward_config(SMALL):
        with torch.inference_mode():
            f(q, k, v)
    for value in plan._cache.values():
        tensors = value.tensors().values() if hasattr(value, "tensors") else [value]
        assert not any(torch.is_tensor(t) and t.is_inference() for t in tensors)
    grads = _autograd_grads(q, k, v, do, plan)
    _assert_grads(grads, q, k, v, do, plan)


def test_torch_func_transforms_get_a_clear_error_on_triton():
    """The kernels take plain tensors: torch.func transforms over the Triton backend raise an
    InputError that names the way out (before, the kernel launch failed on a functorch
    wrapper deep in Triton)."""
    plan = cm.compile(MASKS["causal"](), 40, device=DEVICE)
    q, k, v, _ = _inputs(1, 2, 2, 40, 40, 32, torch.float32, seed=21)
    with pytest.raises(InputError, match="torch.autograd"):
        torch.func.grad(lambda x: cm.attention(x, k, v, plan, backend="triton").sum())(q)
    with pytest.raises(InputError, match="torch.func"):
        torch.func.vmap(lambda x: cm.attention(x, k, v, plan, backend="triton"))(q[None])


def test_double_backward_raises_instead_of_dropping_the_term():
    """With ``create_graph=True`` the Triton backward's gradients are tied to q, k, v and the
    incoming gradient by a node that raises a clear error when differentiated again: a
    gradient penalty through them used to be a constant (no grad_fn), dropped silently by
    ``loss.backward()`` and by ``torch.autograd.grad(loss, q)``. A first-order backward with
    ``create_graph=True`` still gives the same gradients."""
    plan = cm.compile(cm.masks.causal(), 48, device=DEVICE)
    q, k, v, _ = _inputs(1, 2, 2, 48, 48, 32, torch.float32, seed=3)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    w = torch.randn(32, device=DEVICE, requires_grad=True)
    out = cm.attention(q, k, v, plan, backend="triton")
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    (plain,) = torch.autograd.grad(cm.attention(q, k, v, plan, backend="triton").sum(), q)
    assert torch.equal(g.detach(), plain)
    loss = (out * w).sum() + g.pow(2).sum()
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(loss, q, retain_graph=True)
    with pytest.raises(RuntimeError, match="no double backward"):
        loss.backward()
    # the incoming gradient requires grad (d/dw of a term through the gradient)
    out = cm.attention(q, k, v, plan, backend="triton")
    (gk,) = torch.autograd.grad((out * w).sum(), k, create_graph=True)
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(gk.sum(), w)


@pytest.mark.parametrize("tiled", [False, True])
def test_primed_mask_constants_equal_the_per_schedule_reads(tiled):
    """One read for several schedules gives each exactly what its own read gives (intervals
    only, bitmask tiles mixed in, and bits only)."""
    from compilemask.kernels.triton import common

    mask = cm.masks.clear((8, 16), 5, 20)
    plan = cm.compile(cm.tile_grid(mask, (4, 8)) if tiled else mask, 148, device=DEVICE)
    causal = cm.compile(cm.masks.causal(), 148, device=DEVICE)
    tilings = [(plan, 32, 64), (plan, 64, 32), (plan, 16, 16), (causal, 32, 32)]
    got = []
    for p, bm, bn in tilings:
        s = p.tiles(bm, bn)
        got.append({"kind": s.kind, "jlo": s.jlo.clone(), "jhi": s.jhi})
    common.prime_mask_constants(got, plan.row_lo.shape[-1])
    for (p, bm, bn), primed in zip(tilings, got):
        s = p.tiles(bm, bn)
        want = common.mask_constants(s.kind, s.jlo.clone(), s.jhi, plan.row_lo.shape[-1])
        assert common._MASK_CONSTANTS[id(primed["jlo"])][1] == want
    modes = {common._MASK_CONSTANTS[id(s["jlo"])][1][2] for s in got}
    assert 0 in modes and (1 in modes or 2 in modes)  # both kinds of schedule were primed
