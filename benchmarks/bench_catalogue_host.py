"""Host time of building catalogue masks with many pieces and printing them (no GPU needed).

    PYTHONPATH=src python benchmarks/bench_catalogue_host.py \\
        --out benchmarks/results/cpu-catalogue-host-<date>.jsonl

A recognised ``doc[q] == doc[kv]`` mask_mod and ``compile`` of ``document(lengths)`` both build
``masks.document(lengths)`` (its argument check) and print it (the plan's ``source``); with
2,048 documents at 32K this is host time on every call. Per step: min of ``--calls`` calls in
ms; rows carry the commit (``COMPILEMASK_COMMIT`` or git).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from compilemask import masks

sys.path.insert(0, os.path.dirname(__file__))
from bench_from_mask_mod import commit  # noqa: E402


def min_ms(fn, calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return round(best * 1e3, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--documents", type=int, nargs="+", default=[2048, 10000])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()
    sha = commit()
    rows = []
    for n in args.documents:
        lengths = [16] * n
        mask = masks.document(lengths)
        for step, fn in (
            ("masks.document", lambda lengths=lengths: masks.document(lengths)),
            ("str", lambda mask=mask: str(mask)),
        ):
            row = {"what": step, "documents": n, "ms_min": min_ms(fn, args.calls), "commit": sha}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
