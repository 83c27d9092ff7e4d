"""One forward+backward of CompileMask and of FlexAttention on one seed workload, for a profiler.

    ncu --target-processes all -k regex:"_attn_|triton_tem" --launch-count 12 \\
        --section SpeedOfLight --section LaunchStats --section Occupancy \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --csv \\
        python3 benchmarks/profile_once.py --workload causal --n0 8192 --no-torch-profiler \
        > $OUT/ncu.csv

(``PYTHONPATH=src``; B = 1, 16 heads, head_dim 128, bf16.) Each system runs its forward and
backward twice: the first pass compiles, so profile with ``--launch-skip`` past it or read the
second launch of each kernel. Without ``--no-torch-profiler`` it prints the CUDA time of every
kernel of one forward+backward per system (``torch.profiler``): which of dK/dV, dQ and the
forward is behind its Flex counterpart, and the kernel names the ``-k`` regex must match.
"""

from __future__ import annotations

import argparse

import torch

import compilemask as cm
from compilemask.tools.peers import flex_mask_mod
from compilemask.workloads import workload


def main() -> None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="causal")
    ap.add_argument("--n0", type=int, default=8192)
    ap.add_argument("--systems", nargs="+", default=["compilemask", "flex"])
    ap.add_argument("--no-torch-profiler", action="store_true", help="under ncu")
    a = ap.parse_args()
    w = workload(a.workload, a.n0)
    shape = (w.B, 16, w.N, 128)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    fns = {}
    if "compilemask" in a.systems:
        plan = cm.compile(w.mask, w.N, device="cuda")
        fns["compilemask"] = lambda: cm.attention(q, k, v, plan)
    if "flex" in a.systems:
        bm = create_block_mask(flex_mask_mod(w.mask, "cuda"), None, None, w.N, w.N, device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)
        fns["flex"] = lambda: flex(q, k, v, block_mask=bm)
    for name, fn in fns.items():
        for _ in range(2):
            fn().backward(do)
        torch.cuda.synchronize()
        if a.no_torch_profiler:
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn().backward(do)
            torch.cuda.synchronize()
        print(f"== {name}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main()
