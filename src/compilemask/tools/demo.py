"""The attention part of ``compilemask demo``: run each seed workload through the best backend
available here and check it against the reference by the measure of docs/design.md.

* CUDA: the Triton kernels on the workload's own shape (B rows, 16 heads, head_dim 128, bf16),
  timed with CUDA events (median of 10 after 3 warm-ups); the float64 check uses 2 heads.
* CPU: the reference backend in float32 at nominal size 1024 (2 heads, head_dim 64) against
  float64, plus the Triton interpreter (``TRITON_INTERPRET=1``, fp16) on one small case --
  the interpreter runs kernels in Python and is slow, so the case is small.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import time

import torch

from .. import workloads as wl
from ..compiler.pipeline import compile as compile_mask
from ..testing import check_close

CPU_N0 = 1024


def _inputs(shape_q, shape_kv, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(shape_q, generator=g, device=device, dtype=dtype)
    k = torch.randn(shape_kv, generator=g, device=device, dtype=dtype)
    v = torch.randn(shape_kv, generator=g, device=device, dtype=dtype)
    return q, k, v


def _time_ms(fn, device) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(10):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _check(out, q, k, v, plan, dtype):
    from ..kernels.reference import reference_attention

    ref64, _ = reference_attention(q, k, v, plan, compute_dtype=torch.float64)
    ref_dt, _ = reference_attention(q, k, v, plan, compute_dtype=torch.float32, matmul_dtype=dtype)
    return check_close(out, ref64, ref_dt, dtype)


def _row(w, plan, backend, dtype, shape, ms, ok, err, bound):
    st = plan.stats()
    return {
        "workload": w.name,
        "N": w.N,
        "density": round(st["density"], 4),
        "FULL": st["tiles_full"],
        "PARTIAL": st["tiles_partial"],
        "backend": backend,
        "dtype": str(dtype).replace("torch.", ""),
        "B x H x D": shape,
        "ms": round(ms, 3),
        "rel_err": f"{err:.2e}",
        "bound": f"{bound:.2e}",
        "check": "ok" if ok else "FAIL",
    }


def gpu_rows(size: int, progress) -> list[dict]:
    """Triton on CUDA at nominal ``size``."""
    from ..api.functional import attention

    dev = torch.device("cuda")
    rows = []
    for name in progress(wl.SEED_WORKLOADS, desc="attention (triton)"):
        w = wl.workload(name, size)
        plan = compile_mask(w.mask, w.N, device=dev)
        q, k, v = _inputs((w.B, 16, w.N, 128), (w.B, 16, w.N, 128), torch.bfloat16, dev)
        ms = _time_ms(lambda q=q, k=k, v=v, p=plan: attention(q, k, v, p, backend="triton"), dev)
        q2, k2, v2 = (t[:, :2].contiguous() for t in (q, k, v))
        out = attention(q2, k2, v2, plan, backend="triton")
        ok, err, bound = _check(out, q2, k2, v2, plan, torch.bfloat16)
        rows.append(_row(w, plan, "triton", torch.bfloat16, f"{w.B}x16x128", ms, ok, err, bound))
    return rows


def cpu_rows(progress) -> list[dict]:
    """The reference at nominal size 1024 on the CPU, then the interpreter on a small case."""
    from ..api.functional import attention

    dev = torch.device("cpu")
    rows = []
    for name in progress(wl.SEED_WORKLOADS, desc="attention (reference)"):
        w = wl.workload(name, CPU_N0)
        plan = compile_mask(w.mask, w.N)
        q, k, v = _inputs((1, 2, w.N, 64), (1, 2, w.N, 64), torch.float32, dev)
        ms = _time_ms(lambda q=q, k=k, v=v, p=plan: attention(q, k, v, p, backend="reference"), dev)
        out = attention(q, k, v, plan, backend="reference")
        ok, err, bound = _check(out, q, k, v, plan, torch.float32)
        rows.append(_row(w, plan, "reference", torch.float32, "1x2x64", ms, ok, err, bound))
    rows.append(_interpreter_row())
    return rows


_INTERPRETER_CASE = """
import json, time, torch, compilemask as cm
from compilemask.kernels.triton.configs import FwdConfig, override_forward_config
from compilemask.testing import check_attention
mask = cm.masks.shared_prompt(48, [40, 40, 32])
plan = cm.compile(mask, 160, block_m=32, block_n=32)
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 160, 32, generator=g, dtype=torch.float16) for _ in range(3))
t0 = time.perf_counter()
with override_forward_config(FwdConfig(32, 32, 4, 1)):
    out = cm.attention(q, k, v, plan, backend="triton")
ms = (time.perf_counter() - t0) * 1e3
ok, err, bound = check_attention(out, q, k, v, plan)
s = plan.stats()
print(json.dumps(dict(N=160, density=s["density"], full=s["tiles_full"],
                      partial=s["tiles_partial"], ms=ms, ok=ok, err=err, bound=bound)))
"""


def _interpreter_row() -> dict:
    """The Triton kernel under the interpreter, in a subprocess (TRITON_INTERPRET must be set
    before Triton is imported)."""
    base = {"workload": "shared_prompt (small)", "backend": "triton (interpreter)"}
    if importlib.util.find_spec("triton") is None:
        return {**base, "check": "skipped: triton is not installed"}
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_CASE], env=env, capture_output=True, text=True
    )
    if done.returncode:
        return {**base, "check": "FAIL: " + done.stderr.strip().splitlines()[-1][:60]}
    import json

    r = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        **base,
        "N": r["N"],
        "density": round(r["density"], 4),
        "FULL": r["full"],
        "PARTIAL": r["partial"],
        "dtype": "float16",
        "B x H x D": "1x2x32",
        "ms": round(r["ms"], 1),
        "rel_err": f"{r['err']:.2e}",
        "bound": f"{r['bound']:.2e}",
        "check": "ok" if r["ok"] else "FAIL",
    }


def attention_rows(size: int, progress) -> tuple[str, list[dict]]:
    """(title, rows) for the demo's attention table."""
    if torch.cuda.is_available():
        return (
            f"attention, Triton on {torch.cuda.get_device_name()} (bf16), nominal size {size}:",
            gpu_rows(size, progress),
        )
    title = (
        f"attention on the CPU: reference backend (float32) at nominal size {CPU_N0}, and the "
        "Triton kernel in the interpreter on a small case; checked against float64:"
    )
    return title, cpu_rows(progress)
