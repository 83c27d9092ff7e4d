"""GPU checks of decoding (``pytest -m gpu -q tests/test_gpu_decode.py`` on a CUDA machine):
the plan builder makes no host synchronisation, and the split-KV kernel over a paged bf16 cache
(head_dim 128, GQA 4:1, ragged lengths, shuffled pages, an empty row) passes the measure of
docs/design.md against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.kernels.reference.paged import paged_reference_attention
from compilemask.testing import check_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_step_plan_makes_no_host_sync():
    lens = torch.tensor([4000, 9000, 0, 8192], device="cuda", dtype=torch.int32)
    cases = [
        (masks.causal(), 1),
        (masks.sliding_window(1024), 4),  # fmt: skip
        (masks.tree([-1, 0, 0, 1, 1, 2, 2], 0), 7),
        (masks.document([100, 50]), 1),
    ]
    for mask, nq in cases:
        cm.step_plan(mask, lens, nq, kv_len=9216)  # host tables cached
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            plan = cm.step_plan(mask, lens + 1, nq, kv_len=9216)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert plan.row_lo.is_cuda


@pytest.mark.parametrize(
    "mask,nq",
    [(masks.tree([-1] + [i // 2 for i in range(63)], 0), 64), (masks.document([3000, 2000]), 4),
     (masks.shared_prompt(1000, [2000, 3000]), 1), (masks.hstu([4000, 4000], [64, 64], 2), 4)],
    ids=["tree-64", "document", "shared_prompt", "hstu"],
)  # fmt: skip
def test_one_launch_plans_equal_the_tensor_build(monkeypatch, mask, nq):
    """Batch 64 (ragged caches, an empty one, offsets before the first key and past the cache):
    the one-launch build, with no host synchronisation, equals the tensor build."""
    from compilemask.compiler import decode

    g = torch.Generator(device="cuda").manual_seed(0)
    lens = torch.randint(0, 9216, (64,), device="cuda", generator=g, dtype=torch.int32)
    lens[:3] = torch.tensor([0, 5, 64], device="cuda")
    offsets = lens - nq
    offsets[3:6] = torch.tensor([-70, -1, 9300], device="cuda", dtype=torch.int32)
    for off in (None, offsets):
        cm.step_plan(mask, lens, nq, kv_len=9216, q_offset=off)  # tables cached, kernel built
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = cm.step_plan(mask, lens, nq, kv_len=9216, q_offset=off)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        monkeypatch.setattr(decode, "_STEP_BUILDER", None)
        want = cm.step_plan(mask, lens, nq, kv_len=9216, q_offset=off)
        monkeypatch.undo()
        for a, b in [(got.row_lo, want.row_lo), (got.row_hi, want.row_hi),
                     (got.row_count, want.row_count), (got.q_offset, want.q_offset)]:  # fmt: skip
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    "mask,nq,page",
    [(masks.causal(), 1, 16), (masks.sliding_window(1024), 4, 64),
     (masks.tree([-1, 0, 0, 1, 1, 2, 2, 3], 0), 8, 256), (masks.causal(), 64, 128)],
    ids=["causal-1", "window-4", "tree-8", "causal-64"],
)  # fmt: skip
@pytest.mark.parametrize("backend", ["auto", "triton", "fa4"])
def test_paged_decode_bf16(mask, nq, page, backend):
    if backend == "fa4":
        from compilemask.kernels.fa4 import Fa4Backend

        if not Fa4Backend().available()[0]:
            pytest.skip("flash_attn.cute is not installed")
        if mask.name == "tree":
            pytest.skip("FlashAttention-4 runs causal and sliding-window decode plans only")
    B, Hq, Hkv, D, cap = 6, 8, 2, 128, 8192
    per_row = cap // page
    g = torch.Generator(device="cuda").manual_seed(0)
    n = B * per_row + 5
    table = torch.randperm(n, device="cuda", generator=g)[: B * per_row].view(B, per_row)
    table = table.to(torch.int32)
    kc = torch.randn(n, page, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16)
    vc = torch.randn(n, page, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16)
    q = torch.randn(B, Hq, nq, D, device="cuda", generator=g, dtype=torch.bfloat16)
    lens = torch.tensor([cap, 0, nq, 3000, 777, 8000], device="cuda", dtype=torch.int32)
    plan = cm.step_plan(mask, lens, nq, kv_len=cap)
    with torch.no_grad():
        out = cm.attention(q, kc, vc, plan, block_table=table, backend=backend)
    args = (q, kc, vc, plan.row_lo, plan.row_hi, table, lens)
    ref64, _ = paged_reference_attention(*args, compute_dtype=torch.float64)
    ref_dt, _ = paged_reference_attention(*args, compute_dtype=torch.float32, matmul_dtype=q.dtype)
    ok, err, bound = check_close(out, ref64, ref_dt, q.dtype)
    assert ok, f"err {err:.3g} > bound {bound:.3g}"
    assert bool((out[1] == 0).all())


@pytest.mark.parametrize("backend", ["triton", "fa4"])
def test_cache_calls_make_no_host_sync_and_mark_bad_rows(backend):
    """A paged decode call reads nothing back to the host; a bad page id gives its batch row
    NaN (the other rows unchanged), and ``check_plan=True`` raises an InputError naming it."""
    from compilemask.errors import InputError
    from compilemask.kernels.fa4 import Fa4Backend

    if backend == "fa4" and not Fa4Backend().available()[0]:
        pytest.skip("flash_attn.cute is not installed")
    B, Hkv, D, page = 4, 2, 128, 64
    lens = torch.tensor([4000, 900, 0, 4096], device="cuda", dtype=torch.int32)
    plan = cm.step_plan(masks.causal(), lens, 1, kv_len=4096)
    g = torch.Generator(device="cuda").manual_seed(0)
    table = torch.randperm(B * 64, device="cuda", generator=g).view(B, 64).to(torch.int32)
    kc = torch.randn(B * 64, page, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    q = torch.randn(B, 8, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    with torch.no_grad():
        good = cm.attention(q, kc, vc, plan, block_table=table, backend=backend)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            again = cm.attention(q, kc, vc, plan, block_table=table, backend=backend)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(good, again)
        bad_table = table.clone()
        bad_table[1, 3] = -1  # keys 192..255 of row 1 (900 keys): read
        out = cm.attention(q, kc, vc, plan, block_table=bad_table, backend=backend)
        assert bool(torch.isnan(out[1]).all())
        assert torch.equal(out[[0, 2, 3]], good[[0, 2, 3]])
        with pytest.raises(InputError, match=r"block_table\[1, 3\] = -1"):
            cm.attention(q, kc, vc, plan, block_table=bad_table, check_plan=True, backend=backend)
