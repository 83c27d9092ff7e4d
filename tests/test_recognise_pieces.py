"""attention-gym mask_mods with piecewise-affine rows (``migrate/recognise_pieces.py``):
recognised by their trace, built from a host piece table (``migrate/pieces.py``), exact
against ``create_mask``; lookalikes left to the lifting or the evaluation (exact too)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm
import flex_masks as fm
from compilemask.compiler.migrate import lift, pieces, plan_cache
from compilemask.compiler.migrate import recognise_pieces as rp
from compilemask.compiler.migrate.packed import NoForm
from compilemask.tools.op_counts import OpCounter, counting_host_copies
from conftest import on_interpreter

READS = ("aten._local_scalar_dense", "aten.equal", "aten.is_nonzero")


def table_of(mm, nq, nk, batch=None, heads=None):
    """``(table, (M, batch, heads))`` of a recognised form, or None."""
    gm = lift.traced(mm)
    found = rp.match(gm)
    if found is None:
        return None
    name, params = found
    try:
        if name in rp.TENSOR_FORMS:
            tensors = (getattr(gm, target) for target in params)
            rows, m, nb, nh = rp.TENSOR_FORMS[name][2](nq, nk, batch, heads, *tensors)
            return pieces.canonical(*rows, m * nq, nk), (m, nb, nh)
        return rp.table(name, params, nq, nk), (1, None, None)
    except NoForm:
        return None


def built_from_table(mm, nq, nk) -> bool:
    return table_of(mm, nq, nk) is not None


def check(mm, nq, nk, expect: bool, bm=16, bn=16, batch=None, heads=None):
    """Exact against ``create_mask``; built from the form's table exactly when ``expect``."""
    plan_cache.clear()
    plan = cm.from_mask_mod(mm, nq, nk, batch=batch, heads=heads, block_m=bm, block_n=bn,
                            cache=False)  # fmt: skip
    plan.verify()
    want = create_mask(mm, batch, heads, nq, nk, device="cpu")
    got = plan.to_dense()
    assert torch.equal(got.expand_as(want) if got.dim() == 4 else got[None, None].expand_as(want),
                       want)  # fmt: skip
    found = table_of(mm, nq, nk, batch, heads)
    assert (found is not None) == expect
    if expect:  # the plan is the table's
        ref = pieces.plan_of(*found[:1], nq, nk, bm, bn, torch.device("cpu"), "t", found[1])
        assert plan.source == "from_mask_mod:lifted" and plan.encoding == "intervals"
        assert torch.equal(plan.row_lo, ref.row_lo) and torch.equal(plan.row_hi, ref.row_hi)


# ---------------------------------------------------------------- the canonical table
def _dense_raw(s, e, la, lb, ha, hb, nq, nk):
    out = np.zeros((nq, nk), bool)
    kv = np.arange(nk)
    for i in range(len(s)):
        for q in range(s[i], e[i]):
            for j in range(la.shape[1]):
                lo, hi = la[i, j] * q + lb[i, j], ha[i, j] * q + hb[i, j]
                out[q] |= (kv >= lo) & (kv < hi)
    return out


@settings(max_examples=60, deadline=None)
@given(
    nq=st.integers(1, 40),
    nk=st.integers(1, 40),
    j=st.integers(1, 4),
    cuts=st.lists(st.integers(1, 39), max_size=5),
    seed=st.integers(0, 2**31 - 1),
)
def test_canonical_table_of_raw_pieces(nq, nk, j, cuts, seed):
    """Random raw pieces (slopes -1, 0, 1; bounds past both ends): the table's rows are the
    raw intervals' union clipped to ``[0, nk)``, canonical (``plan.verify``)."""
    g = np.random.default_rng(seed)
    s = np.unique([0, *(c for c in cuts if c < nq)])
    e = np.append(s[1:], nq)
    p = len(s)
    la, ha = g.integers(-1, 2, (p, j)), g.integers(-1, 2, (p, j))
    lb, hb = g.integers(-nq - 5, nk + 6, (p, j)), g.integers(-nq - 5, nk + 6, (p, j))
    table = pieces.canonical(s, e, la, lb, ha, hb, nq, nk)
    plan = pieces.plan_of(table, nq, nk, 16, 16, torch.device("cpu"), "test")
    plan.verify()
    want = _dense_raw(s, e, la, lb, ha, hb, nq, nk)
    assert np.array_equal(plan.to_dense().numpy(), want)
    assert table.k == max(1, int(plan.row_count.max()))


