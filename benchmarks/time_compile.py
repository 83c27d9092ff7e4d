"""Warm time of ``compilemask.compile`` from the language at 32K on a GPU: the seed workloads'
masks built with ``cache=False`` (every build lowers its rules and builds its tile schedule),
median of ``--repeat`` builds after three untimed ones, a device synchronisation before and
after each. One JSON line per workload on stdout with ``--label`` and the commit
(``COMPILEMASK_COMMIT`` or git): a lean loop for comparing two source trees on one machine.

    PYTHONPATH=src python benchmarks/time_compile.py --label new
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

import torch

import compilemask as cm
from compilemask.workloads import workload


def commit() -> str:
    sha = os.environ.get("COMPILEMASK_COMMIT")
    if sha:
        return sha
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="")
    ap.add_argument("--size", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--workloads", nargs="+", default=["causal", "hstu", "shared_prompt", "clear"])
    a = ap.parse_args()
    sha = commit()
    for name in a.workloads:
        w = workload(name, a.size)

        def build():
            return cm.compile(w.mask, w.N, device="cuda", cache=False)  # noqa: B023

        for _ in range(3):
            build()
        times = []
        for _ in range(a.repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            build()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        row = {"label": a.label, "commit": sha, "workload": name, "N": w.N,
               "compile_ms": round(statistics.median(times) * 1e3, 3)}  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
