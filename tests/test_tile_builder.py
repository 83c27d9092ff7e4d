"""The Triton tile-schedule builder (kernels/triton/tile_builder.py) equals the tensor builder
(compiler/tiles.py, ``use_bits=False``) field by field, through Triton's interpreter on the CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the tile builder needs triton installed")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import compilemask as cm  # noqa: E402
from compilemask.compiler import tiles as tiles_mod  # noqa: E402
from compilemask.compiler.tiles import build_tiles  # noqa: E402
from compilemask.errors import LayoutError  # noqa: E402
from compilemask.kernels.triton import tile_builder  # noqa: E402
from compilemask.kernels.triton.schedule import split_full_first, work_list  # noqa: E402
from compilemask.language.semantics import dense  # noqa: E402
from conftest import DEVICE, cases, kernel_masks, on_interpreter  # noqa: E402

pytestmark = pytest.mark.kernel
KERNEL_MASKS = kernel_masks(100)
FIELDS = ("kind", "pairs", "jlo", "jhi", "bits_index", "q_count", "q_list", "kv_count",
          "kv_list", "q_order", "kv_order")  # fmt: skip


def _intervals(mask, n, kv, batch=None, heads=None):
    plan = cm.compile(mask, n, kv, batch=batch, heads=heads, cache=False)
    if plan.encoding != "intervals":
        pytest.skip("bits plan")
    return plan.row_lo.to(DEVICE), plan.row_hi.to(DEVICE), plan.row_count.to(DEVICE), plan


def _assert_same(lo, hi, count, q_len, kv_len, bm, bn):
    want = build_tiles(lo, hi, count, q_len, kv_len, bm, bn, use_bits=False)
    got = tile_builder.build_tiles_triton(lo, hi, q_len, kv_len, bm, bn)
    _assert_schedules_equal(got, want)


def _assert_schedules_equal(got, want):
    """``got`` (built by the Triton builder) equals the tensor builder's ``want`` field by
    field, and so do the FULL-first lists and work entries the builder made with it (where
    the kernels' schedules read which tiles are FULL)."""
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), f"{name} differs"
    assert got.bits.shape == want.bits.shape
    for transposed, lists, counts in ((False, want.q_list, want.q_count),
                                      (True, want.kv_list, want.kv_count)):  # fmt: skip
        ref_list, ref_full = split_full_first(want.kind, lists, counts, transposed=transposed)
        made = tile_builder.full_first_lists(got.kind, transposed)
        assert torch.equal(made[1], ref_full), transposed  # what the build launch wrote
        assert torch.equal(made[0], ref_list), transposed
        _, _, full_first, full_count = tile_builder.tile_lists(got.kind, transposed=transposed)
        assert torch.equal(full_count, ref_full)
        assert torch.equal(full_first, ref_list)
        # the work entries made in the ordering launch (schedule.work_list)
        order = want.kv_order if transposed else want.q_order
        if made[2] is not None or got.kind.numel():
            assert made[2] is not None
            assert torch.equal(made[2], work_list(order, counts, ref_full, ref_list)), transposed


@pytest.mark.parametrize(
    "mask, n, kv, tiles",
    [
        (KERNEL_MASKS["causal"](), 100, None, (16, 32)),
        (KERNEL_MASKS["window_prefix"](), 90, 70, (32, 16)),
        (KERNEL_MASKS["document"](), None, None, (32, 32)),
        (KERNEL_MASKS["shared_prompt"](), None, None, (16, 16)),
        (cm.masks.hstu([30, 25, 15], [3, 2, 4], contextual=2), None, None, (16, 32)),
        (cm.masks.clear((8, 12), 3, 16), None, None, (32, 32)),
        (KERNEL_MASKS["dilated_bits"](), 120, None, (16, 64)),
    ],
    ids=["causal", "window_prefix", "document", "shared_prompt", "hstu", "clear", "dilated"],
)
def test_seed_like_masks(mask, n, kv, tiles):
    lo, hi, count, plan = _intervals(mask, n, kv)
    _assert_same(lo, hi, count, plan.q_len, plan.kv_len, *tiles)


