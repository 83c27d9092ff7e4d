"""CPU proxy of CompileMask's host time per call: the Triton launch functions stubbed out.

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/host_proxy.py \\
        [--workloads hstu shared_prompt] [--backends triton auto host-stub] \\
        [--mods none softcap alibi relative_bias sinks] [--profile 25] [--out rows.jsonl]

Runs ``compilemask.attention`` forward (no grad) and forward+backward on small float16 CPU
tensors (B = 2, 16 heads, head_dim 128, the seed workload's length at ``--n0``) with
``attention_forward`` / ``attention_backward`` replaced by functions that only allocate their
outputs, so what is timed is the Python around the kernels (validation, backend resolution,
plan lookups, the modifier's packing, autograd). Triton's own launch path is not in it (it
needs a GPU). ``--backends host-stub``: a registered backend whose ``attend`` only allocates
out and lse (forward only), so the time is the api's own per call, as for a backend whose
launch costs little host time (the cute forward). ``--mods``: each call with that score
modifier (``softcap`` 50, ``alibi`` slopes, ``relative_bias`` a [16, 32] table) or with
``sinks`` [16] (``none``: neither). Prints the minimum and median ms per call over repeats
of ``--calls`` calls, and the Python functions and builtins entered per call
(``sys.setprofile``: a count the other processes of a shared machine do not disturb);
``--out`` appends them as JSON lines with ``date, gpu, torch, triton, commit``.
``--profile N``: cProfile of the last mode's loop, top N.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time

import torch

import compilemask as cm
from compilemask.kernels import registry
from compilemask.kernels.triton import backward as bwd_mod
from compilemask.kernels.triton import forward as fwd_mod
from compilemask.tools.bench_report import environment
from compilemask.workloads import SEED_WORKLOADS, workload

HEADS = 16
MODS = ("none", "softcap", "alibi", "relative_bias", "sinks")


def _fwd_stub(q, k, v, *args, **kwargs):
    B, H, N, _ = q.shape
    return torch.empty_like(q), torch.empty(B, H, N, dtype=torch.float32)


def _bwd_stub(q, k, v, out, lse, do, *args, **kwargs):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class HostStub:
    """A backend that runs every call and computes nothing (forward only)."""

    name = "host-stub"

    def available(self):
        return True, ""

    def supports(self, plan, call):
        return True, ""

    def dispatch_token(self):
        return ()

    def prepare(self, plan, call):
        return None

    def attend(self, q, k, v, plan, prepared, scale, call, *, score_mod=None, sinks=None):
        return _fwd_stub(q, k, v)

    def forward(self, q, k, v, plan, prepared, scale, need_lse=True):
        return _fwd_stub(q, k, v)

    def backward(self, q, k, v, out, lse, dout, plan, prepared, scale):
        return _bwd_stub(q, k, v, out, lse, dout)


def _repeats(fn, repeats: int, n: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e3)
    return out


def _calls_per_call(fn, n: int = 20) -> dict:
    """Python functions and builtins entered per call of ``fn`` (``sys.setprofile``): a count
    of the host work that other processes on the machine do not disturb."""
    counts = {"call": 0, "c_call": 0}

    def count(frame, event, arg):
        if event in counts:
            counts[event] += 1

    sys.setprofile(count)
    try:
        for _ in range(n):
            fn()
    finally:
        sys.setprofile(None)
    return {"py_calls": counts["call"] / n, "c_calls": counts["c_call"] / n}


def _line(what: str, t: list[float]) -> str:
    return f"{what}: min {min(t):.4f} ms, median {statistics.median(t):.4f} ms per call"


def _modifier(mods: str) -> dict:
    """The keyword arguments of ``attention`` for ``--mods`` (tensors made once: a training
    loop passes the same ones every step)."""
    sm = cm.score_mods
    if mods == "softcap":
        return {"score_mod": sm.softcap(50.0)}
    if mods == "alibi":
        return {"score_mod": sm.alibi(sm.alibi_slopes(HEADS))}
    if mods == "relative_bias":
        return {"score_mod": sm.relative_bias(torch.randn(HEADS, 32))}
    if mods == "sinks":
        return {"sinks": torch.zeros(HEADS)}
    return {}


def _steps(name: str, n0: int, backend: str, mods: str):
    w = workload(name, n0)
    plan = cm.compile(w.mask, w.N)
    q, k, v, do = (torch.randn(2, HEADS, w.N, 128, dtype=torch.float16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    extra = _modifier(mods)

    def step():
        qg.grad = kg.grad = vg.grad = None
        cm.attention(qg, kg, vg, plan, backend=backend, **extra).backward(do)

    def forward():
        with torch.no_grad():
            cm.attention(q, k, v, plan, backend=backend, **extra)

    return w, step, forward


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=["hstu", "shared_prompt"])
    ap.add_argument("--backends", nargs="+", default=["triton"])
    ap.add_argument("--mods", nargs="+", default=["none"], choices=MODS)
    ap.add_argument("--n0", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--variant", default="", help="a label stored in each row")
    ap.add_argument("--out", help="append JSON lines here")
    a = ap.parse_args()
    for name in a.workloads:
        if name not in SEED_WORKLOADS:
            ap.error(f"unknown workload {name!r}")
    fwd_mod.attention_forward = _fwd_stub  # imported at call time by the backend
    bwd_mod.attention_backward = _bwd_stub
    registry.register(HostStub())
    env = environment()
    for name in a.workloads:
        for backend in a.backends:
            for mods in a.mods:
                w, step, forward = _steps(name, a.n0, backend, mods)
                modes = [("fwd (no grad)", forward)]
                if backend != "host-stub":
                    modes.append(("fwd+bwd", step))
                for what, fn in modes:
                    _repeats(fn, 1, 20)  # warm
                    t = _repeats(fn, a.repeats, a.calls)
                    counted = _calls_per_call(fn)
                    print(
                        _line(f"{name} {backend} {mods} {what}", t)
                        + f", {counted['py_calls']:.0f} Python calls, "
                        + f"{counted['c_calls']:.0f} builtin calls"
                    )
                    if a.out:
                        row = {
                            **env, "kind": "host_proxy", "workload": name, "N0": a.n0,
                            "N": w.N, "B": 2, "heads": HEADS, "head_dim": 128,
                            "dtype": "fp16", "backend": backend, "mods": mods, "mode": what,
                            "variant": a.variant, "min_ms": round(min(t), 4),
                            "median_ms": round(statistics.median(t), 4),
                            **counted, "repeats": a.repeats, "calls": a.calls,
                            "threads": torch.get_num_threads(),
                        }  # fmt: skip
                        with open(a.out, "a") as f:
                            f.write(json.dumps(row) + "\n")
                if a.profile:
                    prof = cProfile.Profile()
                    prof.runcall(_repeats, modes[-1][1], 1, a.calls)
                    pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)


if __name__ == "__main__":
    main()
