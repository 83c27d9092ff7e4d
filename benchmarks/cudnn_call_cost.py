"""Per-call time at 1K of cuDNN-frontend's interval attention called directly, our cudnn
backend's pieces and ``compilemask.attention`` (needs a CUDA GPU and cuDNN-frontend).

    PYTHONPATH=src python benchmarks/cudnn_call_cost.py

For hstu, shared_prompt and causal at N0 = 1K (B = 32, 16 heads, head_dim 128, bf16, no grad):
host ms per call (issue time over 300 calls) and total ms per call (with the final
synchronisation), then a cProfile of 100 calls of the direct call and of ours (hstu).
Results: ``benchmarks/results/h200-cudnn-call-cost-2026-12-01.txt``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

import torch

import compilemask as cm
from compilemask import workloads as wl
from compilemask.kernels import registry
from compilemask.kernels.interface import call_of
from compilemask.tools.peers import cudnn_endpoints


def per_call(fn, n: int = 300) -> tuple[float, float]:
    """``(host ms, total ms)`` per call of ``fn`` over ``n`` calls after 20 warm ones."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return host * 1e3, (time.perf_counter() - t) / n * 1e3


def calls(name: str) -> dict:
    """The calls timed for workload ``name`` at 1K, by label."""
    from cudnn.flex_attention import create_mask_plan, flex_attn_func

    w = wl.workload(name, 1024)
    plan = cm.compile(w.mask, w.N, device="cuda")
    q, k, v = (
        torch.randn(w.B, 16, w.N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    )
    qb, kb, vb = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    direct = create_mask_plan(cudnn_endpoints(plan, w.B), qb, kb, vb, build_backward=False)
    be = registry.get("cudnn")
    prep = be.prepare(plan, call_of(q, k, v, False))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return {
        "direct contiguous BSHD": lambda: flex_attn_func(qb, kb, vb, mask_plan=direct),
        "direct transposed views": lambda: flex_attn_func(qt, kt, vt, mask_plan=direct),
        "direct with our plan": lambda: flex_attn_func(qb, kb, vb, mask_plan=prep.mask_plan),
        "backend.forward": lambda: be.forward(q, k, v, plan, prep, 128**-0.5, need_lse=False),
        "cm.attention cudnn": lambda: cm.attention(q, k, v, plan, backend="cudnn"),
        "cm.attention triton": lambda: cm.attention(q, k, v, plan, backend="triton"),
        "cm.attention auto": lambda: cm.attention(q, k, v, plan),
    }


def main() -> None:
    for name in ("hstu", "shared_prompt", "causal"):
        rows = calls(name)
        with torch.no_grad():
            for label, fn in rows.items():
                host, total = per_call(fn)
                print(f"{name:14s} {label:26s} host {host:.3f} ms/call  total {total:.3f} ms/call")
            if name != "hstu":
                continue
            for label in ("direct contiguous BSHD", "cm.attention cudnn"):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(100):
                    rows[label]()
                prof.disable()
                torch.cuda.synchronize()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
                print("=====", label)
                print("\n".join(line[:150] for line in out.getvalue().splitlines()[:30]))


if __name__ == "__main__":
    main()
