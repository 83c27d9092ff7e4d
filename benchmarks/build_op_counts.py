"""Count the tensor operations of a device-style plan build (CPU, no GPU needed).

    PYTHONPATH=src python3 benchmarks/build_op_counts.py [--out benchmarks/results/...jsonl]

On a GPU every operation other than views and allocations is at least one kernel launch, and
the builder is launch-bound: these counts bound how fast a plan can be built there (views and
allocations are not counted; each host table copied to the device counts as one). Stages:
``lower`` (row intervals), ``tiles`` (the 128x128 tile schedule) and ``schedules`` (the forward
and dK/dV schedules the kernels read). Seed workloads at N0 = 32768. ``--triton-builder``
builds the schedules with ``kernels/triton/tile_builder.py`` (on the CPU through Triton's
interpreter, so use a small ``--n0``) and adds its kernel launches to the counts.
"""

from __future__ import annotations

import argparse
import collections
import json

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from compilemask.compiler.lower import _Ctx, lower
from compilemask.compiler.pipeline import build_plan
from compilemask.compiler.tiles import build_tiles
from compilemask.kernels.triton.schedule import dkdv_schedule, forward_schedule
from compilemask.tools.bench_report import environment
from compilemask.workloads import SEED_WORKLOADS, workload

VIEWS = {
    "aten.view.default", "aten.unsqueeze.default", "aten.slice.Tensor", "aten.select.int",
    "aten.expand.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.t.default",
    "aten.transpose.int", "aten.squeeze.dim", "aten.permute.default", "aten.alias.default",
    "aten.detach.default", "aten.unbind.int", "aten.split_with_sizes.default",
    "aten.split.Tensor",
    # allocations: no kernel launch (the caching allocator)
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
    # a host list made a CPU tensor: no launch (its copy to the device is counted, below)
    "aten.lift_fresh.default",
}  # fmt: skip
#: Pseudo-operation: a host table copied to the plan's device (``lower._Ctx.t``), a copy on a
#: GPU that a CPU build does not make.
H2D = "host-to-device copy"


class _Launches:
    """Counts the launches of a Triton kernel (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.n = kernel, 0

    def __getitem__(self, grid):
        self.n += 1
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            # Triton's interpreter runs the kernel with tensor operations of its own: not ours
            with _disable_current_modes():
                return launch(*args, **kwargs)

        return run


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __enter__(self):
        table = _Ctx.t

        def counted(ctx, values):
            self.ops[H2D] += 1
            return table(ctx, values)

        self._table, _Ctx.t = table, counted
        return super().__enter__()

    def __exit__(self, *exc):
        _Ctx.t = self._table
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def real(self) -> int:
        return sum(n for op, n in self.ops.items() if op not in VIEWS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--n0", type=int, default=32768)
    ap.add_argument("--triton-builder", action="store_true")
    a = ap.parse_args()
    launches = []
    if a.triton_builder:
        from compilemask.kernels.triton import tile_builder

        tile_builder.enable()
        for name in ("_classify_tiles", "_tile_lists", "_heaviest_first_kernel"):
            launches.append(_Launches(getattr(tile_builder, name)))
            setattr(tile_builder, name, launches[-1])
    rows = []
    for name in SEED_WORKLOADS:
        w = workload(name, a.n0)
        with _Count() as c_lower:
            lo, hi, cnt = lower(w.mask, w.N, w.N, "cpu", trim=False)
        m = lo.shape[0] * lo.shape[1]
        lo, hi = (t.reshape(m, w.N, -1).contiguous() for t in (lo, hi))
        cnt = cnt.reshape(m, w.N).contiguous()
        before = sum(x.n for x in launches)
        with _Count() as c_tiles:
            build_tiles(lo, hi, cnt, w.N, w.N, 128, 128, use_bits=False)
        tiles_launches = sum(x.n for x in launches) - before
        plan = build_plan(w.mask, w.N, w.N, None, None, 128, 128, "cpu", host_sync=False, source="")
        before = sum(x.n for x in launches)
        with _Count() as c_sched:
            forward_schedule(plan, 128, 128)
            dkdv_schedule(plan, 128, 128)
        sched_launches = sum(x.n for x in launches) - before
        row = {
            **environment(), "workload": name, "N0": a.n0, "N": w.N, "kind": "op_count",
            "lower_ops": c_lower.real(), "tiles_ops": c_tiles.real() + tiles_launches,
            "schedules_ops": c_sched.real() + sched_launches, "slots": lo.shape[-1],
            "tile_builder": "triton" if a.triton_builder else "tensor ops",
        }  # fmt: skip
        rows.append(row)
        print(json.dumps({k: row[k] for k in row if k not in ("date", "torch", "triton")}))
    if a.out:
        with open(a.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
