"""The compiler against the specification (the dense evaluator), by property tests.

For random masks (catalogue, rule blocks over random layouts, combinations, per-head and
per-batch), random lengths (not multiples of the tile, q_len != kv_len where the mask allows it)
and random tile sizes: ``plan.to_dense()`` equals ``semantics.dense``; the column intervals are
the transpose; the tile classes, pair counts, slot ranges, bitmasks and both tile lists agree
with the dense mask cut into tiles.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compilemask as cm
from compilemask import masks
from compilemask.compiler.intervals import dense_rows, from_dense_rows
from compilemask.compiler.lower import lower
from compilemask.compiler.tiles import EMPTY, FULL, PARTIAL
from compilemask.errors import CompileMaskError, LayoutError
from compilemask.language.semantics import dense
from conftest import CATALOGUE, cases, fixed_masks

PROFILE = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- checks
def tile_view(d: torch.Tensor, bm: int, bn: int):
    """[M, Tq, Tk, bm, bn] view of a dense [M, Nq, Nk] mask padded with False."""
    m, nq, nk = d.shape
    tq, tk = -(-nq // bm), -(-nk // bn)
    pad = torch.zeros(m, tq * bm, tk * bn, dtype=torch.bool)
    pad[:, :nq, :nk] = d
    return pad.view(m, tq, bm, tk, bn).permute(0, 1, 3, 2, 4)


def check_plan(plan: cm.MaskPlan, expected: torch.Tensor) -> None:
    d = plan.to_dense()
    assert d.shape == expected.shape
    assert torch.equal(d, expected), "plan.to_dense() differs from the dense evaluator"
    plan.verify()
    flat = d.reshape(-1, plan.q_len, plan.kv_len)
    cols = dense_rows(plan.col_lo, plan.col_hi, plan.q_len)
    assert torch.equal(cols, flat.transpose(1, 2)), "column intervals are not the transpose"
    s = plan.schedule
    tiles = tile_view(flat, s.block_m, s.block_n)
    any_ = tiles.flatten(3).any(-1)
    m, tq, tk = any_.shape
    rows = torch.tensor([min(s.block_m, plan.q_len - i * s.block_m) for i in range(tq)])
    colsz = torch.tensor([min(s.block_n, plan.kv_len - j * s.block_n) for j in range(tk)])
    whole = (rows[:, None] == s.block_m) & (colsz[None, :] == s.block_n)
    full = tiles.flatten(3).all(-1) & whole
    assert torch.equal(s.kind == FULL, full)
    assert torch.equal(s.kind == EMPTY, ~any_)
    assert torch.equal(s.pairs, tiles.flatten(3).sum(-1).to(torch.int32))
    for mi, qt, kt in (s.kind >= PARTIAL).nonzero().tolist():
        block = tiles[mi, qt, kt]
        if s.kind[mi, qt, kt] == PARTIAL:
            r = torch.arange(qt * s.block_m, min(plan.q_len, (qt + 1) * s.block_m))
            j = slice(int(s.jlo[mi, qt, kt]), int(s.jhi[mi, qt, kt]))
            lo, hi = plan.row_lo[mi, r][:, j], plan.row_hi[mi, r][:, j]
            c = torch.arange(kt * s.block_n, (kt + 1) * s.block_n)
            vis = ((c[None, :, None] >= lo[:, None]) & (c[None, :, None] < hi[:, None])).any(-1)
            assert torch.equal(vis, block[: len(r)]), "slot range misses an interval"
        else:
            words = s.bits[int(s.bits_index[mi, qt, kt])]
            c = torch.arange(s.block_n)
            vis = ((words[:, c // 32] >> (c % 32)) & 1).bool()
            assert torch.equal(vis, block)
    for mi in range(m):
        for qt in range(tq):
            want = any_[mi, qt].nonzero().flatten().tolist()
            got = s.q_list[mi, qt, : int(s.q_count[mi, qt])].tolist()
            assert got == want
        for kt in range(tk):
            want = any_[mi, :, kt].nonzero().flatten().tolist()
            got = s.kv_list[mi, kt, : int(s.kv_count[mi, kt])].tolist()
            assert got == want
        w = s.q_count[mi]
        order = s.q_order[mi].tolist()
        assert sorted(order) == list(range(tq))
        assert all((w[a] > w[b]) or (w[a] == w[b] and a < b) for a, b in zip(order, order[1:])), (
            "q-tiles are not heaviest first"
        )


@PROFILE
@given(cases())
def test_plan_matches_dense_evaluator(case):
    mask, n, kv, bm, bn = case
    try:
        expected = dense(mask, n, kv)
    except LayoutError:
        with pytest.raises(LayoutError):
            cm.compile(mask, n, kv, block_m=bm, block_n=bn, cache=False)
        return
    plan = cm.compile(mask, n, kv, block_m=bm, block_n=bn, cache=False)
    check_plan(plan, expected)
    other = plan.tiles(16, 32)
    assert torch.equal(other.pairs.sum(), plan.schedule.pairs.sum())


@PROFILE
@given(st.integers(1, 70).flatmap(lambda n: st.tuples(st.just(n), fixed_masks(n))))
def test_untrimmed_lowering_matches_dense_evaluator(case):
    """The lowering a GPU build runs (K at its static bound, ``trim=False``) equals the dense
    evaluator, and the CPU one (trimmed) is the same intervals cut to the largest count."""
    n, mask = case
    try:
        expected = dense(mask, n, n)
    except LayoutError:
        return
    lo, hi, cnt = lower(mask, n, n, "cpu", trim=False)
    t_lo, t_hi, t_cnt = lower(mask, n, n, "cpu", trim=True)
    k = t_lo.shape[-1]
    assert torch.equal(cnt, t_cnt)
    assert torch.equal(lo[..., :k], t_lo) and torch.equal(hi[..., :k], t_hi)
    assert bool((lo[..., k:] == n).all() and (hi[..., k:] == n).all()), "unused slots"
    assert torch.equal(dense_rows(lo, hi, n)[0, 0], expected)


CLEAR_CASES = [  # (h, w), radius, text_len
    ((16, 32), 16, 512),  # the seed at 1K: text a whole number of grid rows, the reach 15 rows
    ((4, 8), 2, 16),
    ((4, 8), 2, 5),  # text shorter than a grid row
    ((4, 8), 2, 21),  # text not a whole number of grid rows
    ((6, 11), 3, 0),  # no text
    ((3, 20), 6, 7),  # a radius larger than the grid's height
    ((3, 20), 9, 0),
    ((1, 7), 2, 5),  # one grid row
    ((1, 5), 1, 0),
    ((9, 12), 5, 30),
    ((5, 6), 1, 3),  # radius 1: the token itself
    ((7, 1), 3, 4),  # one grid column (rows touch: the generic merge)
    ((5, 9), 8, 3),  # radius larger than the grid (rows touch)
    ((1, 1), 1, 0),
]


def check_canonical(mask, nq: int, nk: int, k_bound: int) -> None:
    """``lower`` gives exactly the canonical intervals of the dense mask: trimmed (CPU) with K
    the largest count; untrimmed (GPU) with K = ``k_bound`` and [Nk, Nk) in the unused slots;
    int32."""
    want_lo, want_hi, want_count = from_dense_rows(dense(mask, nq, nk), nk)
    k = want_lo.shape[-1]
    for trim in (True, False):
        lo, hi, count = lower(mask, nq, nk, "cpu", trim=trim)
        assert lo.dtype == hi.dtype == count.dtype == torch.int32
        assert lo.shape[-1] == (k if trim else k_bound)
        assert torch.equal(count[0, 0], want_count)
        assert torch.equal(lo[0, 0, :, :k], want_lo) and torch.equal(hi[0, 0, :, :k], want_hi)
        assert bool((lo[..., k:] == nk).all() and (hi[..., k:] == nk).all()), "unused slots"


@pytest.mark.parametrize("grid,radius,text_len", CLEAR_CASES, ids=str)
def test_clear_lowering_is_the_canonical_form_of_the_dense_mask(grid, radius, text_len):
    """K bound 2 * min(r - 1, h - 1) + 2 (tests/test_build_ops.py counts the operations of the
    direct construction, taken when no two disc rows can touch)."""
    n = text_len + grid[0] * grid[1]
    check_canonical(masks.clear(grid, radius, text_len), n, n, 2 * min(radius - 1, grid[0] - 1) + 2)


@pytest.mark.parametrize("make", [masks.sliding_window, masks.chunked, masks.block_causal])
@pytest.mark.parametrize("param", [1, 3, 7, 40, 2**31 - 1])
@pytest.mark.parametrize("nq,nk", [(20, 20), (20, 33), (33, 20), (40, 5), (1, 1), (7, 1)])
def test_one_interval_closed_forms_are_canonical(make, param, nq, nk):
    """Rows past the keys (q_len > kv_len) may be empty: then they are [Nk, Nk)."""
    check_canonical(make(param), nq, nk, 1)
    check_canonical(masks.prefix_lm(param - 1), nq, nk, 1)


def GLOBAL_LOCAL_CASES(test):  # windows, token sets (runs, tokens past Nk) and lengths
    for name, values in (
        ("nq,nk", [(20, 20), (20, 33), (40, 20), (40, 5)]),
        ("tokens", [(), (0,), (0, 1, 2, 3), (2, 3, 9, 19), (4, 5, 6, 18, 19), (22, 39),
                    tuple(range(0, 40, 3))]),
        ("window", [0, 1, 3, 2**31 - 1]),
    ):  # fmt: skip
        test = pytest.mark.parametrize(name, values, ids=str if name == "tokens" else None)(test)
    return test


@GLOBAL_LOCAL_CASES
def test_global_local_is_canonical(window, tokens, nq, nk):
    """Runs of consecutive global keys merge with the band they touch; global keys past Nk are
    only query rows."""
    tokens = [t for t in tokens if t < max(nq, nk)]
    check_canonical(masks.global_local(window, tokens), nq, nk, 1 + len(tokens))


@GLOBAL_LOCAL_CASES
def test_global_local_from_runs_is_canonical(window, tokens, nq, nk, monkeypatch):
    """The rows built from the runs of global keys on the device (taken when the host table
    would be large), on every case of the piecewise lowering."""
    from compilemask.compiler import global_local

    monkeypatch.setattr(global_local, "GLOBAL_LOCAL_TABLE", 0)
    tokens = [t for t in tokens if t < max(nq, nk)]
    check_canonical(masks.global_local(window, tokens), nq, nk, 1 + len(tokens))


@pytest.mark.parametrize("window", [0, 4, 2**31 - 1])
def test_global_local_with_many_tokens_is_canonical(window):
    """43 global tokens: a host table too large, the device sweep."""
    check_canonical(masks.global_local(window, range(0, 300, 7)), 300, 300, 44)


@pytest.mark.parametrize("mask,n,kv", CATALOGUE.values(), ids=list(CATALOGUE))
@pytest.mark.parametrize("bm,bn", [(32, 32), (16, 64)])
def test_catalogue_compiles_exactly(mask, n, kv, bm, bn):
    plan = cm.compile(mask, n, kv, block_m=bm, block_n=bn, cache=False)
    check_plan(plan, dense(mask, n, kv))


def test_text_and_builders_compile_the_same():
    text = """
    layout prompt:40 resp:4x40
    prompt -> prompt : causal
    resp[i] -> prompt : full
    resp[i] -> resp[i] : causal
    """
    a = cm.compile(cm.parse(text), 200, cache=False)
    b = cm.compile(masks.shared_prompt(40, [40] * 4), 200, cache=False)
    assert torch.equal(a.to_dense(), b.to_dense())


def test_per_head_and_per_batch_shapes():
    m = masks.per_head([masks.causal(), masks.sliding_window(3)])
    plan = cm.compile(m, 10, heads=2)
    assert plan.heads == 2 and plan.batch is None
    assert plan.to_dense().shape == (1, 2, 10, 10)
    with pytest.raises(CompileMaskError, match="heads=3"):
        cm.compile(m, 10, heads=3)
    plan = cm.compile(masks.causal(), 10, batch=4, heads=8)
    assert plan.batch is None and plan.heads is None and plan.to_dense().shape == (10, 10)


def test_cache_and_device_move():
    m = masks.causal()
    assert cm.compile(m, 64) is cm.compile(m, 64)
    assert cm.compile(m, 64, cache=False) is not cm.compile(m, 64)
    p = cm.compile(m, 64).to("cpu")
    assert p.device.type == "cpu"
    assert "MaskPlan(" in repr(p) and "causal()" in repr(p)


# ----------------------------------------------------------------------------- migration
def test_from_dense_random_mask_uses_bitmasks():
    g = torch.Generator().manual_seed(1)
    d = torch.rand(150, 170, generator=g) < 0.5
    d[7] = False  # a row that sees nothing
    plan = cm.from_dense(d, block_m=32, block_n=64)
    check_plan(plan, d)
    assert plan.stats()["tiles_partial_bits"] > 0


def test_from_dense_batch_head():
    d = torch.rand(2, 1, 40, 30) < 0.3
    plan = cm.from_dense(d, block_m=16, block_n=32)
    assert plan.batch == 2 and plan.heads is None
    check_plan(plan, d)


def test_from_mask_mod_matches_flex_convention():
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((q_idx - kv_idx) < 5 + h)

    plan = cm.from_mask_mod(mask_mod, 50, 60, heads=3, block_m=16, block_n=32)
    q, k = torch.arange(50)[:, None], torch.arange(60)[None, :]
    want = torch.stack([(k <= q) & (q - k < 5 + h) for h in range(3)])[None]
    check_plan(plan, want)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: cm.compile(masks.causal(), -3), "q_len"),
        (lambda: cm.compile(masks.causal(), 2.5), "q_len"),
        (lambda: cm.compile(masks.causal(), 8, 0), "kv_len"),
        (lambda: cm.compile(masks.document([3, 4]), 8), "7"),
        (lambda: cm.compile(masks.tree([-1, 0], 3), 2, 4), "kv_len"),
        (lambda: cm.compile(cm.parse("layout a:4 b:*\na -> c : full"), 8), "unknown span"),
        (lambda: cm.compile("causal", 8), "Mask"),
        (lambda: cm.compile(masks.causal(), 8, block_m=0), "block_m"),
        (lambda: cm.compile(masks.global_local(1, [20]), 8), "20"),
        (lambda: cm.from_dense(torch.ones(3, 3)), "bool"),
        (lambda: cm.from_dense(torch.ones(3, dtype=torch.bool)), "Nq, Nk"),
        (lambda: cm.from_mask_mod(lambda b, h, q, k: q / 0 + undefined, 8), "mask_mod raised"),  # noqa: F821
        (lambda: cm.from_mask_mod(lambda b, h, q, k: q - k, 8), "bool"),
        (lambda: masks.sliding_window(0), "window"),
        (lambda: masks.natten2d((4, 4), (2, 3)), "kernel"),
        (lambda: masks.hstu([4], [4]), "num_targets"),
    ],
)
def test_bad_input_raises_clear_errors(call, match):
    with pytest.raises(CompileMaskError, match=match):
        call()


def test_from_dense_bits_only_when_smaller():
    g = torch.Generator().manual_seed(2)
    d = torch.rand(130, 256, generator=g) < 0.5
    d[:, :64] = True
    d[3] = False
    plan = cm.from_dense(d, block_m=32, block_n=64)
    assert plan.encoding == "bits"
    assert plan.nbytes < d.numel() // 2
    check_plan(plan, d)
    s = plan.stats()
    assert s["tiles_full"] > 0 and s["intervals_per_row_max"] > 20
    other = plan.tiles(16, 32)
    assert int(other.pairs.sum()) == int(d.sum())


class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Raise on every operation that reads device data back to the host."""

    SYNCING = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "item"}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[-1] in self.SYNCING:
            raise AssertionError(f"host synchronisation: {func}")
        return func(*args, **(kwargs or {}))


