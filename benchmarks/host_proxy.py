"""CPU proxy of CompileMask's host time per call: the Triton launchers stubbed out.

    TRITON_INTERPRET=1 PYTHONPATH=src python3 benchmarks/host_proxy.py --workload shared_prompt \\
        [--compare-setup-context]

Runs ``cm.attention`` forward+backward (and forward without grad) on small float16 CPU tensors
with ``attention_forward`` / ``attention_backward`` replaced by functions that only allocate
their outputs, so what is timed is the Python around the kernels (validation, config choice,
schedule lookups, autograd). Triton's own launch cost is not in it (it needs a GPU: see
``host_overhead.py --cprofile``). Prints the minimum and median ms per call over rounds of 200
calls. ``--compare-setup-context``: interleaves rounds with an ``autograd.Function`` written in
the ``setup_context`` form (session 6's ``_EagerAttention``), against the classic form in use.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import compilemask as cm
import compilemask.kernels.triton.backend as triton_backend
from compilemask.kernels.triton import backward as bwd_mod
from compilemask.kernels.triton import forward as fwd_mod
from compilemask.kernels.triton.backend import _attention_bwd_impl, setup_context
from compilemask.workloads import workload


def _fwd_stub(q, k, v, *args, **kwargs):
    B, H, N, _ = q.shape
    return torch.empty_like(q), torch.empty(B, H, N, dtype=torch.float32)


def _bwd_stub(q, k, v, out, lse, do, *args, **kwargs):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _SetupContextForm(torch.autograd.Function):
    """Session 6's eager Function: the same calls, the context in ``setup_context``."""

    @staticmethod
    def forward(q, k, v, row_lo, row_hi, schedule, bwd_schedule, scale, msb, msh, cfg, bwd_cfg):
        return triton_backend._attention_fwd_impl(
            q, k, v, row_lo, row_hi, schedule, scale, msb, msh, cfg
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        setup_context(ctx, inputs, output)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, row_lo, row_hi, *bwd_schedule = ctx.saved_tensors
        dq, dk, dv = _attention_bwd_impl(
            q, k, v, out, lse, dout, dlse, row_lo, row_hi, bwd_schedule, ctx.scale,
            *ctx.mask_strides, ctx.bwd_config,
        )  # fmt: skip
        return (dq, dk, dv) + (None,) * 9


def _rounds(fn, rounds: int, n: int = 200) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="shared_prompt")
    ap.add_argument("--n0", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--compare-setup-context", action="store_true")
    a = ap.parse_args()
    fwd_mod.attention_forward = _fwd_stub  # imported at call time by the API
    bwd_mod.attention_backward = _bwd_stub
    w = workload(a.workload, a.n0)
    plan = cm.compile(w.mask, w.N)
    q, k, v, do = (torch.randn(2, 16, w.N, 128, dtype=torch.float16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def step():
        qg.grad = kg.grad = vg.grad = None
        cm.attention(qg, kg, vg, plan, backend="triton").backward(do)

    def forward():
        with torch.no_grad():
            cm.attention(q, k, v, plan, backend="triton")

    forms = {"classic (in use)": triton_backend._EagerAttention}
    if a.compare_setup_context:
        forms["setup_context"] = _SetupContextForm
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(a.rounds):  # interleaved: the machine's drift hits both alike
        for name, cls in forms.items():
            triton_backend._EagerAttention = cls
            _rounds(step, 1, 20)  # warm
            times[name] += _rounds(step, 1)
    for name, t in times.items():
        print(
            f"{a.workload} fwd+bwd, {name}: min {min(t):.4f} ms, median "
            f"{statistics.median(t):.4f} ms per call"
        )
    t = _rounds(forward, a.rounds)
    print(f"{a.workload} fwd (no grad): min {min(t):.4f} ms, median {statistics.median(t):.4f}")


if __name__ == "__main__":
    main()
