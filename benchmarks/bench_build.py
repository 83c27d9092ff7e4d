"""Plan build time on the GPU, for A/B runs of two source trees (one process per tree).

    PYTHONPATH=src python benchmarks/bench_build.py [--n0 1024 32768] [--variant NAME]
        [--repeats 100] [--out FILE.jsonl] [--fresh]

Times what ``compilemask bench --modes plan`` times (``compile(mask, N, device="cuda",
cache=False)`` plus the forward and dK/dV schedules at 128 x 128) for causal, hstu and
shared_prompt: ``ms`` the median of ``--repeats`` warm builds each synchronised before and
after (wall time), ``host_ms`` the median host time of a build issued without waiting for the
device (what the CPU spends; builds do not synchronise). Uses only the public API and the
schedule functions, so an older tree runs it too (``PYTHONPATH=<its src>``); run the trees as
alternating processes (``--variant`` names the tree, ``COMPILEMASK_COMMIT`` its commit).
``--fresh`` forgets the lowering's per-mask tables and what is kept per mask object (its text,
its checked call arguments) before each build (``tables`` column), as a new mask every step
would.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import compilemask as cm
from compilemask.compiler import lower as lower_mod
from compilemask.compiler import pipeline
from compilemask.kernels.triton.schedule import dkdv_schedule, forward_schedule
from compilemask.tools.bench_report import append_rows, environment
from compilemask.workloads import workload

SEEDS = ("causal", "hstu", "shared_prompt")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n0", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--variant", default="this tree")
    ap.add_argument("--out", default=None)
    ap.add_argument("--fresh", action="store_true",
                    help="forget the lowering's per-mask tables and what is kept per mask "
                         "object before every build (untimed): what a new mask each step "
                         "costs")  # fmt: skip
    a = ap.parse_args()
    clear = getattr(lower_mod, "clear_tables", lambda: None)
    # what is kept per mask object (its text, its checked calls): a new mask has none
    forget = getattr(pipeline, "forget_masks", None) or getattr(pipeline, "_TEXTS", {}).clear

    def clear_tables():
        clear()
        forget()

    dev = torch.device("cuda")
    env = environment()
    rows = []
    for n0 in a.n0:
        for name in SEEDS:
            w = workload(name, n0)

            def build(w=w):
                plan = cm.compile(w.mask, w.N, device=dev, cache=False)
                forward_schedule(plan, 128, 128)
                dkdv_schedule(plan, 128, 128)

            for _ in range(5):
                build()
            wall, host = [], []
            for _ in range(a.repeats):
                if a.fresh:
                    clear_tables()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                build()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                host.append((t1 - t0) * 1e3)
                wall.append((t2 - t0) * 1e3)
            row = {
                **env, "kind": "plan_build", "workload": name, "N0": n0, "N": w.N,
                "variant": a.variant, "ms": round(statistics.median(wall), 4),
                "min_ms": round(min(wall), 4), "host_ms": round(statistics.median(host), 4),
                "repeats": a.repeats, "tables": "fresh" if a.fresh else "kept",
                "includes": "compile + forward and dK/dV schedules, 128x128, cache off",
            }  # fmt: skip
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("variant", "workload", "N0", "ms", "host_ms")}))
    if a.out:
        append_rows(a.out, rows)


if __name__ == "__main__":
    main()
