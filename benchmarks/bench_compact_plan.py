"""Plan bytes: today's plan (row intervals, tile schedule, the forward and dK/dV views the
Triton kernels derive), the compact descriptor (``compiler/segments.py``) and FlexAttention's
``BlockMask`` of the same mask, at the default 128 x 128 tiling. Sizes only: they do not
depend on the device, so this runs on the CPU.

Masks at 32K: causal, sliding_window (4096), document (2,000 random causal documents),
prefix_lm (8192), and the seed workloads hstu, shared_prompt, clear (``compilemask.workloads``).
At 1M tokens: causal, sliding_window (4096), document (10,000 random documents), compact form
only (:func:`compilemask.compiler.segments.compact_from_mask`, no ``[Tq, Tk]`` table); today's
plan and the BlockMask are given by their tensor shapes (``*_bytes_from``: ``"shapes"``),
formulas that the 32K rows check against the built objects.

The BlockMask is ``plan.to_block_mask()`` (the same mask at the same block size; its tensor
shapes do not depend on the mask); at 4K the script checks that ``create_block_mask`` on the
hand-written ``mask_mod`` (``tools/peers.py``) has the same bytes.

Results go to ``benchmarks/results/cpu-compact-plan-<date>.jsonl``, one JSON line per mask,
with the git commit (``COMPILEMASK_COMMIT=...`` names it without git).

Usage::

    python benchmarks/bench_compact_plan.py
    python benchmarks/bench_compact_plan.py --no-1m --no-write
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import time
from pathlib import Path

import torch

import compilemask as cm
from compilemask import masks
from compilemask.compiler.segments import compact_from_mask, rows_nbytes
from compilemask.kernels.triton.schedule import dkdv_schedule, forward_schedule
from compilemask.tools.bench_plan import blockmask_nbytes
from compilemask.workloads import workload

BLOCK = 128


def documents(n: int, count: int) -> list[int]:
    """``count`` random document lengths summing to ``n`` (seed 0)."""
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(n - 1, generator=g)[: count - 1] + 1).values.tolist()
    edges = [0, *cuts, n]
    return [b - a for a, b in zip(edges, edges[1:])]


def masks_32k():
    n = 32768
    out = [
        ("causal", masks.causal(), n),
        ("sliding_window", masks.sliding_window(4096), n),
        ("document", masks.document(documents(n, 2000)), n),
        ("prefix_lm", masks.prefix_lm(8192), n),
    ]
    for name in ("hstu", "shared_prompt", "clear"):
        w = workload(name, 32768)
        out.append((name, w.mask, w.N))
    return out


def plan_bytes_from_shapes(m: int, n: int, slots: int) -> int:
    """``plan.nbytes`` of a plan without bitmask tiles: rows and the schedule's tensors."""
    t = math.ceil(n / BLOCK)
    return rows_nbytes(m, n, slots) + 4 * m * (7 * t * t + 4 * t)


def blockmask_bytes_from_shapes(m: int, n: int) -> int:
    """A BlockMask's tensors: counts and indices of partial and full blocks, by rows and by
    columns (int32 ``[M, T]`` and ``[M, T, T]``)."""
    t = math.ceil(n / BLOCK)
    return 4 * m * (4 * t + 4 * t * t)


def views_bytes(plan) -> int:
    """Bytes of the forward and dK/dV schedule tensors beyond the plan's own."""
    own = {x.data_ptr() for x in (plan.row_lo, plan.row_hi, plan.row_count)}
    own |= {x.data_ptr() for x in plan.schedule.tensors().values()}
    seen, total = set(), 0
    for view in (forward_schedule(plan, BLOCK, BLOCK), dkdv_schedule(plan, BLOCK, BLOCK)):
        for x in view.values():
            if x.data_ptr() not in own | seen:
                seen.add(x.data_ptr())
                total += x.numel() * x.element_size()
    return total


