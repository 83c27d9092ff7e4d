"""The README's "Status" table: CompileMask against its peers, from one committed results file.

For one commit of a results file (``benchmarks/results/<gpu>-<what>-<date>.jsonl``, rows as in
docs/benchmarking.md), every timed CompileMask row (``system`` starting with ``compilemask-``,
the reference excluded) is set beside the peers timed in the same case (same workload, N0 and
mode at that commit; every system of a case runs in one process). A cell holds the ratio
``peer ms / CompileMask ms`` (above 1: CompileMask is faster) and the peer's time. When a
case was measured more than once at the commit, the last row of the file counts.

Command line::

    python -m compilemask.tools.status benchmarks/results/h200-speed-2026-11-30.jsonl \\
        --commit 90ae143 [--plot docs/status.png]

Example::

    >>> rows = [
    ...     {"commit": "abc", "workload": "causal", "N0": 1024, "N": 1024, "mode": "fwd",
    ...      "system": "compilemask-triton", "ms": 1.0},
    ...     {"commit": "abc", "workload": "causal", "N0": 1024, "N": 1024, "mode": "fwd",
    ...      "system": "flex-triton", "ms": 1.5},
    ... ]
    >>> print(status_table(rows).splitlines()[-1])
    | causal | 1024 | fwd | 1.000 | 1.50x (1.500) |
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import InputError

#: Column titles of the peers, in the order they are shown.
PEER_TITLES = {
    "flex-triton": "Flex (Triton)",
    "flex-fa4": "Flex (FA4)",
    "cudnn-fe": "cuDNN-frontend",
    "fa4": "FA4",
    "sdpa-cudnn": "SDPA (cuDNN)",
    "sdpa-flash": "SDPA (flash)",
}
WORKLOAD_ORDER = ("causal", "hstu", "shared_prompt", "clear", "clear_tiled")
MODES = ("fwd", "fwd+bwd")
OURS_PREFIX = "compilemask-"
NOT_OURS = ("compilemask-reference",)


def read_results(path: str | Path) -> list[dict]:
    """The rows of a JSON-lines results file.

    Raises:
        InputError: ``path`` does not exist or holds a line that is not JSON.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"results file {str(path)!r} does not exist")
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise InputError(
                    f"results file {str(path)!r}, line {i}: not JSON ({err})"
                ) from None
    return rows


def select(rows: list[dict], commit: str | None = None) -> tuple[str, list[dict]]:
    """The timed attention rows of one commit (a prefix of it; default the last commit in the
    file), the last row of each (workload, N0, mode, system). Returns (full commit, rows).

    Raises:
        InputError: ``commit`` matches no row, or several commits.
    """
    timed = [
        r for r in rows if r.get("ms") and r.get("mode") in MODES and r.get("status", "ok") == "ok"
    ]
    if not timed:
        raise InputError("rows: no timed fwd or fwd+bwd row in the results")
    if commit is None:
        commit = timed[-1]["commit"]
    matches = sorted({r["commit"] for r in timed if r["commit"].startswith(commit)})
    if not matches:
        raise InputError(f"commit {commit!r}: no timed row of the results has that commit")
    if len(matches) > 1:
        raise InputError(f"commit {commit!r}: matches several commits {matches}")
    last: dict[tuple, dict] = {}
    for r in timed:
        if r["commit"] == matches[0]:
            last[(r["workload"], r["N0"], r["mode"], r["system"])] = r
    return matches[0], list(last.values())


def _cases(rows: list[dict]) -> list[tuple]:
    def order(key):
        name, n0, mode, ours = key
        rank = WORKLOAD_ORDER.index(name) if name in WORKLOAD_ORDER else len(WORKLOAD_ORDER)
        return (n0 != max(r["N0"] for r in rows), -n0, rank, name, ours, MODES.index(mode))

    keys = {
        (r["workload"], r["N0"], r["mode"], r["system"])
        for r in rows
        if r["system"].startswith(OURS_PREFIX) and r["system"] not in NOT_OURS
    }
    return sorted(keys, key=order)


def status_rows(rows: list[dict]) -> tuple[list[str], list[dict]]:
    """(peers shown, one dict per CompileMask row: workload, N, mode, system, ms, and per peer
    ``(ratio, peer ms)``)."""
    peers = [p for p in PEER_TITLES if any(r["system"] == p for r in rows)]
    by_key = {(r["workload"], r["N0"], r["mode"], r["system"]): r for r in rows}
    out = []
    for name, n0, mode, ours in _cases(rows):
        mine = by_key[(name, n0, mode, ours)]
        cells = {}
        for p in peers:
            theirs = by_key.get((name, n0, mode, p))
            if theirs is not None:
                cells[p] = (theirs["ms"] / mine["ms"], theirs["ms"])
        out.append(
            {"workload": name, "N": mine["N"], "mode": mode, "system": ours, "ms": mine["ms"],
             "peers": cells}
        )  # fmt: skip
    return peers, out


def status_table(rows: list[dict]) -> str:
    """The markdown table of :func:`status_rows` (``rows`` of one commit, see :func:`select`)."""
    peers, table = status_rows(rows)
    several = len({t["system"] for t in table}) > 1
    head = ["workload", "N", "mode"] + (["system"] if several else []) + ["CompileMask ms"]
    head += [PEER_TITLES[p] for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in table:
        cells = [t["workload"], str(t["N"]), t["mode"]] + ([t["system"]] if several else [])
        cells.append(f"{t['ms']:.3f}")
        for p in peers:
            hit = t["peers"].get(p)
            cells.append(f"{hit[0]:.2f}x ({hit[1]:.3f})" if hit else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_status(rows: list[dict], path: str | Path) -> Path:
    """Bars of ``peer ms / CompileMask ms`` per case and peer (a line at 1).

    Raises:
        ImportError: matplotlib is missing (``pip install '.[pictures]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers, table = status_rows(rows)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.4 * len(table) + 2), 4.2))
    width = 0.8 / max(1, len(peers))
    colours = plt.get_cmap("tab10")
    for pi, p in enumerate(peers):
        xs = [
            i + (pi - (len(peers) - 1) / 2) * width for i, t in enumerate(table) if p in t["peers"]
        ]
        ys = [t["peers"][p][0] for t in table if p in t["peers"]]
        ax.bar(xs, ys, width, label=PEER_TITLES[p], color=colours(pi))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(table)))
    ax.set_xticklabels(
        [f"{t['workload']} {t['N']}\n{t['mode']}" for t in table], rotation=60, fontsize=7
    )
    ax.set_ylabel("peer time / CompileMask time")
    ax.set_title("Above 1: CompileMask is faster", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m compilemask.tools.status",
        description="Markdown table (and plot) of CompileMask against its peers, from one "
        "results file and one commit.",
    )
    ap.add_argument("results", type=Path, help="a JSON-lines results file")
    ap.add_argument("--commit", default=None, help="commit (prefix); default: the file's last")
    ap.add_argument("--plot", type=Path, default=None, help="also write this PNG")
    a = ap.parse_args(argv)
    commit, rows = select(read_results(a.results), a.commit)
    first = rows[0]
    print(
        f"{first.get('gpu')}, torch {first.get('torch')}, triton {first.get('triton')}, "
        f"commit {commit[:7]} ({a.results.name}); cell = peer ms / CompileMask ms (peer ms)"
    )
    print()
    print(status_table(rows))
    if a.plot is not None:
        print(f"\nplot: {plot_status(rows, a.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
