"""A lone ``softcap`` against no modifier on the GPU: causal 32K, bf16, head_dim 128.

    PYTHONPATH=src python3 benchmarks/bench_softcap.py --commit $(git rev-parse --short HEAD) \\
        --out h200-softcap.jsonl [--cap 50] [--n 32768] [--heads 16]

First the correctness of the Triton backend with ``softcap(cap)`` on one head against the
float64 reference (out, dq, dk, dv; ``compilemask.testing.check_close``, the measure of
docs/design.md), then ``triton.testing.do_bench`` medians of the forward and forward+backward
with no modifier, with the softcap, and with no modifier again (the first and last rows show
the drift of the machine within the process). One JSON line per row, the commit in each.
The rows of ``h200-softcap-fma-exp2-2026-12-01.jsonl`` were measured the same way at 607de3d,
where a module switch (since removed) chose the softcap's exp2 path: ``path`` / ``variant``
"new" / "softcap-fma-exp2" with a quarter of the forward's exp2 on the FMA pipe, "old" /
"softcap-mufu-exp2" with all of it on the MUFU (the path kept).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

import compilemask as cm
from compilemask import score_mods as sm
from compilemask.kernels.reference import reference_attention
from compilemask.testing import check_close


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commit", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cap", type=float, default=50.0)
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    a = ap.parse_args()
    n, dt = a.n, torch.bfloat16
    plan = cm.compile(cm.masks.causal(), n, device="cuda")
    base = {"commit": a.commit, "N": n, "dtype": "bf16", "head_dim": 128, "mask": "causal"}
    out = open(a.out, "a")

    def emit(**row):
        row = {**base, **row}
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(1, 1, n, 128, device="cuda", dtype=dt, generator=g) for _ in range(4)
    )
    mod = sm.softcap(a.cap)

    def grads(kind):
        ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if kind == "triton":
            o = cm.attention(*ins, plan, backend="triton", score_mod=mod)
        else:
            if kind == "ref64":
                ins = [t.detach().double().requires_grad_() for t in ins]
            cd, mm = (torch.float64, None) if kind == "ref64" else (torch.float32, dt)
            o, _ = reference_attention(*ins, plan, compute_dtype=cd, matmul_dtype=mm, score_mod=mod)
        return [t.detach() for t in (o, *torch.autograd.grad(o, ins, do.to(o.dtype)))]

    r64, rdt, got = grads("ref64"), grads("refdt"), grads("triton")
    for name, x, y, z in zip(("out", "dq", "dk", "dv"), got, r64, rdt):
        ok, err, bound = check_close(x, y, z, dt)
        emit(kind="correctness", variant="softcap", tensor=name, ok=bool(ok), err=err, bound=bound)
    del r64, rdt, got
    torch.cuda.empty_cache()

    q, k, v, do = (torch.randn(1, a.heads, n, 128, device="cuda", dtype=dt) for _ in range(4))
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    for label, m in (("none", None), ("softcap", mod), ("none", None)):

        def fwd(m=m):
            with torch.no_grad():
                cm.attention(q, k, v, plan, backend="triton", score_mod=m)

        def fwd_bwd(m=m):
            o = cm.attention(qg, kg, vg, plan, backend="triton", score_mod=m)
            torch.autograd.grad(o, (qg, kg, vg), do)

        ms = [triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
              for f in (fwd, fwd_bwd)]  # fmt: skip
        emit(kind="timing", variant=label, heads=a.heads, fwd_ms=ms[0], fwd_bwd_ms=ms[1])
    out.close()


if __name__ == "__main__":
    main()
