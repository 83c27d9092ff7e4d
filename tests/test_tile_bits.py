"""The bitmasks of PARTIAL tiles (``compiler/tiles.py: _tile_bits``) equal the dense mask of
the tile, for rows with many intervals, whole rows among them and ragged edges."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compilemask.compiler import tiles as tiles_mod
from compilemask.compiler.intervals import from_dense_rows
from compilemask.compiler.tiles import _slot_ranges, _tile_bits, unpack_bits


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 70),
    st.integers(1, 90),
    st.sampled_from([(16, 16), (8, 48), (32, 40), (4, 100)]),
    st.integers(0, 2**31),
    st.floats(0.05, 0.95),
)
def test_tile_bits_equal_the_dense_tiles(nq, nk, blocks, seed, p):
    bm, bn = blocks
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(2, nq, nk, generator=g) < p
    dense[0, torch.randint(0, nq, (1,), generator=g)] = True  # a whole row among fragments
    lo, hi, count = from_dense_rows(dense, nk)
    tq, tk = math.ceil(nq / bm), math.ceil(nk / bn)
    jlo, jhi = _slot_ranges(lo, hi, count, tq, tk, bm, bn, nk)
    grid = torch.meshgrid(torch.arange(2), torch.arange(tq), torch.arange(tk), indexing="ij")
    tiles = torch.stack(grid, -1).reshape(-1, 3)
    sel = tiles.unbind(1)
    words = _tile_bits(lo, hi, tiles, jlo[sel], jhi[sel], bm, bn, nq)
    # in chunks of a few rows, and each way of making words (runs, dense rows) for every row
    saved = tiles_mod._BITS_ELEMS, tiles_mod._runs_to_words, tiles_mod._dense_to_words
    try:
        for elems, runs, dense_rows in ((5, saved[1], saved[2]), (saved[0], saved[1], saved[1]),
                                        (saved[0], saved[2], saved[2])):  # fmt: skip
            tiles_mod._BITS_ELEMS, tiles_mod._runs_to_words = elems, runs
            tiles_mod._dense_to_words = dense_rows
            assert torch.equal(_tile_bits(lo, hi, tiles, jlo[sel], jhi[sel], bm, bn, nq), words)
    finally:
        tiles_mod._BITS_ELEMS, tiles_mod._runs_to_words, tiles_mod._dense_to_words = saved
    got = unpack_bits(words)
    assert not got[..., bn:].any()  # the padding bits of the last word
    pad = torch.zeros(2, tq * bm, tk * bn, dtype=torch.bool)
    pad[:, :nq, :nk] = dense
    for i, (m, qt, kt) in enumerate(tiles.tolist()):
        want = pad[m, qt * bm : (qt + 1) * bm, kt * bn : (kt + 1) * bn]
        assert torch.equal(got[i, :, :bn], want), (m, qt, kt)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 140), st.integers(0, 2**31))
def test_pack_bits_puts_key_c_at_bit_c_of_word_c_over_32(rows, nk, seed):
    vis = torch.rand(rows, nk, generator=torch.Generator().manual_seed(seed)) < 0.5
    words = tiles_mod.pack_bits(vis)
    assert words.dtype == torch.int32 and words.shape == (rows, math.ceil(nk / 32))
    for r in range(rows):
        for c in range(math.ceil(nk / 32) * 32):
            bit = (int(words[r, c // 32]) >> (c % 32)) & 1
            assert bit == (c < nk and bool(vis[r, c])), (r, c)


def test_distinct_pages_keep_one_copy_of_each_page():
    g = torch.Generator().manual_seed(0)
    base = torch.randint(-(2**31), 2**31 - 1, (7, 16, 4), generator=g, dtype=torch.int64)
    pages = base[torch.randint(0, 7, (60,), generator=g)].to(torch.int32)
    distinct, index = tiles_mod.distinct_pages(pages)
    assert torch.equal(distinct[index], pages)
    assert distinct.shape[0] == torch.unique(pages, dim=0).shape[0]
    none, idx = tiles_mod.distinct_pages(pages[:0])
    assert none.shape == (0, 16, 4) and idx.shape == (0,)


def test_bitmask_plans_share_pages_between_tiles_that_look_alike():
    """A key mask (every row the same) as a bitmask plan: a page per distinct tile, and
    the plan's mask is the dense one."""
    import compilemask as cm

    keep = torch.rand(700, generator=torch.Generator().manual_seed(1)) < 0.5
    dense = keep[None, :].expand(600, 700)
    plan = cm.from_dense(dense, block_m=64, block_n=64)
    assert plan.encoding == "bits"
    plan.verify()
    assert torch.equal(plan.to_dense(), dense)
    s = plan.schedule
    partial = int((s.bits_index >= 0).sum())
    assert s.bits.shape[0] < partial  # 10 q-tiles x 11 kv-tiles of one pattern per column
    assert s.bits.shape[0] <= 2 * s.kind.shape[2]  # full q-tiles, and the short last one


