"""Triton kernels reading row bounds from the compact descriptor's segments against the same
kernels reading the per-row tensors, in one process (needs a CUDA GPU).

    PYTHONPATH=src python benchmarks/bench_segments.py \\
        --out benchmarks/results/h200-segments-<date>.jsonl

For each seed workload at each ``--sizes`` N0 (``compilemask.workloads``: B = 32768 // N0,
16 heads, head_dim 128, bf16) and each mode, forward (no grad) and forward+backward through
``compilemask.attention(..., backend="triton")``, timed by ``triton.testing.do_bench``
(median ms) with the modes alternating: ``rows`` (``row_lo`` / ``row_hi`` everywhere),
``segments`` (the default: forward and dQ preload their slots from the segments) and
``segments-per-tile`` (``bounds.PER_TILE``: the dK/dV kernel and plans of more than four slots
per row compute bounds per masked tile). Each mode's out and gradients are compared with the
``rows`` mode's (``equal``: bit for bit). Rows carry ``date, gpu, torch, triton, commit``.
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

import compilemask as cm
from compilemask.kernels.triton import backward, bounds, forward
from compilemask.tools.bench_report import environment
from compilemask.workloads import SEED_WORKLOADS, workload

_SEG_ARGS = bounds.seg_args


def _rows(tables, per_program):
    return _SEG_ARGS(None, per_program)


def set_mode(mode: str) -> None:
    fn = _rows if mode == "rows" else _SEG_ARGS
    forward.seg_args = backward.seg_args = fn
    bounds.PER_TILE = mode == "segments-per-tile"


def run_case(name: str, n0: int, env: dict, modes: tuple) -> list[dict]:
    """The rows of one workload at one size (every mode, forward and forward+backward)."""
    w = workload(name, n0)
    plan = cm.compile(w.mask, w.N, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(w.B, 16, w.N, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(4)
    )
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            return cm.attention(q, k, v, plan, backend="triton")

    def step():
        out = cm.attention(*leaves, plan, backend="triton")
        return (out, *torch.autograd.grad(out, leaves, do))

    results = {}
    for mode in modes:
        set_mode(mode)
        results[mode] = [t.clone() for t in step()]
    times = {(m, s): [] for m in modes for s in ("fwd", "fwd+bwd")}
    for _ in range(3):
        for mode in modes:
            set_mode(mode)
            times[mode, "fwd"].append(do_bench(fwd, warmup=5, rep=40))
            times[mode, "fwd+bwd"].append(do_bench(step, warmup=3, rep=60))
    set_mode("segments")
    rows = []
    for (mode, step_name), ts in times.items():
        same = all(torch.equal(a, b) for a, b in zip(results[mode], results["rows"]))
        rows.append({
            **env, "workload": name, "N0": n0, "N": w.N, "B": w.B, "Hq": 16, "D": 128,
            "dtype": "bf16", "mode": step_name, "bounds": mode, "ms": sorted(ts)[1],
            "equal_to_rows": same, "segments": plan.compact().rows == "segments",
        })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[32768, 1024])
    ap.add_argument("--workloads", nargs="+", default=list(SEED_WORKLOADS))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = environment()
    modes = ("rows", "segments", "segments-per-tile")
    with open(args.out, "a") as f:
        for n0 in args.sizes:
            for name in args.workloads:
                for row in run_case(name, n0, env, modes):
                    print(json.dumps(row), flush=True)
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
