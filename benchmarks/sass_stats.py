"""Compile the attention kernels for sm_90 on any machine (no GPU) and count their instructions.

    PYTHONPATH=src python3 benchmarks/sass_stats.py --workload causal --n0 4096 \\
        [--fwd 128,128,8,2] [--bwd 64,64,4,2,128,64,8,3] [--dump /tmp/sass]

Launches of the forward and backward kernels are compiled for sm_90 and not run
(``compilemask.kernels.triton.sass.capture_sm90``; start it without ``TRITON_INTERPRET``). For
each kernel it prints registers, spills, shared memory, the async-copy waits
(``DEPBAR.LE SB0, N``: N = 0 in a loop means no pipelining) and SASS instruction counts of the
whole kernel and of its loops (HGMMA, LDGSTS, LDG, LDS, MUFU.EX2, BAR, branches, spill loads
LDL): the cheapest way to see what a kernel change did to the code before spending GPU time on
it. ``--dump`` writes the SASS and PTX.
"""

from __future__ import annotations

import argparse
import os

import torch

import compilemask as cm
from compilemask.kernels.triton import configs as cfgs
from compilemask.kernels.triton.backward import attention_backward
from compilemask.kernels.triton.forward import attention_forward
from compilemask.kernels.triton.sass import (
    COUNTED,
    async_copy_waits,
    capture_sm90,
    instruction_counts,
    loops,
    resources,
    sass,
)
from compilemask.kernels.triton.schedule import dkdv_schedule, forward_schedule
from compilemask.workloads import workload


def launch_all(w, fwd: cfgs.FwdConfig, bwd: cfgs.BwdConfig, heads: int = 2) -> None:
    """One forward and one backward launch of every kernel on CPU tensors (inside
    ``capture_sm90`` they compile and do not run)."""
    plan = cm.compile(w.mask, w.N)
    q, k, v, do = (torch.randn(1, heads, w.N, 128, dtype=torch.bfloat16) for _ in range(4))
    strides = dict(mask_stride_b=0, mask_stride_h=0)
    fwd_sched = forward_schedule(plan, fwd.block_m, fwd.block_n)
    out, lse = attention_forward(
        q, k, v, plan.row_lo, plan.row_hi, fwd_sched, scale=0.088, cfg=fwd, **strides
    )
    attention_backward(
        q, k, v, out, lse, do, plan.row_lo, plan.row_hi,
        dkdv_schedule(plan, bwd.dkdv_block_m, bwd.dkdv_block_n),
        forward_schedule(plan, bwd.dq_block_m, bwd.dq_block_n),
        scale=0.088, cfg=bwd, **strides,
    )  # fmt: skip


def _fmt(c) -> str:
    return " ".join(f"{k}={c[k]}" for k in ("total", *COUNTED) if c[k])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="causal")
    ap.add_argument("--n0", type=int, default=4096)
    ap.add_argument("--fwd", help="block_m,block_n,warps,stages (default: the library's)")
    ap.add_argument("--bwd", help="BwdConfig ints (default: the library's)")
    ap.add_argument("--dump", help="folder for <kernel>.sass and .ptx")
    a = ap.parse_args()
    dtype = torch.bfloat16
    fwd = cfgs.FwdConfig(*map(int, a.fwd.split(","))) if a.fwd else cfgs.forward_config(128, dtype)
    bwd = cfgs.BwdConfig(*map(int, a.bwd.split(","))) if a.bwd else cfgs.backward_config(128, dtype)
    with capture_sm90() as kernels:
        launch_all(workload(a.workload, a.n0), fwd, bwd)
    for name, kernel in kernels:
        listing = sass(kernel)
        waits = dict(sorted(async_copy_waits(listing).items()))
        print(
            f"{name}: {resources(kernel)} dynamic smem {kernel.metadata.shared} | "
            f"waits {waits} | {_fmt(instruction_counts(listing.splitlines()))}"
        )
        for lo, hi, c in loops(listing)[:6]:
            print(f"   loop {lo:#06x}-{hi:#06x}: {_fmt(c)}")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            with open(os.path.join(a.dump, f"{name}.sass"), "w") as f:
                f.write(listing)
            with open(os.path.join(a.dump, f"{name}.ptx"), "w") as f:
                f.write(kernel.asm["ptx"])


if __name__ == "__main__":
    main()
