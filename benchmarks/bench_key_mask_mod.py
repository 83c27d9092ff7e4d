"""Warm CPU build of ``from_mask_mod`` for FlashAttention-4's key mask ``kv >= bias[kv]``
(``fa4_ima`` of ``lift_gym_masks.py``, evaluated into a bitmask plan) at 8K and 32K: the
minimum of 3 builds (``cache=False``) on 2 threads, the tensor operations of one build
(``tools.op_counts.OpCounter``) and the plan's bytes, one JSON line per size.

    PYTHONPATH=src python benchmarks/bench_key_mask_mod.py LABEL COMMIT
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import compilemask as cm
from compilemask.tools.op_counts import OpCounter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lift_gym_masks import gym_mask_mod  # noqa: E402


def main(label: str, commit: str) -> None:
    torch.set_num_threads(2)
    for n in (8192, 32768):
        mm, nq, nk, b, h = gym_mask_mod("fa4_ima", n)

        def build():
            return cm.from_mask_mod(mm, nq, nk, batch=b, heads=h, cache=False)  # noqa: B023

        plan = build()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            build()
            times.append(time.perf_counter() - t)
        with OpCounter() as counted:
            build()
        row = {"mask": "fa4_ima", "N": n, "label": label, "commit": commit,
               "source": plan.source, "encoding": plan.encoding,
               "build_ms_min": round(min(times) * 1e3, 1), "ops": counted.real(),
               "plan_bytes": plan.stats()["bytes"], "threads": 2, "device": "cpu"}  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
