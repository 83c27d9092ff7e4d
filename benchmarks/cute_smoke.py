"""GPU smoke check of ``backend="cute"`` (sm90): compile time, one causal case, then every
case of the GPU tests. Prints each failure's full traceback and keeps going; exits 1 if any
step failed.

    PYTHONPATH=src python benchmarks/cute_smoke.py
    PYTHONPATH=src CUTE_DSL_ARCH=sm_90a python benchmarks/cute_smoke.py --compile-only

``--compile-only`` (no GPU needed, only ``cutlass``): compile, or load from the disk cache,
the kernel of every (dtype, head_dim) and print the seconds and where each came from; run it
twice to see the second process load from the cache.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

failures = 0


def step(title, fn):
    global failures
    print(f"== {title}", flush=True)
    try:
        result = fn()
        if result is not None:
            print(f"   {result}", flush=True)
    except Exception:
        failures += 1
        print(f"   FAILED: {title}", flush=True)
        traceback.print_exc()
        sys.stderr.flush()


def causal_one():
    import compilemask as cm
    from compilemask.kernels.cute import backend as cb
    from compilemask.kernels.reference import reference_attention

    be = cb.CuteBackend()
    print(f"   available: {be.available()}", flush=True)
    plan = cm.compile(cm.masks.causal(), 1024, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, 2, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(3)
    )
    from compilemask.kernels.interface import call_of

    call = call_of(q, k, v, True)
    print(f"   supports: {be.supports(plan, call)}", flush=True)
    prepared = be.prepare(plan, call)
    start = time.perf_counter()
    out, lse = be.forward(q, k, v, plan, prepared, 128**-0.5)
    torch.cuda.synchronize()
    print(f"   first call {time.perf_counter() - start:.2f} s; compile: {cb.compile_seconds()}")
    print(f"   kernels (compiled, or loaded from the disk cache): {cb.kernel_origins()}")
    ref, lse64 = reference_attention(q, k, v, plan, 128**-0.5, compute_dtype=torch.float64)
    err = (out.double() - ref).abs().max().item()
    lerr = (lse.double() - lse64).abs().max().item()
    return f"causal 1x2x1024x128: max |out - ref64| = {err:.3g}, max |lse - ref64| = {lerr:.3g}"


def compile_only():
    from compilemask.kernels.cute import backend as cb
    from compilemask.kernels.cute import disk_cache

    print(f"cache directory: {disk_cache.cache_dir()}", flush=True)
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in cb.HEAD_DIMS:
            step(
                f"kernel {dtype} d={head_dim}",
                lambda d=dtype, h=head_dim: f"{cb.precompile(h, d):.3f} s",
            )
    for key, origin in cb.kernel_origins().items():
        print(f"   {key}: {origin}, {cb.compile_seconds()[key]:.3f} s", flush=True)
    print(f"== done: {failures} failed", flush=True)
    return 1 if failures else 0


def main():
    if "--compile-only" in sys.argv[1:]:
        return compile_only()
    print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}", flush=True)
    if torch.cuda.is_available():
        print(f"device {torch.cuda.get_device_name()}", flush=True)
    step("causal 1x2x1024x128", causal_one)
    from test_backend_cute import GPU_CASES, check_gpu_case

    for name in GPU_CASES:
        step(f"case {name} (d=128)", lambda name=name: check_gpu_case(name, 128))
    step("case causal (d=64)", lambda: check_gpu_case("causal", 64))
    step("case causal (d=64, fp16)", lambda: check_gpu_case("causal", 64, torch.float16))
    step("case hstu (d=128, fp16)", lambda: check_gpu_case("hstu", 128, torch.float16))
    print(f"== done: {failures} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
