"""Forward times of ``backend="cute"`` beside its peers, for A/B runs of two versions of the
kernel: run it once per version with ``PYTHONPATH`` pointing at that version's ``src`` (it
imports whatever ``compilemask`` is on the path) and compare the rows by ``label``.

    PYTHONPATH=src python benchmarks/cute_ab.py --label new --out rows.jsonl
    PYTHONPATH=old/src python benchmarks/cute_ab.py --label old --systems compilemask-cute

One JSON line per (case, system) is appended to ``--out``: commit, label, workload, N0, system, ms
(median of ``triton.testing.do_bench``, as ``compilemask bench`` times), and for the cute rows
``max_abs_diff`` against the first peer that ran on the case (bf16 outputs; None without one).
Cases are the bench's seed workloads (16 heads, head_dim 128, bf16); a system that does not
apply to a case (FA4: causal only) or is not available is skipped with a line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

CASES = ("causal:32768", "hstu:32768", "shared_prompt:32768", "hstu:1024", "causal:1024")
SYSTEMS = ("compilemask-cute", "cudnn-fe", "fa4")


def main(argv: list[str] | None = None) -> int:
    from compilemask.tools.bench import time_ms
    from compilemask.tools.bench_systems import SYSTEMS as ALL
    from compilemask.tools.bench_systems import make_case

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", required=True, help="the version's name in the rows")
    p.add_argument("--cases", nargs="+", default=list(CASES), help="workload:N0 ...")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    p.add_argument("--out", required=True, help="JSON-lines file the rows are appended to")
    p.add_argument("--commit", default="unknown", help="the commit of the version timed")
    args = p.parse_args(argv)
    by_name = {s.name: s for s in ALL}
    unknown = [s for s in args.systems if s not in by_name]
    if unknown:
        p.error(f"unknown systems {unknown}; known: {sorted(by_name)}")
    systems = [by_name[s] for s in args.systems]
    ok = {s.name: s.available() for s in systems}
    for name, (good, why) in ok.items():
        if not good:
            print(f"skip {name}: {why}", file=sys.stderr)
    with open(args.out, "a") as out:
        for spec in args.cases:
            name, n0 = spec.split(":")
            case = make_case(name, int(n0))
            peer_out = None
            # peers first, so the cute row can be compared with one of them
            order = sorted(systems, key=lambda s: s.name == "compilemask-cute")
            for s in order:
                if not ok[s.name][0] or not s.applies(name, case.workload.N)[0]:
                    continue
                t0 = time.perf_counter()
                runner = s.prepare(case, False)
                with torch.no_grad():
                    o = runner.to_bhsd(runner.fn())
                torch.cuda.synchronize()
                first_s = time.perf_counter() - t0
                diff = None
                if s.name == "compilemask-cute" and peer_out is not None:
                    diff = (o.float() - peer_out.float()).abs().max().item()
                elif peer_out is None:
                    peer_out = o
                ms = time_ms(runner, False)
                row = {
                    "commit": args.commit, "label": args.label, "workload": name, "N0": int(n0),
                    "system": s.name,
                    "ms": round(ms, 4), "first_call_s": round(first_s, 2), "max_abs_diff": diff,
                }  # fmt: skip
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(json.dumps(row), flush=True)
                del runner, o
            del case, peer_out
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
