"""Launch-configuration sweep of the split-KV decode kernel on a GPU (bf16, head_dim 128,
32 query / 8 kv heads, batch 64, page size 64): one JSON line per (case, configuration) with
the median time in microseconds (``triton.testing.do_bench``).

Usage: ``python benchmarks/tune_decode.py [--out FILE.jsonl]``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch
import triton

import compilemask as cm
from compilemask import masks
from compilemask.kernels.triton.decode import decode_attention

B, HQ, HKV, D, PAGE = 64, 32, 8, 128, 64
TREE = [-1] + [i // 2 for i in range(63)]
CASES = [
    ("causal", masks.causal(), 1, 8192),
    ("causal", masks.causal(), 4, 8192),
    ("causal", masks.causal(), 1, 32768),
    ("causal", masks.causal(), 64, 8192),
    ("sliding_window", masks.sliding_window(4096), 1, 32768),
    ("tree", masks.tree(TREE, 0), 64, 8192),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--commit", default="", help="the commit measured, recorded per row")
    args = ap.parse_args(argv)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for kind, mask, nq, nk in CASES:
        per_row = nk // PAGE
        table = torch.randperm(B * per_row, device="cuda", generator=g).view(B, per_row).int()
        kc = torch.randn(B * per_row, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(B, HQ, nq, D, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((B,), nk, device="cuda", dtype=torch.int32)
        plan = cm.step_plan(mask, lens, nq, kv_len=nk)
        big = nq * HQ // HKV > 64
        for bn, warps, stages, splits, bm in itertools.product(
            (64, 128), (4, 8), (2, 3), (None, 1, 4, 16), (64, 128) if big else (None,)
        ):
            run = functools.partial(
                decode_attention, q, kc, vc, plan.row_lo, plan.row_hi, table, lens, D**-0.5,
                num_splits=splits, block_n=bn, block_m=bm, num_warps=warps, num_stages=stages,
            )  # fmt: skip

            try:
                us = triton.testing.do_bench(run, warmup=10, rep=50) * 1e3
            except Exception as e:  # noqa: BLE001 - a configuration that does not fit
                us = f"error: {type(e).__name__}"
            row = {"commit": args.commit, "mask": kind, "new_queries": nq, "cache_len": nk,
                   "block_n": bn, "num_warps": warps, "num_stages": stages,
                   "num_splits": splits, "block_m": bm, "us": us}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
