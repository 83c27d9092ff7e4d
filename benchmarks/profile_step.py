"""Kernel times of one training step (Triton backend) at 1K tokens, B = 32, 16 heads, head_dim
128, bf16: ``do_bench`` of the step, the host time to issue 50 steps, and torch.profiler's table
of CUDA kernels over 20 steps (the gradients accumulate across those steps, so the table also
holds three elementwise adds per step that ``do_bench`` with ``grad_to_none`` does not run).

    PYTHONPATH=src python3 benchmarks/profile_step.py hstu [shared_prompt ...]
"""

from __future__ import annotations

import sys
import time

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

import compilemask as cm
from compilemask import workloads as wl


def main(names: list[str]) -> None:
    for name in names:
        w = wl.workload(name, 1024)
        plan = cm.compile(w.mask, w.N, device="cuda")
        q, k, v, do = (
            torch.randn(w.B, 16, w.N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

        def step(qg=qg, kg=kg, vg=vg, plan=plan, do=do):
            cm.attention(qg, kg, vg, plan, backend="triton").backward(do)

        for _ in range(10):
            step()
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(
            step, warmup=10, rep=100, return_mode="median", grad_to_none=[qg, kg, vg]
        )
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            step()
        host = (time.perf_counter() - t) / 50 * 1e3
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / 50 * 1e3
        print(f"== {name} 1K fwd+bwd do_bench {ms:.3f} ms; host issue {host:.3f} ms/step; "
              f"wall {wall:.3f}")  # fmt: skip
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main(sys.argv[1:] or ["hstu"])
