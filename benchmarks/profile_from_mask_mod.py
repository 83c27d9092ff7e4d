"""Where the time of one ``from_mask_mod`` build goes on a GPU (``cache=False``, warm): the
wall time, the host time to issue it, the CUDA kernels it launches and the runtime calls that
wait (synchronisations, blocking copies, memory queries), and cProfile's top functions.

    PYTHONPATH=src python3 benchmarks/profile_from_mask_mod.py noop hstu global_sliding_window

Names are the seed mask_mods of ``bench_from_mask_mod.py`` or the attention-gym /
FlashAttention-4 mask_mods of ``lift_gym_masks.py``; ``--size`` tokens (default 32768). Prints
one section per mask, headed by the commit (``COMPILEMASK_COMMIT`` or git).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import compilemask as cm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_from_mask_mod import MASKS, commit, mask_mod_for  # noqa: E402
from lift_gym_masks import gym_mask_mod, to_device  # noqa: E402

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemGetInfo",
         "cudaEventSynchronize", "cudaHostAlloc", "cudaMalloc", "cudaFree")  # fmt: skip


def case(name: str, n: int, device):
    if name in MASKS:
        mm, length = mask_mod_for(name, n, device)
        return mm, length, length, None, None
    mm, nq, nk, batch, heads = gym_mask_mod(name, n)
    return to_device(mm, device), nq, nk, batch, heads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="+")
    ap.add_argument("--size", type=int, default=32768)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for name in a.names:
        mm, nq, nk, batch, heads = case(name, a.size, dev)

        def build():
            return cm.from_mask_mod(mm, nq, nk, batch=batch, heads=heads, device=dev, cache=False)  # noqa: B023

        for _ in range(3):
            plan = build()
        sync()
        wall, issue = [], []
        for _ in range(a.repeat):
            sync()
            t0 = time.perf_counter()
            build()
            t1 = time.perf_counter()
            sync()
            wall.append(time.perf_counter() - t0)
            issue.append(t1 - t0)
        print(f"== {commit()} {name} N={nq} kv={nk} source={plan.source}")
        print(f"wall ms median {statistics.median(wall) * 1e3:.3f}, host (until the call returns) "
              f"{statistics.median(issue) * 1e3:.3f}")  # fmt: skip
        with profile(
            activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (dev.type == "cuda")
        ) as prof:
            build()
            sync()
        events = prof.key_averages()
        kernels = [e for e in events if e.device_type.name == "CUDA"]
        print(f"CUDA kernels: {sum(e.count for e in kernels)} launches, "
              f"{sum(e.device_time_total for e in kernels) / 1e3:.3f} ms on the GPU")  # fmt: skip
        for e in sorted(events, key=lambda e: -e.cpu_time_total):
            if any(w in e.key for w in WAITS):
                print(f"  {e.key}: {e.count} calls, {e.cpu_time_total / 1e3:.3f} ms")
        aten = [e for e in events if e.key.startswith("aten::")]
        print(f"aten ops: {sum(e.count for e in aten)} calls")
        top = sorted(kernels, key=lambda e: -e.device_time_total)[:5]
        for e in top:
            print(f"  kernel {e.key[:80]}: {e.count} x, {e.device_time_total / 1e3:.3f} ms")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(10):
            build()
        sync()
        pr.disable()
        s = io.StringIO()
        stats = pstats.Stats(pr, stream=s)
        stats.sort_stats("tottime").print_stats(12)
        stats.sort_stats("cumulative").print_stats("compilemask", 25)
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip()))


if __name__ == "__main__":
    main()