def test_per_head_and_per_batch_masks():
    mask = cm.masks.per_head([cm.masks.causal(), cm.masks.dilated(30, 4)])
    lo, hi, count, plan = _intervals(mask, 75, None, heads=2)
    _assert_same(lo, hi, count, 75, 75, 16, 32)
    mask = cm.masks.per_batch([cm.masks.chunked(16), cm.masks.sliding_window(5)])
    lo, hi, count, plan = _intervals(mask, 60, 80, batch=2)
    _assert_same(lo, hi, count, 60, 80, 32, 16)


def test_schedules_ordered_in_a_second_launch(monkeypatch):
    # axes longer than _FUSED_ORDER_MAX_TILES: no tickets in the allocation, the orders and
    # work entries from heaviest_first
    monkeypatch.setattr(tile_builder, "_FUSED_ORDER_MAX_TILES", 2)
    mask = cm.masks.per_head([cm.masks.causal(), cm.masks.dilated(30, 4)])
    lo, hi, count, plan = _intervals(mask, 75, None, heads=2)
    _assert_same(lo, hi, count, 75, 75, 16, 32)
    _assert_same(lo, hi, count, 75, 75, 32, 32)


@pytest.mark.parametrize("m, tq, tk, order", [(2, 5, 3, True), (3, 4, 4, True), (1, 7, 9, False)])
def test_outputs_tile_one_allocation(m, tq, tk, order):
    # the views _build_schedule's offsets assume: contiguous, in memory order, back to back
    runs, where = tile_builder._layout(m, tq, tk, 32, 64, order)
    flat, out = tile_builder._outputs(runs, where, torch.device("cpu"))
    memory = sorted(range(len(out)), key=where.__getitem__)
    offset = 0
    for i in memory:
        t = out[i]
        assert t.is_contiguous() and t.dtype == torch.int32
        assert t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert t.storage_offset() == offset, i
        offset += t.numel()
    assert offset == flat.numel()
    tiles, per_q, per_kv = m * tq * tk, m * tq, m * tk
    assert [out[i].numel() for i in memory] == (
        [tiles] * 10 + [per_q] * 3 + [per_kv] * 3 + [8 * per_q, 8 * per_kv, m if order else 0, 0]
    )


def test_outputs_with_the_rows_tile_one_allocation():
    # a build from a piece table: the plan's rows after the schedule's work entries, then the
    # table's 9 words (its first word the ordering's ticket), in the same allocation
    runs, where = tile_builder._layout(1, 4, 3, 32, 64, True, (100, 2, 9))
    flat, out = tile_builder._outputs(runs, where, torch.device("cpu"))
    assert [tuple(t.shape) for t in out[20:]] == [(1, 100, 2), (1, 100, 2), (1, 100)]
    assert out[20].storage_offset() == out[17].storage_offset() + out[17].numel()  # kv_work
    assert out[21].storage_offset() == out[20].storage_offset() + 200
    assert out[18].storage_offset() == out[22].storage_offset() + 100  # the table
    assert tuple(out[18].shape) == (9,) and out[18].storage_offset() + 9 == flat.numel()


TABLED = [
    (cm.masks.causal(), 100, 100),
    (cm.masks.causal(), 100, 70),  # rows past Nk: a second piece
    (cm.masks.causal(), 70, 100),
    (cm.masks.document([40, 25, 35]), 100, 100),
    (cm.masks.document([40, 25, 35], causal=False), 100, 100),
    (cm.masks.shared_prompt([10, 0, 7], [[20, 5], [9], [1, 1, 12]]), 65, 65),
    (cm.masks.hstu([30, 25, 15], [3, 2, 4], contextual=2), 70, 70),
    (cm.masks.hstu([1, 9, 33, 2, 20], [0, 8, 1, 1, 0], contextual=40), 65, 65),
]


@on_interpreter
@pytest.mark.parametrize("tiles", [(16, 32), (32, 16), (64, 64)], ids=str)
@pytest.mark.parametrize("mask, n, kv", TABLED, ids=[f"{m}-{n}-{kv}" for m, n, kv in TABLED])
def test_rows_from_a_piece_table_in_the_launch(mask, n, kv, tiles, monkeypatch):
    """A device build of a mask with a piece table: the one launch evaluates the table and
    writes the plan's rows into its allocation. Rows equal the lowering's, bit for bit (and
    the dense evaluator's), the schedule the tensor builder's of those rows."""
    monkeypatch.setattr(tile_builder, "_FUSED_ORDER_MAX_TILES", 4)  # both ordering paths
    _assert_built_from_table(mask, n, kv, tiles)