DEVICE_BUILD_CASES = [
    *((w, n0) for w in ("causal", "hstu", "shared_prompt", "clear") for n0 in (1024,)),
]


@pytest.mark.parametrize("name,n0", DEVICE_BUILD_CASES)
def test_device_build_reads_nothing_back(name, n0):
    """The build a GPU runs (K at its bound, no bitmasks) never reads device data on the host,
    so it cannot synchronise; and it gives the same mask as the CPU build."""
    from compilemask.compiler.pipeline import build_plan
    from compilemask.workloads import workload

    w = workload(name, n0)
    with _NoHostSync():
        plan = build_plan(w.mask, w.N, w.N, None, None, 128, 128, "cpu", host_sync=False, source="")
    ref = cm.compile(w.mask, w.N, cache=False)
    assert torch.equal(plan.to_dense(), ref.to_dense())
    assert torch.equal(plan.schedule.pairs, ref.schedule.pairs)


def test_device_build_of_other_masks_reads_nothing_back():
    from compilemask.compiler.pipeline import build_plan

    for mask, n, kv in [
        (masks.global_local(4, [0, 50]) | masks.sliding_window(9), 100, 100),
        (masks.tree([-1, 0, 0, 1], 7), 4, 11),
        (
            masks.per_head([masks.natten2d((8, 8), (3, 5)), masks.dilated(9, 2) - masks.causal()]),
            64,
            64,
        ),
        (
            cm.parse(
                "layout a:10 b:3x10 c:*\na -> a : causal\nb[i] -> b[i] : band(-3, 0)\nc -> * : full"
            ),
            60,
            60,
        ),
    ]:
        heads = mask.head_count
        with _NoHostSync():
            plan = build_plan(mask, n, kv, None, heads, 32, 32, "cpu", host_sync=False, source="")
        assert torch.equal(
            plan.to_dense(), cm.compile(mask, n, kv, heads=heads, cache=False).to_dense()
        )


