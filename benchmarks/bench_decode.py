"""Decode-step timings on a GPU: ``compilemask.attention`` over a paged bf16 cache
(``backend="auto"``: ``compilemask_us``; the split-KV kernel: ``compilemask_triton_us``),
FlexAttention on
the same keys (contiguous cache, its decoding path for short queries), FlashAttention-4 on the
same paged cache (``flash_attn.cute.flash_attn_varlen_func`` with ``page_table`` and
``seqused_k``; causal and sliding window, bottom-right aligned as ours; where it is installed),
and the GPU time of ``step_plan``.

Usage: ``python benchmarks/bench_decode.py [--out FILE.jsonl] [--quick]``. One JSON line per
(mask, cache length, new queries): times in microseconds (``triton.testing.do_bench``,
median), the shape, and the check of the output against the float32 reference on the first
batch rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import triton

import compilemask as cm
from compilemask import masks
from compilemask.kernels.reference.paged import paged_reference_attention

B, HQ, HKV, D, PAGE = 64, 32, 8, 128, 64
TREE = [-1] + [i // 2 for i in range(63)]  # a binary tree of 64 draft tokens


def _flex(q, k, v, mask_kind, nq, window):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    nk = k.shape[2]
    off = nk - nq

    def causal(b, h, qi, ki):
        return ki <= qi + off

    def sliding(b, h, qi, ki):
        return (ki <= qi + off) & (qi + off - ki < window)

    parents = torch.tensor(TREE[:nq], device=q.device)
    depth_anc = torch.eye(nq, dtype=torch.bool, device=q.device)
    for i, p in enumerate(TREE[:nq]):
        if p >= 0:
            depth_anc[i] |= depth_anc[p]
    del parents

    def tree(b, h, qi, ki):
        node = ki - off
        return (ki < off) | ((node >= 0) & depth_anc[qi, node.clamp(0, nq - 1)])

    mod = {"causal": causal, "sliding_window": sliding, "tree": tree}[mask_kind]
    bm = create_block_mask(mod, None, None, nq, nk, device=q.device)
    fn = torch.compile(flex_attention)
    return lambda: fn(q, k, v, block_mask=bm, enable_gqa=True)


def _fa4(q, kc, vc, table, lens, mask_kind, window):
    """FlashAttention-4 over the paged cache, or None for masks it has no form for."""
    if mask_kind not in ("causal", "sliding_window"):
        return None
    from flash_attn.cute import flash_attn_varlen_func

    qb = q.transpose(1, 2).contiguous()  # [B, nq, Hq, D]
    win = (window - 1, 0) if mask_kind == "sliding_window" else (None, None)

    def run():
        out = flash_attn_varlen_func(
            qb, kc, vc, seqused_k=lens, page_table=table, causal=True, window_size=win
        )
        return out[0] if isinstance(out, tuple) else out

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--commit", default="", help="the commit measured, recorded per row")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    dev = "cuda"
    rows = []
    cases = [
        ("causal", masks.causal(), 1),
        ("causal", masks.causal(), 4),
        ("causal", masks.causal(), 16),
        ("causal", masks.causal(), 64),
        ("sliding_window", masks.sliding_window(4096), 1),
        ("sliding_window", masks.sliding_window(4096), 4),
        ("tree", masks.tree(TREE, 0), 64),
    ]
    lengths = [8192] if args.quick else [8192, 32768]
    for nk in lengths:
        per_row = nk // PAGE
        n_pages = B * per_row
        g = torch.Generator(device=dev).manual_seed(0)
        table = torch.randperm(n_pages, device=dev, generator=g).view(B, per_row).to(torch.int32)
        kc = torch.randn(n_pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
        vc = torch.randn(n_pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
        lens = torch.full((B,), nk, device=dev, dtype=torch.int32)
        kf = kc[table.long()].reshape(B, nk, HKV, D).transpose(1, 2).contiguous()
        vf = vc[table.long()].reshape(B, nk, HKV, D).transpose(1, 2).contiguous()
        for kind, mask, nq in cases:
            if kind == "tree" and nq != len(TREE):
                continue
            q = torch.randn(B, HQ, nq, D, device=dev, dtype=torch.bfloat16, generator=g)
            plan = cm.step_plan(mask, lens, nq, kv_len=nk)
            with torch.no_grad():
                run = functools.partial(cm.attention, q, kc, vc, plan, block_table=table)
                out = run()
                ours = triton.testing.do_bench(run, warmup=25, rep=100) * 1e3
                split = functools.partial(run, backend="triton")
                split()
                ours_triton = triton.testing.do_bench(split, warmup=25, rep=100) * 1e3
                ref, _ = paged_reference_attention(
                    q[:2], kc, vc, plan.row_lo[:2], plan.row_hi[:2], table[:2], lens[:2]
                )
                err = float((out[:2].float() - ref.float()).abs().max())
                step = functools.partial(cm.step_plan, mask, lens, nq, kv_len=nk)
                build = triton.testing.do_bench(step, warmup=25, rep=100) * 1e3
                flex = None
                try:
                    window = 4096
                    f = _flex(q, kf, vf, kind, nq, window)
                    f()
                    flex = triton.testing.do_bench(f, warmup=25, rep=100) * 1e3
                except Exception as e:  # noqa: BLE001 - a peer that does not run is reported
                    flex = f"error: {type(e).__name__}: {str(e)[:120]}"
                fa4 = fa4_err = None
                try:
                    f = _fa4(q, kc, vc, table, lens, kind, 4096)
                    if f is not None:
                        got = f().transpose(1, 2)
                        fa4_err = float((got[:2].float() - ref.float()).abs().max())
                        fa4 = triton.testing.do_bench(f, warmup=25, rep=100) * 1e3
                except Exception as e:  # noqa: BLE001 - a peer that does not run is reported
                    fa4 = f"error: {type(e).__name__}: {str(e)[:120]}"
            row = {
                "commit": args.commit,
                "mask": kind, "cache_len": nk, "new_queries": nq, "B": B, "Hq": HQ, "Hkv": HKV,
                "D": D, "page_size": PAGE, "dtype": "bfloat16", "compilemask_us": ours,
                "compilemask_triton_us": ours_triton,
                "flex_us": flex, "fa4_paged_us": fa4, "fa4_max_abs_err_vs_fp32_ref": fa4_err,
                "step_plan_wall_us": build, "max_abs_err_vs_fp32_ref": err,
                "gpu": torch.cuda.get_device_name(),
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
