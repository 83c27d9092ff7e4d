"""NATTEN over tokens stored in tiles (attention-gym's ``tiled_natten``,
``migrate/recognise_tiled.py``): recognised as ``tile_grid(natten2d(...))`` in its tiled order
and exact against ``create_mask``; lookalikes left to the lifting or the evaluation (exact)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm
import flex_masks as fm
from compilemask.compiler.migrate import lift, plan_cache
from compilemask.compiler.migrate.recognise import recognise


def check(mm, n, expect: bool):
    plan_cache.clear()
    plan = cm.from_mask_mod(mm, n, block_m=16, block_n=16)
    plan.verify()
    assert plan.permutation is None
    want = create_mask(mm, None, None, n, n, device="cpu")[0, 0]
    assert torch.equal(plan.to_dense(), want)
    assert (recognise(lift.traced(mm), n, n) is not None) == expect


@settings(max_examples=25, deadline=None)
@given(
    tiles=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    tile=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    kernel=st.tuples(st.integers(0, 3), st.integers(0, 3)),
)
def test_tiled_natten_exact(tiles, tile, kernel):
    (ty, tx), (th, tw), (rh, rw) = tiles, tile, kernel
    hgt, w = ty * th, tx * tw
    kh, kw = 2 * rh + 1, 2 * rw + 1
    fits = kh <= hgt and kw <= w
    check(fm.tiled_natten(w, hgt, kw, kh, tw, th), w * hgt, fits)


def _tiled(w, hgt, tw, th, cx, cy, rx, ry, op="le"):
    """``tiled_natten`` with its clamp bounds and radii given (``op`` the comparison)."""

    xy = fm.tiled_xy(w, tw, th)

    def fn(b, h, q, k):
        qx, qy = xy(q)
        kx, ky = xy(k)
        a = (qx.clamp(*cx) - kx).abs()
        c = (ky - qy.clamp(*cy)).abs()  # the other sign order
        if op == "lt":
            return (a < rx + 1) & (ry + 1 > c)
        return (a <= rx) & (c <= ry)

    return fn


def test_spellings():
    check(_tiled(8, 6, 4, 3, (1, 6), (2, 3), 1, 2, "lt"), 48, True)
    check(_tiled(8, 6, 4, 3, (1, 6), (2, 3), 1, 2), 48, True)


@pytest.mark.parametrize(
    "mm, n",
    [
        (_tiled(8, 6, 4, 3, (0, 6), (2, 3), 1, 2), 48),  # a clamp not shifted inward
        (_tiled(8, 6, 4, 3, (1, 6), (2, 3), 1, 1), 48),  # clamp of another radius
        (_tiled(8, 6, 4, 3, (1, 6), (2, 3), 1, 2), 40),  # the length not a whole tile row
        (_tiled(8, 6, 4, 3, (1, 6), (2, 3), 1, 2), 56),
    ],
)
def test_lookalikes(mm, n):
    check(mm, n, False)


def test_row_major_natten_still_recognised_untiled():
    got = recognise(lift.traced(fm.natten(8, 8, 3, 5)), 64, 64)
    assert got is not None and "tile_grid" not in str(got)


def test_in_a_union_or_with_other_terms_not_recognised():
    base = fm.tiled_natten(8, 6, 3, 3, 4, 3)

    def union(b, h, q, k):
        return base(b, h, q, k) | (k == 0)

    def more(b, h, q, k):
        return base(b, h, q, k) & (k <= q)

    check(union, 48, False)
    check(more, 48, False)