HUGE = 2**31 - 1


@pytest.mark.parametrize(
    "mask,n",
    [
        (masks.sliding_window(HUGE), 37),
        (masks.block_causal(HUGE), 37),
        (masks.global_local(HUGE, [0]), 37),
        (masks.chunked(HUGE), 37),
        (masks.prefix_lm(HUGE), 37),
        (masks.dilated(HUGE, 3), 37),
        (masks.clear((6, 6), HUGE, 3), 39),
        (cm.parse(f"layout a:*\na -> a : band(-{HUGE}, {HUGE})"), 37),
        (cm.parse(f"layout g:grid(6,6)\ng -> g : disc({HUGE})"), 36),
    ],
    ids=lambda x: str(x)[:20],
)
def test_parameters_larger_than_the_axis_compile_exactly(mask, n):
    """Parameters are clamped to the axis before the int32 arithmetic (no silent overflow)."""
    check_plan(cm.compile(mask, n, cache=False), dense(mask, n))


@pytest.mark.parametrize(
    "make",
    [
        lambda: masks.sliding_window(2**32),
        lambda: masks.chunked(2**31),
        lambda: cm.compile(masks.causal(), 2**31),  # before any allocation
        lambda: cm.compile(masks.document([2**30, 2**30])),
        lambda: cm.parse("sliding_window(9223372036854775808)"),
        lambda: cm.parse("layout a:*\na -> a : band(-100000000000000000000, 0)"),
    ],
)
def test_parameters_beyond_int32_are_refused(make):
    with pytest.raises(CompileMaskError, match="2\\*\\*31"):
        make()


