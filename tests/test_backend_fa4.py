"""``backend="fa4"``: the lowering of plans to FlashAttention-4's block lists and tile bitmasks
(CPU, against the dense mask) and the backend's answers without FlashAttention-4. The GPU
suite of every backend is ``test_backends_gpu.py``."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

import compilemask as cm
from compilemask.kernels.fa4 import Fa4Backend
from compilemask.kernels.fa4.lower import expand, lower
from plan_catalogue import catalogue

M = cm.masks
CATALOGUE = catalogue()


def _dense(plan):
    return plan.to_dense().reshape(plan.batch or 1, plan.heads or 1, plan.q_len, plan.kv_len)


@pytest.mark.parametrize("name,plan,batch,heads", CATALOGUE, ids=[c[0] for c in CATALOGUE])
@pytest.mark.parametrize("block", [32, 64, 128])
def test_block_lists_and_bits_rebuild_the_plan(name, plan, batch, heads, block):
    blocks = lower(plan, block)
    want = _dense(plan)
    for backward in (False, True):
        got = expand(blocks, plan.q_len, plan.kv_len, backward=backward)
        assert torch.equal(got, want), (name, backward)
    # FULL blocks are whole in-bounds blocks with every pair visible; PARTIAL ones hold one
    tq, tk = blocks.tile_index.shape[2:]
    padded = torch.zeros(*want.shape[:2], tq * block, tk * block, dtype=torch.bool)
    padded[..., : plan.q_len, : plan.kv_len] = want
    per_tile = padded.view(*want.shape[:2], tq, block, tk, block).sum((3, 5))
    f = blocks.forward
    for bi in range(want.shape[0]):
        for hi in range(want.shape[1]):
            for qt in range(tq):
                full = f.full_idx[bi, hi, qt, : int(f.full_cnt[bi, hi, qt])].tolist()
                part = f.mask_idx[bi, hi, qt, : int(f.mask_cnt[bi, hi, qt])].tolist()
                assert full == sorted(full) and part == sorted(part)
                assert not set(full) & set(part)
                for kt in range(tk):
                    n = int(per_tile[bi, hi, qt, kt])
                    assert (kt in full) == (n == block * block), (qt, kt)
                    assert (kt in full or kt in part) == (n > 0), (qt, kt)


def test_bits_lookup_is_defined_for_every_tile():
    plan = cm.compile(M.causal(), 100, block_m=16, block_n=16)
    blocks = lower(plan, 32)
    assert blocks.bits.shape[1:] == (32, 1)
    assert int(blocks.bits[0].abs().sum()) == 0 and bool((blocks.bits[1] == -1).all())
    assert int(blocks.tile_index.max()) < blocks.bits.shape[0]
    assert int(blocks.tile_index.min()) >= 0


def test_lowering_is_cached_on_the_plan():
    plan = cm.compile(M.sliding_window(8), 64, block_m=16, block_n=16)
    call = SimpleNamespace(device=plan.device)
    be = Fa4Backend()
    assert be.prepare(plan, call) is be.prepare(plan, call)


def test_lower_rejects_a_block_size_that_is_not_a_word_multiple():
    with pytest.raises(ValueError, match="multiple of 32"):
        lower(cm.compile(M.causal(), 64), 48)


def _call(**over):
    base = dict(
        batch=2, heads_q=4, heads_kv=2, q_len=256, kv_len=256, head_dim=128,
        dtype=torch.bfloat16, device=torch.device("cuda"), requires_grad=True, return_lse=False,
    )  # fmt: skip
    base.update(over)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    "over,reason",
    [
        ({"device": torch.device("cpu")}, "CUDA"),
        ({"dtype": torch.float32}, "float16 / bfloat16"),
        ({"head_dim": 96}, "head_dim"),
        ({"heads_kv": 3}, "multiple"),
        ({"return_lse": True}, "lse"),
        ({"q_len": 128}, "q_len"),
    ],
)
def test_supports_names_the_reason(over, reason):
    plan = cm.compile(M.causal(), 256)
    ok, why = Fa4Backend().supports(plan, _call(**over))
    assert not ok and reason in why


def test_available_names_the_install_extra_without_flash_attn_4():
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:
        ok, why = Fa4Backend().available()
        assert not ok and "compilemask[fa4]" in why
    else:
        pytest.skip("flash_attn.cute is installed here")


def test_explicit_request_without_flash_attn_4_raises_input_error():
    if Fa4Backend().available()[0]:
        pytest.skip("flash_attn.cute runs here")
    plan = cm.compile(M.causal(), 64)
    q = torch.randn(1, 2, 64, 64)
    with pytest.raises(cm.CompileMaskError, match="fa4"):
        cm.attention(q, q, q, plan, backend="fa4")


@pytest.mark.parametrize("name", ["fa4", "cute", "cudnn"])
@pytest.mark.parametrize(
    "over,reason",
    [
        ({"score_mod": object()}, "score"),
        ({"has_sinks": True}, "sinks"),
        ({"head_dim_v": 64}, "Dv 64"),
    ],
)
def test_plain_attention_backends_refuse_modifiers_sinks_and_other_value_dims(name, over, reason):
    from compilemask.kernels import registry

    plan = cm.compile(M.causal(), 256)
    ok, why = registry.get(name).supports(plan, _call(**over))
    if name == "fa4" and "has_sinks" in over:  # FlashAttention-4's learnable_sink runs them
        assert reason not in why
    else:
        assert not ok and reason in why


# ------------------------------------------------------------------ native causal / window plans


def test_native_form_of_causal_and_sliding_window_plans():
    from compilemask.kernels.fa4.native import Fa4Native, native_form

    assert native_form(cm.compile(cm.masks.causal(), 300)) == Fa4Native(0)
    assert native_form(cm.compile(cm.masks.sliding_window(64), 300)) == Fa4Native(64)
    assert native_form(cm.compile(cm.masks.sliding_window(300), 300)) == Fa4Native(0)
    assert Fa4Native(0).flash_args() == {"causal": True}
    assert Fa4Native(64).flash_args() == {"causal": False, "window_size": (63, 0)}
    assert Fa4Native(64).bwd_args() == {
        "causal": False, "window_size_left": 63, "window_size_right": 0,
    }  # fmt: skip


@pytest.mark.parametrize(
    "plan",
    [
        cm.compile(cm.masks.causal(), 300, 200),  # q_len != kv_len
        cm.compile(cm.masks.prefix_lm(40), 300),
        cm.compile(cm.masks.document([100, 200]), 300),
        cm.compile(cm.masks.per_batch([cm.masks.causal(), cm.masks.causal()]), 300, batch=2),
        cm.compile(cm.masks.per_head([cm.masks.causal(), cm.masks.causal()]), 300, heads=2),
        cm.compile(cm.masks.tile_grid(cm.masks.clear((8, 16), 3, 0), (4, 8)), 128),
    ],
    ids=["q_ne_kv", "prefix_lm", "document", "per_batch", "per_head", "tile_grid"],
)
def test_native_form_refuses_other_plans(plan):
    from compilemask.kernels.fa4.native import native_form

    assert native_form(plan) is None


def test_native_form_checks_the_intervals_not_the_name():
    """A plan named causal whose tensors say otherwise (modified in place, or built by hand)
    runs the block-sparse path; the verdict follows the tensors' versions."""
    import dataclasses

    from compilemask.kernels.fa4.native import native_form

    plan = cm.compile(cm.masks.causal(), 300, cache=False)
    assert native_form(plan) is not None
    plan.row_hi[0, 5, 0] = 3  # row 5 now sees keys [0, 3)
    assert native_form(plan) is None
    window = cm.compile(cm.masks.sliding_window(8), 300, cache=False)
    named = dataclasses.replace(window, source="causal()", _cache={})
    assert native_form(named) is None