def _assert_built_from_table(mask, n, kv, tiles):
    from compilemask.compiler import pipeline
    from compilemask.compiler.lower import clear_tables, lower
    from compilemask.tools.op_counts import counting_builder_launches

    clear_tables()  # a new mask
    with counting_builder_launches() as launches, tile_builder.using(True):
        plan = pipeline.build_plan(mask, n, kv, None, None, *tiles, "cpu", host_sync=False,
                                   source="")  # fmt: skip
    assert launches["_build_schedule"].n == 1
    flat = plan.schedule.kind.untyped_storage().data_ptr()
    for name, want in zip(("row_lo", "row_hi", "row_count"), lower(mask, n, kv, "cpu", trim=False)):
        got = getattr(plan, name)
        assert got.untyped_storage().data_ptr() == flat, name
        assert got.shape == want.shape[1:] and torch.equal(got, want[0]), name
    rows = torch.arange(kv)
    seen = ((plan.row_lo[0, :, :, None] <= rows) & (rows < plan.row_hi[0, :, :, None])).any(1)
    assert torch.equal(seen, dense(mask, n, kv).reshape(n, kv))
    ref = build_tiles(plan.row_lo, plan.row_hi, plan.row_count, n, kv, *tiles, use_bits=False)
    _assert_schedules_equal(plan.schedule, ref)


EDGES = [
    # rows 0-14 see [0, 38), row 15 [0, 16): the first 16 x 16 tile FULL through two pieces
    cm.masks.hstu([40, 24], [2, 3], contextual=15),
    # targets from row 21 see [0, 20) and [q, q + 1): tile (rows 48-63, keys 32-47) empty
    cm.masks.hstu([60], [40]),
    # row 0 sees [0, 1), rows 1-40 [1, 41): tile (rows 0-15, keys 16-31) one row short of
    # FULL; rows 48-63 see [48, 64): tile (rows 48-63, keys 32-47) empty
    cm.masks.document([1, 40, 7, 16], causal=False),
    cm.masks.shared_prompt([15, 1], [[1, 20], [3, 24]]),
]


@on_interpreter
@pytest.mark.parametrize("mask", EDGES, ids=str)
def test_column_kinds_where_pieces_meet_tile_edges(mask):
    """Pieces ending one row before or after a tile's edge, diagonals reaching one key short
    of a tile: the kv-tile programs' kinds from the pieces' ranges of rows (FULL, partial,
    empty by one row) equal the tensor builder's."""
    n = cm.compile(mask, None, cache=False).q_len
    _assert_built_from_table(mask, n, n, (16, 16))


@st.composite
def tabled_masks(draw):
    """(mask, Nq, Nk) of a catalogue mask with a piece table: runs as short as one row (a
    q-tile then crosses many pieces, and pieces end one row into a tile), documents seen
    both ways, and long runs that leave whole q-tile chunks out of a kv-tile's column."""
    name = draw(st.sampled_from(["causal", "document", "shared_prompt", "hstu"]))
    run = st.one_of(st.integers(1, 3), st.integers(1, 24))
    if name == "causal":
        return cm.masks.causal(), draw(st.integers(1, 120)), draw(st.integers(1, 120))
    if name == "document":
        lengths = draw(st.lists(run, min_size=1, max_size=8))
        return cm.masks.document(lengths, causal=draw(st.booleans())), sum(lengths), sum(lengths)
    if name == "shared_prompt":
        prompts = draw(st.lists(st.integers(0, 20), min_size=1, max_size=3))
        responses = [draw(st.lists(run, min_size=1, max_size=3)) for _ in prompts]
        n = sum(prompts) + sum(map(sum, responses))
        return cm.masks.shared_prompt(prompts, responses), n, n
    lengths = draw(st.lists(st.integers(1, 30), min_size=1, max_size=6))
    targets = [draw(st.integers(0, length - 1)) for length in lengths]
    mask = cm.masks.hstu(lengths, targets, contextual=draw(st.integers(0, 40)))
    return mask, sum(lengths), sum(lengths)


