"""Compile the Triton forward for sm_90 on any machine (no GPU) with no modifier, with softcap
through the exact tanh, and with a lone softcap through ``tanh.approx.f32`` (folded, see
``score_mods.softcap_alone``), and print registers, instruction counts, special-function
operations and, per iteration of the FULL-tile loop, its instructions, MUFU ops, HGMMAs and
TMA copies (causal, 1K, 2 heads, head_dim 128, bf16, TMA as on an H200).

    env -u TRITON_INTERPRET PYTHONPATH=src python3 benchmarks/sass_softcap.py

Results: ``benchmarks/results/cpu-sass-sm90-softcap-2026-12-01.txt``.
"""

from __future__ import annotations

import collections
import re

import torch

import compilemask as cm
from compilemask import score_mods as sm
from compilemask.kernels.triton.configs import forward_config, replace
from compilemask.kernels.triton.forward import attention_forward
from compilemask.kernels.triton.sass import capture_sm90, loops, resources, sass
from compilemask.kernels.triton.schedule import forward_schedule
from compilemask.kernels.triton.score_mods import pack

N, H = 1024, 2


def main() -> None:
    plan = cm.compile(cm.masks.causal(), N)
    cfg = replace(forward_config(128, torch.bfloat16, None), tma=1)
    sched = forward_schedule(plan, cfg.block_m, cfg.block_n)
    q, k, v = (torch.randn(1, H, N, 128, dtype=torch.bfloat16) for _ in range(3))

    variants = (
        ("no modifier", None),
        ("softcap, exact tanh", pack(sm.softcap(50.0), N, N, "cpu", fast_tanh=False)),
        ("softcap, tanh.approx", pack(sm.softcap(50.0), N, N, "cpu", fast_tanh=True)),
    )
    for name, mods in variants:
        with capture_sm90() as kernels:
            attention_forward(
                q, k, v, plan.row_lo, plan.row_hi, sched, scale=0.088, cfg=cfg, mods=mods,
                sinks=None, mask_stride_b=0, mask_stride_h=0,
            )  # fmt: skip
        for kname, kernel in kernels:
            listing = sass(kernel)
            mufu = collections.Counter(re.findall(r"\bMUFU\.\w+", listing))
            instr = re.compile(r"\s*/\*[0-9a-f]{4}\*/")
            lines = sum(1 for line in listing.splitlines() if instr.match(line))
            print(f"{name:35s} {kname} {resources(kernel)[:40]} instructions={lines} {dict(mufu)}")
            # the FULL-tile loop: the shortest loop with the two GEMMs of a tile (no mask code)
            start, end, _c = next(
                x for x in loops(listing) if x[2]["HGMMA"] >= 3 and x[2]["MUFU.EX2"]
            )
            body = listing[listing.index(f"/*{start:04x}*/") : listing.index(f"/*{end:04x}*/")]
            ops = collections.Counter(re.findall(r"\b(MUFU\.\w+|HGMMA|UTMALDG)\b", body))
            print(f"{'':35s}   FULL loop: {_c['total']} instructions {dict(sorted(ops.items()))}")


if __name__ == "__main__":
    main()
