"""Inputs at the edges that once crashed, hung or gave NaN: each is refused by name, or
accepted and right."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import compilemask as cm
from compilemask.errors import CompileMaskError, InputError


def _qkv(n=16, d=32):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, n, d, generator=g) for _ in range(3))


def test_dense_refuses_a_mask_too_large_to_hold_before_allocating():
    with pytest.raises(CompileMaskError, match=r"dense would hold .*q_len=2147483648"):
        cm.dense(cm.masks.causal(), 2**31)
    with pytest.raises(CompileMaskError, match="heads=2"):
        cm.dense(cm.masks.per_head([cm.masks.causal()] * 2), 2**17, heads=2)


@pytest.mark.parametrize("scale", [1e-46, 1e39])
def test_scale_outside_float32_normal_range_is_refused(scale):
    plan = cm.compile(cm.masks.causal(), 16)
    q, k, v = _qkv()
    with pytest.raises(InputError, match="scale must lie in float32's normal range"):
        cm.attention(q, k, v, plan, scale=scale, backend="reference")


def test_numpy_scales_are_taken_as_floats():
    plan = cm.compile(cm.masks.causal(), 16)
    q, k, v = _qkv()
    want = cm.attention(q, k, v, plan, scale=0.25, backend="reference")
    for scale in (np.float32(0.25), np.float64(0.25)):
        torch.testing.assert_close(
            cm.attention(q, k, v, plan, scale=scale, backend="reference"), want
        )
    with pytest.raises(InputError, match="scale must be a float"):
        cm.attention(q, k, v, plan, scale=np.bool_(True), backend="reference")


def test_explain_with_the_plan_last_says_the_order():
    plan = cm.compile(cm.masks.causal(), 16)
    q, k, v = _qkv()
    with pytest.raises(InputError, match=r"explain takes \(plan, q, k, v\)"):
        cm.explain(q, k, v, plan)


def test_a_misspelt_keyword_in_text_is_named():
    with pytest.raises(CompileMaskError, match="unexpected keyword 'w'"):
        cm.parse("sliding_window(w=3)")
    with pytest.raises(CompileMaskError, match="unexpected keyword 'casual'"):
        cm.parse("document([3, 5], casual=false)")


def test_lengths_and_counts_take_numpy_integers_and_0d_tensors_everywhere():
    m = cm.masks.per_head([cm.masks.causal(), cm.masks.sliding_window(2)])
    for n, h in ((torch.tensor(8), np.int64(2)), (np.int32(8), torch.tensor(2)), (8, 2)):
        plan = cm.compile(m, n, heads=h)
        assert (plan.q_len, plan.heads) == (8, 2) and type(plan.heads) is int
        assert cm.dense(m, n, heads=h).shape == (1, 2, 8, 8)
    for bad in (torch.tensor(8.0), torch.tensor([8]), True, 8.0):
        with pytest.raises(CompileMaskError, match="q_len must be an int"):
            cm.compile(cm.masks.causal(), bad)
    with pytest.raises(CompileMaskError, match="heads must be a positive int"):
        cm.compile(m, 8, heads=np.bool_(True))
    assert cm.masks.document([3, 5], causal=np.bool_(False)) == cm.masks.document([3, 5], False)


def test_masks_chained_too_deep_to_print_or_evaluate_say_so():
    m = cm.masks.prefix_lm(0)
    for i in range(1, 3000):
        m = m | cm.masks.prefix_lm(i % 7)
    for show in (str, repr, lambda mask: cm.dense(mask, 64)):
        with pytest.raises(CompileMaskError, match="nested too deeply"):
            show(m)
    assert repr(cm.masks.causal() | cm.masks.prefix_lm(3)) == "Combine(causal() | prefix_lm(3))"


def test_masks_chained_thousands_deep_hash_and_compare_without_recursing():
    a, b = cm.masks.prefix_lm(0), cm.masks.prefix_lm(0)
    for i in range(1, 5000):
        a, b = a | cm.masks.prefix_lm(i % 7), b | cm.masks.prefix_lm(i % 7)
    assert hash(a) == hash(b) and a == b and len({a, b}) == 1
    assert a != (b | cm.masks.causal()) and a != (b & cm.masks.causal())
    c, s = cm.masks.causal(), cm.masks.sliding_window(3)
    assert (c | s) == (c | s) and (c | s) != (c & s) and (c | s) != (c | cm.masks.sliding_window(4))
    assert (c | s) != (s | c) and (c | (s | c)) != ((c | s) | c)  # structure, not the set


def test_plan_files_name_a_bad_path_or_a_meta_location(tmp_path):
    plan = cm.compile(cm.masks.causal(), 8)
    for path in (None, 3):
        with pytest.raises(InputError, match="path must be a str, an os.PathLike or a writable"):
            plan.save(path)
    with pytest.raises(InputError, match="readable file object, got NoneType"):
        cm.load_plan(None)
    plan.save(tmp_path / "p.plan")
    with pytest.raises(CompileMaskError, match="map_location='meta' holds no data"):
        cm.load_plan(tmp_path / "p.plan", map_location="meta")
    assert cm.load_plan(tmp_path / "p.plan").q_len == 8


def test_builders_refuse_meta_tensors_by_name():
    with pytest.raises(CompileMaskError, match="lengths must be .* on the meta device"):
        cm.masks.document(torch.tensor([3, 4], device="meta"))
    with pytest.raises(CompileMaskError, match="window must be an integer, .* meta device"):
        cm.masks.sliding_window(torch.tensor(3, device="meta"))


def test_complement_and_text_masks_point_to_what_works():
    with pytest.raises(CompileMaskError, match="no complement operator"):
        ~cm.masks.causal()  # noqa: B018
    with pytest.raises(CompileMaskError, match=r"compilemask.parse\(text\)"):
        cm.compile("causal()", 8)


def test_from_mask_mod_refuses_lengths_no_plan_can_hold_before_any_work():
    def window(b, h, q, kv):
        return (q - kv < 8) & (kv <= q)

    with pytest.raises(CompileMaskError, match="must be below 2"):
        cm.from_mask_mod(window, 64, 2**31)
    for n in (10**8, 2**31 - 1):  # the tile schedule alone: refused, not evaluated
        with pytest.raises(CompileMaskError, match="needs about"):
            cm.from_mask_mod(window, n, cache=False)


def test_dense_with_one_offset_per_row_takes_compiles_key_length():
    m = cm.masks.sliding_window(5)
    d = cm.dense(m, 32, q_offset=[1, 2])
    plan = cm.compile(m, 32, q_offset=[1, 2])
    assert d.shape == (2, 1, 32, 34) and torch.equal(plan.to_dense(), d)


def test_from_mask_mod_takes_numpy_integers_and_0d_tensors_as_compile_does():
    def window(b, h, q, kv):
        return (q - kv < 4) & (kv <= q)

    plan = cm.from_mask_mod(window, np.int64(64), block_m=np.int32(16), batch=torch.tensor(2))
    assert (plan.q_len, plan.block_m) == (64, 16) and type(plan.q_len) is int
    for bad in (True, 0, 2.0, torch.tensor(2.0)):
        with pytest.raises(CompileMaskError, match="q_len must be a positive int"):
            cm.from_mask_mod(window, bad)
