"""The bitmasks of PARTIAL tiles (``compiler/tiles.py: _tile_bits``) equal the dense mask of
the tile, for rows with many intervals, whole rows among them and ragged edges."""

from __future__ import annotations

import math

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
