"""Results of ``compilemask bench``: the JSON-lines rows of docs/benchmarking.md ("Results
files"), the effective TFLOP/s of docs/workloads.md, the printed table and the PNG plot.

Nothing here needs a GPU: ``compilemask bench --report FILE.jsonl`` prints the table and draws
the plot of results measured elsewhere.

A row holds exactly the keys of :data:`RESULT_KEYS`, in that order, followed by extra keys
(``status``, ``reason``, ``plan_bytes``, ...). ``mode`` is ``fwd``, ``fwd+bwd`` or ``plan``;
``N`` is the real tokens per row, ``N0`` the nominal size.

Example::

    >>> env = {"date": "2026-12-01T00:00:00+00:00", "gpu": "NVIDIA H200", "torch": "2.11.0",
    ...        "triton": "3.6.0", "commit": "abc"}
    >>> shape = Shape("causal", 1024, 1024, 32, 16, 16, 128, "bf16")
    >>> row = result_row(env, shape, "fwd", "flex-triton", ms=1.0, tflops=2.0, rel_err=1e-3)
    >>> list(row) == list(RESULT_KEYS)
    True
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import subprocess
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

#: The keys of one results line, in order (docs/benchmarking.md, "Results files").
RESULT_KEYS = (
    "date", "gpu", "torch", "triton", "commit", "workload", "N0", "N", "B", "Hq", "Hkv", "D",
    "dtype", "mode", "system", "ms", "tflops", "rel_err",
)  # fmt: skip
MODES = ("fwd", "fwd+bwd", "plan", "fresh")
#: The timed attention modes, in the order they run.
ATTENTION_MODES = ("fwd", "fwd+bwd")
#: fwd+bwd counts 3.5x the forward's work (forward 1 + backward 2.5; docs/workloads.md).
FWD_BWD_FACTOR = 3.5
#: The system every ratio is taken against (per mode; plan rows use Flex's create_block_mask).
BASELINE = {"fwd": "flex-triton", "fwd+bwd": "flex-triton", "plan": "flex-create_block_mask"}

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Shape:
    """What a row measures: the workload at one size and the attention shape.

    Legend: B batch rows, Hq / Hkv query / key-value heads, D head_dim; ``N`` real tokens per
    row, ``N0`` nominal size. Plan rows leave Hq, Hkv, D and dtype as None.
    """

    workload: str
    N0: int
    N: int
    B: int
    Hq: int | None = None
    Hkv: int | None = None
    D: int | None = None
    dtype: str | None = None


def environment() -> dict:
    """``date, gpu, torch, triton, commit`` of this run (Triton's version read without
    importing it; the commit from ``COMPILEMASK_COMMIT``, else ``git rev-parse HEAD``)."""
    import torch

    try:
        triton_version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": commit(),
    }


def gpu_slug(name: str) -> str:
    """The ``<gpu>`` of a results file name: ``"NVIDIA H200"`` -> ``"h200"``,
    ``"NVIDIA GeForce RTX 4090"`` -> ``"geforce-rtx-4090"``, ``"none"`` -> ``"cpu"``."""
    words = name.replace("NVIDIA", " ").lower().split()
    slug = "-".join("".join(c for c in w if c.isalnum()) for w in words).strip("-")
    return slug if slug and slug != "none" else "cpu"


def commit() -> str:
    """The commit being measured: ``COMPILEMASK_COMMIT``, else git, else ``"unknown"`` (the
    tree measured may be a copy without ``.git``)."""
    named = os.environ.get("COMPILEMASK_COMMIT")
    if named:
        return named
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def result_row(
    env: dict,
    shape: Shape,
    mode: str,
    system: str,
    *,
    ms: float | None = None,
    tflops: float | None = None,
    rel_err: float | None = None,
    **extra,
) -> dict:
    """One results line: the keys of :data:`RESULT_KEYS` in order, then ``extra``.

    Args:
        env: :func:`environment` (date, gpu, torch, triton, commit).
        shape: the workload and attention shape.
        mode: ``fwd``, ``fwd+bwd``, ``plan`` or ``fresh``.
        system: ``compilemask-<backend>``, ``flex-triton``, ``flex-fa4``, ``cudnn-fe``,
            ``fa4``, ``sdpa-cudnn``, ``sdpa-flash`` (plan rows: ``compilemask-cuda``,
            ``flex-create_block_mask``).
        ms, tflops, rel_err: the measurement (None when not measured).
        extra: further keys (``status``, ``reason``, ``plan_bytes``, ...).

    Raises:
        ValueError: an unknown mode, or an extra key that would overwrite a fixed one.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    clash = sorted(set(extra) & set(RESULT_KEYS))
    if clash:
        raise ValueError(f"extra keys {clash} would overwrite fixed result keys")
    row = {key: env.get(key) for key in RESULT_KEYS[:5]}
    row.update(asdict(shape))
    row.update(mode=mode, system=system, ms=ms, tflops=tflops, rel_err=rel_err)
    row.update(extra)
    return row