def test_masks_that_fix_their_lengths_compile_without_them():
    assert cm.compile(masks.tree([-1, 0, 0], 4)).kv_len == 7
    assert cm.compile(masks.document([3, 4]) | masks.causal()).q_len == 7
    with pytest.raises(CompileMaskError, match="q_len is needed"):
        cm.compile(masks.causal())


@pytest.mark.parametrize("bm,bn", [(64, 16), (16, 16), (5, 3), (7, 48)])
def test_bitmask_tiles_at_any_block_n(bm, bn):
    """Bitmask rows take whole int32 words (the last one padded), so every tiling works."""
    g = torch.Generator().manual_seed(3)
    d = torch.rand(70, 90, generator=g) < 0.5
    plan = cm.from_dense(d, block_m=bm, block_n=bn)
    assert plan.encoding == "bits"
    check_plan(plan, d)
    other = cm.from_dense(d).tiles(bm, bn)
    assert int(other.pairs.sum()) == int(d.sum())
    dil = cm.compile(masks.dilated(60, 3), 90, block_m=bm, block_n=bn, cache=False)
    check_plan(dil, dense(masks.dilated(60, 3), 90))


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: cm.parse("layout r:99999999999999999999x3"), "parts"),
        (lambda: cm.parse("layout r:3000000000x1"), "parts"),
        (lambda: cm.compile(masks.causal(), 4, device="nope"), "device"),
        (lambda: cm.compile(masks.causal(), 4, cache="x"), "cache must be True or False"),
        (lambda: cm.compile(masks.causal(), 4, cache=1), "cache must be True or False, got 1"),
        (lambda: masks.per_head([1]), r"per_head: masks\[0\] must be a compilemask Mask, got int"),
        (
            lambda: masks.per_batch([masks.causal(), "causal()"]),
            r"per_batch: masks\[1\] must be a compilemask Mask, got str",
        ),
        (lambda: masks.per_head([]), "per_head needs a non-empty list of masks"),
        (lambda: masks.per_batch(masks.causal()), "per_batch needs a list of masks, got Builtin"),
        (lambda: masks.per_head(3), "per_head needs a list of masks, got int"),
    ],
)
def test_more_bad_input(call, match):
    with pytest.raises(CompileMaskError, match=match):
        call()


