"""Host reads of one training step on a new plan (``compile`` + forward + backward through the
Triton backend), counted on the CPU in Triton's interpreter (no GPU needed).

    PYTHONPATH=src python benchmarks/count_fresh_reads.py \\
        --out benchmarks/results/cpu-fresh-host-reads-<date>.jsonl

On a GPU each read of a device value back to the host (``.item()``, ``.tolist()``, ``bool()``,
``int()``, ``.numpy()``) waits for the device: ``compilemask bench --modes fresh`` counts them
there with ``torch.cuda.set_sync_debug_mode``. Here the same reads are counted where our code
makes them (the calling line inside ``compilemask``), for a small hstu plan; the reads the
interpreter itself makes are not ours and not counted. One JSON row per step with the commit
(``COMPILEMASK_COMMIT`` or git).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import compilemask as cm  # noqa: E402
from compilemask import workloads as wl  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from bench_from_mask_mod import commit  # noqa: E402

READS = ("item", "tolist", "__bool__", "__int__", "numpy")


def count_reads(fn) -> collections.Counter:
    """``fn()``'s host reads, by the ``compilemask`` line that made them."""
    hits: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name):
        orig = originals[name]

        def read(self, *args, **kwargs):
            for frame in reversed(traceback.extract_stack()[:-1]):
                if "/compilemask/" in frame.filename:
                    where = frame.filename.split("compilemask/", 1)[1]
                    hits[f"{where}:{frame.name}"] += 1
                    break
            return orig(self, *args, **kwargs)

        return read

    try:
        for name in READS:
            setattr(torch.Tensor, name, wrap(name))
        fn()
    finally:
        for name, orig in originals.items():
            setattr(torch.Tensor, name, orig)
    return hits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(1)
    lengths, targets = wl.hstu_users(args.n, g)
    mask = cm.masks.hstu(lengths, targets, contextual=6)
    q, k, v = (
        torch.randn(1, 2, args.n, 32, dtype=torch.float16, requires_grad=True) for _ in range(3)
    )

    def step():
        plan = cm.compile(mask, args.n, cache=False, block_m=32, block_n=32)
        cm.attention(q, k, v, plan, backend="triton").float().sum().backward()

    sha, rows = commit(), []
    for i in range(args.steps):
        hits = count_reads(step)
        row = {"what": "fresh step, hstu, triton", "n": args.n, "step": i,
               "host_reads": sum(hits.values()), "where": dict(hits), "commit": sha}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