def effective_tflops(B: int, H: int, D: int, pairs: float, ms: float, mode: str) -> float:
    """Effective TFLOP/s of docs/workloads.md: ``4 * B * H * D * pairs / time``, x3.5 for fwd+bwd.

    Args:
        B, H, D: batch rows, query heads, head_dim.
        pairs: visible (q, k) pairs of one row-mask.
        ms: milliseconds of one call (one forward, or one forward+backward step).
        mode: ``fwd`` or ``fwd+bwd``.

    Example::

        >>> effective_tflops(1, 1, 128, 1e9, 1.0, "fwd")
        512.0
    """
    if mode not in ATTENTION_MODES:
        raise ValueError(f"mode must be one of {ATTENTION_MODES}, got {mode!r}")
    flops = 4.0 * B * H * D * pairs * (FWD_BWD_FACTOR if mode == "fwd+bwd" else 1.0)
    return flops / (ms * 1e-3) / 1e12


# ------------------------------------------------------------------------------ files


def append_rows(path: str | Path, rows: Iterable[dict]) -> None:
    """Append rows to a JSON-lines file (created with its folder when missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_rows(path: str | Path, start: int = 0) -> list[dict]:
    """The rows of a JSON-lines file from byte offset ``start`` (blank lines skipped)."""
    with Path(path).open() as f:
        f.seek(start)
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------ table


def ratios(rows: list[dict]) -> dict[int, float]:
    """``baseline ms / ms`` per row index, for rows measured beside their baseline (same
    workload, N0 and mode, see :data:`BASELINE`); > 1 means faster than the baseline."""
    base = {}
    for r in rows:
        if r.get("ms") and r["system"] == BASELINE.get(r["mode"]):
            base[(r["workload"], r["N0"], r["mode"])] = r["ms"]
    out = {}
    for i, r in enumerate(rows):
        b = base.get((r["workload"], r["N0"], r["mode"]))
        if b and r.get("ms") and r["system"] != BASELINE.get(r["mode"]):
            out[i] = b / r["ms"]
    return out


def _note(r: dict) -> str:
    status = r.get("status", "ok" if r.get("ms") else "")
    if r["mode"] == "plan":
        parts = []
        if r.get("plan_bytes") is not None:
            parts.append(f"plan {r['plan_bytes'] / 1024:.1f} KiB")
        if r.get("blockmask_bytes") is not None:
            parts.append(f"BlockMask {r['blockmask_bytes'] / 1024:.1f} KiB")
        if r.get("sync_free") is not None:
            parts.append("sync-free" if r["sync_free"] is True else "SYNCS")
        return ", ".join(parts)
    if status == "failed":
        return f"FAIL err={r.get('rel_err', float('nan')):.2e} > {r.get('bound', float('nan')):.2e}"
    if status == "error":
        return "ERROR " + _short(str(r.get("reason", "")), 60)
    if r.get("rel_err") is not None:
        return f"ok err={r['rel_err']:.1e}"
    return status


def table_rows(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """The printed table (measured, failed and errored rows) and the skipped systems, one line
    per (system, reason)."""
    ratio = ratios(rows)
    shown, skipped = [], {}
    for i, r in enumerate(rows):
        if r.get("status") == "skipped":
            key = (r["system"], str(r.get("reason", "")))
            skipped.setdefault(key, set()).add(r["workload"])
            continue
        shown.append(
            {
                "workload": r["workload"],
                "N0": r["N0"],
                "mode": r["mode"],
                "system": r["system"],
                "ms": "" if r.get("ms") is None else f"{r['ms']:.3f}",
                "TFLOP/s": "" if r.get("tflops") is None else f"{r['tflops']:.1f}",
                "x base": f"{ratio[i]:.2f}" if i in ratio else "",
                "check": _note(r),
            }
        )
    lines = [
        f"{system}: {reason} ({', '.join(sorted(names))})"
        for (system, reason), names in skipped.items()
    ]
    return shown, lines


def format_table(rows: list[dict]) -> str:
    """The table of :func:`table_rows` as aligned text, with a legend and the skipped list."""
    shown, skipped = table_rows(rows)
    lines = []
    if shown:
        cols = list(shown[0])
        widths = [max(len(c), *(len(str(s[c])) for s in shown)) for c in cols]
        lines.append("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
        lines += ["  ".join(str(s[c]).rjust(w) for c, w in zip(cols, widths)) for s in shown]
        lines.append(
            "x base = baseline ms / ms (baseline: flex-triton; plan rows: create_block_mask); "
            "> 1 is faster. Ratios hold only within one process (one workload and size)."
        )
    if skipped:
        lines.append("skipped:")
        lines += [f"  {s}" for s in skipped]
    return "\n".join(lines)


def _short(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


# ------------------------------------------------------------------------------ plot


def plot_rows(rows: list[dict], path: str | Path) -> Path | None:
    """Bars of effective TFLOP/s per system and size: one panel per (mode, workload).

    Returns the PNG's path, or None when no row has a TFLOP/s value. Raises ImportError when
    matplotlib is missing (the caller reports it and carries on).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.get("tflops") and r["mode"] in ATTENTION_MODES]
    if not timed:
        return None
    modes = [m for m in ATTENTION_MODES if any(r["mode"] == m for r in timed)]
    names = list(dict.fromkeys(r["workload"] for r in timed))
    systems = list(dict.fromkeys(r["system"] for r in timed))
    colours = plt.get_cmap("tab10")
    fig, axes = plt.subplots(
        len(modes), len(names), figsize=(4.2 * len(names), 3.4 * len(modes)), squeeze=False
    )
    width = 0.8 / len(systems)
    for mi, mode in enumerate(modes):
        for wi, name in enumerate(names):
            ax = axes[mi][wi]
            mine = [r for r in timed if r["mode"] == mode and r["workload"] == name]
            sizes = sorted({r["N0"] for r in mine})
            for si, system in enumerate(systems):
                xs, ys = [], []
                for xi, n0 in enumerate(sizes):
                    hit = [r["tflops"] for r in mine if r["N0"] == n0 and r["system"] == system]
                    if hit:
                        xs.append(xi + (si - (len(systems) - 1) / 2) * width)
                        ys.append(hit[-1])
                ax.bar(xs, ys, width, color=colours(si % 10), label=system)
            ax.set_xticks(range(len(sizes)), [str(n) for n in sizes])
            ax.set_title(f"{name} — {mode}", fontsize=10)
            ax.set_xlabel("N0")
            if wi == 0:
                ax.set_ylabel("effective TFLOP/s")
            ax.grid(axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours(i % 10)) for i in range(len(systems))]
    fig.legend(handles, systems, loc="lower center", ncol=min(len(systems), 8), fontsize=8)
    meta = timed[0]
    fig.suptitle(
        f"compilemask bench — {meta.get('gpu')}, torch {meta.get('torch')}, "
        f"triton {meta.get('triton')}, commit {str(meta.get('commit'))[:10]}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