@on_interpreter
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=tabled_masks(), bm=st.sampled_from([16, 32, 64]),
       bn=st.sampled_from([16, 32, 48, 64]), chunk=st.sampled_from([2, 256]))  # fmt: skip
def test_column_kinds_from_the_pieces(case, bm, bn, chunk):
    """The kv-tile programs classify their column from the table's pieces (``table_tiles``:
    per q-tile, per piece crossed, the ranges of rows touching and covering the kv-tile), not
    from evaluated rows: their lists, FULL-first lists and work entries equal the tensor
    builder's for random tables, ``chunk`` q-tiles at a time."""
    mask, n, kv = case
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tile_builder, "_TABLE_CHUNK", chunk)
        mp.setattr(tile_builder, "_SETUPS", {})  # the launch's constants, made again
        _assert_built_from_table(mask, n, kv, (bm, bn))


def test_masks_without_a_piece_table_lower_their_rows_first():
    from compilemask.compiler import pipeline

    args = (cm.masks.sliding_window(9), 50, 50, None, None, 16, 16, "cpu")
    with tile_builder.using(True):
        plan = pipeline.build_plan(*args, host_sync=False, source="")
    flat = plan.schedule.kind.untyped_storage().data_ptr()
    assert plan.row_lo.untyped_storage().data_ptr() != flat


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases())
def test_random_masks(case):
    mask, n, kv, bm, bn = case
    try:
        dense(mask, n, kv)
    except LayoutError:
        return
    heads = mask.head_count or None
    batch = mask.batch_count or None
    plan = cm.compile(mask, n, kv, batch=batch, heads=heads, cache=False)
    if plan.encoding != "intervals":
        return
    lo, hi, count = (t.to(DEVICE) for t in (plan.row_lo, plan.row_hi, plan.row_count))
    bm = 1 << max(4, (bm - 1).bit_length())  # the kernel's BLOCK_M: a power of two >= 16
    _assert_same(lo, hi, count, plan.q_len, plan.kv_len, bm, bn)


@on_interpreter
def test_enable_routes_compile_and_attention_through_the_kernels():
    mask = cm.masks.document([40, 25, 35])
    ref_plan = cm.compile(mask, None, block_m=16, block_n=32, cache=False)
    calls = []
    real = tile_builder.build_tiles_triton

    def spy(*args, **kwargs):
        calls.append(args[2:])
        return real(*args, **kwargs)

    tile_builder.build_tiles_triton = spy
    before = tiles_mod.device_tile_builder()
    try:
        tile_builder.enable()
        plan = cm.compile(mask, None, block_m=16, block_n=32, cache=False)
        assert calls, "the Triton builder was not used"
        for name in FIELDS:
            assert torch.equal(getattr(plan.schedule, name), getattr(ref_plan.schedule, name))
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 100, 32, generator=g, dtype=torch.float16) for _ in range(3))
        out = cm.attention(q, k, v, plan, backend="triton")
        ref = cm.attention(q, k, v, ref_plan, backend="triton")
        torch.testing.assert_close(out, ref)
    finally:
        tiles_mod.register_device_tile_builder(before)
        tile_builder.build_tiles_triton = real
    assert tiles_mod.device_tile_builder() is before


def test_cuda_plans_take_the_triton_builder_by_default():
    """``import compilemask`` registers a builder that serves CUDA tensors only and declines
    CPU ones (CPU plans keep the tensor builder) without loading Triton for them."""
    from compilemask.kernels.triton import device_builder

    assert tiles_mod.device_tile_builder() is device_builder.triton_tile_builder
    lo = torch.zeros((1, 8, 1), dtype=torch.int32)
    hi = torch.full((1, 8, 1), 8, dtype=torch.int32)
    count = torch.ones((1, 8), dtype=torch.int32)
    assert not device_builder.triton_tile_builder.serves(lo)
    assert device_builder.triton_tile_builder(lo, hi, count, 8, 8, 16, 16) is None


