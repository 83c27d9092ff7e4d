"""Where the cudnn backend's time goes beside cuDNN-frontend called directly, on the same endpoints:
per-call medians (CUDA events around one call, host time included) and the kernels of one
call (torch.profiler), for clear at 32K (row-major, through tile_grid with attention permuting
the tokens, and with the tokens kept in the tiled order) and hstu / shared_prompt / causal at 4K.

    PYTHONPATH=src python benchmarks/profile_cudnn_backend.py \\
        > benchmarks/results/h200-cudnn-profile-<date>.txt

With ``--host``: the 1K training step (B = 32) of shared_prompt and causal instead, host time
per step (50 steps issued back to back, no synchronisation inside) beside the wall time per
step, for cuDNN-frontend direct, our cudnn backend (on [B, H, N, D] tensors, and on views of
BSHD storage) and our Triton backend, the kernels of one step, then cProfile of 50 steps of the
first two (top functions by own time).

Each timed function runs within the loop iteration that defines it (hence B023 is off).
"""

# ruff: noqa: B023
import cProfile
import io
import pstats
import statistics
import sys
import time
import traceback

import torch
from cudnn.flex_attention import create_mask_plan, flex_attn_func
from torch.profiler import ProfilerActivity, profile

import compilemask as cm
from compilemask import workloads as wl
from compilemask.tools.peers import cudnn_endpoints

dev = "cuda"


def med(fn, n=25):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def kernels(fn, label):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    print("=== kernels:", label)
    for e in sorted(p.key_averages(), key=lambda e: -e.device_time_total)[:10]:
        print(f"  {e.device_time_total / 1e3:8.3f} ms x{e.count:3d}  {e.key[:110]}")


def leaves(B, N, grad, bshd):
    shape = (B, N, 16, 128) if bshd else (B, 16, N, 128)
    return [
        torch.randn(shape, device=dev, dtype=torch.bfloat16, requires_grad=grad) for _ in range(3)
    ]


def step(fn, ins, dout):
    def run():
        for t in ins:
            t.grad = None
        o = fn()
        o = o[0] if isinstance(o, tuple) else o
        if dout is not None:
            o.backward(dout)

    return run


def host_profile():
    for name in ("shared_prompt", "causal"):
        w = wl.workload(name, 1024)
        plan = cm.compile(w.mask, w.N, device=dev)
        qb, kb, vb = leaves(w.B, w.N, True, True)
        cp = create_mask_plan(cudnn_endpoints(plan, w.B), qb, kb, vb, build_backward=True)
        dob = torch.randn_like(qb)
        q, k, v = leaves(w.B, w.N, True, False)
        do = torch.randn_like(q)
        fe = lambda: flex_attn_func(qb, kb, vb, mask_plan=cp)  # noqa: E731
        # the same call on [B, H, N, D] views of BSHD storage (cuDNN's own layout)
        bshd = leaves(w.B, w.N, False, True)
        qs, ks, vs = (t.transpose(1, 2).requires_grad_() for t in bshd)
        dos = torch.randn_like(qb).transpose(1, 2)
        steps = {
            "cudnn-fe direct": step(fe, (qb, kb, vb), dob),
            "cm cudnn": step(lambda: cm.attention(q, k, v, plan, backend="cudnn"), (q, k, v), do),
            "cm cudnn, BSHD": step(
                lambda: cm.attention(qs, ks, vs, plan, backend="cudnn"), (qs, ks, vs), dos
            ),
            "cm triton": step(lambda: cm.attention(q, k, v, plan, backend="triton"), (q, k, v), do),
        }
        for label, fn in steps.items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            host, wall = [], []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(50):
                    fn()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                host.append((t1 - t0) / 50 * 1e3)
                wall.append((t2 - t0) / 50 * 1e3)
            hm, wm = statistics.median(host), statistics.median(wall)
            print(
                f"{name:14s} N={w.N} B={w.B} fwd+bwd {label:18s} host {min(host):.3f} ms/step "
                f"(median {hm:.3f}), wall {wm:.3f} ms/step, single call {med(fn):.3f} ms"
            )
        for label in ("cudnn-fe direct", "cm cudnn", "cm cudnn, BSHD"):
            kernels(steps[label], f"{name} fwd+bwd {label} (1K, B={w.B})")
        for label in ("cudnn-fe direct", "cm cudnn"):
            fn = steps[label]
            torch.cuda.synchronize()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            pr.disable()
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(30)
            print(f"=== cProfile, 50 steps: {name} {label}")
            print("\n".join(line[:150] for line in out.getvalue().splitlines()[:48]))


if "--host" in sys.argv:
    host_profile()
    sys.exit(0)

for name, n0, modes, tiled in (
    ("clear", 32768, ("fwd", "fwd+bwd"), True),
    ("hstu", 4096, ("fwd+bwd", "fwd"), False),
    ("shared_prompt", 4096, ("fwd+bwd",), False),
    ("causal", 4096, ("fwd+bwd",), False),
):
    try:
        w = wl.workload(name, n0)
        plan_r = cm.compile(w.mask, w.N, device=dev)
        plans = {"row-major": plan_r}
        if tiled:
            plan_t = cm.compile(cm.masks.tile_grid(w.mask, (8, 16)), w.N, device=dev)
            plans["tile_grid (attention permutes)"] = plan_t
            plans["tile_grid, tokens kept tiled"] = plan_t.in_permuted_order()
        for mode in modes:
            grad = mode == "fwd+bwd"
            res = {}
            for pname, plan in plans.items():
                base = plan.in_permuted_order() if "tile_grid" in pname else plan
                qb, kb, vb = leaves(w.B, w.N, grad, True)
                cp = create_mask_plan(cudnn_endpoints(base, w.B), qb, kb, vb, build_backward=grad)
                dob = torch.randn_like(qb) if grad else None
                fe = step(lambda: flex_attn_func(qb, kb, vb, mask_plan=cp), (qb, kb, vb), dob)
                q, k, v = leaves(w.B, w.N, grad, False)
                do = torch.randn_like(q) if grad else None
                ours = step(lambda: cm.attention(q, k, v, plan, backend="cudnn"), (q, k, v), do)
                ctx = torch.enable_grad() if grad else torch.no_grad()
                with ctx:
                    if "attention permutes" not in pname:
                        res[f"cudnn-fe direct, {pname}"] = med(fe)
                    res[f"cm cudnn, {pname}"] = med(ours)
                    if pname != "row-major" or name != "clear":
                        kernels(ours, f"{name} {mode} cm cudnn {pname}")
                        if "attention permutes" not in pname:
                            kernels(fe, f"{name} {mode} cudnn-fe {pname}")
            for r, t in res.items():
                print(f"{name:14s} N={w.N} {mode:8s} {r:48s} {t:8.3f} ms")
    except Exception:
        traceback.print_exc()
