"""Decoding steps: ``step_plan`` (the new rows' intervals, against the dense evaluator) and
attention over paged / contiguous KV caches (reference and the Triton split-KV kernel, against
the float64 reference), with ragged cache lengths, shuffled pages and empty rows."""

from __future__ import annotations

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.errors import CompileMaskError, InputError
from compilemask.kernels.reference import reference_attention
from compilemask.kernels.reference.paged import gather_pages, paged_reference_attention
from compilemask.language.ast import Builtin
from compilemask.testing import check_close
from conftest import DEVICE

KV = 24
LENS = [13, 1, 0, 7, 20]  # ragged, with an empty row and a row shorter than the draft
RULES = cm.parse("{ layout p:4 rest:*; p -> p : full; rest -> p : full; rest -> rest : causal }")
# (mask, the same mask at length KV with its last part run on, for the reference)
MASKS = [
    (masks.causal(), None),
    (masks.sliding_window(3), None),
    (masks.prefix_lm(4), None),
    (masks.chunked(4), None),
    (masks.block_causal(3), None),
    (masks.dilated(4, 2), None),
    (RULES, None),
    (masks.causal() - masks.sliding_window(2), None),
    (masks.sliding_window(5) | masks.prefix_lm(2), None),
    (masks.document([5, 4, 4]), masks.document([5, 4, 15])),
    (masks.document([5, 4, 4], causal=False), masks.document([5, 4, 15], causal=False)),
    (masks.shared_prompt(4, [3, 3]), masks.shared_prompt(4, [3, 17])),
    (masks.hstu([6, 5], [2, 2], 1), masks.hstu([6, 18], [2, 15], 1)),
]


def _expected(full: torch.Tensor, lens, nq: int, offsets) -> torch.Tensor:
    """``[B, 1, Nq, KV]``: row i of batch row b is row ``offsets[b] + i`` of the full mask,
    cut to the row's cache; rows outside the axis see nothing."""
    rows = []
    for L, o in zip(lens, offsets):
        d = torch.zeros(nq, full.shape[-1], dtype=torch.bool)
        for i in range(nq):
            if 0 <= o + i < full.shape[0]:
                d[i] = full[o + i]
        d[:, L:] = False
        rows.append(d)
    return torch.stack(rows)[:, None]


@pytest.mark.parametrize("mask,whole", MASKS, ids=[str(m) for m, _ in MASKS])
@pytest.mark.parametrize("nq", [1, 3])
def test_step_plan_matches_dense(mask, whole, nq):
    lens = torch.tensor(LENS)
    full = cm.dense(whole or mask, KV, KV)
    plan = cm.step_plan(mask, lens, nq, kv_len=KV)
    assert torch.equal(plan.to_dense(), _expected(full, LENS, nq, [n - nq for n in LENS]))
    offsets = torch.tensor([2, 0, 5, 4, 17])
    plan = cm.step_plan(mask, lens, nq, kv_len=KV, q_offset=offsets)
    assert torch.equal(plan.to_dense(), _expected(full, LENS, nq, offsets.tolist()))
    _assert_canonical(plan)


def _assert_canonical(plan):
    lo, hi, cnt = plan.row_lo, plan.row_hi, plan.row_count
    used = torch.arange(lo.shape[-1]) < cnt[..., None]
    assert bool((lo[used] < hi[used]).all())
    assert bool((lo[~used] == plan.kv_len).all()) and bool((hi[~used] == plan.kv_len).all())
    gaps = lo[..., 1:] > hi[..., :-1]
    assert bool(gaps[used[..., 1:]].all())


def test_step_plan_agrees_with_compile_q_offset():
    lens = torch.tensor([9, 16, 12])
    for mask in (masks.causal(), masks.sliding_window(4), masks.chunked(3)):
        step = cm.step_plan(mask, lens, 2, kv_len=16)
        plan = cm.compile(mask, 2, 16, q_offset=lens - 2)
        want = plan.to_dense() & (torch.arange(16) < lens[:, None, None, None])
        assert torch.equal(step.to_dense(), want)


@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 3, -1], [-1, 0, 1, 2], [-1]])
def test_tree_draft_over_ragged_prefixes(parents):
    n = len(parents)
    lens = torch.tensor([n + 9, n, n - 1, 0, n + 2])
    plan = cm.step_plan(masks.tree(parents, 0), lens, n, kv_len=KV)
    for b, L in enumerate(lens.tolist()):
        want = torch.zeros(n, KV, dtype=torch.bool)
        if L >= n:  # node i at key L - n + i sees the prefix and its ancestors
            want[:, :L] = cm.dense(masks.tree(parents, L - n), n)
        elif L:  # the draft starts before the first key: what lies inside [0, L) remains
            own = cm.dense(masks.tree(parents, 0), n)[n - L :, n - L :]
            want[n - L :, :L] = own
        assert torch.equal(plan.to_dense()[b, 0], want), b
    _assert_canonical(plan)
    with pytest.raises(CompileMaskError, match="needs q_len"):
        cm.step_plan(masks.tree(parents, 0), lens, n + 1, kv_len=KV)


