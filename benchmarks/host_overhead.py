"""Is a case host-bound? Host time to issue one step against its GPU time.

    PYTHONPATH=src python3 benchmarks/host_overhead.py --workloads shared_prompt clear \\
        --n0 1024 --modes fwd fwd+bwd --out host.jsonl

For each workload and mode (fwd: no grad; fwd+bwd: one forward and backward step):
``gpu_ms``, the median of ``triton.testing.do_bench`` (what the speed tables report);
``issue_ms``, the wall time per step of issuing 50 steps back to back with no synchronisation
in between (the CUDA queue does not fill at that depth); and ``hidden_ms``, the median of the
same timing as do_bench (L2 flushed, events around each step) with a GPU sleep of
``--sleep-ms`` queued before each step, so that the host has issued the step before the GPU
reaches it: the GPU time alone. do_bench starts its clock when the GPU reaches the start
event, right after its L2 flush (a 256 MB memset); host work before a step's first launch
that outlasts the flush is therefore inside ``gpu_ms``: ``gpu_ms - hidden_ms`` is the host
time the speed tables see. When issue_ms is close to gpu_ms the step is host-bound. Rows for
CompileMask (Triton backend) and FlexAttention (compiled, its mask built once), one JSON line
each.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

import compilemask as cm
from compilemask.tools.bench_report import environment
from compilemask.workloads import workload


def _issue_ms(step, n: int = 50) -> float:
    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e3


def _hidden_ms(step, sleep_ms: float, n: int = 50, grad_to_none=()) -> float:
    """Median GPU ms of ``step`` as do_bench times it, with ``sleep_ms`` of GPU sleep queued
    before each step (after the L2 flush) so that the host's issue time is hidden."""
    cache = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    step()
    torch.cuda.synchronize()
    # torch.cuda._sleep spins for a number of cycles: calibrate cycles per ms once
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    torch.cuda._sleep(1_000_000)
    t1.record()
    torch.cuda.synchronize()
    cycles = int(1_000_000 * sleep_ms / t0.elapsed_time(t1))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        for x in grad_to_none:
            x.grad = None
        cache.zero_()
        torch.cuda._sleep(cycles)
        starts[i].record()
        step()
        ends[i].record()
        torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    return times[n // 2]


def _profile(step, top: int, grads, n: int = 100) -> None:
    """cProfile of ``n`` steps issued back to back: the ``top`` functions by own time."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(n):
        for x in grads:
            x.grad = None
        step()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=["shared_prompt"])
    ap.add_argument("--n0", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=["fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--sleep-ms", type=float, default=5.0, help="GPU sleep before each step")
    ap.add_argument(
        "--cprofile",
        type=int,
        default=0,
        help="print the N costliest host functions (cProfile, by own time) of CompileMask's steps",
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from compilemask.tools.peers import flex_mask_mod

    flex = torch.compile(flex_attention, dynamic=False)
    env = environment()
    with open(a.out, "a") as out:
        for name in a.workloads:
            w = workload(name, a.n0)
            plan = cm.compile(w.mask, w.N, device="cuda")
            mod = flex_mask_mod(w.mask, "cuda")
            bm = create_block_mask(mod, None, None, w.N, w.N, device="cuda")
            shape = (w.B, a.heads, w.N, 128)
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (
                torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(4)
            )
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

            def ours(qg=qg, kg=kg, vg=vg, plan=plan, do=do):
                cm.attention(qg, kg, vg, plan, backend="triton").backward(do)

            def theirs(qg=qg, kg=kg, vg=vg, bm=bm, do=do):
                flex(qg, kg, vg, block_mask=bm).backward(do)

            def ours_fwd(q=q, k=k, v=v, plan=plan):
                with torch.no_grad():
                    cm.attention(q, k, v, plan, backend="triton")

            def theirs_fwd(q=q, k=k, v=v, bm=bm):
                with torch.no_grad():
                    flex(q, k, v, block_mask=bm)

            steps = {
                "fwd": (("compilemask-triton", ours_fwd), ("flex-triton", theirs_fwd)),
                "fwd+bwd": (("compilemask-triton", ours), ("flex-triton", theirs)),
            }
            for mode in a.modes:
                grads = [qg, kg, vg] if mode == "fwd+bwd" else []
                for system, step in steps[mode]:
                    gpu = triton.testing.do_bench(
                        step, warmup=10, rep=50, return_mode="median", grad_to_none=grads
                    )
                    issue = _issue_ms(step)
                    hidden = _hidden_ms(step, a.sleep_ms, grad_to_none=grads)
                    row = {
                        **env, "workload": name, "N0": a.n0, "N": w.N, "B": w.B,
                        "Hq": a.heads, "D": 128, "dtype": "bf16", "mode": mode,
                        "system": system, "gpu_ms": gpu, "issue_ms": issue,
                        "hidden_ms": hidden, "sleep_ms": a.sleep_ms, "kind": "host_overhead",
                    }  # fmt: skip
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(
                        f"{name:<14} {mode:<8} {system:<20} gpu {gpu:7.3f} ms  "
                        f"issue {issue:7.3f} ms  hidden {hidden:7.3f} ms",
                        flush=True,
                    )
                    if a.cprofile and system == "compilemask-triton":
                        _profile(step, a.cprofile, grads)


if __name__ == "__main__":
    main()