def test_compile_does_not_hand_out_a_cached_plan_modified_in_place():
    from compilemask.errors import PlanError

    p = cm.compile(cm.masks.causal(), 64, block_m=16, block_n=16)
    assert cm.compile(cm.masks.causal(), 64, block_m=16, block_n=16) is p
    p.row_hi[0, 3, 0] = 64  # a write the plan notices
    fresh = cm.compile(cm.masks.causal(), 64, block_m=16, block_n=16)
    assert fresh is not p
    assert torch.equal(fresh.to_dense(), torch.ones(64, 64, dtype=torch.bool).tril())
    with pytest.raises(PlanError):
        p.check_unchanged()


@pytest.mark.parametrize(
    "bad",
    [
        {"q_len": True}, {"q_len": 1.0}, {"kv_len": 1.0}, {"block_m": 1.0}, {"block_m": True},
        {"cache": 1}, {"heads": 2.0},
    ],
    ids=str,
)  # fmt: skip
def test_checked_calls_kept_per_mask_do_not_admit_equal_values_of_other_types(bad):
    """``compile`` keeps each mask object's checked call arguments; a later call whose
    arguments equal a kept call's but are of another type (True == 1, 1.0 == 1) is checked
    as before, and refused."""
    from compilemask.compiler import pipeline

    mask = masks.causal()
    good = {"q_len": 1, "kv_len": 1, "block_m": 1, "block_n": 16, "heads": 2}
    cm.compile(mask, **good, cache=False)
    cm.compile(mask, **good, cache=True)
    assert len(pipeline._entry(mask)[2]) == 1
    with pytest.raises(CompileMaskError):
        cm.compile(mask, **{**good, **bad})
    assert len(pipeline._entry(mask)[2]) == 1  # a refused call is not kept


