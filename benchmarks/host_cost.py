"""Per-call host and GPU time of ``compilemask.attention`` at 1K (needs a CUDA GPU).

    PYTHONPATH=src python benchmarks/host_cost.py \\
        --out benchmarks/results/h200-host-cost-<date>.jsonl

For each seed workload at ``--n0`` (B = 32768 // n0, 16 heads, head_dim 128, bf16) and each
backend (``triton``, ``auto``), forward without grad and forward+backward: ``--calls`` calls
issued back to back, ``--repeats`` times. Per repeat: ``host_ms``, the wall time of issuing the
calls (``time.perf_counter``, no synchronisation inside) per call; ``wall_ms``, the same with
a final synchronisation; ``gpu_ms``, CUDA events around the calls per call. ``--mods``: the
calls with a score modifier (``softcap`` 50, ``alibi`` slopes; forwards only, so the cute
backend can take them) or ``none``. Rows hold the medians (and the minimum host time) with
``date, gpu, torch, triton, commit`` (commit from ``COMPILEMASK_COMMIT``, else ``git
rev-parse``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import compilemask as cm
from compilemask.tools.bench_report import environment
from compilemask.workloads import SEED_WORKLOADS, workload


def _time(fn, calls: int, repeats: int) -> dict:
    fn()
    torch.cuda.synchronize()
    host, wall, gpu = [], [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e3)
        wall.append((t2 - t0) / calls * 1e3)
        gpu.append(start.elapsed_time(end) / calls)
    med = statistics.median
    return {
        "host_ms": med(host), "host_min_ms": min(host), "wall_ms": med(wall), "gpu_ms": med(gpu)
    }  # fmt: skip


def _modifier(mods: str) -> dict:
    sm = cm.score_mods
    if mods == "softcap":
        return {"score_mod": sm.softcap(50.0)}
    if mods == "alibi":
        return {"score_mod": sm.alibi(sm.alibi_slopes(16, "cuda"))}
    return {}


def _calls(name: str, n0: int, backend: str, mods: str = "none"):
    """``(forward without grad, forward+backward)`` of workload ``name`` on ``backend``."""
    w = workload(name, n0)
    plan = cm.compile(w.mask, w.N, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (w.B, 16, w.N, 128)
    q, k, v, do = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
    )
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    extra = _modifier(mods)

    def forward():
        with torch.no_grad():
            cm.attention(q, k, v, plan, backend=backend, **extra)

    def step():
        qg.grad = kg.grad = vg.grad = None
        cm.attention(qg, kg, vg, plan, backend=backend).backward(do)

    return w, forward, step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=list(SEED_WORKLOADS))
    ap.add_argument("--backends", nargs="+", default=["triton", "auto"])
    ap.add_argument("--mods", nargs="+", default=["none"], choices=["none", "softcap", "alibi"])
    ap.add_argument("--n0", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", required=True, help="append JSON lines here")
    a = ap.parse_args()
    env = environment()
    for name in a.workloads:
        for backend in a.backends:
            for mods in a.mods:
                w, forward, step = _calls(name, a.n0, backend, mods)
                modes = (
                    (("fwd", forward),) if mods != "none" else (("fwd", forward), ("fwd+bwd", step))
                )
                for mode, fn in modes:
                    row = {
                        **env, "workload": name, "N0": a.n0, "N": w.N, "B": w.B, "heads": 16,
                        "head_dim": 128, "dtype": "bf16", "backend": backend, "mods": mods,
                        "mode": mode, "calls": a.calls, "repeats": a.repeats,
                        **_time(fn, a.calls, a.repeats),
                    }  # fmt: skip
                    print(json.dumps(row))
                    with open(a.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
