"""Time of one ``step_plan`` build per decoding mask: wall and GPU microseconds.

    PYTHONPATH=src python benchmarks/bench_decode_plan.py \\
        --out benchmarks/results/h200-decode-plan-<date>.jsonl [--builder both]

One JSON line per (mask, new queries, builder): ``wall_us``, the median of
``triton.testing.do_bench`` over the eager call (on a GPU, the host launching the build and the
device waiting on it), and ``gpu_us``, the device time of one build (the sum of the kernels'
device time in a ``torch.profiler`` trace of ``--calls`` builds, divided by ``--calls``).
Batch 64 (``--batch``), every cache full at 8192 keys (``--cache-len``), ``kv_len`` given (no
host read). ``--builder``: ``default`` (the registered one-launch builder where it serves the
mask), ``tensor`` (the tensor operations of ``compiler/decode.py`` only) or ``both``.
``--device cpu`` checks the script without a GPU (``wall_us`` only, by ``time.perf_counter``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import compilemask as cm
from compilemask import masks
from compilemask.compiler import decode

TREE = [-1] + [i // 2 for i in range(63)]  # a binary tree of 64 draft tokens


def cases(cache_len: int) -> list:
    """``(name, mask, new queries)``: the catalogue masks with a decoding form."""
    n = cache_len
    return [
        ("causal", masks.causal(), 1),
        ("causal", masks.causal(), 4),
        ("sliding_window", masks.sliding_window(4096), 4),
        ("prefix_lm", masks.prefix_lm(n // 4), 1),
        ("chunked", masks.chunked(1024), 4),
        ("block_causal", masks.block_causal(64), 4),
        ("dilated", masks.dilated(256, 2), 1),
        ("document", masks.document([n // 4, n // 4, n // 2]), 1),
        ("shared_prompt", masks.shared_prompt(n // 8, [n // 4, n // 4, n // 4, n // 8]), 1),
        ("hstu", masks.hstu([n // 2, n // 2], [n // 64, n // 64], 1), 1),
        ("tree", masks.tree(TREE, 0), len(TREE)),
    ]


def wall_us(fn, device: str) -> float:
    if device == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
    fn()
    times = []
    for _ in range(20):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def gpu_us(fn, calls: int) -> float:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in kernels)
    return total / calls


def commit() -> str:
    """``COMPILEMASK_COMMIT`` (a copy of the tree without its git history), else git HEAD."""
    env = os.environ.get("COMPILEMASK_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True)
        return out.stdout.decode().strip()
    except OSError:
        return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git HEAD)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--builder", default="default", choices=["default", "tensor", "both"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--cache-len", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--masks", nargs="+", help="only these mask names")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU (use --device cpu to check the script)")
    builders = ["default", "tensor"] if args.builder == "both" else [args.builder]
    lens = torch.full((args.batch,), args.cache_len, device=args.device, dtype=torch.int32)
    registered = decode._STEP_BUILDER
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    sha = commit() if args.commit is None else args.commit
    rows = []
    for name, mask, nq in cases(args.cache_len):
        if args.masks and name not in args.masks:
            continue
        for builder in builders:
            decode.register_device_step_builder(registered if builder == "default" else None)
            try:
                build = functools.partial(cm.step_plan, mask, lens, nq, kv_len=args.cache_len)
                plan = build()
                row = {
                    "commit": sha, "what": "step_plan", "mask": name, "builder": builder,
                    "new_queries": nq, "B": args.batch, "cache_len": args.cache_len,
                    "K": plan.row_lo.shape[-1], "wall_us": round(wall_us(build, args.device), 1),
                    "gpu_us": round(gpu_us(build, args.calls), 2) if gpu != "cpu" else None,
                    "gpu": gpu,
                }  # fmt: skip
            finally:
                decode.register_device_step_builder(registered)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