# ------------------------------------------------------------------------------ KV caches
def test_decode_plans_name_their_native_window():
    lens = torch.tensor([9, 30, 2])
    assert cm.step_plan(M.causal(), lens, 2, kv_len=32).native_window() == 0
    assert cm.step_plan(M.sliding_window(5), lens, 1, kv_len=32).native_window() == 5
    assert cm.step_plan(M.causal(), lens, 2, kv_len=32, q_offset=3).native_window() is None
    assert cm.step_plan(M.prefix_lm(4), lens, 1, kv_len=32).native_window() is None
    plan = cm.step_plan(M.causal(), lens, 2, kv_len=32)
    assert plan.next(lens + 1).native_window() == 0
    plan.row_hi[0, 0, 0] = 3  # modified in place: its rows are no longer the mask's
    assert plan.native_window() is None
    plan = cm.step_plan(M.causal(), lens, 2, kv_len=32)
    plan.cache_seqlens[0] = 5  # lengths modified in place
    assert plan.native_window() is None
    plan = cm.step_plan(M.sliding_window(5), lens, 1, kv_len=32)
    # a plan made from a step plan with other rows is not the mask's: its rows are run
    narrow = dataclasses.replace(plan, row_hi=plan.row_hi.clamp(max=4))
    assert narrow.native_window() is None
    assert dataclasses.replace(plan, cache_seqlens=lens - 1).native_window() is None
    assert plan.native_window() == 5


