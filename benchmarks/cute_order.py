"""Forward times of ``backend="cute"`` for several work-list orders of one plan, beside
cuDNN-frontend in the same process: the L2 groups of ``lower.work_order`` (``kv_group``:
``none`` for one list heaviest first, or a number of (batch row, kv head) pairs per group),
the kernel's CTAs taking the entries in list order.

    PYTHONPATH=src python benchmarks/cute_order.py --out rows.jsonl --commit abc1234

One JSON line per (case, order) and per peer: commit, workload, N0, system, kv_group, ms
(median of ``triton.testing.do_bench``), and for the cute rows ``max_abs_diff`` against
cuDNN-frontend's output (bf16).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch

CASES = ("hstu:32768", "shared_prompt:32768", "causal:32768", "clear:32768", "hstu:1024",
         "causal:1024", "shared_prompt:1024")  # fmt: skip
GROUPS = ("auto", "none", "1", "2", "4", "16", "50")


def main(argv: list[str] | None = None) -> int:
    from triton.testing import do_bench

    from compilemask.kernels.cute.backend import _kv_group, run_forward
    from compilemask.kernels.cute.lower import lower
    from compilemask.tools.bench_systems import SYSTEMS, make_case

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), help="workload:N0 ...")
    p.add_argument("--groups", nargs="+", default=list(GROUPS))
    p.add_argument("--out", required=True)
    p.add_argument("--commit", default="unknown")
    args = p.parse_args(argv)
    cudnn = {s.name: s for s in SYSTEMS}["cudnn-fe"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with open(args.out, "a") as out:

        def emit(row):
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)

        for spec in args.cases:
            name, n0 = spec.split(":")
            case = make_case(name, int(n0))
            B, H, N, D = case.q.shape
            base = {"commit": args.commit, "workload": name, "N0": int(n0)}
            ref = None
            if cudnn.available()[0]:
                runner = cudnn.prepare(case, False)
                with torch.no_grad():
                    ref = runner.to_bhsd(runner.fn())
                    ms = do_bench(runner.fn, warmup=25, rep=100, return_mode="median")
                emit({**base, "system": "cudnn-fe", "kv_group": None, "ms": round(ms, 4)})
                del runner
            call = _call_like(case)
            for g in args.groups:
                if g == "auto":
                    group = _kv_group(case.plan, call)
                elif g == "none":
                    group = None
                else:
                    group = int(g)
                    if group >= B * H:
                        continue
                low = lower(case.plan, B, H, H, group, sms)
                scale = D**-0.5
                o, _ = run_forward(case.q, case.k, case.v, low, scale)
                diff = None if ref is None else (o.float() - ref.float()).abs().max().item()
                call_once = partial(run_forward, case.q, case.k, case.v, low, scale)
                ms = do_bench(call_once, warmup=25, rep=100, return_mode="median")
                emit({**base, "system": "compilemask-cute", "kv_group": g if g != "auto" else
                      f"auto={group}", "ms": round(ms, 4), "max_abs_diff": diff})  # fmt: skip
                del low, o
            del case, ref
            torch.cuda.empty_cache()
    return 0


def _call_like(case):
    """What ``_kv_group`` reads of a call: its shapes, dtype and device."""
    from types import SimpleNamespace

    B, H, N, D = case.q.shape
    return SimpleNamespace(batch=B, heads_q=H, heads_kv=case.k.shape[1], q_len=N,
                           kv_len=case.k.shape[2], head_dim=D, dtype=case.q.dtype,
                           device=case.q.device)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
