"""Is the spread of our kernel times between runs a GPU clock effect? (needs a CUDA GPU)

    PYTHONPATH=src python benchmarks/spread.py --workload clear --n0 1024 --rounds 5 \\
        --out spread.jsonl

Times CompileMask (Triton) and FlexAttention (Triton) forward, alternately, ``--rounds`` times
in one process (``triton.testing.do_bench``, median, as ``gpu_check.py``), and reads the GPU's
SM clock, temperature, power and active clock-throttle reasons from ``nvidia-smi`` after each
timing. Optionally (``--heat-s``) runs a heavy causal forward for that many seconds first, to
see the same kernels on a hot GPU. One JSON line per timing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch
import triton

import compilemask as cm
from compilemask.tools.bench_report import environment
from compilemask.tools.peers import flex_mask_mod
from compilemask.workloads import workload

_QUERY = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"


def gpu_state() -> dict:
    """SM / memory clock (MHz), temperature (C), power (W), throttle reasons (bit mask)."""
    try:
        line = subprocess.run(
            ["nvidia-smi", f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip().splitlines()[0]  # fmt: skip
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        return {"nvidia_smi_error": str(exc)[:80]}
    sm, mem, temp, power, reasons = (x.strip() for x in line.split(","))
    return {"sm_mhz": sm, "mem_mhz": mem, "temp_c": temp, "power_w": power, "throttle": reasons}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="clear")
    ap.add_argument("--n0", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--heat-s", type=float, default=0.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    w = workload(a.workload, a.n0)
    plan = cm.compile(w.mask, w.N, device="cuda")
    bm = create_block_mask(flex_mask_mod(w.mask, "cuda"), None, None, w.N, w.N, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (w.B, a.heads, w.N, 128)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)
    )
    fns = {
        "compilemask-triton": lambda: cm.attention(q, k, v, plan, backend="triton"),
        "flex-triton": lambda: flex(q, k, v, block_mask=bm),
    }
    env = environment()
    with torch.no_grad(), open(a.out, "a") as out:
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        if a.heat_s > 0:  # a hot GPU: a dense causal forward at 32K for heat_s seconds
            hp = cm.compile(cm.masks.causal(), 32768, device="cuda")
            hq = torch.randn(1, 16, 32768, 128, device="cuda", dtype=torch.bfloat16)
            t_end = time.perf_counter() + a.heat_s
            while time.perf_counter() < t_end:
                for _ in range(20):
                    cm.attention(hq, hq, hq, hp, backend="triton")
                torch.cuda.synchronize()
            print("heated:", gpu_state(), flush=True)
        for r in range(a.rounds):
            for system, fn in fns.items():
                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                state = gpu_state()
                row = {**env, "workload": a.workload, "N0": a.n0, "N": w.N, "B": w.B,
                       "Hq": a.heads, "D": 128, "dtype": "bf16", "mode": "fwd",
                       "system": system, "round": r, "heat_s": a.heat_s, "ms": ms, **state,
                       "kind": "spread"}  # fmt: skip
                out.write(json.dumps(row) + "\n")
                print(f"round {r} {system:<20} {ms:7.3f} ms  {state}", flush=True)


if __name__ == "__main__":
    main()