def test_per_batch_masks_and_next_step():
    lens = torch.tensor([10, 6])
    mask = masks.per_batch([masks.causal(), masks.sliding_window(2)])
    plan = cm.step_plan(mask, lens, 1, kv_len=12)
    assert plan.to_dense()[:, 0, 0].int().tolist() == [
        [1] * 10 + [0] * 2,
        [0] * 4 + [1] * 2 + [0] * 6,
    ]
    nxt = plan.next(lens + 1)
    assert nxt.to_dense()[:, 0, 0].sum(-1).tolist() == [11, 2]
    with pytest.raises(CompileMaskError, match="per_batch with 2"):
        cm.step_plan(mask, torch.tensor([3]), 1, kv_len=12)


@pytest.mark.parametrize(
    "mask,match",
    [
        (masks.per_head([masks.causal()]), "no decoding form"),
        (masks.natten2d((2, 2), (1, 1)), "no decoding form"),
        (masks.causal() | masks.tree([-1], 1), "whole mask"),
    ],
)
def test_step_plan_refuses(mask, match):
    with pytest.raises(CompileMaskError, match=match):
        cm.step_plan(mask, torch.tensor([4]), 1, kv_len=8)


@pytest.mark.parametrize(
    "lens,kwargs,match",
    [
        ([[3]], {}, "cache_seqlens"),
        ([3.0], {}, "cache_seqlens"),
        ([3], {"q_len": 0}, "q_len"),
        ([3], {"kv_len": 0}, "kv_len"),
        ([3], {"q_offset": -1}, "q_offset"),
        ([3], {"q_offset": torch.tensor([1, 2])}, "q_offset"),
    ],
)
def test_step_plan_bad_arguments(lens, kwargs, match):
    with pytest.raises(CompileMaskError, match=match):
        cm.step_plan(masks.causal(), torch.tensor(lens), **kwargs)


# ----------------------------------------------------------------- attention over caches
def _paged(B, Hkv, D, page, pages_per_row, dtype, seed=0):
    """A paged cache with the pages of each row shuffled among spare ones."""
    g = torch.Generator().manual_seed(seed)
    n = B * pages_per_row + 3
    table = torch.randperm(n, generator=g)[: B * pages_per_row].view(B, pages_per_row)
    k = torch.randn(n, page, Hkv, D, generator=g).to(dtype)
    v = torch.randn(n, page, Hkv, D, generator=g).to(dtype)
    return k.to(DEVICE), v.to(DEVICE), table.to(torch.int32).to(DEVICE)


def _check(out, q, kc, vc, plan, table, lens):
    args = (q, kc, vc, plan.row_lo, plan.row_hi, table, lens)
    ref64, _ = paged_reference_attention(*args, compute_dtype=torch.float64)
    ref_dt, _ = paged_reference_attention(*args, compute_dtype=torch.float32, matmul_dtype=q.dtype)
    ok, err, bound = check_close(out, ref64, ref_dt, q.dtype)
    assert ok, f"err {err:.3g} > bound {bound:.3g}"


