"""GPU correctness and speed run for the Triton kernels (one process, H200).

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out $OUT/run.jsonl [--bwd] [--parts ...]

Correctness: every result against the float64 reference by docs/design.md (2 heads at
32K, where 16 heads of float64 do not fit). Speed: CompileMask (Triton) and FlexAttention (Triton
backend, ``create_block_mask`` on the natural mask_mod) side by side in this process, with
``triton.testing.do_bench`` (median), forward and, with ``--bwd``, forward+backward.
Writes JSON lines with the keys of docs/benchmarking.md "Results files" and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import compilemask as cm
from compilemask import masks
from compilemask.kernels.reference import reference_attention
from compilemask.testing import check_close
from compilemask.tools.bench_report import environment
from compilemask.tools.peers import flex_mask_mod
from compilemask.workloads import SEED_WORKLOADS, workload

DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


env = environment


ROWS: list[dict] = []


def record(out, **kw):
    row = {**env(), **kw}
    ROWS.append(row)
    out.write(json.dumps(row) + "\n")
    out.flush()
    print(
        json.dumps(
            {k: row[k] for k in row if k not in ("date", "gpu", "torch", "triton", "commit")}
        ),
        flush=True,
    )


def inputs(B, Hq, Hkv, Nq, Nk, D, dtype, seed=0, grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, Nk, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, Nk, D, device="cuda", dtype=dtype, generator=g)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def fwd_case(out, name, plan, B, Hq, Hkv, D, dtype_name, N0=None, check_empty=True):
    dtype = DT[dtype_name]
    Nq, Nk = plan.q_len, plan.kv_len
    q, k, v = inputs(B, Hq, Hkv, Nq, Nk, D, dtype)
    o, lse = cm.attention(q, k, v, plan, return_lse=True, backend="triton")
    torch.cuda.synchronize()
    ref64, lse64 = reference_attention(q, k, v, plan, compute_dtype=torch.float64)
    refdt, _ = reference_attention(q, k, v, plan, compute_dtype=torch.float32, matmul_dtype=dtype)
    ok, err, bound = check_close(o, ref64, refdt, dtype)
    nan = bool(torch.isnan(o).any() or torch.isnan(lse).any())
    empty_ok = True
    if check_empty:
        empty = plan.row_count == 0  # [M, Nq]
        if bool(empty.any()):
            m_e = empty.reshape(plan.batch or 1, plan.heads or 1, Nq)
            m_e = m_e.expand(B, Hq, Nq)
            empty_ok = bool((o[m_e] == 0).all()) and bool(torch.isneginf(lse[m_e]).all())
    lse_err = (
        float(((lse.double() - lse64)[torch.isfinite(lse64)]).abs().max())
        if bool(torch.isfinite(lse64).any())
        else 0.0
    )
    passed = ok and not nan and empty_ok
    record(
        out,
        workload=name,
        N0=N0,
        N=Nq,
        Nk=Nk,
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        dtype=dtype_name,
        mode="fwd",
        system="compilemask-triton",
        ms=None,
        tflops=None,
        rel_err=err,
        bound=bound,
        lse_abs_err=lse_err,
        passed=passed,
        kind="correctness",
    )
    return passed


def bwd_case(out, name, plan, B, Hq, Hkv, D, dtype_name, N0=None):
    from compilemask.kernels.reference import reference_attention_backward

    dtype = DT[dtype_name]
    q, k, v = inputs(B, Hq, Hkv, plan.q_len, plan.kv_len, D, dtype, grad=True)
    do = torch.randn(B, Hq, plan.q_len, D, device="cuda", dtype=dtype)
    o = cm.attention(q, k, v, plan, backend="triton")
    o.backward(do)
    grads = [q.grad.clone(), k.grad.clone(), v.grad.clone()]
    q.grad = k.grad = v.grad = None
    o2 = cm.attention(q, k, v, plan, backend="triton")
    o2.backward(do)
    identical = all(torch.equal(a, b) for a, b in zip(grads, (q.grad, k.grad, v.grad)))
    qd, kd, vd = (t.detach() for t in (q, k, v))
    r64 = reference_attention_backward(qd, kd, vd, plan, do, None, compute_dtype=torch.float64)
    rdt = reference_attention_backward(
        qd, kd, vd, plan, do, None, compute_dtype=torch.float32, matmul_dtype=dtype
    )
    passed = identical
    errs = {}
    for nm, g, a, b in zip(("dq", "dk", "dv"), grads, r64, rdt):
        ok, err, bound = check_close(g, a, b, dtype)
        nan = bool(torch.isnan(g).any())
        errs[nm] = (err, bound)
        passed = passed and ok and not nan
    record(
        out,
        workload=name,
        N0=N0,
        N=plan.q_len,
        Nk=plan.kv_len,
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        dtype=dtype_name,
        mode="fwd+bwd",
        system="compilemask-triton",
        ms=None,
        tflops=None,
        rel_err=max(e for e, _ in errs.values()),
        errors=errs,
        bit_identical=identical,
        passed=passed,
        kind="correctness",
    )
    return passed


def correctness(out, dtypes, bwd, big):
    """Small and 1K cases always; the 32K seeds (2 heads, float64 check) with ``big``."""
    results = []
    for dt in dtypes:
        for name in SEED_WORKLOADS:
            for N0, H in ((32768, 2),) if big else ((1024, 16),):
                w = workload(name, N0)
                plan = cm.compile(w.mask, w.N, device="cuda")
                results.append(fwd_case(out, name, plan, w.B, H, H, 128, dt, N0))
                if bwd and dt == "bf16":
                    for D in (128, 64):
                        results.append(bwd_case(out, name, plan, w.B, H, H, D, dt, N0))
        if big:
            continue
        plan = cm.compile(masks.causal(), 4096, device="cuda")
        for D in (32, 64, 96, 128, 256):
            results.append(fwd_case(out, "causal", plan, 2, 4, 4, D, dt, 4096))
        results.append(fwd_case(out, "causal-gqa16/4", plan, 1, 16, 4, 128, dt, 4096))
        if bwd and dt == "bf16":
            results.append(bwd_case(out, "causal-gqa16/4", plan, 1, 16, 4, 128, dt, 4096))
        small = [
            (
                "sliding_window-q1300-kv700",
                cm.compile(masks.sliding_window(256), 1300, 700, device="cuda"),
                2,
                4,
                2,
            ),
            (
                "prefix_lm-q700-kv1300",
                cm.compile(masks.prefix_lm(900), 700, 1300, device="cuda"),
                2,
                4,
                4,
            ),
            (
                "per_batch-document",
                cm.compile(
                    masks.per_batch([masks.document([300, 700]), masks.document([999, 1])]),
                    1000,
                    batch=2,
                    device="cuda",
                ),
                2,
                4,
                2,
            ),
            (
                "per_head-mixed",
                cm.compile(
                    masks.per_head(
                        [
                            masks.causal(),
                            masks.sliding_window(100),
                            masks.clear((20, 40), 6, 200),
                            masks.dilated(64, 4),
                        ]
                    ),
                    1000,
                    heads=4,
                    device="cuda",
                ),
                2,
                4,
                2,
            ),
        ]
        for nm, plan, B, Hq, Hkv in small:
            results.append(fwd_case(out, nm, plan, B, Hq, Hkv, 128, dt))
            if bwd and dt == "bf16":
                results.append(bwd_case(out, nm, plan, B, Hq, Hkv, 128, dt))
    return results


def plan_build(out, N0=32768):
    """GPU plan building vs create_block_mask (median of 20 warm synchronised runs), and a
    check that our GPU build does not synchronise."""
    from torch.nn.attention.flex_attention import create_block_mask

    def med(fn):
        for _ in range(3):
            fn()
        ts = []
        for _ in range(20):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t) * 1e3)
        return sorted(ts)[10]

    for name in SEED_WORKLOADS:
        w = workload(name, N0)
        mm = flex_mask_mod(w.mask, "cuda")
        ours = med(lambda w=w: cm.compile(w.mask, w.N, device="cuda", cache=False))
        flex = med(lambda w=w, mm=mm: create_block_mask(mm, None, None, w.N, w.N, device="cuda"))
        # with the forward and dK/dV schedules the kernels read: the Triton tile-schedule
        # builder (kernels/triton/tile_builder.py, the default on CUDA) and the tensor builder
        from compilemask.kernels.triton import tile_builder
        from compilemask.kernels.triton.schedule import dkdv_schedule, forward_schedule

        def build_all(w=w):
            plan = cm.compile(w.mask, w.N, device="cuda", cache=False)
            forward_schedule(plan, 128, 128)
            dkdv_schedule(plan, 128, 128)

        with tile_builder.using(True):
            ours_triton = med(build_all)
            torch.cuda.set_sync_debug_mode("error")
            try:
                build_all()
                sync_free_triton = True
            except RuntimeError as e:
                sync_free_triton = str(e)[:120]
            finally:
                torch.cuda.set_sync_debug_mode("default")
        with tile_builder.using(False):
            ours_all = med(build_all)
        for sys_name, ms, sf in (
            ("compilemask-cuda+schedules", ours_all, None),
            ("compilemask-cuda-triton-builder+schedules", ours_triton, sync_free_triton),
        ):
            record(out, workload=name, N0=N0, N=w.N, B=w.B, Hq=None, Hkv=None, D=None,
                   dtype=None, mode="plan", system=sys_name, ms=ms, tflops=None, rel_err=None,
                   sync_free=sf, kind="plan")  # fmt: skip
        try:
            torch.cuda.set_sync_debug_mode("error")
            cm.compile(w.mask, w.N, device="cuda", cache=False)
            sync_free = True
        except RuntimeError as e:
            sync_free = str(e)[:120]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for sys_name, ms in (("compilemask-cuda", ours), ("flex-create_block_mask", flex)):
            record(
                out,
                workload=name,
                N0=N0,
                N=w.N,
                B=w.B,
                Hq=None,
                Hkv=None,
                D=None,
                dtype=None,
                mode="plan",
                system=sys_name,
                ms=ms,
                tflops=None,
                rel_err=None,
                sync_free=sync_free if sys_name.startswith("compilemask") else None,
                kind="plan",
            )


def speed(out, sizes, bwd, heads=16, names=(*SEED_WORKLOADS, "clear_tiled")):
    import triton.testing
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.recompile_limit = 1000
    torch._dynamo.config.accumulated_recompile_limit = 10000
    flex = torch.compile(flex_attention, dynamic=False)
    table = []
    for N0 in sizes:
        for name in names:
            tiled = name == "clear_tiled"
            w = workload("clear" if tiled else name, N0)
            # clear_tiled: our plan in tiled order (q, k, v stay in the original order); Flex
            # always runs the row-major mask
            mask = cm.masks.tile_grid(w.mask, (8, 16)) if tiled else w.mask
            plan = cm.compile(mask, w.N, device="cuda")
            pairs = int(plan.schedule.pairs[0].sum())
            bm = create_block_mask(
                flex_mask_mod(w.mask, "cuda"), None, None, w.N, w.N, device="cuda"
            )
            modes = ["fwd"] + (["fwd+bwd"] if bwd else [])
            for mode in modes:
                q, k, v = inputs(
                    w.B, heads, heads, w.N, w.N, 128, torch.bfloat16, grad=mode != "fwd"
                )
                do = torch.randn_like(q)
                fns = {
                    "compilemask-triton": lambda q=q, k=k, v=v, p=plan: cm.attention(
                        q, k, v, p, backend="triton"
                    ),
                    "flex-triton": lambda q=q, k=k, v=v, bm=bm: flex(q, k, v, block_mask=bm),
                }
                ref = fns["flex-triton"]().float()
                mine = fns["compilemask-triton"]().float()
                rel = float((mine - ref).norm() / ref.norm())
                ms = {}
                for sys_name, fn in fns.items():
                    if mode == "fwd":
                        with torch.no_grad():
                            t = triton.testing.do_bench(
                                fn, warmup=25, rep=100, return_mode="median"
                            )
                    else:

                        def step(fn=fn):
                            o = fn()
                            o.backward(do)  # noqa: B023 - called at once, in this iteration

                        t = triton.testing.do_bench(
                            step, warmup=25, rep=100, return_mode="median", grad_to_none=[q, k, v]
                        )
                    flops = 4 * w.B * heads * 128 * pairs * (3.5 if mode != "fwd" else 1.0)
                    ms[sys_name] = t
                    record(
                        out,
                        workload=name,
                        N0=N0,
                        N=w.N,
                        B=w.B,
                        Hq=heads,
                        Hkv=heads,
                        D=128,
                        dtype="bf16",
                        mode=mode,
                        system=sys_name,
                        ms=t,
                        tflops=flops / t / 1e9,
                        rel_err=rel if sys_name.startswith("compilemask") else None,
                        kind="speed",
                    )
                table.append((name, N0, mode, ms["compilemask-triton"], ms["flex-triton"]))
    print(f"\n{'workload':<15}{'N0':>7} {'mode':<8}{'ours ms':>9}{'flex ms':>9}{'speedup':>9}")
    for name, N0, mode, a, b in table:
        print(f"{name:<15}{N0:>7} {mode:<8}{a:>9.3f}{b:>9.3f}{b / a:>8.2f}x")
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="correctness,speed")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--sizes", default="32768")
    ap.add_argument(
        "--workloads", help="speed part: comma-separated, default the seeds and clear_tiled"
    )
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--big", action="store_true", help="correctness of the 32K seeds only")
    a = ap.parse_args()
    t0 = time.time()
    with open(a.out, "a") as out:
        ok = True
        if "correctness" in a.parts:
            res = correctness(out, a.dtypes.split(","), a.bwd, a.big)
            ok = all(res)
            print(f"correctness: {sum(res)}/{len(res)} passed", flush=True)
        if "plan" in a.parts:
            plan_build(out)
        if "speed" in a.parts:
            names = a.workloads.split(",") if a.workloads else (*SEED_WORKLOADS, "clear_tiled")
            speed(out, [int(s) for s in a.sizes.split(",")], a.bwd, names=names)
    print(f"total {time.time() - t0:.0f}s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
