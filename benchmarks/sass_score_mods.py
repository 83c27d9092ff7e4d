"""Compile the attention kernels with score modifiers, sinks and Dv != D for sm_90 on any
machine (no GPU) and print their resources (registers, stack = spills) and async-copy waits.

    env -u TRITON_INTERPRET PYTHONPATH=src python3 benchmarks/sass_score_mods.py

(``compilemask.kernels.triton.sass.capture_sm90``: the launches compile and do not run.)
Results: ``benchmarks/results/cpu-sass-sm90-score-mods-2026-12-01.txt``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import compilemask as cm
from compilemask import score_mods as sm
from compilemask.kernels.triton.backward import attention_backward
from compilemask.kernels.triton.configs import backward_config, forward_config, replace
from compilemask.kernels.triton.forward import attention_forward
from compilemask.kernels.triton.sass import async_copy_waits, capture_sm90, resources, sass
from compilemask.kernels.triton.schedule import dkdv_schedule, ds_slots, forward_schedule
from compilemask.kernels.triton.score_mods import pack

N, H = 1024, 2


@triton.jit
def _custom(score, b, h, q_idx, kv_idx, aux):
    return score * tl.load(aux) + 0.25 * h.to(tl.float32)


@triton.jit
def _custom_grad(score, b, h, q_idx, kv_idx, aux):
    return tl.load(aux) + 0.0 * score


def run(plan, name, mod, sinks, D=128, Dv=128, ds=True) -> None:
    d = max(D, Dv)
    d = 256 if d == 192 else d
    fwd = forward_config(d, torch.bfloat16, None)
    bwd = backward_config(d, torch.bfloat16, None)
    fwd, bwd = replace(fwd, tma=int(d == 128)), replace(bwd, tma=int(d == 128))  # H200: TMA
    q, k = (torch.randn(1, H, N, D, dtype=torch.bfloat16) for _ in range(2))
    v, do = (torch.randn(1, H, N, Dv, dtype=torch.bfloat16) for _ in range(2))
    mods = pack(sm.as_score_mod(mod), N, N, "cpu", fast_tanh=True) if mod is not None else None
    st = dict(mask_stride_b=0, mask_stride_h=0)
    with capture_sm90() as kernels:
        sched = forward_schedule(plan, fwd.block_m, fwd.block_n)
        out, lse = attention_forward(
            q, k, v, plan.row_lo, plan.row_hi, sched, scale=0.088, cfg=fwd, mods=mods,
            sinks=sinks, **st,
        )  # fmt: skip
        s1 = dkdv_schedule(plan, bwd.dkdv_block_m, bwd.dkdv_block_n)
        s2 = forward_schedule(plan, bwd.dq_block_m, bwd.dq_block_n)
        slots = None
        if bwd.ds_dq and ds:
            slots = ds_slots(s1["kind"])
            bwd = replace(bwd, ds_dq=int((s2["kind"] != 0).sum()))
        else:
            bwd = replace(bwd, ds_dq=0)
        g = mods.grad_buffer(1, H, N, N, s1["kind"].shape[2]) if mods is not None else None
        attention_backward(
            q, k, v, out, lse, do, plan.row_lo, plan.row_hi, s1, s2, scale=0.088, cfg=bwd,
            ds_slots=slots, mods=mods, mod_grad=g, **st,
        )  # fmt: skip
    for kname, kernel in kernels:
        waits = dict(async_copy_waits(sass(kernel)))
        print(f"{name:28s} {kname:22s} {resources(kernel)[:60]} waits={waits}")


def main() -> None:
    plan = cm.compile(cm.masks.sliding_window(300), N)
    table = torch.randn(H, 32, requires_grad=True)
    bias = torch.randn(1, H, N, N, requires_grad=True)
    run(plan, "none", None, None)
    run(plan, "softcap", sm.softcap(50.0), None)
    run(plan, "alibi+softcap+sinks", [sm.alibi(sm.alibi_slopes(H)), sm.softcap(30.0)],
        torch.zeros(H))  # fmt: skip
    run(plan, "relbias+bias learnable",
        [sm.relative_bias(table, 32, 128, False), sm.bias(bias)], None)  # fmt: skip
    run(plan, "relbias no-ds", [sm.relative_bias(table, 32, 128, True)], None, ds=False)
    run(plan, "custom", sm.custom(lambda *a: a[0], _custom, _custom_grad, aux=torch.ones(1)), None)
    run(plan, "Dv 192/128", None, torch.zeros(H), D=192, Dv=128)
    run(plan, "Dv 128/64 softcap", sm.softcap(50.0), None, D=128, Dv=64)
    run(plan, "Dv 64/128", None, None, D=64, Dv=128)


if __name__ == "__main__":
    main()
