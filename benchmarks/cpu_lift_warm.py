"""Warm host time and operations of ``from_mask_mod`` on the CPU, each call on a new mask_mod
(a new closure over new tables of the same kind, as a user builds one per batch).

Per mask_mod (the seeds of ``bench_from_mask_mod.py`` and the attention-gym / FA4 mask_mods
of ``lift_gym_masks.py`` at about ``--size`` tokens): one call not timed, then ``--calls``
timed calls, each on a freshly built mask_mod (built outside the timing); the median and
minimum ms, and the operations (non-view aten operations, ``OpCounter.real``) and host reads
of one more such call, the plan's ``source`` and whether the trace came from the cache
(``trace.structure``; null where the tree has no structural cache). One thread. One JSON line
per mask on stdout and appended to ``--out``, with ``--label`` and the commit
(``COMPILEMASK_COMMIT`` or git).

    PYTHONPATH=src python benchmarks/cpu_lift_warm.py --label new \\
        --out benchmarks/results/cpu-lift-warm-<date>.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import compilemask as cm
from compilemask.compiler.migrate import trace
from compilemask.tools.op_counts import OpCounter, counting_host_copies

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_from_mask_mod import MASKS, commit, mask_mod_for  # noqa: E402
from bench_lift_ops import HOST_READS  # noqa: E402
from lift_gym_masks import GYM, gym_mask_mod  # noqa: E402


def builder(kind: str, name: str, n: int):
    """A function making a new ``(mask_mod, q_len, kv_len, batch, heads)`` on each call."""
    if kind == "seed":

        def make():
            mm, length = mask_mod_for(name, n, "cpu")
            return mm, length, length, None, None

        return make
    return lambda: gym_mask_mod(name, n)


def cached(mm) -> bool | None:
    structure = getattr(trace, "structure", None)
    if structure is None:
        return None
    state = structure(mm)
    return state is not None and state[0] in trace._CACHE


def measure(make, calls: int) -> dict:
    def call(args):
        mm, nq, nk, batch, heads = args
        return cm.from_mask_mod(mm, nq, nk, batch=batch, heads=heads)

    out = call(make())
    times = []
    for _ in range(calls):
        args = make()
        t = time.perf_counter()
        call(args)
        times.append(time.perf_counter() - t)
    args = make()
    hit = cached(args[0])
    with OpCounter() as counted, counting_host_copies() as copies:
        call(args)
    reads = copies["n"] + sum(n for op, n in counted.ops.items() if op.startswith(HOST_READS))
    return {"ms_median": round(statistics.median(times) * 1e3, 3),
            "ms_min": round(min(times) * 1e3, 3), "ops": counted.real(), "host_reads": reads,
            "trace_cached": hit, "source": out.source}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("--masks", nargs="*", default=None, help="only these (seed or gym names)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    sha = commit()
    todo = [("seed", m) for m in MASKS] + [("gym", m) for m in GYM]
    with open(a.out, "a") as f:
        for kind, name in todo:
            if a.masks and name not in a.masks:
                continue
            row = {"label": a.label, "commit": sha, "set": kind, "mask": name, "n": a.size,
                   "device": "cpu", "threads": 1}  # fmt: skip
            try:
                row.update(measure(builder(kind, name, a.size), a.calls))
            except Exception as exc:  # noqa: BLE001 - one failing case does not stop the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
