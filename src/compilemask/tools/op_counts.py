"""Count the tensor operations of a device-style plan build (CPU, no GPU needed).

On a GPU every operation other than views and allocations is at least one kernel launch, and
the plan builder is launch-bound: these counts bound how fast a plan can be built there (views
and allocations are not counted; each host table copied to the device counts as one). Stages:
``lower`` (row intervals), ``tiles`` (the 128x128 tile schedule) and ``schedules`` (the forward
and dK/dV schedules the kernels read), for the seed workloads. With ``triton_builder`` the
schedules come from ``kernels/triton/tile_builder.py`` (on the CPU through Triton's
interpreter, so use a small ``n0``) and its kernel launches are added to the counts.

Command line::

    python -m compilemask.tools.op_counts [--n0 32768] [--triton-builder] [--out FILE.jsonl]

Example::

    >>> from compilemask.compiler.lower import lower
    >>> from compilemask.workloads import workload
    >>> w = workload("causal", 1024)
    >>> with OpCounter() as counted:
    ...     _ = lower(w.mask, w.N, w.N, "cpu", trim=False)
    >>> counted.real() <= 3
    True
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Iterator
from contextlib import contextmanager

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..compiler.lower import _Ctx, lower

#: Operations that launch no kernel: views, allocations (the caching allocator) and a host list
#: made a CPU tensor (its copy to the device is counted as :data:`H2D`).
NO_LAUNCH = frozenset({
    "aten.view.default", "aten.unsqueeze.default", "aten.slice.Tensor", "aten.select.int",
    "aten.expand.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.t.default",
    "aten.transpose.int", "aten.squeeze.dim", "aten.permute.default", "aten.alias.default",
    "aten.detach.default", "aten.unbind.int", "aten.split_with_sizes.default",
    "aten.split.Tensor", "aten.as_strided.default",
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
    "aten.lift_fresh.default",
})  # fmt: skip
#: Pseudo-operation: a host table copied to the plan's device (``lower._Ctx.t``), a copy on a
#: GPU that a CPU build does not make.
H2D = "host-to-device copy"
#: The Triton tile builder's kernels (``kernels/triton/tile_builder.py``).
BUILDER_KERNELS = ("_build_schedule", "_tile_lists", "_heaviest_first_kernel")


class LaunchCounter:
    """Stands in for a Triton kernel and counts its launches (``kernel[grid](...)``)."""

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


class OpCounter(TorchDispatchMode):
    """Counts every aten operation (and every host table copied to the device) in its block;
    :meth:`real` is the number that launch a kernel on a GPU."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

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
        """Operations that launch a kernel on a GPU."""
        return sum(n for op, n in self.ops.items() if op not in NO_LAUNCH)


@contextmanager
def counting_builder_launches() -> Iterator[dict[str, LaunchCounter]]:
    """Replaces the Triton tile builder's kernels by :class:`LaunchCounter` s for the block
    (imports Triton); yields them by kernel name."""
    from ..kernels.triton import tile_builder

    real = {name: getattr(tile_builder, name) for name in BUILDER_KERNELS}
    counters = {name: LaunchCounter(kernel) for name, kernel in real.items()}
    for name, counter in counters.items():
        setattr(tile_builder, name, counter)
    try:
        yield counters
    finally:
        for name, kernel in real.items():
            setattr(tile_builder, name, kernel)


#: ``Tensor`` methods that copy a whole tensor to the host (no aten operation on the CPU, so
#: :class:`OpCounter` does not see them)
HOST_COPIES = ("tolist", "cpu", "numpy")


@contextmanager
def counting_host_copies() -> Iterator[dict[str, int]]:
    """Counts, in the block, the calls of :data:`HOST_COPIES` (``"n"``: on a GPU each is a read
    back) and of ``torch.tensor`` / ``torch.as_tensor`` on host data with a ``device``
    (``"h2d"``: on a GPU a copy from pageable memory that waits for the stream like a read)."""
    import torch

    seen = {"n": 0, "h2d": 0}
    real = {name: getattr(torch.Tensor, name) for name in HOST_COPIES}
    makers = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}

    def wrap(method):
        def counted(self, *args, **kwargs):
            seen["n"] += 1
            return method(self, *args, **kwargs)

        return counted

    def wrap_maker(maker):
        def counted(data, *args, **kwargs):
            if kwargs.get("device") is not None and not isinstance(data, torch.Tensor):
                seen["h2d"] += 1
            return maker(data, *args, **kwargs)

        return counted

    for name, method in real.items():
        setattr(torch.Tensor, name, wrap(method))
    for name, maker in makers.items():
        setattr(torch, name, wrap_maker(maker))
    try:
        yield seen
    finally:
        for name, method in real.items():
            setattr(torch.Tensor, name, method)
        for name, maker in makers.items():
            setattr(torch, name, maker)


def count_build_ops(n0: int = 32768, triton_builder: bool = False) -> list[dict]:
    """One row per seed workload: ``lower_ops``, ``tiles_ops``, ``schedules_ops`` (kernel
    launches a GPU build would make, at 128x128 tiles) and ``slots`` (interval slots per row).
    """
    from contextlib import nullcontext

    from ..compiler.pipeline import build_plan
    from ..compiler.tiles import build_tiles
    from ..kernels.triton.schedule import dkdv_schedule, forward_schedule
    from ..workloads import SEED_WORKLOADS, workload

    if triton_builder:
        from ..kernels.triton import tile_builder

        tile_builder.enable()
    rows = []
    with counting_builder_launches() if triton_builder else nullcontext({}) as counters:

        def launched() -> int:
            return sum(c.n for c in counters.values())

        for name in SEED_WORKLOADS:
            w = workload(name, n0)
            with OpCounter() as c_lower:
                lo, hi, cnt = lower(w.mask, w.N, w.N, "cpu", trim=False)
            m = lo.shape[0] * lo.shape[1]
            lo, hi = (t.reshape(m, w.N, -1).contiguous() for t in (lo, hi))
            cnt = cnt.reshape(m, w.N).contiguous()
            before = launched()
            with OpCounter() as c_tiles:
                build_tiles(lo, hi, cnt, w.N, w.N, 128, 128, use_bits=False)
            tiles_launches = launched() - before
            plan = build_plan(
                w.mask, w.N, w.N, None, None, 128, 128, "cpu", host_sync=False, source=""
            )
            before = launched()
            with OpCounter() as c_sched:
                forward_schedule(plan, 128, 128)
                dkdv_schedule(plan, 128, 128)
            sched_launches = launched() - before
            rows.append({
                "workload": name, "N0": n0, "N": w.N, "kind": "op_count",
                "lower_ops": c_lower.real(), "tiles_ops": c_tiles.real() + tiles_launches,
                "schedules_ops": c_sched.real() + sched_launches, "slots": lo.shape[-1],
                "tile_builder": "triton" if triton_builder else "tensor ops",
            })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    from .bench_report import append_rows, environment

    ap = argparse.ArgumentParser(prog="python -m compilemask.tools.op_counts", description=__doc__)
    ap.add_argument("--n0", type=int, default=32768, help="nominal size (default 32768)")
    ap.add_argument("--triton-builder", action="store_true", help="count the Triton builder")
    ap.add_argument("--out", default=None, help="JSON-lines file the rows are appended to")
    a = ap.parse_args(argv)
    env = environment()
    rows = [{**env, **row} for row in count_build_ops(a.n0, a.triton_builder)]
    for row in rows:
        print(json.dumps({k: row[k] for k in row if k not in ("date", "torch", "triton")}))
    if a.out:
        append_rows(a.out, rows)


if __name__ == "__main__":
    main()