def test_paged_reference_equals_reference_on_gathered_cache():
    kc, vc, table = _paged(3, 2, 32, 16, 3, torch.float64)
    lens = torch.tensor([40, 0, 17], device=DEVICE)
    q = torch.randn(3, 4, 2, 32, dtype=torch.float64, device=DEVICE)
    dplan = cm.step_plan(masks.sliding_window(9), lens, 2, kv_len=48)
    out, lse = paged_reference_attention(
        q, kc, vc, dplan.row_lo, dplan.row_hi, table, lens, compute_dtype=torch.float64
    )
    plan = cm.compile(masks.sliding_window(9), 2, 48, q_offset=[38, 0, 15], device=DEVICE)
    k, v = gather_pages(kc, table), gather_pages(vc, table)
    ref, ref_lse = reference_attention(q, k, v, plan, compute_dtype=torch.float64)
    ref[1], ref_lse[1] = 0, float("-inf")  # the empty cache
    assert torch.allclose(out, ref) and torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    assert bool((out[1] == 0).all())


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(
    "mask,nq,page",
    [
        (masks.causal(), 1, 16),
        (masks.sliding_window(20), 4, 32),
        (masks.chunked(16), 2, 64),
        (masks.tree([-1, 0, 0, 1, 1, 2], 0), 6, 16),
        (masks.causal(), 3, 256),
    ],
    ids=["causal-1", "window-4", "chunked-2", "tree-6", "page256"],
)
def test_paged_attention(backend, mask, nq, page):
    pytest.importorskip("triton")
    B, Hq, Hkv, D = 4, 4, 2, 32
    pages_per_row = max(1, 96 // page)
    kc, vc, table = _paged(B, Hkv, D, page, pages_per_row, torch.float16)
    cap = pages_per_row * page
    lens = torch.tensor([cap, 0, nq, min(cap, 37)], dtype=torch.int32, device=DEVICE)
    plan = cm.step_plan(mask, lens, nq, kv_len=cap)
    q = torch.randn(B, Hq, nq, D).to(torch.float16).to(DEVICE)
    with torch.no_grad():
        out, lse = cm.attention(
            q, kc, vc, plan, block_table=table, backend=backend, return_lse=True
        )
    assert out.shape == q.shape and lse.shape == (B, Hq, nq) and lse.dtype == torch.float32
    assert bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())
    _check(out, q, kc, vc, plan, table, lens)


@pytest.mark.kernel
@pytest.mark.parametrize("splits", [1, 2, 5])
def test_split_kv_merge(splits):
    pytest.importorskip("triton")
    from compilemask.kernels.triton.decode import decode_attention

    kc, vc, table = _paged(2, 1, 64, 16, 6, torch.float32)
    lens = torch.tensor([96, 41], dtype=torch.int32, device=DEVICE)
    plan = cm.step_plan(masks.sliding_window(50) - masks.sliding_window(3), lens, 2, kv_len=96)
    q = torch.randn(2, 3, 2, 64).to(DEVICE)  # 3 query heads share the one kv head
    out, lse = decode_attention(
        q, kc, vc, plan.row_lo, plan.row_hi, table, lens, 0.125, num_splits=splits, block_n=16
    )
    ref, ref_lse = paged_reference_attention(
        q, kc, vc, plan.row_lo, plan.row_hi, table, lens, 0.125, compute_dtype=torch.float64
    )
    assert torch.allclose(out.double(), ref, atol=1e-4)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4)


@pytest.mark.kernel
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize(
    "bad", ["page_negative", "page_past_the_cache", "length_negative", "length_past", "plan_lens"]
)
def test_decode_kernel_gives_nan_to_a_batch_row_with_a_bad_page_or_length(bad, splits):
    """The check the kernel makes in place of the host read on CUDA: only the bad batch row
    gets NaN (out and lse, every head), the others are exact."""
    pytest.importorskip("triton")
    from compilemask.kernels.triton.decode import decode_attention

    kc, vc, table = _paged(3, 1, 64, 16, 9, torch.float32)
    lens = torch.tensor([96, 41, 70], dtype=torch.int32, device=DEVICE)
    plan = cm.step_plan(masks.causal(), lens, 2, kv_len=96)
    q = torch.randn(3, 2, 2, 64).to(DEVICE)
    ref, ref_lse = paged_reference_attention(
        q, kc, vc, plan.row_lo, plan.row_hi, table, lens, 0.125, compute_dtype=torch.float64
    )
    table, call_lens, plan_lens = table.clone(), lens.clone(), None
    if bad == "page_negative":
        table[1, 2] = -3  # keys 32..47 of row 1: read (41 keys, causal)
    elif bad == "page_past_the_cache":
        table[1, 0] = kc.shape[0]
    elif bad == "length_negative":
        call_lens[1] = -1
    elif bad == "length_past":
        call_lens[1] = 97  # the plan's key axis is 96 (the cache holds 144)
    else:
        plan_lens = lens.clone()
        plan_lens[1] = 40
    table[0, 7] = 10**6  # past row 0's keys (96 = pages 0-5 of 16): never read, no effect
    out, lse = decode_attention(
        q, kc, vc, plan.row_lo, plan.row_hi, table, call_lens, 0.125, num_splits=splits,
        block_n=16, plan_seqlens=plan_lens, len_limit=96,
    )  # fmt: skip
    assert bool(torch.isnan(out[1]).all()) and bool(torch.isnan(lse[1]).all())
    for b in (0, 2):
        assert torch.allclose(out[b].double(), ref[b], atol=1e-4)
        assert torch.allclose(lse[b].double(), ref_lse[b], atol=1e-4)


