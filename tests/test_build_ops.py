"""Operation counts of a device-style plan build (CPU): on a GPU every operation is a launch and
plan building is launch-bound, so these counts are what keeps it >= 20x faster than
``create_block_mask`` (``compilemask.tools.op_counts``; benchmarks/results/
cpu-build-op-counts-2026-11-30.jsonl). A change that adds operations to the build fails here
first."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton builder runs interpreted

from compilemask import masks  # noqa: E402
from compilemask.compiler import pipeline  # noqa: E402
from compilemask.compiler.lower import clear_tables, lower  # noqa: E402
from compilemask.tools.op_counts import (  # noqa: E402
    OpCounter,
    count_build_ops,
    counting_builder_launches,
)
from compilemask.workloads import workload  # noqa: E402

# measured (lower, N0 = 4096; a host table copied to the device counts as one): raise only with
# a reason in docs/perf-notes.md. First lowering of a mask / the same mask again (the piecewise
# masks keep their device table and query rows)
LOWER_OPS = {"causal": 3, "hstu": 6, "shared_prompt": 6, "clear": 6}
LOWER_OPS_AGAIN = {"causal": 3, "hstu": 4, "shared_prompt": 4, "clear": 6}
# a device build with the Triton builder (plan, forward and dK/dV schedules): these seeds have
# a piece table, which the one launch evaluates: the table's copy into the build's allocation
# (its first word the ordering's ticket: no fill), for a new mask and the same mask again (its
# host table kept) alike
BUILD_OPS = {"causal": 1, "hstu": 1, "shared_prompt": 1}
BUILD_OPS_AGAIN = {"causal": 1, "hstu": 1, "shared_prompt": 1}


@pytest.mark.parametrize("name", list(LOWER_OPS))
def test_lowering_the_seeds_stays_within_its_operation_count(name):
    w = workload(name, 4096)
    clear_tables()
    with OpCounter() as first:
        want = lower(w.mask, w.N, w.N, "cpu", trim=False)
    with OpCounter() as again:
        got = lower(w.mask, w.N, w.N, "cpu", trim=False)
    assert first.real() <= LOWER_OPS[name], dict(first.ops)
    assert again.real() <= LOWER_OPS_AGAIN[name], dict(again.ops)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize(
    "grid,radius,text_len,ops",
    [((16, 32), 16, 512, 6), ((4, 8), 2, 21, 8), ((6, 11), 3, 0, 4), ((3, 20), 6, 7, 8)],
    ids=str,
)
def test_clear_is_built_directly_whatever_its_text(grid, radius, text_len, ops):
    """No two disc rows touch: one host table and a few operations, whatever the text length
    (a text that is not a whole number of grid rows adds a copy and a fill)."""
    mask = masks.clear(grid, radius, text_len)
    n = text_len + grid[0] * grid[1]
    for trim in (False, True):
        with OpCounter() as counted:
            lower(mask, n, n, "cpu", trim=trim)
        assert counted.real() == ops, dict(counted.ops)


@pytest.mark.parametrize(
    "mask,ops",
    [
        (masks.sliding_window(1024), 4),
        (masks.prefix_lm(1000), 4),
        (masks.chunked(1000), 4),
        (masks.block_causal(1000), 5),  # the last block cut at Nk: a clamp
        (masks.global_local(256, [0, 1, 2, 3, 100, 2000]), 6),  # piecewise affine
    ],
    ids=str,
)
def test_closed_forms_lower_in_a_few_operations(mask, ops):
    """[lo, hi) canonical by construction (aranges, a clamp, the counts); global_local as
    piecewise-affine rows (a host table, searchsorted, two gathers, an addcmul)."""
    for trim in (False, True):
        with OpCounter() as counted:
            lower(mask, 4096, 4096, "cpu", trim=trim)
        assert counted.real() <= ops, dict(counted.ops)


@pytest.mark.parametrize("name", list(BUILD_OPS))
def test_the_triton_builder_launches_one_kernel_and_nothing_else(name):
    """A device-style build (plan, then the forward and dK/dV schedules at the plan's tiling):
    the host table's copy into the build's allocation (the ordering's ticket included) and one
    ``_build_schedule`` launch, which also makes the rows; the schedules reuse the build's
    lists and work entries."""
    from compilemask.kernels.triton import tile_builder
    from compilemask.kernels.triton.schedule import dkdv_schedule, forward_schedule
    from compilemask.tools.op_counts import H2D

    w = workload(name, 1024)
    args = (w.mask, w.N, w.N, None, None)
    with counting_builder_launches() as launches, tile_builder.using(True):
        plan = pipeline.build_plan(*args, 128, 128, "cpu", host_sync=False, source="")
        forward_schedule(plan, 128, 128)  # the dummy bits tensor, once per device
        for again, limit in ((False, BUILD_OPS), (True, BUILD_OPS_AGAIN)):
            if not again:
                clear_tables()  # a new mask
            before = sum(x.n for x in launches.values())
            with OpCounter() as counted:
                plan = pipeline.build_plan(*args, 64, 64, "cpu", host_sync=False, source="")
                tiles_launches = sum(x.n for x in launches.values()) - before
                forward_schedule(plan, 64, 64)
                dkdv_schedule(plan, 64, 64)
            assert launches["_build_schedule"].n - before == tiles_launches == 1
            assert sum(x.n for x in launches.values()) - before == 1  # schedules launch nothing
            assert counted.real() <= limit[name], dict(counted.ops)
            assert counted.ops["aten.copy_.default"] == 1, dict(counted.ops)
            assert counted.ops[H2D] == 0, dict(counted.ops)  # no table copied on its own


def test_op_count_rows_name_every_stage_of_every_seed():
    rows = count_build_ops(1024)
    assert [r["workload"] for r in rows] == ["causal", "hstu", "shared_prompt", "clear"]
    for r in rows:
        assert r["lower_ops"] <= LOWER_OPS[r["workload"]]
        assert r["tiles_ops"] > 0 and r["schedules_ops"] > 0 and r["slots"] >= 1
        assert r["tile_builder"] == "tensor ops"