def row_32k(name, mask, n) -> dict:
    t0 = time.perf_counter()
    plan = cm.compile(mask, n, block_m=BLOCK, block_n=BLOCK, cache=False)
    t1 = time.perf_counter()
    c = plan.compact()
    t2 = time.perf_counter()
    bm = blockmask_nbytes(plan.to_block_mask())
    assert bm == blockmask_bytes_from_shapes(plan.num_masks, n), name
    if plan.schedule.bits.shape[0] == 0:
        assert plan.nbytes == plan_bytes_from_shapes(plan.num_masks, n, plan.max_intervals), name
    views = views_bytes(plan)
    return {
        "mask": name,
        "N": n,
        "plan_bytes": plan.nbytes,
        "plan_views_bytes": views,
        "plan_total_bytes": plan.nbytes + views,
        "compact_bytes": c.nbytes,
        "blockmask_bytes": bm,
        "compact_over_blockmask": round(c.nbytes / bm, 4),
        "plan_over_blockmask": round((plan.nbytes + views) / bm, 4),
        **{f"compact_{k}": v for k, v in c.parts().items() if k != "bytes"},
        "intervals_per_row_max": plan.max_intervals,
        "compile_s": round(t1 - t0, 3),
        "compact_s": round(t2 - t1, 3),
        "plan_bytes_from": "built",
        "blockmask_bytes_from": "plan.to_block_mask()",
    }


def row_1m(name, mask, n) -> dict:
    t0 = time.perf_counter()
    c = compact_from_mask(mask, n, block_m=BLOCK, block_n=BLOCK)
    t1 = time.perf_counter()
    from compilemask.compiler.lower import lower

    slots = lower(mask, n, n, "cpu")[0].shape[-1]
    plan = plan_bytes_from_shapes(c.num_masks, n, slots)
    bm = blockmask_bytes_from_shapes(c.num_masks, n)
    return {
        "mask": name,
        "N": n,
        "plan_bytes": plan,
        "plan_views_bytes": None,
        "compact_bytes": c.nbytes,
        "blockmask_bytes": bm,
        "compact_over_blockmask": round(c.nbytes / bm, 6),
        **{f"compact_{k}": v for k, v in c.parts().items() if k != "bytes"},
        "intervals_per_row_max": slots,
        "compact_s": round(t1 - t0, 3),
        "plan_bytes_from": "shapes (not built: its [Tq, Tk] tables alone are "
        f"{7 * 4 * math.ceil(n / BLOCK) ** 2 / 2**30:.2f} GiB)",
        "blockmask_bytes_from": "shapes",
    }


def check_create_block_mask(n: int = 4096) -> dict:
    """``create_block_mask`` on the hand-written mask_mod has the bytes of ``to_block_mask``."""
    from torch.nn.attention.flex_attention import create_block_mask

    from compilemask.tools.peers import flex_mask_mod

    w = workload("hstu", n)
    bm = create_block_mask(flex_mask_mod(w.mask, "cpu"), None, None, w.N, w.N, device="cpu")
    plan = cm.compile(w.mask, w.N, cache=False)
    got, want = blockmask_nbytes(bm), blockmask_nbytes(plan.to_block_mask())
    assert got == want, (got, want)
    return {"mask": "hstu", "N": n, "check": "create_block_mask bytes == to_block_mask bytes",
            "blockmask_bytes": got}  # fmt: skip


def commit() -> str:
    if os.environ.get("COMPILEMASK_COMMIT"):
        return os.environ["COMPILEMASK_COMMIT"]
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-1m", action="store_true", help="skip the 1M-token masks")
    ap.add_argument("--no-write", action="store_true", help="print the rows only")
    args = ap.parse_args()
    common = {"mode": "plan-bytes", "block": BLOCK, "device": "cpu", "torch": torch.__version__,
              "commit": commit()}  # fmt: skip
    rows = [check_create_block_mask()]
    rows += [row_32k(*m) for m in masks_32k()]
    if not args.no_1m:
        n = 1 << 20
        for name, mask in (
            ("causal", masks.causal()),
            ("sliding_window", masks.sliding_window(4096)),
            ("document", masks.document(documents(n, 10000))),
        ):
            rows.append(row_1m(name, mask, n))
    lines = [json.dumps({**common, **r}) for r in rows]
    print("\n".join(lines))
    if not args.no_write:
        day = datetime.date.today().isoformat()
        path = Path(__file__).parent / "results" / f"cpu-compact-plan-{day}.jsonl"
        path.write_text("\n".join(lines) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
