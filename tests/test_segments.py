"""The compact descriptor (``compiler/segments.py``) against the plan and the dense evaluator:
segments expand to the plan's row intervals exactly, tile runs to its kinds and lists, for the
catalogue and random compositions; the size choice; small edge cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import compilemask as cm
from compilemask import masks
from compilemask.compiler import segments as sg
from compilemask.compiler.intervals import dense_rows
from compilemask.compiler.tiles import PARTIAL
from compilemask.errors import CompileMaskError, LayoutError
from compilemask.language.semantics import dense
from conftest import cases
from plan_catalogue import catalogue

PROFILE = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_compact(plan: cm.MaskPlan) -> sg.CompactPlan:
    """Every part of ``plan.compact()`` expands to what the plan holds."""
    c = plan.compact()
    s, m = plan.schedule, plan.num_masks
    if plan.encoding == "intervals":
        seg = sg.segments_from_rows(plan.row_lo, plan.row_hi, plan.row_count, plan.kv_len)
        lo, hi, count = sg.expand_rows(seg, k=plan.max_intervals)
        assert torch.equal(lo, plan.row_lo)
        assert torch.equal(hi, plan.row_hi)
        assert torch.equal(count, plan.row_count)
        if c.rows == "segments":
            assert c.segments.nbytes == c.row_bytes
            assert c.row_bytes < sg.rows_nbytes(m, plan.q_len, plan.max_intervals)
        else:
            assert c.row_bytes == sg.rows_nbytes(m, plan.q_len, plan.max_intervals)
            assert seg.nbytes >= c.row_bytes
        # a band of rows on its own
        a, b = plan.q_len // 3, plan.q_len - plan.q_len // 4
        lo, hi, count = sg.expand_rows(seg, a, b, k=plan.max_intervals)
        assert torch.equal(lo, plan.row_lo[:, a:b]) and torch.equal(count, plan.row_count[:, a:b])
    else:
        assert c.rows == "bits" and c.segments is None
    kind = s.kind.clamp(max=PARTIAL)
    assert torch.equal(sg.expand_kind(c.forward, m), kind)
    assert torch.equal(sg.expand_kind(c.backward, m), kind.transpose(1, 2))
    for got, want in zip(sg.expand_lists(c.forward, m), (s.q_count, s.q_list, s.q_order)):
        assert torch.equal(got, want)
    for got, want in zip(sg.expand_lists(c.backward, m), (s.kv_count, s.kv_list, s.kv_order)):
        assert torch.equal(got, want)
    assert c.nbytes == c.row_bytes + c.forward.nbytes + c.backward.nbytes
    assert plan.compact() is c  # cached
    return c


@pytest.mark.parametrize("name,plan,B,Hq", catalogue(), ids=[c[0] for c in catalogue()])
def test_catalogue_plans_expand_exactly(name, plan, B, Hq):
    check_compact(plan)


@PROFILE
@given(cases())
def test_random_masks_expand_to_the_dense_evaluator(case):
    mask, n, kv, bm, bn = case
    try:
        expected = dense(mask, n, kv)
    except LayoutError:
        return
    plan = cm.compile(mask, n, kv, block_m=bm, block_n=bn, cache=False)
    c = check_compact(plan)
    if c.segments is not None and plan.permutation is None:
        lo, hi, _ = sg.expand_rows(c.segments)
        got = dense_rows(lo, hi, plan.kv_len)
        assert torch.equal(got, expected.reshape(-1, *got.shape[1:]).expand_as(got))


@pytest.mark.parametrize("chunk_tiles", [1, 3, 10**6])
@pytest.mark.parametrize(
    "mask,n,kv",
    [
        (masks.causal(), 100, None),
        (masks.sliding_window(9), 77, 50),
        (masks.document([13, 40, 3, 44]), 100, None),
        (masks.hstu([30, 34], [4, 5], contextual=3), 64, None),
        (masks.clear((5, 7), 2, 6), 41, None),
        (masks.per_head([masks.causal(), masks.prefix_lm(20)]), 50, None),
        (masks.sliding_window(4), 50, 30),  # the last rows see no key
    ],
)
def test_compact_from_mask_equals_the_plans(mask, n, kv, chunk_tiles):
    c = sg.compact_from_mask(mask, n, kv, block_m=16, block_n=8, chunk_tiles=chunk_tiles)
    heads = 2 if mask.head_count else None
    plan = cm.compile(mask, n, kv, heads=heads, block_m=16, block_n=8, cache=False)
    ref = check_compact(plan)
    assert (c.forward.encoding, c.backward.encoding) == (ref.forward.encoding,
                                                         ref.backward.encoding)  # fmt: skip
    for got, want in ((c.forward, ref.forward), (c.backward, ref.backward)):
        assert torch.equal(got.ptr, want.ptr) and torch.equal(got.entries, want.entries)
    assert c.nbytes == ref.nbytes


def test_tile_grid_masks_are_refused_by_compact_from_mask():
    with pytest.raises(CompileMaskError):
        sg.compact_from_mask(masks.tile_grid(masks.clear((8, 8), 3, 4), (4, 4)), 68)


def test_size_choice():
    causal = cm.compile(masks.causal(), 4096, cache=False).compact()
    assert causal.rows == "segments" and causal.segments.num_segments == 1
    assert causal.forward.encoding == "runs"  # one FULL run and one PARTIAL tile per q-tile
    assert causal.forward.entries.shape[0] == 2 * 32 - 1
    # a random mask: rows of many short runs keep their rows / bitmasks
    g = torch.Generator().manual_seed(1)
    noisy = cm.from_dense(torch.rand(96, 96, generator=g) < 0.5, block_m=16, block_n=16)
    assert noisy.compact().rows in ("rows", "bits")
    rows = cm.from_dense(torch.rand(64, 64, generator=g) < 0.05, block_m=16, block_n=16)
    c = check_compact(rows)
    if c.rows == "rows":
        assert c.row_bytes == sg.rows_nbytes(1, 64, rows.max_intervals)


def test_documents_share_one_template():
    lengths = [5, 17, 3, 40, 63]
    c = cm.compile(masks.document(lengths), cache=False).compact()
    seg = c.segments
    assert seg.num_segments == len(lengths)
    assert seg.slot_ptr.shape[0] == 2  # one template: [r0, q + 1)
    assert seg.r0.tolist() == [0, 5, 22, 25, 65]


def test_segment_starts_are_the_greedy_ones():
    # lo: 0 0 0 5 0 0 0 -> runs [0, 3), [3, 4) and [4, 7) (greedy: a pair is always affine)
    lo = torch.tensor([0, 0, 0, 5, 0, 0, 0], dtype=torch.int32).view(1, 7, 1)
    hi = lo + 1
    seg = sg.segments_from_rows(lo, hi, torch.ones(1, 7, dtype=torch.int32), 10)
    assert seg.r0.tolist() == [0, 3, 5]  # [3, 5) is the pair (5, 0): slope -5
    got = sg.expand_rows(seg, k=1)
    assert torch.equal(got[0], lo) and torch.equal(got[1], hi)


def test_large_jumps_split_segments():
    lo = torch.tensor([0, 200, 400, 600], dtype=torch.int32).view(1, 4, 1)
    seg = sg.segments_from_rows(lo, lo + 1, torch.ones(1, 4, dtype=torch.int32), 700)
    assert seg.num_segments == 4  # slopes must fit int8
    assert torch.equal(sg.expand_rows(seg, k=1)[0], lo)


def test_empty_rows_and_single_rows():
    plan = cm.compile(masks.sliding_window(3), 1, 1, block_m=16, block_n=16, cache=False)
    check_compact(plan)
    plan = cm.compile(masks.sliding_window(2), 40, 10, block_m=16, block_n=16, cache=False)
    c = check_compact(plan)
    assert int(sg.expand_rows(c.segments, 20, 40)[2].max()) == 0


def test_bad_row_shapes_are_refused():
    lo = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(CompileMaskError, match="lo, hi"):
        sg.segments_from_rows(lo, lo, lo, 3)


def test_verify_checks_the_segments():
    plan = cm.compile(cm.masks.document([5, 9, 6]))
    seg = plan.compact().segments
    plan.verify()
    seg.base[0, 1] += 1  # a bound of the first template moves: rows no longer expand back
    with pytest.raises(CompileMaskError, match="segments"):
        plan.verify()
    seg.base[0, 1] -= 1
    seg.r0[1], seg.r0[2] = int(seg.r0[2]), int(seg.r0[1])  # out of order
    with pytest.raises(CompileMaskError, match="segments.r0"):
        plan.verify()


def test_stats_report_the_compact_size():
    plan = cm.compile(cm.masks.causal(), 1024)
    st = plan.stats()
    assert st["compact_bytes"] == plan.compact().nbytes < st["bytes"] / 10


def test_bytes_by_part_add_up_and_count_derived_tilings():
    """``nbytes_by_part``: the row tensors, the default schedule and the tilings derived so
    far; ``stats`` reports it beside the compact form's parts."""
    plan = cm.compile(masks.hstu([300, 200, 12], [4, 2, 1]), 512, block_m=64, block_n=64)
    parts = plan.nbytes_by_part()
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert parts["total"] - parts["tilings"] == plan.nbytes
    assert parts["row_lo"] == plan.row_lo.numel() * 4 and parts["permutation"] == 0
    before = parts["tilings"]
    derived = plan.tiles(32, 32)
    assert plan.nbytes_by_part()["tilings"] == before + derived.nbytes
    stats = plan.stats()
    assert stats["bytes_by_part"] == plan.nbytes_by_part()
    assert stats["compact_parts"]["bytes"] == stats["compact_bytes"] < stats["bytes"]
