"""Where the host time of a GPU plan build goes (torch.profiler and cProfile).

    PYTHONPATH=src python3 benchmarks/profile_plan_build.py [--workloads causal shared_prompt]
        [--n0 32768] [--device cuda]

The build is what ``gpu_check.py --parts plan`` times: ``cm.compile(mask, N, device=...,
cache=False)`` and the forward and dK/dV schedules at 128x128. On a GPU the build is
host-bound (session 4: about 16 device operations take 0.64 ms for causal), so this prints, per
workload: the median wall time of one build, the device operations and Triton launches the
profiler sees (count and host time), and cProfile's heaviest Python functions (cumulative and
own time) over 20 builds.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import compilemask as cm
from compilemask.workloads import workload


def build(w, device):
    from compilemask.kernels.triton.schedule import dkdv_schedule, forward_schedule

    plan = cm.compile(w.mask, w.N, device=device, cache=False)
    forward_schedule(plan, 128, 128)
    dkdv_schedule(plan, 128, 128)
    return plan


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=["causal", "shared_prompt", "hstu"])
    ap.add_argument("--n0", type=int, default=32768)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    for name in a.workloads:
        w = workload(name, a.n0)
        for _ in range(3):
            build(w, a.device)
        ts = []
        for _ in range(20):
            _sync(a.device)
            t = time.perf_counter()
            build(w, a.device)
            _sync(a.device)
            ts.append((time.perf_counter() - t) * 1e3)
        print(f"\n==== {name} N={w.N} device={a.device}: median build {sorted(ts)[10]:.3f} ms")
        acts = [torch.profiler.ProfilerActivity.CPU]
        if a.device == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(5):
                build(w, a.device)
            _sync(a.device)
        print("-- torch.profiler, 5 builds (self CPU time per op)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            build(w, a.device)
        _sync(a.device)
        pr.disable()
        for key in ("cumulative", "tottime"):
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats(key).print_stats(a.top)
            print(f"-- cProfile, 20 builds, by {key}")
            print(s.getvalue()[-6000:])


if __name__ == "__main__":
    main()
