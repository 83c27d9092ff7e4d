"""Registers, spills and shared memory of the compiled Triton kernels (one GPU process).

    PYTHONPATH=src python3 benchmarks/kernel_stats.py [--n0 4096] [--out $OUT/kernel-stats.jsonl]

Runs forward and backward once per seed workload (B=1, 16 heads, head_dim 128, bf16, the
default launch configurations) and prints, for every compiled specialisation of the forward and
backward kernels, ``n_regs``, ``n_spills`` and shared memory: register spills in a pipelined
loop are the first suspect when a kernel runs slower than its peer with the same tiling.
"""

from __future__ import annotations

import argparse
import json

import torch

import compilemask as cm
from compilemask.kernels.triton import backward as bwd_mod
from compilemask.kernels.triton import forward as fwd_mod
from compilemask.tools.bench_report import environment
from compilemask.workloads import SEED_WORKLOADS, workload


def _kernels(fn):
    caches = getattr(fn, "device_caches", {})
    for entry in caches.values():
        kernel_cache = entry[0] if isinstance(entry, tuple) else entry
        for key, k in kernel_cache.items():
            if hasattr(k, "_init_handles"):
                k._init_handles()
            meta = getattr(k, "metadata", None)
            yield {
                "kernel": fn.__name__,
                "n_regs": getattr(k, "n_regs", None),
                "n_spills": getattr(k, "n_spills", None),
                "shared": getattr(meta, "shared", None),
                "num_warps": getattr(meta, "num_warps", None),
                "num_stages": getattr(meta, "num_stages", None),
                "key": str(key)[-300:],
            }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n0", type=int, default=4096)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    for name in SEED_WORKLOADS:
        w = workload(name, a.n0)
        plan = cm.compile(w.mask, w.N, device="cuda")
        shape = (w.B, 16, w.N, 128)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for t in (q, k, v):
            t.requires_grad_(True)
        cm.attention(q, k, v, plan).backward(torch.randn_like(q))
    torch.cuda.synchronize()
    rows = []
    for fn in (fwd_mod._attn_fwd, bwd_mod._attn_bwd_dkdv, bwd_mod._attn_bwd_dq):
        for row in _kernels(fn):
            rows.append({**environment(), **row})
            print(json.dumps({k: row[k] for k in row if k != "key"}), row["key"][-160:])
    if a.out:
        with open(a.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
