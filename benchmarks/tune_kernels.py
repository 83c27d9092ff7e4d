"""Sweep the Triton kernels' launch configurations on a GPU (one process, a few minutes).

    PYTHONPATH=src python3 benchmarks/tune_kernels.py --out $OUT/tune.jsonl \\
        [--workloads causal hstu shared_prompt clear clear_tiled] [--part fwd bwd] [--n0 32768]

For every workload (B = 1, 16 heads, head_dim 128, bf16, N0 = 32768 by default) and every
candidate configuration: one correctness check against the float64 reference on 2 heads (the
correctness measure of docs/design.md; a failing configuration is reported and not timed),
then ``triton.testing.do_bench`` (median). ``clear_tiled`` is clear through
``tile_grid(..., (8, 16))``. Prints a table per workload, best first, and writes JSON lines (the
results-file keys of docs/benchmarking.md plus ``config``) so that the winners can go into
``kernels/triton/configs.py`` with evidence.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time

import torch

import compilemask as cm
from compilemask.kernels.reference import reference_attention, reference_attention_backward
from compilemask.kernels.triton.configs import (
    BwdConfig,
    FwdConfig,
    override_backward_config,
    override_forward_config,
)
from compilemask.testing import check_close
from compilemask.tools.bench_report import environment
from compilemask.workloads import workload

# (BLOCK_M, BLOCK_N, num_warps, num_stages, grid_order); grid_order: see configs.GRID_ORDERS
FWD_CANDIDATES = [
    FwdConfig(64, 64, 4, 3, 1),
    FwdConfig(64, 64, 4, 3, 2),
    FwdConfig(128, 64, 8, 3, 1),
    FwdConfig(128, 64, 8, 2, 1),
    FwdConfig(128, 128, 8, 2, 1),
    FwdConfig(64, 128, 4, 3, 1),
]
# --fwd-set tma: K/V through TMA descriptors (201-230 registers instead of 255 at
# 128x128, so 3 stages fit; 164 at 64x64), against the pointer loads of the defaults
FWD_TMA = [
    FwdConfig(128, 128, 8, 2, 1, 0),
    FwdConfig(128, 128, 8, 2, 1, 1),
    FwdConfig(128, 128, 8, 3, 1, 1),
    FwdConfig(128, 128, 8, 3, 1, 0),
    FwdConfig(64, 64, 4, 3, 1, 0),
    FwdConfig(64, 64, 4, 3, 1, 1),
    FwdConfig(64, 64, 4, 4, 1, 1),
    FwdConfig(128, 64, 8, 3, 1, 1),
    FwdConfig(128, 64, 8, 3, 1, 0),
    FwdConfig(128, 64, 8, 4, 1, 1),
]
# --fwd-set occupancy: 64x64 with 2 stages fits two programs per SM (83 KiB of
# shared memory each, 161 registers; 3 stages take 116 KiB: one program of 4 warps per SM),
# and 64x128 (wider MMAs, half the iterations; 200-231 registers, no spill in the SASS)
FWD_OCCUPANCY = [
    FwdConfig(64, 64, 4, 3, 1, 1),
    FwdConfig(64, 64, 4, 2, 1, 1),
    FwdConfig(64, 128, 4, 2, 1, 1),
    FwdConfig(64, 128, 4, 3, 1, 1),
    FwdConfig(128, 64, 8, 2, 1, 1),
]
# --fwd-set causal: the causal default (pointers, 128x128, 3 stages) against TMA
# (after the scale fold the pointer loop spills 16 bytes) and the launch orders
FWD_CAUSAL = [
    FwdConfig(128, 128, 8, 3, 1, 0),
    FwdConfig(128, 128, 8, 3, 1, 1),
    FwdConfig(128, 128, 8, 2, 1, 1),
    FwdConfig(128, 128, 8, 3, 0, 0),
    FwdConfig(128, 128, 8, 3, 2, 0),
    FwdConfig(128, 128, 8, 3, 3, 0),
]
# --fwd-set bits: bitmask plans (clear via tile_grid) at small N, where 128x64
# loses to Flex at 1K: smaller and larger tiles, two programs per SM (2 stages at 64x64)
FWD_BITS = [
    FwdConfig(128, 64, 8, 3, 1, 1),
    FwdConfig(64, 64, 4, 3, 1, 1),
    FwdConfig(64, 64, 4, 2, 1, 1),
    FwdConfig(128, 128, 8, 3, 1, 1),
    FwdConfig(128, 64, 8, 2, 1, 1),
    FwdConfig(64, 128, 4, 3, 1, 1),
]
# --fwd-set masked: larger tiles for masked plans with TMA and heaviest-first
# order (earlier sweeps measured 128x128 only with pointers and 2 stages on them: 1.373 ms for hstu
# against 1.162 at 64x64 with TMA), and 128x128 for bitmask plans that are nearly dense
# (clear at 1K: 92% of the pairs visible)
FWD_MASKED = [
    FwdConfig(64, 64, 4, 3, 3, 1),
    FwdConfig(128, 128, 8, 3, 3, 1),
    FwdConfig(128, 128, 8, 2, 3, 1),
    FwdConfig(128, 64, 8, 3, 3, 1),
    FwdConfig(64, 128, 4, 3, 3, 1),
    FwdConfig(128, 128, 8, 3, 3, 0),
]
# --fwd-set bits1k: nearly dense bitmask plans at 1K (clear: 92% of the pairs
# visible), 64x64 with 2 stages (the earlier choice) against 128x64 in both launch orders
FWD_BITS1K = [
    FwdConfig(64, 64, 4, 2, 1, 1),
    FwdConfig(64, 64, 4, 2, 3, 1),
    FwdConfig(128, 64, 8, 3, 3, 1),
    FwdConfig(128, 64, 8, 3, 1, 1),
    FwdConfig(128, 128, 8, 2, 3, 1),
]
# --fwd-set bits16: bitmask words loaded as 16-bit halves, which the pipeliner
# does not stage through shared memory (the 32-bit words took 512 bytes per stage): 64x64 with
# 3 stages now fits two programs per SM (115712 bytes of dynamic shared memory, the limit;
# was 116280) and 128x128 with 3 stages compiles (230400; was over the limit)
FWD_BITS16 = [
    FwdConfig(64, 64, 4, 2, 3, 1),
    FwdConfig(64, 64, 4, 3, 3, 1),
    FwdConfig(128, 128, 8, 3, 3, 1),
    FwdConfig(128, 128, 8, 3, 3, 0),
    FwdConfig(128, 64, 8, 3, 3, 1),
]
# --fwd-set prefetch: the program's q-tile, counts and first tiles from one work
# entry (FwdConfig.prefetch) against the chain of dependent loads, at both library tilings,
# alternated twice (the same process measures both within the spread)
FWD_PREFETCH = [
    FwdConfig(64, 64, 4, 3, 3, 1),
    FwdConfig(64, 64, 4, 3, 3, 1, prefetch=1),
    FwdConfig(128, 128, 8, 3, 3, 0),
    FwdConfig(128, 128, 8, 3, 3, 0, prefetch=1),
] * 2
# --fwd-set oneslot: PARTIAL tiles masked from the one slot per row that meets the
# tile (FwdConfig.one_slot; plans with no row holding two intervals in one kv-tile, such as
# shared_prompt), with the work-list prefetch, at both tilings (128x128 also through TMA:
# 235 registers against 255 and 8 bytes of stack with pointers), alternated twice
FWD_ONESLOT = [
    FwdConfig(128, 128, 8, 3, 3, 0, prefetch=1),
    FwdConfig(128, 128, 8, 3, 3, 0, prefetch=1, one_slot=1),
    FwdConfig(128, 128, 8, 3, 3, 1, prefetch=1, one_slot=1),
    FwdConfig(64, 64, 4, 3, 3, 1, prefetch=1),
    FwdConfig(64, 64, 4, 3, 3, 1, prefetch=1, one_slot=1),
] * 2
# --fwd-set stages: 64x64 with 1 stage (48 KiB of shared memory: three programs
# of 4 warps per SM, registers permitting) or 2 (two per SM) against 3, prefetch and one slot
FWD_STAGES = [
    FwdConfig(64, 64, 4, 3, 3, 1, prefetch=1, one_slot=1),
    FwdConfig(64, 64, 4, 1, 3, 1, prefetch=1, one_slot=1),
    FwdConfig(64, 64, 4, 2, 3, 1, prefetch=1, one_slot=1),
] * 2
# --fwd-set dense: the dense tiling (128x128, 8 warps, prefetch) with pointer loads
# (255 registers, 8 bytes of stack) against TMA (235, none) and the masked tiling with one slot
# per tile, for plans near DENSE_TILE_EFFICIENCY (shared_prompt: 0.945), alternated three times
FWD_DENSE = [
    FwdConfig(128, 128, 8, 3, 3, 0, prefetch=1),
    FwdConfig(128, 128, 8, 3, 3, 1, prefetch=1),
    FwdConfig(64, 64, 4, 3, 3, 1, prefetch=1, one_slot=1),
] * 3
# --fwd-set order: the earlier default for masked plans in every launch order (hstu's q-tiles
# differ a lot in length: heaviest first may balance the SMs better)
FWD_ORDER = [FwdConfig(64, 64, 4, 3, order, 1) for order in (1, 0, 2, 3)]
BWD_CANDIDATES = [
    BwdConfig(64, 64, 4, 2, 128, 64, 8, 3, 1, 2),  # an earlier D=128 default
    BwdConfig(64, 64, 4, 3, 64, 64, 4, 3, 1, 2),
    BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, 1, 2),
    BwdConfig(64, 64, 4, 3, 128, 64, 8, 3, 1, 2),
    BwdConfig(64, 128, 8, 2, 128, 64, 8, 2, 1, 2),
]
# --bwd-set spill: dK/dV 64x64 with 4 warps spills 42-62 registers (kernel_stats.py): 8 warps
BWD_SPILL = [
    BwdConfig(64, 64, 8, 3, 128, 64, 8, 2, 1, 2),
    BwdConfig(64, 64, 8, 3, 128, 128, 8, 2, 1, 2),
    BwdConfig(64, 64, 8, 2, 128, 64, 8, 2, 1, 2),
    BwdConfig(64, 64, 4, 3, 128, 64, 8, 2, 1, 2),
]
# --bwd-set pipelined: after the tile index is loaded one iteration ahead, the
# 3-stage loops really pipeline (async-copy waits 0x4 / 0x2 instead of 0x0 in the SASS)
BWD_PIPELINED = [
    BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, 1, 2),
    BwdConfig(64, 128, 8, 2, 128, 64, 8, 3, 1, 2),
    BwdConfig(32, 128, 8, 3, 128, 64, 8, 3, 1, 2),
    BwdConfig(32, 128, 8, 4, 128, 64, 8, 3, 1, 2),
    BwdConfig(64, 64, 4, 2, 128, 64, 8, 3, 1, 2),
    BwdConfig(64, 64, 4, 3, 128, 64, 8, 3, 1, 2),
]
# --bwd-set tma: Q/dO (dK/dV) and K/V (dQ) through TMA descriptors: dK/dV spills 24-40 bytes
# instead of 80-120 in the SASS, so 3 stages and 64x128 tiles may pay now
BWD_TMA = [
    BwdConfig(64, 64, 4, 2, 128, 64, 8, 3, 1, 2),
    BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, 1, 2),  # clear_tiled's best of the earlier defaults
    BwdConfig(64, 64, 4, 2, 128, 64, 8, 3, 1, 2, tma=1),
    BwdConfig(64, 64, 4, 3, 128, 64, 8, 3, 1, 2, tma=1),
    BwdConfig(64, 128, 8, 3, 128, 64, 8, 3, 1, 2, tma=1),
    BwdConfig(64, 128, 8, 3, 128, 128, 8, 2, 1, 2, tma=1),
    BwdConfig(64, 128, 8, 2, 128, 64, 8, 3, 1, 2, tma=1),
]
# --bwd-set order (untimed): heaviest-first launch orders (3) for dK/dV
# and dQ (order 3 gave the hstu forward 5%), and dQ at 64x64 with 2 stages (SASS: 180
# registers, 97 KiB of shared memory: two programs per SM; 128x64 takes 161 KiB: one)
BWD_ORDER = [
    BwdConfig(64, 64, 4, 2, 128, 64, 8, 3, 1, 2, tma=1),
    BwdConfig(64, 64, 4, 2, 128, 64, 8, 3, 3, 3, tma=1),
    BwdConfig(64, 64, 4, 2, 128, 64, 8, 3, 3, 2, tma=1),
    BwdConfig(64, 64, 4, 2, 128, 64, 8, 3, 1, 3, tma=1),
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 1, 2, tma=1),
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 3, 3, tma=1),
]
# --bwd-set occupancy: the earlier default against the winner of --bwd-set order
# on hstu and shared_prompt (dQ 64x64, 4 warps, 2 stages: two programs per SM; both kernels
# heaviest first), on the other seeds (causal: dense rows, where dQ at 128x64 may still win)
BWD_OCCUPANCY = [
    BwdConfig(64, 64, 4, 2, 128, 64, 8, 3, 1, 2, tma=1),
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 3, 3, tma=1),
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 1, 2, tma=1),
    BwdConfig(64, 64, 4, 2, 128, 64, 8, 3, 3, 3, tma=1),
]
# --bwd-set ds: dQ from the dS tiles the dK/dV kernel stores (BwdConfig.ds_dq: one
# MMA per tile pair in a GEMM-only dQ kernel instead of three; SASS: 90 registers, 49 KiB of
# shared memory at 64x64 with 2 stages; dK/dV 255 registers, 56 bytes of stack, 108 KiB),
# against the winners of --bwd-set order / occupancy (masks whose buffer exceeds the limit,
# causal from 16K, fall back to the dQ kernel)
BWD_DS = [
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 3, 3, tma=1),
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 3, 3, tma=1, ds_dq=1),
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 3, 3, 3, tma=1, ds_dq=1),
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 3, 3, 1, tma=1, ds_dq=1),
    BwdConfig(64, 64, 4, 2, 64, 64, 8, 3, 3, 3, tma=1, ds_dq=1),
    BwdConfig(64, 64, 4, 2, 128, 64, 8, 3, 3, 3, tma=1),
]
# --bwd-set dstma: the dS tiles stored through a TMA descriptor (BwdConfig.ds_tma:
# an asynchronous bulk copy from shared memory that the pipeliner waits for one iteration
# later; SASS: UTMASTG.2D, same 255 registers / 56 bytes of stack / 108 KiB as the per-thread
# stores), with 2 and 3 stages in the dS GEMM and 3 in dK/dV (143 KiB: one program per SM)
BWD_DSTMA = [
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 3, 3, tma=1, ds_dq=1),
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 3, 3, tma=1, ds_dq=1, ds_tma=1),
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 3, 3, 3, tma=1, ds_dq=1, ds_tma=1),
    BwdConfig(64, 64, 4, 3, 64, 64, 4, 2, 3, 3, tma=1, ds_dq=1, ds_tma=1),
]
# --bwd-set dkdv: with ds_tma, the dK/dV kernel at 64x64 with 8 warps (SASS: 251
# registers and no stack, against 255 and 56 bytes at 4 warps; 108 KiB: one program of 8 warps
# per SM instead of two of 4) and at 32x64 (254 registers, no stack, 70 KiB)
BWD_DKDV = [
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 3, 3, tma=1, ds_dq=1, ds_tma=1),
    BwdConfig(64, 64, 8, 2, 64, 64, 4, 2, 3, 3, tma=1, ds_dq=1, ds_tma=1),
    BwdConfig(32, 64, 4, 2, 32, 64, 4, 2, 3, 3, tma=1, ds_dq=1, ds_tma=1),
]
# --bwd-set wide: around the winners of the first sweeps (dense masks: causal, shared_prompt)
BWD_WIDE = [
    BwdConfig(64, 64, 4, 3, 128, 64, 8, 3, 1, 2),
    BwdConfig(64, 64, 4, 4, 128, 64, 8, 3, 1, 2),
    BwdConfig(64, 64, 4, 3, 128, 64, 8, 2, 1, 2),
    BwdConfig(64, 64, 4, 3, 128, 128, 8, 2, 1, 2),
    BwdConfig(128, 64, 8, 3, 128, 64, 8, 3, 1, 2),
    BwdConfig(64, 128, 8, 3, 128, 128, 8, 2, 1, 2),
    BwdConfig(64, 64, 4, 3, 128, 64, 8, 3, 2, 1),
    BwdConfig(32, 64, 4, 3, 128, 64, 8, 3, 1, 2),
]
# --bwd-set small: around the default for short sequences (1K tokens, B = 32: 8 q-tiles per
# row), where launch order, tile height and dQ from stored dS weigh differently than at 32K
BWD_SMALL = [
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 3, 3, tma=1, ds_dq=1, ds_tma=1),
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 1, 2, tma=1, ds_dq=1, ds_tma=1),
    BwdConfig(64, 64, 4, 3, 64, 64, 4, 3, 3, 3, tma=1, ds_dq=1, ds_tma=1),
    BwdConfig(32, 64, 4, 2, 32, 64, 4, 2, 3, 3, tma=1, ds_dq=1, ds_tma=1),
    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 3, 3, tma=1),
    BwdConfig(64, 64, 4, 2, 128, 64, 8, 3, 3, 3, tma=1),
    BwdConfig(64, 128, 8, 2, 64, 128, 8, 2, 3, 3, tma=1, ds_dq=1, ds_tma=1),
    BwdConfig(64, 64, 8, 2, 64, 64, 4, 2, 3, 3, tma=1, ds_dq=1, ds_tma=1),
]


def _mask(name: str, n0: int):
    if name == "clear_tiled":
        w = workload("clear", n0)
        return w, cm.masks.tile_grid(w.mask, (8, 16))
    if name == "dense":  # every pair visible (one bidirectional document) at clear's N and B:
        # the floor of a nearly dense mask (Flex's block mask is all FULL blocks)
        w = workload("clear", n0)
        w = dataclasses.replace(w, name="dense", mask=cm.masks.document([w.N], causal=False))
        return w, w.mask
    w = workload(name, n0)
    return w, w.mask


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", nargs="+", default=["causal", "hstu", "shared_prompt", "clear"])
    ap.add_argument("--part", nargs="+", default=["fwd"], choices=["fwd", "bwd"])
    ap.add_argument("--n0", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--no-flex", action="store_true", help="do not time FlexAttention")
    bwd_sets = ["default", "wide", "spill", "pipelined", "tma", "order"]
    bwd_sets += ["occupancy", "ds", "dstma", "dkdv", "small"]
    bwd_sets += ["library"]
    ap.add_argument("--bwd-set", default="default", choices=bwd_sets)
    fwd_sets = ["default", "tma", "order", "occupancy", "causal", "bits", "masked", "bits1k"]
    fwd_sets += ["bits16", "prefetch", "oneslot", "stages", "dense"]
    fwd_sets += ["library"]  # library: the library's own choice, no override
    ap.add_argument("--fwd-set", default="default", choices=fwd_sets)
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no candidate after this")
    a = ap.parse_args()
    env = environment()
    t_start = time.perf_counter()
    summary = []
    flex_cache: dict[str, dict[str, float]] = {}
    with open(a.out, "a") as out:
        for name in a.workloads:
            w, mask = _mask(name, a.n0)
            plan = cm.compile(mask, w.N, device="cuda")
            pairs = int(plan.schedule.pairs[0].sum())
            g = torch.Generator(device="cuda").manual_seed(0)
            shape = (w.B, a.heads, w.N, 128)
            q, k, v, do = (
                torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(4)
            )
            q2, k2, v2, do2 = (t[:, :2].contiguous() for t in (q, k, v, do))
            ref64 = reference_attention(q2, k2, v2, plan, compute_dtype=torch.float64)[0]
            refdt = reference_attention(
                q2, k2, v2, plan, compute_dtype=torch.float32, matmul_dtype=torch.bfloat16
            )[0]
            results = []
            fwd_list = {
                "tma": FWD_TMA,
                "order": FWD_ORDER,
                "occupancy": FWD_OCCUPANCY,
                "causal": FWD_CAUSAL,
                "bits": FWD_BITS,
                "masked": FWD_MASKED,
                "bits1k": FWD_BITS1K,
                "bits16": FWD_BITS16,
                "prefetch": FWD_PREFETCH,
                "oneslot": FWD_ONESLOT,
                "stages": FWD_STAGES,
                "dense": FWD_DENSE,
                "library": [None],
            }.get(a.fwd_set, FWD_CANDIDATES)
            parts = [("fwd", c) for c in fwd_list] if "fwd" in a.part else []
            bwd_list = {
                "wide": BWD_WIDE,
                "spill": BWD_SPILL,
                "pipelined": BWD_PIPELINED,
                "tma": BWD_TMA,
                "order": BWD_ORDER,
                "occupancy": BWD_OCCUPANCY,
                "ds": BWD_DS,
                "dstma": BWD_DSTMA,
                "dkdv": BWD_DKDV,
                "small": BWD_SMALL,
                "library": [None],
            }.get(a.bwd_set, BWD_CANDIDATES)
            parts += [("fwd+bwd", c) for c in bwd_list] if "bwd" in a.part else []
            if "bwd" in a.part:
                g64 = reference_attention_backward(
                    q2, k2, v2, plan, do2, None, compute_dtype=torch.float64
                )
                gdt = reference_attention_backward(
                    q2, k2, v2, plan, do2, None, compute_dtype=torch.float32,
                    matmul_dtype=torch.bfloat16,
                )  # fmt: skip
            base = name.removesuffix("_tiled")  # Flex always runs the row-major mask
            if base not in flex_cache and not a.no_flex:
                flex_cache[base] = _time_flex(w, a.heads, a.part)
            flex_ms = flex_cache.get(base, {})
            for mode, ms in flex_ms.items():
                row = {
                    **env, "workload": name, "N0": a.n0, "N": w.N, "B": w.B, "Hq": a.heads,
                    "Hkv": a.heads, "D": 128, "dtype": "bf16", "mode": mode,
                    "system": "flex-triton", "ms": ms,
                }  # fmt: skip
                out.write(json.dumps(row) + "\n")
                print(f"{name:<14} {mode:<8} {ms:8.3f} ms  flex-triton", flush=True)
            for mode, cfg in parts:
                if time.perf_counter() - t_start > a.budget_s:
                    print("budget spent: stopping", flush=True)
                    break
                ctx = override_forward_config if mode == "fwd" else override_backward_config
                if cfg is None:  # --*-set library: no override
                    ctx = lambda _: contextlib.nullcontext()  # noqa: E731
                row = {
                    **env, "workload": name, "N0": a.n0, "N": w.N, "B": w.B, "Hq": a.heads,
                    "Hkv": a.heads, "D": 128, "dtype": "bf16", "mode": mode,
                    "system": "compilemask-triton",
                    "config": list(vars(cfg).values()) if cfg else "library",
                    "ptxas": os.environ.get("TRITON_PTXAS_PATH"),
                }  # fmt: skip
                try:
                    with ctx(cfg):
                        if mode == "fwd":
                            o = cm.attention(q2, k2, v2, plan, backend="triton")
                            ok, err, _ = check_close(o, ref64, refdt, torch.bfloat16)

                            def fn(q=q, k=k, v=v, plan=plan):
                                return cm.attention(q, k, v, plan, backend="triton")

                            with torch.no_grad():
                                ms = triton.testing.do_bench(fn, warmup=25, rep=100,
                                                             return_mode="median")  # fmt: skip
                        else:
                            qs, ks, vs = (t.clone().requires_grad_(True) for t in (q2, k2, v2))
                            cm.attention(qs, ks, vs, plan, backend="triton").backward(do2)
                            checks = [
                                check_close(x, y, z, torch.bfloat16)
                                for x, y, z in zip((qs.grad, ks.grad, vs.grad), g64, gdt)
                            ]
                            ok, err = all(c[0] for c in checks), max(c[1] for c in checks)
                            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

                            def step(qg=qg, kg=kg, vg=vg, plan=plan, do=do):
                                out = cm.attention(qg, kg, vg, plan, backend="triton")
                                out.backward(do)

                            ms = triton.testing.do_bench(step, warmup=10, rep=50,
                                                         return_mode="median",
                                                         grad_to_none=[qg, kg, vg])  # fmt: skip
                except Exception as exc:  # a config that does not compile or run
                    row.update(ms=None, tflops=None, rel_err=None, error=str(exc)[:200])
                    out.write(json.dumps(row) + "\n")
                    print(name, mode, cfg, "ERROR", str(exc)[:120], flush=True)
                    continue
                if not ok:
                    row.update(ms=None, tflops=None, rel_err=err, error="correctness check failed")
                else:
                    flops = 4 * w.B * a.heads * 128 * pairs * (3.5 if mode != "fwd" else 1.0)
                    row.update(ms=ms, tflops=flops / ms / 1e9, rel_err=err)
                    results.append((ms, mode, cfg))
                out.write(json.dumps(row) + "\n")
                out.flush()
            for ms, mode, cfg in sorted(results, key=lambda r: (r[1], r[0])):
                print(f"{name:<14} {mode:<8} {ms:8.3f} ms  {cfg}", flush=True)
            for mode in sorted({r[1] for r in results}):
                ms, _, cfg = min(r for r in results if r[1] == mode)
                summary.append((name, mode, ms, flex_ms.get(mode), cfg))
    print(f"\n{'workload':<14} {'mode':<8} {'best ms':>9} {'flex ms':>9} {'ratio':>7}  config")
    for name, mode, ms, fms, cfg in summary:
        ratio = f"{fms / ms:6.2f}x" if fms else "      -"
        fms_s = f"{fms:9.3f}" if fms else "        -"
        print(f"{name:<14} {mode:<8} {ms:9.3f} {fms_s} {ratio}  {cfg}", flush=True)


def _time_flex(w, heads: int, part: list[str]) -> dict[str, float]:
    """FlexAttention (Triton backend, compiled) on the row-major mask: ms per mode."""
    import triton.testing
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from compilemask.tools.peers import flex_mask_mod

    torch._dynamo.config.recompile_limit = 1000
    torch._dynamo.config.accumulated_recompile_limit = 10000
    flex = torch.compile(flex_attention, dynamic=False)
    bm = create_block_mask(flex_mask_mod(w.mask, "cuda"), None, None, w.N, w.N, device="cuda")
    shape = (w.B, heads, w.N, 128)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    res = {}
    if "fwd" in part:
        with torch.no_grad():
            res["fwd"] = triton.testing.do_bench(
                lambda: flex(q, k, v, block_mask=bm), warmup=25, rep=100, return_mode="median"
            )
    if "bwd" in part:
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

        def step():
            flex(qg, kg, vg, block_mask=bm).backward(do)

        res["fwd+bwd"] = triton.testing.do_bench(
            step, warmup=10, rep=50, return_mode="median", grad_to_none=[qg, kg, vg]
        )
    return res


if __name__ == "__main__":
    main()
