"""Host time of a ``tile_grid`` plan's permutation in a build (``pipeline.build_plan``'s
``_permutation``), the first build of a mask and length against a later one, on the CPU:
``clear`` through ``tile_grid`` (32K grid tokens) and attention-gym's tiled NATTEN at 32K.

    PYTHONPATH=src python benchmarks/bench_tile_grid_host.py LABEL COMMIT
"""

from __future__ import annotations

import json
import sys
import time

import torch

from compilemask import masks
from compilemask.compiler import pipeline
from compilemask.language.permutation import grid_permutation

CASES = {
    "clear_tiled": (masks.tile_grid(masks.clear((128, 256), 16, 0), (8, 16)), 32768),
    "tiled_natten": (masks.tile_grid(masks.natten2d((128, 256), (7, 7)), (8, 8)), 32768),
}


def main(label: str, commit: str) -> None:
    torch.set_num_threads(1)
    for name, (mask, n) in CASES.items():
        first = []
        for _ in range(5):
            t = time.perf_counter()
            grid_permutation(mask.mask, n, mask.tile)
            first.append(time.perf_counter() - t)
        kept = None
        if hasattr(pipeline, "_permutation"):
            pipeline._permutation(mask, n, "cpu")
            times = []
            for _ in range(20):
                t = time.perf_counter()
                pipeline._permutation(mask, n, "cpu")
                times.append(time.perf_counter() - t)
            kept = round(min(times) * 1e3, 4)
        row = {"case": name, "N": n, "label": label, "commit": commit, "threads": 1,
               "permutation_ms_min": round(min(first) * 1e3, 3), "kept_ms_min": kept}  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
