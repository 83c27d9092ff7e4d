"""CPU proxy of CompileMask's host time per call: the Triton launch functions stubbed out.

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/host_proxy.py \\
        [--workloads hstu shared_prompt] [--backends triton auto] [--profile 25]

Runs ``compilemask.attention`` forward (no grad) and forward+backward on small float16 CPU
tensors (B = 2, 16 heads, head_dim 128, the seed workload's length at ``--n0``) with
``attention_forward`` / ``attention_backward`` replaced by functions that only allocate their
outputs, so what is timed is the Python around the kernels (validation, backend resolution,
plan lookups, autograd). Triton's own launch path is not in it (it needs a GPU). Prints the
minimum and median ms per call over repeats of ``--calls`` calls. ``--profile N``: cProfile of
the forward+backward loop, top N.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import compilemask as cm
from compilemask.kernels.triton import backward as bwd_mod
from compilemask.kernels.triton import forward as fwd_mod
from compilemask.workloads import SEED_WORKLOADS, workload


def _fwd_stub(q, k, v, *args, **kwargs):
    B, H, N, _ = q.shape
    return torch.empty_like(q), torch.empty(B, H, N, dtype=torch.float32)


def _bwd_stub(q, k, v, out, lse, do, *args, **kwargs):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _repeats(fn, repeats: int, n: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e3)
    return out


def _line(what: str, t: list[float]) -> str:
    return f"{what}: min {min(t):.4f} ms, median {statistics.median(t):.4f} ms per call"


def _steps(name: str, n0: int, backend: str):
    w = workload(name, n0)
    plan = cm.compile(w.mask, w.N)
    q, k, v, do = (torch.randn(2, 16, w.N, 128, dtype=torch.float16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def step():
        qg.grad = kg.grad = vg.grad = None
        cm.attention(qg, kg, vg, plan, backend=backend).backward(do)

    def forward():
        with torch.no_grad():
            cm.attention(q, k, v, plan, backend=backend)

    return step, forward


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=["hstu", "shared_prompt"])
    ap.add_argument("--backends", nargs="+", default=["triton"])
    ap.add_argument("--n0", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", type=int, default=0)
    a = ap.parse_args()
    for name in a.workloads:
        if name not in SEED_WORKLOADS:
            ap.error(f"unknown workload {name!r}")
    fwd_mod.attention_forward = _fwd_stub  # imported at call time by the backend
    bwd_mod.attention_backward = _bwd_stub
    for name in a.workloads:
        for backend in a.backends:
            step, forward = _steps(name, a.n0, backend)
            for what, fn in (("fwd (no grad)", forward), ("fwd+bwd", step)):
                _repeats(fn, 1, 20)  # warm
                print(_line(f"{name} {backend} {what}", _repeats(fn, a.repeats, a.calls)))
            if a.profile:
                prof = cProfile.Profile()
                prof.runcall(_repeats, step, 1, a.calls)
                pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)


if __name__ == "__main__":
    main()