@pytest.mark.kernel
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_contiguous_cache_with_mask_plan(backend):
    pytest.importorskip("triton")
    B, Hq, Hkv, Nk, D = 3, 2, 1, 40, 32
    lens = torch.tensor([40, 25, 0], dtype=torch.int32, device=DEVICE)
    k = torch.randn(B, Nk, Hkv, D).to(torch.float16).to(DEVICE).transpose(1, 2)  # strided
    v = torch.randn(B, Hkv, Nk, D).to(torch.float16).to(DEVICE)
    q = torch.randn(B, Hq, 2, D).to(torch.float16).to(DEVICE)
    plan = cm.compile(masks.causal(), 2, Nk, q_offset=[38, 23, 0], device=DEVICE)
    with torch.no_grad():
        out = cm.attention(q, k, v, plan, cache_seqlens=lens, backend=backend)
    table = torch.arange(B, dtype=torch.int32, device=DEVICE)[:, None]
    kc, vc = k.transpose(1, 2), v.transpose(1, 2)
    _check(out, q, kc, vc, cm.step_plan(masks.causal(), lens, 2, kv_len=Nk), table, lens)
    assert bool((out[2] == 0).all())


def test_cache_calls_refuse_bad_input():
    kc, vc, table = _paged(2, 1, 32, 16, 2, torch.float32)
    lens = torch.tensor([20, 5], device=DEVICE)
    plan = cm.step_plan(masks.causal(), lens, 1, kv_len=32)
    q = torch.randn(2, 2, 1, 32, device=DEVICE)
    with pytest.raises(InputError, match="forward only"):
        cm.attention(q.requires_grad_(), kc, vc, plan, block_table=table)
    q = q.detach()
    with pytest.raises(InputError, match="block_table"):
        cm.attention(q, kc, vc, plan, block_table=table[:1])
    with pytest.raises(InputError, match="longer than the cache"):
        cm.attention(q, kc, vc, cm.step_plan(masks.causal(), lens, 1, kv_len=64), block_table=table)
    with pytest.raises(InputError, match="B=2, q_len=1"):
        cm.attention(q[:, :, :0], kc, vc, plan, block_table=table)
    with pytest.raises(InputError, match="per_head"):
        per_head = cm.compile(masks.per_head([masks.causal()] * 2), 1, 32, heads=2)
        cm.attention(q, kc, vc, per_head, block_table=table, cache_seqlens=lens)
    with pytest.raises(InputError, match="cache_seqlens"):
        cm.attention(q, kc, vc, plan, block_table=table, cache_seqlens=lens[:1])
    with pytest.raises(InputError, match="cache_seqlens .* on meta"):
        cm.attention(q, kc, vc, plan, block_table=table, cache_seqlens=lens.to("meta"))


def test_step_plan_keeps_lengths_of_its_own():
    """A serving loop that updates its int32 lengths in place for the next step: the old plan
    still holds the lengths it was built for, so the call with the new lengths is refused."""
    kc, vc, table = _paged(2, 1, 32, 16, 2, torch.float32)
    lens = torch.tensor([20, 5], dtype=torch.int32, device=DEVICE)
    offset = torch.tensor([19, 4], dtype=torch.int32, device=DEVICE)
    plan = cm.step_plan(masks.dilated(4, 2), lens, 1, kv_len=32, q_offset=offset)
    lens += 1
    offset += 1
    assert plan.cache_seqlens.tolist() == [20, 5] and plan.q_offset.tolist() == [19, 4]
    q = torch.randn(2, 2, 1, 32, device=DEVICE)
    with pytest.raises(InputError, match="built for 20 keys"):
        cm.attention(q, kc, vc, plan, block_table=table, cache_seqlens=lens)


