"""CPU proxy of CompileMask's host time per call: the Triton launch functions stubbed out.

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/host_proxy.py \\
        [--workloads hstu shared_prompt] [--backends triton auto] [--profile 25]

Runs ``compilemask.attention`` forward (no grad) and forward+backward on small float16 CPU
tensors (B = 2, 16 heads, head_dim 128, the seed workload's length at ``--n0``) with
``attention_forward`` / ``attention_backward`` replaced by functions that only allocate their
outputs, so what is timed is the Python around the kernels (validation, backend resolution,
plan lookups, autograd). Triton's own launch path is not in it (it needs a GPU): ``--launch``
times, for the forward kernel's real argument list, Triton's binder and cache key (what
``JITFunction.run`` computes before every launch, built here for an sm_90 target) against the
key of ``kernels/triton/launcher.py``. Prints the minimum and median ms per call over rounds
of ``--calls`` calls. ``--profile N``: cProfile of the forward+backward loop, top N.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import compilemask as cm
from compilemask.kernels.triton import backward as bwd_mod
from compilemask.kernels.triton import forward as fwd_mod
from compilemask.workloads import SEED_WORKLOADS, workload


def _fwd_stub(q, k, v, *args, **kwargs):
    B, H, N, _ = q.shape
    return torch.empty_like(q), torch.empty(B, H, N, dtype=torch.float32)


def _bwd_stub(q, k, v, out, lse, do, *args, **kwargs):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _rounds(fn, rounds: int, n: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e3)
    return out


def _line(what: str, t: list[float]) -> str:
    return f"{what}: min {min(t):.4f} ms, median {statistics.median(t):.4f} ms per call"


def _steps(name: str, n0: int, backend: str):
    w = workload(name, n0)
    plan = cm.compile(w.mask, w.N)
    q, k, v, do = (torch.randn(2, 16, w.N, 128, dtype=torch.float16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def step():
        qg.grad = kg.grad = vg.grad = None
        cm.attention(qg, kg, vg, plan, backend=backend).backward(do)

    def forward():
        with torch.no_grad():
            cm.attention(q, k, v, plan, backend=backend)

    return step, forward


def _launch_proxy(rounds: int, calls: int) -> None:
    """Per launch of the forward kernel (hstu 1K's real argument list): what
    ``JITFunction.run`` computes before every launch (Triton's binder for sm_90, its cache key,
    the launch metadata's dict) against the launcher's key and argument list."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

    from compilemask.kernels.triton import launcher

    seen = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append((a, kw))

    real, fwd_mod._attn_fwd = fwd_mod._attn_fwd, Spy()
    q = torch.randn(2, 16, 1024, 128, dtype=torch.float16)
    with torch.no_grad():
        cm.attention(q, q, q, cm.compile(workload("hstu", 1024).mask, 1024), backend="triton")
    fwd_mod._attn_fwd = real
    args, kwargs = seen[-1]
    jit = launcher.CachedLaunchJIT(getattr(real, "fn", real))
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    jit.device_caches[0] = ({}, {}, backend.target, backend, binder)
    key_cache: dict = {}
    tail = jit._tail(len(args))

    def triton_run():
        kw = dict(kwargs)
        kw["debug"] = kw.get("debug", jit.debug) or False
        kw["instrumentation_mode"] = ""
        bound, spec, opts = binder(*args, **kw)
        compute_cache_key(key_cache, spec, opts)
        return tuple(bound.values())

    def ours():
        launcher.launch_key(jit, args, kwargs)
        return (*args, *tail(kwargs))

    assert triton_run() == ours() or all(a is b for a, b in zip(triton_run(), ours()))
    assert isinstance(jit, JITFunction)
    for what, fn in (("Triton binder + cache key", triton_run), ("launcher key", ours)):
        fn()
        print(_line(f"forward launch, {what}", _rounds(fn, rounds, calls)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", nargs="+", default=["hstu", "shared_prompt"])
    ap.add_argument("--backends", nargs="+", default=["triton"])
    ap.add_argument("--n0", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--launch", action="store_true")
    a = ap.parse_args()
    for name in a.workloads:
        if name not in SEED_WORKLOADS:
            ap.error(f"unknown workload {name!r}")
    if a.launch:
        _launch_proxy(a.rounds, a.calls)
        return
    fwd_mod.attention_forward = _fwd_stub  # imported at call time by the backend
    bwd_mod.attention_backward = _bwd_stub
    for name in a.workloads:
        for backend in a.backends:
            step, forward = _steps(name, a.n0, backend)
            for what, fn in (("fwd (no grad)", forward), ("fwd+bwd", step)):
                _rounds(fn, 1, 20)  # warm
                print(_line(f"{name} {backend} {what}", _rounds(fn, a.rounds, a.calls)))
            if a.profile:
                prof = cProfile.Profile()
                prof.runcall(_rounds, step, 1, a.calls)
                pstats.Stats(prof).sort_stats("tottime").print_stats(a.profile)


if __name__ == "__main__":
    main()
