"""Is a small case host-bound? Host time to issue one fwd+bwd step against its GPU time.

    PYTHONPATH=src python3 benchmarks/host_overhead.py --workloads shared_prompt clear \\
        --n0 1024 --out host.jsonl

For each workload: ``gpu_ms``, the median of ``triton.testing.do_bench`` (what the speed
tables report), and ``issue_ms``, the wall time per step of issuing 50 steps back to back with
no synchronisation in between (the CUDA queue does not fill at that depth). When issue_ms is
close to gpu_ms the step is host-bound: the GPU waits for Python. Rows for CompileMask
(Triton backend) and FlexAttention (compiled, its mask built once), one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

import compilemask as cm
from compilemask.tools.bench_report import environment
from compilemask.workloads import workload


def _issue_ms(step, n: int = 50) -> float:
    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=["shared_prompt"])
    ap.add_argument("--n0", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from compilemask.tools.peers import flex_mask_mod

    flex = torch.compile(flex_attention, dynamic=False)
    env = environment()
    with open(a.out, "a") as out:
        for name in a.workloads:
            w = workload(name, a.n0)
            plan = cm.compile(w.mask, w.N, device="cuda")
            mod = flex_mask_mod(w.mask, "cuda")
            bm = create_block_mask(mod, None, None, w.N, w.N, device="cuda")
            shape = (w.B, a.heads, w.N, 128)
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (
                torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(4)
            )
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

            def ours(qg=qg, kg=kg, vg=vg, plan=plan, do=do):
                cm.attention(qg, kg, vg, plan, backend="triton").backward(do)

            def theirs(qg=qg, kg=kg, vg=vg, bm=bm, do=do):
                flex(qg, kg, vg, block_mask=bm).backward(do)

            for system, step in (("compilemask-triton", ours), ("flex-triton", theirs)):
                gpu = triton.testing.do_bench(
                    step, warmup=10, rep=50, return_mode="median", grad_to_none=[qg, kg, vg]
                )
                issue = _issue_ms(step)
                row = {
                    **env, "workload": name, "N0": a.n0, "N": w.N, "B": w.B, "Hq": a.heads,
                    "D": 128, "dtype": "bf16", "mode": "fwd+bwd", "system": system,
                    "gpu_ms": gpu, "issue_ms": issue, "kind": "host_overhead",
                }  # fmt: skip
                out.write(json.dumps(row) + "\n")
                print(f"{name:<14} {system:<20} gpu {gpu:7.3f} ms  issue {issue:7.3f} ms")


if __name__ == "__main__":
    main()