def test_cache_ids_and_lengths_past_int32_are_bad_not_wrapped(monkeypatch):
    """int64 page ids and lengths past int32 are refused with their own value on the host, and
    reach a backend's decode as bad values (not wrapped onto a real page or length)."""
    from compilemask.api import paged

    kc, vc, table = _paged(2, 1, 32, 16, 2, torch.float32)
    lens = torch.tensor([20, 5], device=DEVICE)
    plan = cm.compile(masks.causal(), 1, 32, q_offset=[19, 4], device=DEVICE)
    q = torch.randn(2, 2, 1, 32, device=DEVICE)
    with torch.no_grad():
        out = cm.attention(q, kc, vc, plan, block_table=table, cache_seqlens=lens)
        wide = table.long()
        wide[1, 1] = 2**40  # unused by row 1 (5 keys): accepted
        assert torch.equal(cm.attention(q, kc, vc, plan, block_table=wide, cache_seqlens=lens), out)
        wide[0, 0] = 2**32 + int(table[0, 0])  # wraps onto row 0's own first page
        with pytest.raises(InputError, match=rf"block_table\[0, 0\] = {2**32 + int(table[0, 0])}"):
            cm.attention(q, kc, vc, plan, block_table=wide, cache_seqlens=lens)
        long_lens = lens.clone()
        long_lens[1] = 2**32 + 5
        with pytest.raises(InputError, match=rf"cache_seqlens\[1\] = {2**32 + 5}"):
            cm.attention(q, kc, vc, plan, block_table=table, cache_seqlens=long_lens)
        seen = []
        monkeypatch.setattr(paged, "_check_cache_values", lambda *a: None)
        monkeypatch.setattr(paged, "_resolve", lambda name, call: _Spy(seen, call))
        cm.attention(q, kc, vc, plan, block_table=wide, cache_seqlens=long_lens)
    call = seen[0]
    assert call.block_table.dtype == torch.int32 and call.cache_seqlens.dtype == torch.int32
    assert not 0 <= int(call.block_table[0, 0]) < kc.shape[0]
    assert int(call.cache_seqlens[1]) > call.len_limit


class _Spy:
    def __init__(self, seen, call):
        self.seen, self.call = seen, call

    def decode(self, q, k, v, call, scale):
        self.seen.append(call)
        return torch.zeros_like(q), torch.zeros(q.shape[:3], device=q.device)