def _fake_varlen(calls):
    """A stand-in for ``flash_attn.cute.flash_attn_varlen_func`` over paged caches: FlashAttention's
    documented semantics (bottom-right causal / window over ``seqused_k`` keys) in float64."""

    def flash_attn_varlen_func(q, k, v, *, seqused_k, page_table, softmax_scale, return_lse,
                               causal=False, window_size=(None, None)):  # fmt: skip
        calls.append({"causal": causal, "window_size": window_size})
        assert q.shape[0] == page_table.shape[0] and return_lse
        assert bool((page_table >= 0).all() & (page_table < k.shape[0]).all())
        b, nq, hq, _ = q.shape
        page, hkv = k.shape[1], k.shape[2]
        keys = page_table.shape[1] * page
        kk = k[page_table.long()].reshape(b, keys, hkv, -1).transpose(1, 2).double()
        vv = v[page_table.long()].reshape(b, keys, hkv, -1).transpose(1, 2).double()
        kk, vv = (t.repeat_interleave(hq // hkv, 1) for t in (kk, vv))
        s = q.transpose(1, 2).double() @ kk.transpose(-1, -2) * softmax_scale
        j = torch.arange(keys)
        pos = (seqused_k[:, None] - nq + torch.arange(nq))[:, None, :, None]  # [B, 1, Nq, 1]
        seen = (j < seqused_k[:, None, None, None]) & (j <= pos)
        if window_size[0] is not None:
            seen = seen & (j >= pos - window_size[0])
        s = s.masked_fill(~seen, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
        return (p @ vv).transpose(1, 2).to(q.dtype), lse.float()

    return flash_attn_varlen_func


@pytest.mark.parametrize("mask", [M.causal(), M.sliding_window(7)], ids=["causal", "sliding"])
def test_paged_decode_plumbing_matches_the_reference(monkeypatch, mask):
    """Layouts, the mask's arguments, rows that see no key and batch rows with a bad page id
    or length (NaN), with a stand-in for FlashAttention-4's paged kernel."""
    import sys
    import types

    from compilemask.api.paged import attend_cache
    from compilemask.kernels.fa4 import paged
    from compilemask.kernels.reference.paged import paged_reference_attention

    calls = []
    flash = types.ModuleType("flash_attn")
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func, flash.cute = _fake_varlen(calls), cute
    monkeypatch.setitem(sys.modules, "flash_attn", flash)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    g = torch.Generator().manual_seed(0)
    B, hq, hkv, nq, d, page, per_row = 4, 4, 2, 3, 32, 8, 4
    table = torch.randperm(B * per_row + 2, generator=g)[: B * per_row].view(B, per_row).int()
    kc = torch.randn(B * per_row + 2, page, hkv, d, generator=g, dtype=torch.float64)
    vc = torch.randn_like(kc)
    lens = torch.tensor([32, 13, 2, 20], dtype=torch.int32)  # row 2: shorter than the draft
    plan = cm.step_plan(mask, lens, nq, kv_len=32)
    q = torch.randn(B, hq, nq, d, generator=g, dtype=torch.float64)
    monkeypatch.setattr(
        "compilemask.api.paged._resolve", lambda name, call: SimpleNamespace(decode=paged.decode)
    )
    out, lse = attend_cache(q, kc, vc, plan, table, None, 0.25, True, "fa4")
    ref, ref_lse = paged_reference_attention(
        q, kc, vc, plan.row_lo, plan.row_hi, table, lens, 0.25, compute_dtype=torch.float64
    )
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse.float())
    assert bool((out[2, :, :1] == 0).all()) and bool(torch.isneginf(lse[2, :, :1]).all())
    want = {"causal": True, "window_size": (None, None)}
    if mask.name == "sliding_window":
        want = {"causal": True, "window_size": (6, 0)}
    assert calls[-1] == want
    # on CUDA the host check is skipped for this backend: the device-side marking answers
    monkeypatch.setattr("compilemask.api.paged._check_cache_values", lambda *a: None)
    bad = table.clone()
    bad[1, 1] = -5  # keys 8..15 of row 1 (13 keys): used
    bad[2, 3] = 10**6  # past row 2's keys: never used, no effect
    out, lse = attend_cache(q, kc, vc, plan, bad, None, 0.25, True, "fa4")
    assert bool(torch.isnan(out[1]).all()) and bool(torch.isnan(lse[1]).all())
    torch.testing.assert_close(out[[0, 2, 3]], ref[[0, 2, 3]])
    lens_bad = lens.clone()
    lens_bad[3] = 33  # past the plan's key axis (and not the plan's length)
    call_plan = cm.step_plan(mask, lens, nq, kv_len=32)
    out, _ = attend_cache(q, kc, vc, call_plan, table, lens_bad, 0.25, True, "fa4")
    assert bool(torch.isnan(out[3]).all()) and not bool(torch.isnan(out[:3]).any())


def test_paged_decode_is_offered_for_native_plans_only():
    from compilemask.kernels.fa4.paged import decode_reason, many_rows
    from compilemask.kernels.interface import AttentionCall, DecodeCall

    def call(native, nq=1, dtype=torch.bfloat16, device="cuda"):
        a = AttentionCall(2, 32, 8, nq, 64, 128, dtype, torch.device(device), False, False)
        z = torch.zeros(1)
        return DecodeCall(z, z, z, z, 16, 64, a, None, 64, z, native)

    assert decode_reason(call(0)) == "" and decode_reason(call(7)) == ""
    assert "causal() or sliding_window" in decode_reason(call(None))
    assert "float16" in decode_reason(call(0, dtype=torch.float32))
    assert "CUDA" in decode_reason(call(0, device="cpu"))
    assert not many_rows(call(0, nq=4)) and many_rows(call(0, nq=16))


def test_explicit_fa4_cache_call_names_its_reason():
    lens = torch.tensor([9, 12])
    plan = cm.step_plan(M.prefix_lm(3), lens, 1, kv_len=16)
    q = torch.randn(2, 2, 1, 32)
    cache = torch.randn(2, 2, 16, 32)
    with pytest.raises(cm.CompileMaskError, match="fa4"):
        cm.attention(q, cache, cache, plan, cache_seqlens=lens, backend="fa4")
