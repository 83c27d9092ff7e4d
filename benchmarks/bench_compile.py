"""Time plan building on the CPU for the seed workloads, beside FlexAttention's BlockMask size.

For each seed workload at each nominal size (default 32768) this times
``compile(mask, N, block_m=128, block_n=128, cache=False)`` plus the kernels' FULL-first tile
lists of the forward/dQ and dK/dV passes at 128 x 128 (``kernels.triton.schedule``), i.e.
everything the forward and backward read: median of 20 warm runs, ``time.perf_counter``.
It reports ``plan.nbytes`` beside the bytes a FlexAttention ``BlockMask`` of the same shape
holds (computed from its tensor shapes, not built): for B = H = 1 and 128 x 128 blocks, int32
``kv_num_blocks [Tq]``, ``kv_indices [Tq, Tk]``, ``full_kv_num_blocks [Tq]``,
``full_kv_indices [Tq, Tk]`` and the transposed ``q_num_blocks [Tk]``, ``q_indices [Tk, Tq]``,
``full_q_num_blocks [Tk]``, ``full_q_indices [Tk, Tq]``.

Results go to ``benchmarks/results/cpu-compile-<date>.jsonl`` as JSON lines with the keys of
docs/benchmarking.md ("Results files"), ``mode = "plan"``, ``system = "compilemask-cpu"``, plus
``plan_bytes`` and ``flex_blockmask_bytes``. Name the commit with ``COMPILEMASK_COMMIT=...``
where there is no git.

Usage::

    python benchmarks/bench_compile.py                       # 32768, all four workloads
    python benchmarks/bench_compile.py --sizes 1024 4096 --workloads hstu clear --no-write
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # run from the source tree without installing

import compilemask as cm  # noqa: E402
from compilemask.kernels.triton.schedule import dkdv_schedule, forward_schedule  # noqa: E402
from compilemask.workloads import NOMINAL_SIZES, SEED_WORKLOADS, workload  # noqa: E402

BLOCK = 128
DEFAULT_OUTPUT = ROOT / "benchmarks" / "results" / f"cpu-compile-{datetime.date.today()}.jsonl"


def flex_blockmask_bytes(q_len: int, kv_len: int, block: int = BLOCK) -> int:
    """Bytes of a FlexAttention BlockMask for B = H = 1 (int32 tensors, see the docstring)."""
    tq, tk = -(-q_len // block), -(-kv_len // block)
    return 4 * (2 * tq + 2 * tq * tk + 2 * tk + 2 * tk * tq)


def time_compile(mask, n: int, repeats: int, warmup: int = 2) -> tuple[float, object]:
    """Median milliseconds of ``repeats`` warm compiles (cache off) and the last plan."""
    times, plan = [], None
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        plan = cm.compile(mask, n, block_m=BLOCK, block_n=BLOCK, cache=False)
        # what the kernels read beyond the plan: FULL-first tile lists of both passes
        forward_schedule(plan, BLOCK, BLOCK)
        dkdv_schedule(plan, BLOCK, BLOCK)
        elapsed = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times), plan


def environment() -> dict:
    """The fixed keys of a results line that describe the machine and the code."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = os.environ.get("COMPILEMASK_COMMIT")
    if not commit:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
        )
        commit = done.stdout.strip() if done.returncode == 0 else None
    return {
        "gpu": f"none (CPU: {model}, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": commit,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32768], choices=NOMINAL_SIZES)
    parser.add_argument(
        "--workloads", nargs="+", default=list(SEED_WORKLOADS), choices=SEED_WORKLOADS
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)

    env = environment()
    rows = []
    for n0 in args.sizes:
        for name in args.workloads:
            w = workload(name, n0)
            ms, plan = time_compile(w.mask, w.N, args.repeats)
            rows.append(
                {
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds"
                    ),
                    **env,
                    "workload": name,
                    "N0": n0,
                    "N": w.N,
                    "B": w.B,
                    "Hq": None,
                    "Hkv": None,
                    "D": None,
                    "dtype": None,
                    "mode": "plan",
                    "system": "compilemask-cpu",
                    "ms": round(ms, 3),
                    "tflops": None,
                    "rel_err": None,
                    "plan_bytes": int(plan.nbytes),
                    "flex_blockmask_bytes": flex_blockmask_bytes(w.N, w.N),
                }
            )
    if not args.no_write:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        with args.output.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    print(
        f"plan building, {BLOCK}x{BLOCK} tiles, cache off, median of {args.repeats} "
        f"warm runs; {env['gpu']}, torch {env['torch']}"
    )
    header = f"{'workload':>14} {'N':>6} {'ms':>9} {'plan KiB':>9} {'Flex BlockMask KiB':>19}"
    print(header)
    for r in rows:
        print(
            f"{r['workload']:>14} {r['N']:>6} {r['ms']:>9.2f} {r['plan_bytes'] / 1024:>9.1f} "
            f"{r['flex_blockmask_bytes'] / 1024:>19.1f}"
        )
    if not args.no_write:
        print(f"appended {len(rows)} lines to {args.output}")


if __name__ == "__main__":
    main()