def test_pack_bits_reads_other_dtypes_as_nonzero():
    vis = torch.tensor([[1, 0, 1, 1, 0, 0, 0, 1] * 5])
    for dtype in (torch.int32, torch.int64, torch.float32, torch.uint8):
        assert torch.equal(tiles_mod.pack_bits(vis.to(dtype)), tiles_mod.pack_bits(vis != 0))


@settings(max_examples=12, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(1, 90),
    st.sampled_from([(16, 16), (8, 48), (32, 40), (4, 100), (16, 128)]),
    st.integers(0, 2**31),
    st.floats(0.05, 0.95),
)
def test_tile_bits_kernel_equals_the_tensor_operations(nq, nk, blocks, seed, p):
    """``tile_bits_triton`` (one launch; Triton's interpreter here) gives ``_tile_bits``'s
    words bit for bit, tiles with empty rows, rows past ``q_len`` and ragged widths included."""
    pytest.importorskip("triton")
    from compilemask.kernels.triton.tile_bits import tile_bits_triton
    from conftest import DEVICE

    bm, bn = blocks
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(2, nq, nk, generator=g) < p
    dense[1, torch.randint(0, nq, (1,), generator=g)] = False  # a row that sees nothing
    lo, hi, count = (t.to(DEVICE) for t in from_dense_rows(dense, nk))
    tq, tk = math.ceil(nq / bm), math.ceil(nk / bn)
    jlo, jhi = _slot_ranges(lo, hi, count, tq, tk, bm, bn, nk)
    grid = torch.meshgrid(torch.arange(2), torch.arange(tq), torch.arange(tk), indexing="ij")
    tiles = torch.stack(grid, -1).reshape(-1, 3).to(DEVICE)
    sel = tiles.unbind(1)
    want = _tile_bits(lo, hi, tiles, jlo[sel], jhi[sel], bm, bn, nq)
    got = tile_bits_triton(lo.int(), hi.int(), tiles, jlo[sel], jhi[sel], bm, bn, nq)
    assert torch.equal(got, want)


def test_the_device_builder_adds_bitmask_tiles_as_the_tensor_builder_makes_them():
    """A plan of more than ``BITS_MIN_SLOTS`` slots per row through the device builder (Triton's
    interpreter here) and ``tile_bits``: the schedule equals the tensor builder's, its bitmask
    tiles included."""
    pytest.importorskip("triton")
    from compilemask.kernels.triton import tile_builder
    from conftest import DEVICE

    g = torch.Generator().manual_seed(3)
    nq, nk, bm, bn = 200, 300, 32, 64
    dense = torch.rand(1, nq, nk, generator=g) < 0.3
    dense[0, :50, :40] = True
    lo, hi, count = (t.to(DEVICE) for t in from_dense_rows(dense, nk))
    assert lo.shape[-1] > tiles_mod.BITS_MIN_SLOTS
    with tile_builder.using(False):
        want = tiles_mod.build_tiles(lo, hi, count, nq, nk, bm, bn)
    with tile_builder.using(True):
        got = tiles_mod.build_tiles(lo.int(), hi.int(), count, nq, nk, bm, bn)
    assert int((want.kind == tiles_mod.PARTIAL_BITS).sum()) > 0
    for name, a in want.tensors().items():
        assert torch.equal(getattr(got, name), a), name