@pytest.mark.parametrize(
    "s, e, la",
    [
        ([0, 3], [4, 10], [[0], [0]]),  # pieces that do not tile the rows
        ([0], [9], [[0]]),  # the last piece short of q_len
        ([0], [10], [[2]]),  # a slope outside {-1, 0, 1}
    ],
)
def test_canonical_refuses_bad_raw_pieces(s, e, la):
    z = np.zeros((len(s), 1), np.int64)
    with pytest.raises(NoForm):
        pieces.canonical(s, e, np.array(la), z, z, z + 5, 10, 10)


# ---------------------------------------------------------------- the forms
@settings(max_examples=30, deadline=None)
@given(
    prefix=st.integers(0, 40),
    block=st.integers(1, 9),
    nq=st.integers(1, 40),
    extra=st.integers(-20, 20),
)
def test_jetspec_training_exact(prefix, block, nq, extra):
    nk = max(1, prefix + nq + extra)
    check(fm.jetspec_training(prefix, block), nq, nk, True)


@settings(max_examples=30, deadline=None)
@given(
    half=st.integers(1, 30), block=st.integers(1, 9), dq=st.integers(0, 30), dk=st.integers(0, 30)
)
def test_block_diffusion_exact(half, block, dq, dk):
    nq, nk = max(1, 2 * half - dq), max(1, 2 * half - dk)
    check(fm.block_diffusion(half, block), nq, nk, True)


@pytest.mark.parametrize("nq, nk", [(61, 40), (40, 61)])
def test_block_diffusion_past_two_halves_not_from_a_table(nq, nk):
    check(fm.block_diffusion(20, 4), nq, nk, False)


@settings(max_examples=30, deadline=None)
@given(
    prompt=st.integers(-3, 20),
    frame=st.integers(0, 20),
    width=st.integers(-2, 30),
    nq=st.integers(1, 50),
    nk=st.integers(1, 50),
)
def test_svg_spatial_exact(prompt, frame, width, nq, nk):
    def fn(b, h, q_idx, kv_idx):
        return (kv_idx < prompt + frame) | (q_idx < prompt) | (torch.abs(q_idx - kv_idx) < width)

    check(fn, nq, nk, True)


@pytest.mark.parametrize("sink", [False, True])
def test_svg_spatial_gym(sink):
    check(fm.svg_spatial(16, 4, 40, 2, sink, 8), 176, 176, True)


@settings(max_examples=30, deadline=None)
@given(
    tiles=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    tile=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    text=st.integers(0, 12),
    dq=st.integers(-8, 8),
    dk=st.integers(-8, 8),
)
def test_sta_2d_exact(tiles, tile, kernel, text, dq, dk):
    (th, tw), (ty, tx) = tile, tiles
    canvas, kern = (ty * th, tx * tw), (kernel[0] * th, kernel[1] * tw)
    n = ty * th * tx * tw + text
    form = kernel[0] <= ty and kernel[1] <= tx and kernel[0] <= pieces.MAX_RAW - 1
    check(fm.sta_2d(canvas, kern, tile, text), max(1, n + dq), max(1, n + dk), form)


def test_sta_2d_gym():
    check(fm.sta_2d((32, 48), (16, 16), (8, 8), 64), 32 * 48 + 64, 32 * 48 + 64, True)


