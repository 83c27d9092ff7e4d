"""The ``compilemask bench`` command: options, the sweep over (workload, size) cases, and the
report (table and plot) at the end.

    compilemask bench [--workloads causal hstu ...] [--sizes 1024 4096 16384 32768]
                      [--modes plan fwd fwd+bwd fresh] [--systems flex-triton ...]
                      [--out benchmarks/results/<gpu>-bench-<date>.jsonl] [--plot PNG | --no-plot]
                      [--no-check] [--one-per-process | --in-process] [--budget-s S]
    compilemask bench --report RESULTS.jsonl [--plot PNG]       table and plot, no GPU needed
    compilemask bench --list                                    which systems run here, and why not

Every case runs all its systems side by side in one process; with more than one case the
default is one subprocess per case (``--one-per-process``), so a crash or a hang costs one case
and a full sweep can be split over several commands; ``--in-process`` runs all the cases of one
command in one process (one workload at several sizes in one process compiles each peer's
kernels once; ratios still hold, since every system of a case runs in the same process).
``--budget-s`` stops starting cases when the budget is spent (one per process: also stops the
running one), so a sweep ends within a time of your choosing; every row is written to the
JSON-lines file as soon as it is measured.
Without a CUDA GPU the command exits with status 2. Also runnable without click:
``python -m compilemask.tools.bench_sweep ...``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .. import workloads as wl
from . import progress
from .bench_report import append_rows, format_table, gpu_slug, plot_rows, read_rows

NO_GPU_MESSAGE = (
    "compilemask bench needs a CUDA GPU and none was found. On a machine with one run "
    "`compilemask bench ...` (docs/benchmarking.md); here, "
    "`compilemask bench --report RESULTS.jsonl` prints the table and plot of results, "
    "`compilemask bench --list` shows which systems would run, and "
    "`python benchmarks/bench_compile.py` times plan building on the CPU."
)
BUDGET_MARGIN_S = 15  # leave this much of --budget-s for the table and the plot


def default_out() -> Path:
    """``benchmarks/results/<gpu>-bench-<date>.jsonl`` (``gpu`` as :func:`gpu_slug` names it)."""
    import torch

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    day = datetime.date.today().isoformat()
    return Path("benchmarks") / "results" / f"{gpu_slug(name)}-bench-{day}.jsonl"


def build_parser() -> argparse.ArgumentParser:
    from .bench import SYSTEM_NAMES

    p = argparse.ArgumentParser(
        prog="compilemask bench",
        description="Time CompileMask beside its peers on the seed workloads "
        "(docs/benchmarking.md).",
        epilog="compilemask bench --distributed [--help]: context parallelism's balance and "
        "per-rank times (its own options).",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        default=list(wl.SEED_WORKLOADS),
        choices=wl.SEED_WORKLOADS,
        metavar="NAME",
        help="seed workloads (default: all)",
    )
    p.add_argument(
        "--sizes",
        nargs="+",
        type=int,
        default=list(wl.NOMINAL_SIZES),
        choices=wl.NOMINAL_SIZES,
        metavar="N0",
        help="nominal sizes (default: all)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=["plan", "fwd", "fwd+bwd"],
        choices=["plan", "fwd", "fwd+bwd", "fresh"],
        help="what to time (default: plan fwd fwd+bwd; fresh: a training step on a new mask "
        "every step, hstu and shared_prompt)",
    )
    p.add_argument(
        "--systems",
        nargs="+",
        default=list(SYSTEM_NAMES),
        choices=SYSTEM_NAMES,
        metavar="SYSTEM",
        help=f"contenders (default: all of {', '.join(SYSTEM_NAMES)})",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON-lines file rows are appended to "
        "(default: benchmarks/results/<gpu>-bench-<date>.jsonl)",
    )
    p.add_argument(
        "--plot", type=Path, default=None, help="PNG of TFLOP/s bars (default: --out with .png)"
    )
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--no-table", action="store_true", help="print no table at the end")
    p.add_argument(
        "--no-check",
        action="store_true",
        help="skip the float64 correctness check (rel_err stays null)",
    )
    split = p.add_mutually_exclusive_group()
    split.add_argument(
        "--one-per-process",
        dest="one_per_process",
        action="store_true",
        default=None,
        help="one subprocess per (workload, size) (the default when there is more than one)",
    )
    split.add_argument(
        "--in-process",
        dest="one_per_process",
        action="store_false",
        help="every case in this process",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop starting (and stop running) cases after this many seconds",
    )
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="JSONL",
        help="only print the table and draw the plot of an existing results file",
    )
    p.add_argument("--list", action="store_true", help="show which systems run here and exit")
    return p


def _echo(message: str) -> None:
    progress.write(message)
    sys.stdout.flush()


def _row_line(r: dict) -> str:
    head = f"{r['workload']:>13} {r['N0']:>6} {r['mode']:>7} {r['system']:>22}"
    status = r.get("status", "")
    if r.get("ms") is not None:
        tf = f" {r['tflops']:7.1f} TFLOP/s" if r.get("tflops") is not None else ""
        err = f" err={r['rel_err']:.1e}" if r.get("rel_err") is not None else ""
        return f"{head} {r['ms']:9.3f} ms{tf}{err}"
    if status == "failed":
        return f"{head} FAILED the check: err={r['rel_err']:.2e} > bound {r.get('bound', 0):.2e}"
    return f"{head} {status}: {r.get('reason')}"


def _finish(rows: list[dict], args, out: Path | None) -> None:
    if not args.no_table:
        _echo("")
        _echo(format_table(rows))
    if args.no_plot:
        return
    png = args.plot or (out.with_suffix(".png") if out else Path("out/bench.png"))
    try:
        path = plot_rows(rows, png)
    except ImportError as err:
        _echo(f"plot skipped: {err}")
        return
    _echo(f"plot: {path}" if path else "plot skipped: no timed rows")


def _child_env() -> dict:
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([src, *[p for p in parts if p != src]])
    env.setdefault("CM_NO_PROGRESS", "1")
    return env


def _run_children(cases, args, out: Path, t0: float) -> list[str]:
    """One subprocess per case (stopped with its process group at the budget); returns the
    cases not run to the end."""
    missed = []
    for i, (name, n0) in enumerate(cases):
        elapsed = time.perf_counter() - t0
        left = None if args.budget_s is None else args.budget_s - BUDGET_MARGIN_S - elapsed
        if left is not None and left < 30:
            missed.append(f"{name}@{n0} (budget spent)")
            continue
        _echo(f"[{i + 1}/{len(cases)}] {name} N0={n0} in a subprocess ({elapsed:.0f} s elapsed)")
        cmd = [sys.executable, "-m", "compilemask.tools.bench_sweep", "--in-process"]
        cmd += ["--workloads", name, "--sizes", str(n0), "--modes", *args.modes]
        cmd += ["--systems", *args.systems, "--out", str(out), "--no-plot", "--no-table"]
        if args.no_check:
            cmd.append("--no-check")
        # its own process group (not setsid, so a terminal's or a job runner's
        # signals still reach it), so a stop ends its compile workers too
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        proc = subprocess.Popen(cmd, env=_child_env(), **group)
        try:
            status = proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the case and its compile workers
            proc.wait()
            missed.append(f"{name}@{n0} (stopped at the budget)")
            continue
        if status != 0:
            missed.append(f"{name}@{n0} (exit status {status})")
    return missed


def _run_here(cases, args, out: Path, t0: float) -> list[str]:
    """Every case in this process; with a budget, a case starts only when the longest case so
    far still fits. Returns the cases not run."""
    import torch

    from .bench import SYSTEMS, run_case
    from .bench_report import environment

    env = environment()
    systems = tuple(s for s in SYSTEMS if s.name in args.systems)
    missed, longest = [], 0.0

    def emit(row: dict) -> None:
        append_rows(out, [row])
        _echo(_row_line(row))

    for i, (name, n0) in enumerate(progress.progress(cases, desc="cases")):
        start = time.perf_counter()
        if args.budget_s is not None and start - t0 + longest > args.budget_s - BUDGET_MARGIN_S:
            missed.append(f"{name}@{n0} (budget spent)")
            continue
        _echo(f"[{i + 1}/{len(cases)}] {name} N0={n0} ({start - t0:.0f} s elapsed)")
        run_case(name, n0, tuple(args.modes), systems, env, emit, check=not args.no_check)
        torch.cuda.empty_cache()
        longest = max(longest, time.perf_counter() - start)
    return missed


def main(argv: list[str] | None = None) -> int:
    """Run ``compilemask bench``; returns the exit status (2: no GPU or bad arguments)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:  # argparse exits on --help (0) and on errors (2)
        return int(stop.code or 0)
    if args.report is not None:
        rows = read_rows(args.report)
        _finish(rows, args, args.report)
        return 0
    if args.list:
        from .bench import SYSTEMS, availability

        for name, (ok, why) in availability(SYSTEMS).items():
            _echo(f"{name:>22}  {'runs' if ok else 'skipped: ' + why}")
        return 0
    import torch

    from .bench import SMOKE_ENV

    if not torch.cuda.is_available() and os.environ.get(SMOKE_ENV) != "cpu":
        _echo(NO_GPU_MESSAGE)
        return 2
    out = args.out or default_out()
    start = out.stat().st_size if out.exists() else 0
    cases = [(name, n0) for name in args.workloads for n0 in args.sizes]
    split = args.one_per_process if args.one_per_process is not None else len(cases) > 1
    t0 = time.perf_counter()
    run = _run_children if split else _run_here
    missed = run(cases, args, out, t0)
    rows = read_rows(out, start) if out.exists() else []
    if not args.no_table or not args.no_plot:
        _finish(rows, args, out)
    for m in missed:
        _echo(f"not finished: {m}")
    _echo(f"{len(rows)} rows in {out} ({time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