def test_calls_kept_per_mask_give_the_plans_of_fresh_masks():
    """A mask object compiled again (its checked arguments kept), at other lengths and
    tilings too, gives the plan a new equal mask object gives; the arguments kept per mask
    stay bounded."""
    from compilemask.compiler import pipeline

    mask = masks.shared_prompt(9, [5, 7, 4])
    for _ in range(2):
        for kw in ({}, {"block_m": 16, "block_n": 32}, {"kv_len": 25, "heads": 3}):
            plan = cm.compile(mask, None, **kw, cache=False)
            ref = cm.compile(masks.shared_prompt(9, [5, 7, 4]), None, **kw, cache=False)
            assert (plan.q_len, plan.kv_len, plan.block_m, plan.source) == (
                ref.q_len, ref.kv_len, ref.block_m, ref.source,
            )  # fmt: skip
            assert torch.equal(plan.to_dense(), ref.to_dense())
    causal = masks.causal()
    for n in range(1, 3 * pipeline._CALLS_KEPT):
        assert cm.compile(causal, n, cache=False).q_len == n
    assert len(pipeline._entry(causal)[2]) <= pipeline._CALLS_KEPT


def _reference_table(mask, q_len, kv_len, trim):
    """The piece table of a document / shared_prompt / hstu mask as the pieces it is
    defined by (``(end, lo_a, lo_b, hi_a, hi_b)``, ends ascending, a piece without rows
    skipped), padded to K slots: ``[ends | lo_a | hi_a | lo_b | hi_b | counts]``."""
    pieces, nk = [], kv_len
    if mask.name == "document":
        (lengths, causal), k, s = mask.args, 1, 0
        for n in lengths:
            pieces.append((s + n, (0,), (s,), (1,), (1,)) if causal else
                          (s + n, (0,), (s,), (0,), (s + n,)))  # fmt: skip
            s += n
    elif mask.name == "shared_prompt":
        k, pos = 2, 0
        for p, resp in zip(*mask.args):
            gs, pe = pos, pos + p
            pos = pe
            pieces.append((pe, (0,), (gs,), (1,), (1,)))
            for n in resp:
                s, pos = pos, pos + n
                if s == pe:
                    pieces.append((pos, (0,), (gs,), (1,), (1,)))
                elif p:
                    pieces.append((pos, (0, 0), (gs, s), (0, 1), (pe, 1)))
                else:
                    pieces.append((pos, (0,), (s,), (1,), (1,)))
    else:
        (lengths, targets, contextual), k, s = mask.args, 2, 0
        for n, t in zip(lengths, targets):
            e, h = s + n, s + n - t
            pieces.append((s + min(contextual, h - s), (0,), (s,), (0,), (h,)))
            pieces.append((min(h + 1, e), (0,), (s,), (1,), (1,)))
            pieces.append((e, (0, 1), (s, 0), (0, 1), (h, 1)))
            s = e
    rows, start = [], 0
    for piece in pieces:
        if piece[0] > start:
            rows.append(piece)
            start = piece[0]
    if trim:
        k = max(len(piece[1]) for piece in rows)
    cols = [[], [], [], []]
    for _, la, lb, ha, hb in rows:
        pad = k - len(la)
        for col, v, fill in zip(cols, (la, ha, lb, hb), (0, 0, nk, nk)):
            col += [*v, *(fill,) * pad]
    values = [r[0] for r in rows] + sum(cols, []) + [len(r[1]) for r in rows]
    return values, len(rows), k


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(1, 90).flatmap(lambda n: st.tuples(st.just(n), fixed_masks(n))), st.booleans())
def test_piece_tables_are_their_pieces(case, trim):
    """The tables of document, shared_prompt and hstu (written as records by their lowering,
    ``lower._Ctx.host_values``) are those of the pieces that define them, bit for bit, for
    a device table (``lower.piece_table``) and the lowering's host values, trimmed or not."""
    from compilemask.compiler import lower as lower_mod

    n, mask = case
    if getattr(mask, "name", None) not in ("document", "shared_prompt", "hstu"):
        return
    want = _reference_table(mask, n, n, trim)
    lower_mod.clear_tables()
    table = lower_mod.piece_table(mask, n, n, "cpu", trim=trim)
    assert (table.flat.tolist(), table.pieces, table.k) == ([0, *want[0]], *want[1:])