@settings(max_examples=40, deadline=None)
@given(
    prompt=st.integers(-2, 12),
    frame=st.integers(1, 12),
    width=st.integers(0, 14),
    nq=st.integers(1, 70),
    nk=st.integers(1, 70),
)
def test_svg_temporal_exact(prompt, frame, width, nq, nk):
    def fn(b, h, q_idx, kv_idx):
        qt = (q_idx - prompt) % frame
        kt = (kv_idx - prompt) % frame
        return (kv_idx < prompt) | (q_idx < prompt) | (torch.abs(qt - kt) < width)

    frames = max(0, -(-(nk - prompt) // frame))
    form = prompt >= 0 and width >= 1 and frames + 1 <= pieces.MAX_RAW
    check(fn, nq, nk, form)


def test_svg_temporal_gym():
    check(fm.svg_temporal(16, 8, 20, 2), 176, 176, True)


@settings(max_examples=40, deadline=None)
@given(
    images=st.integers(1, 6),
    tok=st.integers(1, 6),
    nq=st.integers(1, 60),
    seed=st.integers(0, 2**31 - 1),
    negative=st.booleans(),
)
def test_flamingo_exact(images, tok, nq, seed, negative):
    """Image ``i``'s tokens seen by rows ``[start_i, end_i)``: ranges in any order, empty,
    past the rows or negative; ids from the end (``-1``) too."""
    g = torch.Generator().manual_seed(seed)
    iv = torch.randint(-10, nq + 10, (images, 2), generator=g)
    mm = fm.flamingo(iv, tok)
    if negative:
        bounds = mm.__closure__[0].cell_contents
        mm.__closure__[0].cell_contents = bounds - images * (bounds % 2)
    check(mm, nq, images * tok, True)


def test_flamingo_gym_and_its_kept_plan():
    starts = torch.arange(8) * 32
    iv = torch.stack([starts, torch.clamp(starts + 96, max=256)], 1)
    mm = fm.flamingo(iv, 16)
    check(mm, 256, 128, True)
    plan_cache.clear()
    first = cm.from_mask_mod(mm, 256, 128)
    assert cm.from_mask_mod(mm, 256, 128) is first  # the same values read: kept
    iv[0, 1] = 10  # written in place: read again, built again
    again = cm.from_mask_mod(mm, 256, 128)
    assert again is not first
    want = create_mask(mm, None, None, 256, 128, device="cpu")[0, 0]
    assert torch.equal(again.to_dense(), want)


@pytest.mark.parametrize("kind", ["gt", "swapped", "bool", "short"])
def test_flamingo_lookalikes(kind):
    iv = torch.tensor([[0, 30], [10, 50], [20, 70]])
    bounds = torch.repeat_interleave(torch.arange(3), 5)
    if kind == "bool":
        bounds = bounds > 0
    if kind == "short":
        bounds = bounds[:-1]

    def fn(b, h, q_idx, kv_idx):
        interval = iv[bounds[kv_idx]]
        if kind == "gt":
            return (q_idx > interval[0]) & (q_idx < interval[1])
        if kind == "swapped":
            return (q_idx >= interval[1]) & (q_idx < interval[0])
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    plan_cache.clear()
    if kind in ("short", "bool"):  # past the table / a boolean mask: FlexAttention fails too
        assert not built_from_table(fn, 70, 15)
        with pytest.raises(cm.CompileMaskError):
            cm.from_mask_mod(fn, 70, 15, cache=False)
        return
    check(fn, 70, 15, False)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 40)),
    ids=st.integers(1, 6),
    given_=st.tuples(st.booleans(), st.booleans()),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.int32, torch.int64]),
)
def test_fa4_document_exact(shape, ids, given_, seed, dtype):
    """FlashAttention-4's documents per batch row and head: one plan of ``(batch or 1) x
    (heads or 1)`` masks from one table; a longer table read up to the length."""
    b, h, n = shape
    g = torch.Generator().manual_seed(seed)
    doc = torch.sort(torch.randint(0, ids, (b, h, n + 3), generator=g), -1).values.to(dtype)
    batch, heads = (b if given_[0] else None), (h if given_[1] else None)
    check(fm.fa4_document(doc), n, n, True, batch=batch, heads=heads)


