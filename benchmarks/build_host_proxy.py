"""CPU proxy of a GPU plan build's host time: a device-style build with the Triton builder's
kernels stubbed out.

    PYTHONPATH=src python benchmarks/build_host_proxy.py [--n0 1024 32768] [--out FILE.jsonl]
        [--fresh | --kept]

Times ``compile(mask, N, device="cpu", cache=False)`` plus the forward and dK/dV schedules at
128 x 128 (what ``compilemask bench --modes plan`` times on a GPU) for causal, hstu and
shared_prompt, built the way a GPU build is: K untrimmed, no bitmask tiles, the Triton tile
builder (``kernels/triton/tile_builder.py``) with its kernels replaced by stubs that launch
nothing, and no memory query (a GPU build asks the driver, a CPU build reads /proc/meminfo).
What remains is the Python of the build and the tensor operations, which on the CPU also
compute (at 32K that is not host time). Each row: minimum and median ms over ``--repeats``
builds, the operations a GPU would launch (``compilemask.tools.op_counts.OpCounter``) and the
Triton launches; ``launch_at_*``: the time from the build's start to its ``_build_schedule``
launch (on a GPU the device builds from then on, while the rest of the Python runs: a build's
wall time there is about this plus the longer of the launch's device time and the Python
after it). ``tables``: ``kept`` builds the same mask object again (its lowering tables kept,
if the tree keeps them), ``fresh`` forgets them and what is kept per mask object (its text,
its checked call arguments) before every build (a new mask each step, what
``benchmarks/bench_build.py --fresh`` times on a GPU); both by default, ``--fresh`` or
``--kept`` for one. Runs on any tree with ``tools/op_counts.py`` (an older one: pass its
``src`` on PYTHONPATH, ``--variant`` names it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"  # the builder serves the CPU only through the interpreter

import torch  # noqa: E402

import compilemask as cm  # noqa: E402
from compilemask.compiler import lower as lower_mod  # noqa: E402
from compilemask.compiler import pipeline  # noqa: E402
from compilemask.kernels.triton import tile_builder  # noqa: E402
from compilemask.kernels.triton.schedule import dkdv_schedule, forward_schedule  # noqa: E402
from compilemask.tools.bench_report import append_rows, environment  # noqa: E402
from compilemask.tools.op_counts import BUILDER_KERNELS, OpCounter  # noqa: E402
from compilemask.workloads import workload  # noqa: E402

SEEDS = ("causal", "hstu", "shared_prompt")


class _Stub:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` counts, notes when it was
    launched (``perf_counter``) and launches nothing."""

    def __init__(self):
        self.n = 0
        self.at = 0.0

    def __getitem__(self, grid):
        self.n += 1
        self.at = time.perf_counter()
        return lambda *args, **kwargs: None


def _device_style() -> dict[str, _Stub]:
    stubs = {name: _Stub() for name in BUILDER_KERNELS}
    for name, stub in stubs.items():
        setattr(tile_builder, name, stub)
    tile_builder.enable()
    build_plan = pipeline.build_plan

    def untrimmed(*args, host_sync, **kwargs):
        return build_plan(*args, host_sync=False, **kwargs)

    pipeline.build_plan = untrimmed
    pipeline.available_memory = lambda device: None
    return stubs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n0", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--variant", default="this tree")
    ap.add_argument("--out", default=None, help="JSON-lines file the rows are appended to")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--fresh", action="store_true", help="only a new mask each build")
    only.add_argument("--kept", action="store_true", help="only the same mask again")
    a = ap.parse_args()
    modes = ("fresh",) if a.fresh else ("kept",) if a.kept else ("kept", "fresh")
    torch.set_num_threads(1)
    stubs = _device_style()
    clear_tables = getattr(lower_mod, "clear_tables", lambda: None)
    # what is kept per mask object (its text, its checked calls): a new mask has none
    forget = getattr(pipeline, "forget_masks", None) or getattr(pipeline, "_TEXTS", {}).clear

    def clear():
        clear_tables()
        forget()

    env = environment()
    rows = []
    for n0 in a.n0:
        for name in SEEDS:
            w = workload(name, n0)
            for tables in modes:

                def build(w=w, tables=tables):
                    if tables == "fresh":
                        clear()
                    plan = cm.compile(w.mask, w.N, device="cpu", cache=False)
                    forward_schedule(plan, 128, 128)
                    dkdv_schedule(plan, 128, 128)

                for _ in range(10):
                    build()
                before = sum(s.n for s in stubs.values())
                with OpCounter() as ops:
                    build()
                launches = sum(s.n for s in stubs.values()) - before
                times, before_launch = [], []
                first = stubs["_build_schedule"]
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    build()
                    times.append((time.perf_counter() - t0) * 1e3)
                    before_launch.append((first.at - t0) * 1e3)
                row = {
                    **env, "kind": "host_proxy", "workload": name, "N0": n0, "N": w.N,
                    "variant": a.variant, "tables": tables, "ops": ops.real(),
                    "launches": launches, "min_ms": round(min(times), 4),
                    "median_ms": round(statistics.median(times), 4), "repeats": a.repeats,
                    "threads": 1, "launch_at_min_ms": round(min(before_launch), 4),
                    "launch_at_median_ms": round(statistics.median(before_launch), 4),
                }  # fmt: skip
                rows.append(row)
                print(json.dumps({k: row[k] for k in row if k not in ("date", "torch", "triton")}))
    if a.out:
        append_rows(a.out, rows)


if __name__ == "__main__":
    main()
