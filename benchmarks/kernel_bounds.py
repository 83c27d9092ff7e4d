"""Upper bounds of what cheaper masking and fewer programs could save (GPU, timing only).

    PYTHONPATH=src python3 benchmarks/kernel_bounds.py --out $OUT/bounds.jsonl \\
        [--workloads causal hstu shared_prompt] [--n0 32768]

For each seed workload (B as in WORKLOADS.md, 16 heads, head_dim 128, bf16) the library's
forward and backward kernels are launched directly (``attention_forward`` /
``attention_backward``, the library's configurations and schedules) and timed with
``triton.testing.do_bench`` (median) against two altered schedules of the same plan:

- ``all_full``: every touched tile run as FULL (the FULL count set to the tile count): the same
  tiles and MMAs without any masking or the second loop. ``library - all_full`` bounds what a
  cheaper partial-tile mask (or a single loop) could save. Results are wrong by design and
  never checked.
- ``full_only``: the PARTIAL tiles skipped (the tile count set to the FULL count): what the
  partial tiles cost in all.

It also prints ns per touched tile per SM (``ms * SMs / tiles``) beside causal's at the same
tiling, which bounds the cost of short rows (per-program prologue, epilogue and pipeline fill),
and the backward's kernels one by one (``torch.profiler``, one call).
"""

from __future__ import annotations

import argparse
import json

import torch

import compilemask as cm
from compilemask.kernels.triton.backward import attention_backward
from compilemask.kernels.triton.configs import (
    FwdConfig,
    backward_config,
    fit_ds_buffer,
    forward_config,
    has_bitmask_tiles,
    tile_efficiency_128,
)
from compilemask.kernels.triton.forward import attention_forward, default_scale
from compilemask.kernels.triton.schedule import dkdv_schedule, ds_slots, forward_schedule
from compilemask.tools.bench_report import environment
from compilemask.workloads import workload


def _bench(fn) -> float:
    import triton.testing

    if not torch.cuda.is_available():  # a smoke run under TRITON_INTERPRET=1: one call
        fn()
        return float("nan")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _touched(sched: dict, count_key: str) -> int:
    return int(sched[count_key].sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", nargs="+", default=["causal", "hstu", "shared_prompt"])
    ap.add_argument("--n0", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument(
        "--fwd-tiling",
        default=None,
        help="BLOCK_MxBLOCK_N (e.g. 64x64): override the forward tiling (4 warps at 64x64, "
        "8 otherwise; 3 stages; TMA)",
    )
    a = ap.parse_args()
    env = environment()
    cuda = torch.cuda.is_available()
    sms = torch.cuda.get_device_properties(0).multi_processor_count if cuda else 1
    dev = torch.device("cuda" if cuda else "cpu")
    dt = torch.bfloat16 if cuda else torch.float16
    with open(a.out, "a") as out:
        for name in a.workloads:
            _workload(name, a, env, sms, dev, dt, cuda, out)


def _workload(name: str, a, env: dict, sms: int, dev, dt, cuda: bool, out) -> None:
    """Time the variants of one workload, print them and write their rows to ``out``."""
    w = workload(name, a.n0)
    plan = cm.compile(w.mask, w.N, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    shape = (w.B, a.heads, w.N, 128)
    q, k, v, do = (torch.randn(shape, device=dev, dtype=dt, generator=g) for _ in range(4))
    eff = tile_efficiency_128(plan)
    fcfg = forward_config(128, dt, dev, eff, has_bitmask_tiles(plan))
    if a.fwd_tiling:
        bm, bn = (int(x) for x in a.fwd_tiling.split("x"))
        fcfg = FwdConfig(bm, bn, 4 if bm == 64 else 8, 3, 3, tma=1)
    scale = default_scale(128)
    fs = forward_schedule(plan, fcfg.block_m, fcfg.block_n, bits=True)
    variants = {
        "library": fs,
        "all_full": {**fs, "q_full_count": fs["q_count"]},
        "full_only": {**fs, "q_count": fs["q_full_count"]},
    }
    tiles = _touched(fs, "q_count") * w.B * a.heads
    base = {**env, "workload": name, "N0": a.n0, "N": w.N, "B": w.B, "Hq": a.heads,
            "Hkv": a.heads, "D": 128, "dtype": "bf16", "kind": "bound"}  # fmt: skip

    def fwd(s):
        return lambda: attention_forward(
            q, k, v, plan.row_lo, plan.row_hi, s, scale=scale, mask_stride_b=0,
            mask_stride_h=0, cfg=fcfg,
        )  # fmt: skip

    o, lse = fwd(fs)()
    for label, s in variants.items():
        ms = _bench(fwd(s))
        ns_tile = ms * 1e6 * sms / tiles
        row = {**base, "mode": "fwd", "variant": label, "ms": ms,
               "config": list(vars(fcfg).values()), "tiles": tiles,
               "ns_per_tile_per_sm": ns_tile}  # fmt: skip
        out.write(json.dumps(row) + "\n")
        print(f"{name:<14} fwd {label:<10} {ms:8.3f} ms  {tiles:>8} tiles "
              f"{ns_tile:8.1f} ns/tile/SM  {fcfg}", flush=True)  # fmt: skip
    if a.no_bwd:
        return
    bcfg = backward_config(128, dt, dev)
    bcfg = fit_ds_buffer(bcfg, plan, w.B, a.heads, 2, dev)
    dks = dkdv_schedule(plan, bcfg.dkdv_block_m, bcfg.dkdv_block_n, bits=True)
    dqs = forward_schedule(plan, bcfg.dq_block_m, bcfg.dq_block_n, bits=True)
    slots = ds_slots(dks["kind"]) if bcfg.ds_dq else None
    bvariants = {
        "library": (dks, dqs),
        "all_full": (
            {**dks, "kv_full_count": dks["kv_count"]},
            {**dqs, "q_full_count": dqs["q_count"]},
        ),
    }

    def bwd(s1, s2):
        return lambda: attention_backward(
            q, k, v, o, lse, do, plan.row_lo, plan.row_hi, s1, s2, scale=scale,
            mask_stride_b=0, mask_stride_h=0, cfg=bcfg, ds_slots=slots,
        )  # fmt: skip

    btiles = _touched(dks, "kv_count") * w.B * a.heads
    for label, (s1, s2) in bvariants.items():
        ms = _bench(bwd(s1, s2))
        row = {**base, "mode": "bwd", "variant": label, "ms": ms,
               "config": list(vars(bcfg).values()), "tiles": btiles,
               "ns_per_tile_per_sm": ms * 1e6 * sms / btiles}  # fmt: skip
        out.write(json.dumps(row) + "\n")
        print(f"{name:<14} bwd {label:<10} {ms:8.3f} ms  {btiles:>8} tiles "
              f"{ms * 1e6 * sms / btiles:8.1f} ns/tile/SM  {bcfg}", flush=True)  # fmt: skip
    if not cuda:
        return
    fn = bwd(dks, dqs)
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        fwd(fs)()
        fn()
        torch.cuda.synchronize()
    for e in p.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA or "attn" in e.key:
            us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
            row = {**base, "mode": "kernel", "variant": e.key[:80], "ms": us / 1e3}
            out.write(json.dumps(row) + "\n")
            print(f"{name:<14} kernel {e.key[:60]:<60} {us / 1e3:8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