@pytest.mark.parametrize("kind", ["unsorted", "float", "two", "lengths"])
def test_fa4_document_lookalikes(kind):
    g = torch.Generator().manual_seed(1)
    doc = torch.sort(torch.randint(0, 4, (2, 2, 30), generator=g), -1).values
    other = doc.clone()
    if kind == "unsorted":
        doc = doc.flip(-1)
    if kind == "float":
        doc = doc.double()

    def fn(b, h, q_idx, kv_idx):
        return doc[b, h, q_idx] == (other if kind == "two" else doc)[b, h, kv_idx]

    nk = 20 if kind == "lengths" else 30
    check(fn, 30, nk, False, batch=2, heads=2)


def _jet_lookalike(kind):
    p, blk = 12, 4

    def fn(b, h, q_idx, kv_idx):
        kv_rel = kv_idx - p
        same = (kv_idx >= (p + 1 if kind == "prefix" else p)) & (q_idx // blk == kv_rel // blk)
        rel = (kv_rel % blk < q_idx % blk) if kind == "lt" else (kv_rel % blk <= q_idx % blk)
        out = (kv_idx < p) | (same & rel)
        return out & (h == 0) if kind == "head" else out

    return fn


def _svg_lookalike(kind):
    def fn(b, h, q_idx, kv_idx):
        if kind == "method":
            band = (q_idx - kv_idx).abs() < 5
        elif kind == "le":
            band = torch.abs(q_idx - kv_idx) <= 5
        else:
            band = torch.abs(q_idx - kv_idx + 1) < 5
        return (kv_idx < 7) | (q_idx < 3) | band

    return fn


@pytest.mark.parametrize(
    "mm",
    [
        _jet_lookalike("prefix"),  # two different prefixes
        _jet_lookalike("lt"),  # another comparison
        _jet_lookalike("head"),  # a head dependence
        _svg_lookalike("method"),  # .abs() (not this template's spelling)
        _svg_lookalike("le"),
        _svg_lookalike("shifted"),
        fm.jetspec_training(-4, 4),  # a negative prefix
        fm.jetspec_training(8, 0.5),  # a float block
    ],
)
def test_lookalikes(mm):
    check(mm, 30, 40, False)


def test_float_constants_do_not_bind_int_parameters():
    def fn(b, h, q_idx, kv_idx):
        return (kv_idx < 4.0) | (q_idx < 3) | (torch.abs(q_idx - kv_idx) < 5)

    assert rp.match(lift.traced(fn)) is None


# ---------------------------------------------------------------- the cost of a build
@pytest.mark.parametrize(
    "mm, n",
    [
        (fm.jetspec_training(1024, 16), 1024),
        (fm.block_diffusion(1024, 16), 2048),
        (fm.svg_spatial(128, 8, 240, 2, True, 8), 2048),
        (fm.sta_2d((32, 48), (16, 16), (8, 8), 512), 2048),
        (fm.svg_temporal(128, 8, 240, 2), 2048),
    ],
)
def test_a_build_reads_nothing_back_and_lowers_in_a_few_operations(mm, n):
    """On the CPU: the piece table's rows in five operations beside ``build_tiles``'s own (the
    same tiles as the lifted plan's), no host read (the counts are known on the host)."""
    from compilemask.compiler import tiles

    nk = n + 1024 if mm.__qualname__.startswith("jetspec") else n
    cm.from_mask_mod(mm, n, nk, cache=False)
    with OpCounter() as counted, counting_host_copies() as copies:
        plan = cm.from_mask_mod(mm, n, nk, cache=False)
    with OpCounter() as tiled:
        tiles.build_tiles(plan.row_lo, plan.row_hi, plan.row_count, n, nk, 128, 128)
    assert sum(v for op, v in counted.ops.items() if op.startswith(READS)) == 0
    assert copies["n"] == 0
    assert counted.real() <= tiled.real() + 5
    lifted = cm.from_mask_mod(mm, n, nk, lifting=False)
    assert torch.equal(plan.to_dense(), lifted.to_dense())


@pytest.mark.parametrize("form", ["flamingo", "fa4_document"])
def test_a_build_of_a_form_with_tables_reads_them_once(form):
    from compilemask.compiler import tiles

    if form == "flamingo":
        mm, nq, nk, batch, heads = (
            fm.flamingo(torch.tensor([[0, 700], [500, 1500], [1200, 2048]]), 64), 2048, 192,
            None, None,
        )  # fmt: skip
    else:
        g = torch.Generator().manual_seed(0)
        doc = torch.sort(torch.randint(0, 8, (2, 3, 2048), generator=g), -1).values
        mm, nq, nk, batch, heads = fm.fa4_document(doc), 2048, 2048, 2, 3

    def build():
        return cm.from_mask_mod(mm, nq, nk, batch=batch, heads=heads, cache=False)

    build()
    with OpCounter() as counted, counting_host_copies() as copies:
        plan = build()
    with OpCounter() as tiled:
        tiles.build_tiles(plan.row_lo, plan.row_hi, plan.row_count, nq, nk, 128, 128)
    reads = sum(v for op, v in counted.ops.items() if op.startswith(READS)) + copies["n"]
    assert reads == 1
    assert counted.real() <= tiled.real() + 8


@on_interpreter
def test_triton_builder_from_the_table():
    """The device path (the registered builder's ``from_table``, through Triton's interpreter
    here): the rows and schedule equal the host build's."""
    pytest.importorskip("triton")
    from compilemask.compiler.tiles import build_tiles
    from compilemask.kernels.triton import tile_builder

    mm, nq, nk = fm.jetspec_training(40, 8), 56, 96
    table = rp.table(*rp.match(lift.traced(mm)), nq, nk)
    host = pieces.plan_of(table, nq, nk, 16, 16, torch.device("cpu"), "t")
    with tile_builder.using(True):
        dev = pieces.plan_of(table, nq, nk, 16, 16, torch.device("cpu"), "t")
    flat = dev.schedule.kind.untyped_storage().data_ptr()
    assert dev.row_lo.untyped_storage().data_ptr() == flat  # written by the one launch
    k = host.row_lo.shape[-1]
    assert torch.equal(dev.row_lo[..., :k], host.row_lo)
    assert torch.equal(dev.row_hi[..., :k], host.row_hi)
    assert torch.equal(dev.row_count, host.row_count)
    ref = build_tiles(dev.row_lo, dev.row_hi, dev.row_count, nq, nk, 16, 16, use_bits=False)
    for name in ("kind", "pairs", "jlo", "jhi", "q_count", "kv_count"):
        assert torch.equal(getattr(dev.schedule, name), getattr(ref, name)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("form", ["block_diffusion", "fa4_document"])
def test_cuda_build_from_the_table(form):
    """On CUDA: the plan equals the CPU build's rows; block_diffusion's build (one launch of
    the Triton builder from the pinned table) neither reads back nor blocks on a copy (CUDA's
    sync debug mode raises on either)."""
    if form == "block_diffusion":
        mm, n, batch, heads = fm.block_diffusion(1024, 16), 2048, None, None
    else:
        g = torch.Generator().manual_seed(0)
        doc = torch.sort(torch.randint(0, 8, (2, 3, 2048), generator=g), -1).values
        mm, n, batch, heads = fm.fa4_document(doc.cuda()), 2048, 2, 3
    dev = torch.device("cuda")

    def build():
        return cm.from_mask_mod(mm, n, batch=batch, heads=heads, device=dev, cache=False)

    want = cm.from_mask_mod(mm, n, batch=batch, heads=heads, cache=False)
    got = build()
    assert got.source == "from_mask_mod:lifted"
    k = want.row_lo.shape[-1]
    assert torch.equal(got.row_lo[..., :k].cpu(), want.row_lo)
    assert torch.equal(got.row_hi[..., :k].cpu(), want.row_hi)
    assert torch.equal(got.row_count.cpu(), want.row_count)
    if form == "block_diffusion":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            build()
        finally:
            torch.cuda.set_sync_debug_mode(0)