@pytest.mark.kernel
def test_generation_example(capsys):
    """examples/generate_paged.py: greedy tokens over a paged cache equal full recomputation,
    and a tree draft's logits equal each branch run alone (the example asserts both)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import generate_paged

    assert generate_paged.main(["--device", "cpu", "--steps", "2"]) == 0
    assert "tree draft" in capsys.readouterr().out


@pytest.mark.kernel
@pytest.mark.parametrize("head_dim", [64, 96, 256])
def test_paged_attention_head_dims(head_dim):
    pytest.importorskip("triton")
    kc, vc, table = _paged(2, 2, head_dim, 32, 2, torch.float16)
    lens = torch.tensor([64, 30], dtype=torch.int32, device=DEVICE)
    plan = cm.step_plan(masks.chunked(8), lens, 3, kv_len=64)
    q = torch.randn(2, 6, 3, head_dim).to(torch.float16).to(DEVICE)  # 3 query heads per kv head
    with torch.no_grad():
        out = cm.attention(q, kc, vc, plan, block_table=table, backend="triton")
    _check(out, q, kc, vc, plan, table, lens)


def test_cache_longer_than_the_plan_axis_is_refused():
    with pytest.raises(CompileMaskError, match="kv_len=64 is shorter"):
        cm.step_plan(masks.causal(), torch.tensor([70, 3]), 1, kv_len=64)


def test_cache_lengths_outside_int32_are_refused_before_the_conversion():
    """CPU lengths are checked on their own dtype: 2**32 + 5 would otherwise become a plan for
    5 keys, 2**31 a negative length."""
    for bad in (2**32 + 5, 2**31, -1):
        with pytest.raises(CompileMaskError, match=rf"cache_seqlens\[1\] = {bad} is outside"):
            cm.step_plan(masks.causal(), torch.tensor([4, bad]), 1)
    with pytest.raises(CompileMaskError, match=r"kv_len must be an int in \[1, 2\*\*31 - 1\]"):
        cm.step_plan(masks.causal(), torch.tensor([4]), 1, kv_len=2**31)


@pytest.mark.parametrize(
    "mask", [masks.causal(), masks.block_causal(16), masks.sliding_window(8)], ids=str
)
def test_the_longest_int32_cache(mask):
    """A cache of 2**31 - 1 keys (the int32 bound): the last row sees up to the last key; the
    block of block_causal that runs past the bound does not wrap."""
    n = 2**31 - 1
    plan = cm.step_plan(mask, torch.tensor([n]), 1, kv_len=n)
    assert plan.row_hi[0, 0, 0] == n and plan.row_count[0, 0] == 1


@pytest.mark.kernel
@pytest.mark.parametrize(
    "mask",
    [masks.causal(), masks.sliding_window(3), masks.prefix_lm(5), masks.chunked(4),
     masks.block_causal(3)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("nq", [1, 3])
def test_one_launch_step_rows_equal_the_tensor_build(mask, nq):
    """The Triton builder of one-interval masks (the CUDA fast path of step_plan)."""
    pytest.importorskip("triton")
    from compilemask.kernels.triton.decode import step_rows

    lens = torch.tensor(LENS, dtype=torch.int32)
    for offsets in (None, torch.tensor([2, 0, 5, 4, 17], dtype=torch.int32)):
        want = cm.step_plan(mask, lens, nq, kv_len=KV, q_offset=offsets)
        param = mask.args[0] if mask.args else 1
        lo, hi, count, off, got_lens = step_rows(mask.name, param, lens, offsets, nq, KV)
        assert torch.equal(lo, want.row_lo) and torch.equal(hi, want.row_hi)
        assert torch.equal(count, want.row_count) and torch.equal(off, want.q_offset)
        assert torch.equal(got_lens, lens)


def _trees():
    """Chains, stars, a binary tree and random forests of 1 to 64 nodes."""
    g = torch.Generator().manual_seed(3)
    out = [[-1], [-1, -1], list(range(-1, 63)), [-1] + [0] * 63, [-1] + [i // 2 for i in range(63)]]
    for n in (2, 5, 9, 17, 40, 64):
        par = [-1]
        for i in range(1, n):
            root = int(torch.randint(0, 8, (), generator=g)) == 0
            par.append(-1 if root else int(torch.randint(0, i, (), generator=g)))
        out.append(par)
    return out


def _tree_dense(parents, lens, offsets, kv_len) -> torch.Tensor:
    """``[B, 1, n, kv_len]`` from the definition: node i at key ``o + i`` sees ``[0, o)`` and
    the keys ``o + j`` of its ancestors j (itself included), inside ``[0, min(L, kv_len))``;
    nodes at a negative key see nothing."""
    n = len(parents)
    own = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            own[i, j], j = True, parents[j]
    rows = []
    for L, o in zip(lens, offsets):
        d = torch.zeros(n, kv_len + n + abs(o), dtype=torch.bool)
        for i in range(n):
            if o + i >= 0:
                d[i, : max(o, 0)] = True
                for j in range(n):
                    if own[i, j] and o + j >= 0:
                        d[i, o + j] = True
        d = d[:, :kv_len].clone()
        d[:, min(L, kv_len) :] = False
        rows.append(d)
    return torch.stack(rows)[:, None]


@pytest.mark.kernel
def test_one_launch_tree_equals_the_tensor_build():
    """The Triton builder of tree drafts (the CUDA fast path of step_plan): the same tensors as
    the tensor build, and the tree's definition, over ragged caches (empty, shorter than the
    draft), offsets before the first key and past the cache, and a key axis that cuts."""
    pytest.importorskip("triton")
    from compilemask.compiler.decode import _tree_runs
    from compilemask.kernels.triton.decode import step_tree

    g = torch.Generator().manual_seed(0)
    for parents in _trees():
        n = len(parents)
        mask = masks.tree(parents, 0)
        kv = n + 7
        lens = torch.tensor([n + 7, n, n - 1, 0, 1, n + 3], dtype=torch.int32).clamp(max=kv)
        offsets = torch.randint(-n - 2, kv + 2, (6,), generator=g, dtype=torch.int32)
        offsets[0] = -(n // 2)  # some nodes before the first key, the rest after it
        for off in (None, offsets, offsets.long()):
            want = cm.step_plan(mask, lens, n, kv_len=kv, q_offset=off)
            runs = _tree_runs(parents, n, lens.device)
            lo, hi, count, got_off, got_lens = step_tree(runs, lens, off, n, kv)
            assert torch.equal(lo, want.row_lo) and torch.equal(hi, want.row_hi), parents
            assert torch.equal(count, want.row_count) and torch.equal(got_off, want.q_offset)
            assert torch.equal(got_lens, lens)
            _assert_canonical(want)
            o = (lens - n if off is None else off).tolist()
            assert torch.equal(want.to_dense(), _tree_dense(parents, lens.tolist(), o, kv))


PIECEWISE = [(m, w) for m, w in MASKS if isinstance(m, Builtin)
             and m.name in ("document", "shared_prompt", "hstu")]  # fmt: skip


@pytest.mark.kernel
@pytest.mark.parametrize("mask,whole", PIECEWISE, ids=[str(m) for m, _ in PIECEWISE])
@pytest.mark.parametrize("nq", [1, 3])
def test_one_launch_piecewise_equal_the_tensor_build(mask, whole, nq):
    """The Triton builder of document, shared_prompt and hstu (the CUDA fast path of step_plan):
    the same tensors as the tensor build, and the dense evaluator's rows; offsets before the
    first key and past the mask's last piece."""
    pytest.importorskip("triton")
    from compilemask.compiler.decode import _device_table, _pieces_table
    from compilemask.kernels.triton.decode import step_pieces

    lens = torch.tensor(LENS, dtype=torch.int32)
    full = cm.dense(whole or mask, KV, KV)
    values, n, k = _pieces_table(mask, KV)
    table = _device_table(("pieces", mask, KV), values, lens.device).view(n, 1 + 4 * k)
    for offsets in (None, torch.tensor([2, 0, -2, 4, 17]), torch.tensor([-5, 23, 5, 0, 19])):
        want = cm.step_plan(mask, lens, nq, kv_len=KV, q_offset=offsets)
        lo, hi, count, off, got_lens = step_pieces(table, lens, offsets, nq, KV)
        assert torch.equal(lo, want.row_lo) and torch.equal(hi, want.row_hi)
        assert torch.equal(count, want.row_count) and torch.equal(off, want.q_offset)
        assert torch.equal(got_lens, lens)
        _assert_canonical(want)
        o = [n - nq for n in LENS] if offsets is None else offsets.tolist()
        if min(o) >= 0:  # (_expected has no rows before the axis)
            assert torch.equal(want.to_dense(), _expected(full, LENS, nq, o))


