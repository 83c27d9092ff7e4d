"""The kv-tile side's work in the tile builder's one launch (``_build_schedule``) for masks with
a piece table, counted on the CPU from the table (no GPU, no launch).

    PYTHONPATH=src python benchmarks/count_build_work.py [--n0 1024 32768] [--out FILE.jsonl]

Each kv-tile program classifies its column of tiles. ``rows``: evaluating every row of every
q-tile from the table (the per-row path: per row a binary search of ``steps`` halvings over
the pieces' ends, then ``4 K`` coefficient loads), what the launch did before the kv side
classified from the pieces. ``pieces``: per q-tile two binary searches (its first and last
rows) and, per piece it crosses, ``2 + 4 K`` loads (the piece's ends and coefficients), in
chunks of ``tile_builder._table_chunk(K_PAD)`` q-tiles, each running its widest q-tile's
piece count of iterations (``table_tiles.column_kinds_from_table``). Columns per launch (all
``Tk`` kv-tile programs): ``evaluations`` (rows, or (q-tile, piece) pairs), ``loads`` (table
words read, masked lanes not counted), ``lanes`` (load lanes issued, masked ones included) and
per kv-tile program ``serial`` (dependent steps: binary-search halvings and loop iterations).
The q-tile programs' work (``Nq`` row evaluations and ``Tq x Tk`` tile steps) is the same in
both and given for scale. One JSON row per (mask, N, path) with the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from compilemask import masks
from compilemask.compiler.lower import piece_table
from compilemask.kernels.triton import tile_builder
from compilemask.tools.bench_report import append_rows
from compilemask.workloads import workload

sys.path.insert(0, os.path.dirname(__file__))
from bench_from_mask_mod import commit  # noqa: E402

BLOCK = 128


def _masks(n0: int) -> list:
    """(name, mask, N): the seeds with a piece table, and documents of 32 rows (a 128-row
    q-tile crosses 4 or 5 pieces)."""
    out = []
    for name in ("causal", "hstu", "shared_prompt"):
        w = workload(name, n0)
        out.append((name, w.mask, w.N))
    out.append(("document_32", masks.document([32] * (n0 // 32)), n0))
    return out


def count(mask, n: int, block_m: int = BLOCK, block_n: int = BLOCK) -> dict:
    """``{path: counts}`` of the kv-tile side of one launch (the module docstring's columns)."""
    table = piece_table(mask, n, n, torch.device("cpu"))
    p, k = table.pieces, table.k
    k_pad = max(1 << (max(k, 1) - 1).bit_length(), 2)
    steps = p.bit_length()
    tq, tk = -(-n // block_m), -(-n // block_n)
    ends = table.flat[1 : 1 + p]
    r0 = torch.arange(tq) * block_m
    r1 = torch.clamp(r0 + block_m, max=n)
    first = torch.searchsorted(ends, r0, right=True)
    last = torch.searchsorted(ends, r1 - 1, right=True)
    crossed = last - first + 1  # pieces per q-tile
    chunk_rows = max(1, min(64, 4096 // (block_m * k_pad)))  # the per-row path's CHUNK_Q
    rows = {
        "evaluations": tk * n,
        "loads": tk * n * (steps + 4 * k),
        "lanes": tk * -(-tq // chunk_rows) * chunk_rows * block_m * (steps + 4 * k_pad),
        "serial": -(-tq // chunk_rows) * steps,
    }
    chunk = tile_builder._table_chunk(k_pad)
    iterations = [int(crossed[c : c + chunk].max()) for c in range(0, tq, chunk)]
    pieces = {
        "evaluations": tk * int(crossed.sum()),
        "loads": tk * (2 * tq * steps + int(crossed.sum()) * (2 + 4 * k)),
        "lanes": tk * sum((2 * steps + i * (2 + 4 * k_pad)) * chunk for i in iterations),
        "serial": len(iterations) * steps + sum(iterations),
    }
    q_side = {"row_evaluations": n, "tile_steps": tq * tk}
    shape = {"pieces": p, "K": k, "Tq": tq, "Tk": tk, "max_crossed": int(crossed.max())}
    return {"rows": rows, "pieces": pieces, "q_side": q_side, "table": shape}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n0", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for n0 in a.n0:
        for name, mask, n in _masks(n0):
            counts = count(mask, n)
            for path in ("rows", "pieces"):
                row = {
                    "kind": "build_kv_work", "commit": commit(), "workload": name, "N": n,
                    "block": BLOCK, "path": path, **counts[path], "q_side": counts["q_side"],
                    "table": counts["table"],
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row))
    if a.out:
        append_rows(a.out, rows)


if __name__ == "__main__":
    main()
