"""Tile statistics of the seed workloads at the kernels' tilings (CPU, deterministic).

    PYTHONPATH=src python3 benchmarks/tile_stats.py [--out benchmarks/results/tile-stats-cpu.jsonl]

For each seed workload (and clear through ``tile_grid(..., (8, 16))``) at N0 = 32768 and each
tiling: FULL and PARTIAL tiles, tile efficiency (visible pairs / pairs in touched tiles),
kv-tiles per q-tile (max, mean) and the widest slot range of interval-masked tiles.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import compilemask as cm
from compilemask.kernels.triton.common import mask_constants
from compilemask.tools.bench_report import environment
from compilemask.workloads import workload

TILINGS = ((128, 128), (128, 64), (64, 64), (32, 128), (128, 32))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/tile-stats-cpu.jsonl"))
    ap.add_argument("--n0", type=int, default=32768)
    a = ap.parse_args()
    env = environment()
    rows = []
    for name in ("causal", "hstu", "shared_prompt", "clear", "clear_tiled"):
        w = workload("clear" if name == "clear_tiled" else name, a.n0)
        mask = cm.masks.tile_grid(w.mask, (8, 16)) if name == "clear_tiled" else w.mask
        plan = cm.compile(mask, w.N)
        for bm, bn in TILINGS:
            s = plan.tiles(bm, bn)
            full = int((s.kind == 1).sum())
            partial = int((s.kind >= 2).sum())
            pairs = int(s.pairs.sum())
            qc = s.q_count[0].float()
            row = {
                **env, "workload": name, "N0": a.n0, "N": w.N, "block_m": bm, "block_n": bn,
                "tiles_full": full, "tiles_partial": partial,
                "tiles_partial_bits": int((s.kind == 3).sum()),
                "tile_efficiency": round(pairs / ((full + partial) * bm * bn), 4),
                "kv_tiles_per_q_tile_max": int(qc.max()),
                "kv_tiles_per_q_tile_mean": round(float(qc.mean()), 2),
                "max_span": mask_constants(s.kind, s.jlo, s.jhi, plan.row_lo.shape[-1])[0],
            }  # fmt: skip
            rows.append(row)
            print(json.dumps({k: row[k] for k in list(row)[5:]}))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