@pytest.mark.kernel
def test_step_plan_routes_tables_to_the_registered_builder(monkeypatch):
    """step_plan hands a tree (its name and its device table of ancestor runs) and a document
    (its table of pieces) to the registered builder and returns what it built; int64 lengths
    and offsets are taken."""
    pytest.importorskip("triton")
    from compilemask.compiler import decode
    from compilemask.kernels.triton import device_builder

    parents = [-1, 0, 0, 1, 3, -1, 5]
    mask = masks.tree(parents, 0)
    lens = torch.tensor([20, 7, 3, 0])
    offsets = torch.tensor([13, 0, -4, 2])
    want = [cm.step_plan(mask, lens, 7, kv_len=KV, q_offset=o) for o in (None, offsets)]
    seen = []

    def spy(name, param, *args):
        seen.append((name, tuple(param.shape)))
        return device_builder.triton_step_builder(name, param, *args)

    monkeypatch.setattr(device_builder, "_on_cuda", lambda t: True)
    monkeypatch.setattr(decode, "_STEP_BUILDER", spy)
    for w, o in zip(want, (None, offsets)):
        got = cm.step_plan(mask, lens, 7, kv_len=KV, q_offset=o)
        assert torch.equal(got.row_lo, w.row_lo) and torch.equal(got.row_hi, w.row_hi)
        assert torch.equal(got.row_count, w.row_count) and torch.equal(got.q_offset, w.q_offset)
        assert got.cache_seqlens.dtype == torch.int32 and got.source == w.source
    assert seen == [("tree", (2, 7, 2))] * 2
    with pytest.raises(CompileMaskError, match="needs q_len"):
        cm.step_plan(mask, lens, 6, kv_len=KV)
    doc = masks.document([5, 4, 4])
    got = cm.step_plan(doc, lens, 2, kv_len=KV)
    monkeypatch.undo()
    want = cm.step_plan(doc, lens, 2, kv_len=KV)
    assert torch.equal(got.row_lo, want.row_lo) and torch.equal(got.row_hi, want.row_hi)
    assert seen[-1] == ("document", (3, 5))


def test_cache_calls_refuse_score_mods_and_sinks():
    plan = cm.step_plan(cm.masks.causal(), torch.tensor([5]), 1, kv_len=8)
    q = torch.randn(1, 2, 1, 32)
    cache = torch.randn(1, 8, 2, 32)
    with pytest.raises(InputError, match="score_mod and sinks"):
        cm.attention(q, cache, cache, plan, cache_seqlens=torch.tensor([5]), sinks=torch.zeros(2))


def test_next_infers_the_key_axis_again_when_it_was_inferred():
    lens = torch.tensor([5, 17, 9])
    plan = cm.step_plan(masks.causal(), lens, q_len=2)
    assert plan.next(lens + 1).kv_len == 18  # the longest cache grew: so does the axis
    fixed = cm.step_plan(masks.causal(), lens, q_len=2, kv_len=64)
    assert fixed.next(lens + 1).kv_len == 64


@pytest.mark.parametrize(
    "table,lens,match",
    [
        ([[0, 1], [2, -1], [3, 0]], [5, 17, 9], r"block_table\[1, 1\] = -1"),
        ([[0, 1], [2, 4], [3, 0]], [5, 17, 9], r"block_table\[1, 1\] = 4"),
        ([[0, 1], [2, 3], [3, 0]], [5, -2, 9], r"cache_seqlens\[1\] = -2"),
        ([[0, 1], [2, 3], [3, 0]], [5, 33, 9], r"cache_seqlens\[1\] = 33"),
    ],
)
def test_bad_page_ids_and_cache_lengths_are_refused(table, lens, match):
    plan = cm.step_plan(masks.causal(), torch.tensor([5, 17, 9]), q_len=2, kv_len=32)
    q = torch.randn(3, 2, 2, 32)
    cache = torch.randn(4, 16, 2, 32)
    with pytest.raises(InputError, match=match):
        cm.attention(
            q, cache, cache, plan, block_table=torch.tensor(table), cache_seqlens=torch.tensor(lens)
        )