def test_tile_builder_environment_variable(monkeypatch):
    from compilemask.kernels.triton import device_builder

    try:
        monkeypatch.setenv(device_builder.ENV, "tensor")
        device_builder.install_default()
        assert tiles_mod.device_tile_builder() is None
        monkeypatch.setenv(device_builder.ENV, "")  # empty: the default
        device_builder.install_default()
        assert tiles_mod.device_tile_builder() is device_builder.triton_tile_builder
        monkeypatch.setenv(device_builder.ENV, "cuda-graphs")
        with pytest.warns(RuntimeWarning, match="COMPILEMASK_TILE_BUILDER"):
            device_builder.install_default()
        assert tiles_mod.device_tile_builder() is device_builder.triton_tile_builder
    finally:
        monkeypatch.delenv(device_builder.ENV)
        device_builder.install_default()
    assert tiles_mod.device_tile_builder() is device_builder.triton_tile_builder


def test_cuda_plans_keep_the_tensor_builder_without_triton(monkeypatch):
    """Where Triton is not installed, CUDA plans fall back to the tensor builder (as
    ``backend="auto"`` falls back to the reference) instead of failing to import it."""
    from compilemask.kernels.triton import backend as validate
    from compilemask.kernels.triton import device_builder

    assert device_builder.serves_device(torch.device("cuda"))
    assert not device_builder.serves_device(torch.device("cpu"))
    monkeypatch.setattr(validate, "_TRITON_INSTALLED", False)
    assert not device_builder.serves_device(torch.device("cuda"))


def test_rows_with_many_slots_go_to_the_tensor_builder():
    """More than MAX_SLOTS intervals per row (a dilated mask): the Triton builder declines
    (its per-program interval tile would not fit) and the schedule equals the tensor
    builder's."""
    plan = cm.compile(cm.masks.dilated(200, 2), 64, 512, block_m=32, block_n=64, cache=False)
    assert plan.row_lo.shape[-1] > tile_builder.MAX_SLOTS
    args = (plan.row_lo, plan.row_hi, plan.row_count, 64, 512, 32, 64)
    assert tile_builder._device_builder(*args) is None
    ref = build_tiles(*args, use_bits=False)
    with tile_builder.using(True):
        got = build_tiles(*args, use_bits=False)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(ref, name)), name


@on_interpreter
def test_heaviest_first_kernel_equals_a_stable_argsort(monkeypatch):
    g = torch.Generator().manual_seed(1)
    q_count = torch.randint(0, 5, (3, 150), generator=g, dtype=torch.int32)
    kv_count = torch.randint(0, 5, (3, 70), generator=g, dtype=torch.int32)
    want = [torch.argsort(-c, dim=-1, stable=True).to(torch.int32) for c in (q_count, kv_count)]
    for limit in (8192, 100):  # the kernel, then the sort fallback for the longer axis
        monkeypatch.setattr(tile_builder, "_ORDER_KERNEL_MAX_TILES", limit)
        got = tile_builder.heaviest_first(q_count, kv_count)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_kept_causal_table_serves_only_its_own_query_length():
    """Causal's piece table ends at ``min(Nq, Nk)`` and ``Nq``: a build for another ``Nq``
    with the same ``Nk`` (table kept from the first) gets its own table, rows equal to the
    dense evaluator's."""
    from compilemask.compiler import pipeline
    from compilemask.compiler.lower import clear_tables

    mask = cm.masks.causal()
    clear_tables()
    with tile_builder.using(True):
        for n in (30, 40, 20):
            plan = pipeline.build_plan(mask, n, 20, None, None, 16, 16, "cpu", host_sync=False,
                                       source="")  # fmt: skip
            assert torch.equal(plan.to_dense().reshape(n, 20), dense(mask, n, 20).reshape(n, 20))


def test_built_schedules_are_the_dataclass_of_their_fields():
    """The builder sets a schedule's fields directly (no generated ``__init__``): the object
    is the one the constructor makes from the same values (fields in order, nothing else),
    frozen, and ``dataclasses.replace`` copies it."""
    import dataclasses

    lo, hi, count, plan = _intervals(cm.masks.causal(), 40, None)
    got = tile_builder.build_tiles_triton(lo, hi, 40, 40, 16, 16)
    names = [f.name for f in dataclasses.fields(tiles_mod.TileSchedule)]
    made = tiles_mod.TileSchedule(*(getattr(got, n) for n in names))
    assert list(vars(got)) == list(vars(made)) == names
    assert all(getattr(got, n) is getattr(made, n) for n in names)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.kind = got.pairs
    assert dataclasses.replace(got, block_m=32).block_m == 32