def test_unused_block_table_entries_may_hold_anything():
    plan = cm.step_plan(masks.causal(), torch.tensor([5, 17, 9]), q_len=2, kv_len=32)
    q = torch.randn(3, 2, 2, 32)
    cache = torch.randn(4, 16, 2, 32)
    table = torch.tensor([[0, -1], [2, 3], [3, 99]])  # rows 0 and 2 read one page only
    out = cm.attention(
        q, cache, cache, plan, block_table=table, cache_seqlens=torch.tensor([5, 17, 9])
    )
    assert torch.isfinite(out).all()


def test_decode_plans_must_cover_the_caches_they_run_on():
    with pytest.raises(CompileMaskError, match="shorter than the longest cache"):
        cm.step_plan(masks.causal(), torch.tensor([20]), 1, kv_len=16)
    plan = cm.step_plan(masks.causal(), torch.tensor([5, 17, 9]), 2, kv_len=32)
    q = torch.randn(3, 2, 2, 32)
    cache = torch.randn(4, 16, 2, 32)
    table = torch.tensor([[0, 1], [2, 3], [3, 0]])
    with pytest.raises(InputError, match="DecodePlan was built for 17 keys"):
        cm.attention(
            q, cache, cache, plan, block_table=table, cache_seqlens=torch.tensor([5, 16, 9])
        )


def test_kv_cache_calls_refuse_bitmask_plans():
    g = torch.Generator().manual_seed(0)
    plan = cm.from_dense(torch.rand(2, 40, generator=g) < 0.5)
    assert plan.encoding == "bits"
    q, k = torch.randn(1, 2, 2, 32), torch.randn(1, 2, 40, 32)
    with pytest.raises(InputError, match="stores bitmasks"):
        cm.attention(q, k, k, plan, cache_seqlens=torch.tensor([40]))


def test_step_plan_refuses_offsets_past_int32():
    """Key positions are int32: an offset whose rows would end past 2**31 - 1 is refused (an
    int anywhere, a tensor where it can be read without a device synchronisation)."""
    lens = torch.tensor([9])
    for q_offset in (2**31, 2**31 - 2, torch.tensor([2**40]), torch.tensor([-(2**40)])):
        with pytest.raises(CompileMaskError, match="q_offset"):
            cm.step_plan(cm.masks.causal(), lens, 2, kv_len=16, q_offset=q_offset)
    plan = cm.step_plan(cm.masks.causal(), lens, 2, kv_len=16, q_offset=2**31 - 3)
    assert plan.row_hi[..., 0].tolist() == [[9, 9]]  # rows past the cache see all of it


@pytest.mark.parametrize(
    "mask,nq,offset",
    [(masks.causal(), 3, None), (masks.sliding_window(5), 2, None),
     (masks.tree([-1, 0, 0, 1], 0), 4, None), (masks.document([7, 9]), 2, None),
     (masks.prefix_lm(4), 3, torch.tensor([-2, 30, 5])), (masks.causal(), 40, None)],
)  # fmt: skip
def test_step_plans_pass_their_own_verify(mask, nq, offset):
    lens = torch.tensor([0, 17, 32])
    cm.step_plan(mask, lens, nq, kv_len=32, q_offset=offset).verify()


@pytest.mark.parametrize(
    "edit,match",
    [(lambda p: p.row_hi.__setitem__((1, 0, 0), 1000), "slot 0"),
     (lambda p: p.row_lo.__setitem__((2, 1, 0), -50), "row 1 of batch row 2"),
     (lambda p: p.row_count.__setitem__((1, 0), 2), "row_count 2")],
)  # fmt: skip
def test_edited_decode_plans_fail_verify_and_check_plan(edit, match):
    from compilemask.errors import PlanError

    lens = torch.tensor([9, 17, 30])
    plan = cm.step_plan(masks.causal(), lens, 2, kv_len=32)
    edit(plan)
    with pytest.raises(PlanError, match=match):
        plan.verify()
    q = torch.randn(3, 2, 2, 32)
    cache = torch.randn(3, 2, 32, 32)
    with pytest.raises(PlanError, match=match):
        cm.attention(q, cache, cache, plan, check_plan=True, backend="reference")
