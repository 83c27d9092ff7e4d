"""Write the four seed workloads at nominal size 4096 as mask text: examples/<name>.txt.

Run from the repository root: ``python examples/make_examples.py`` (regenerate whenever the
printer or the workload rules change; tests/test_workloads.py checks they parse back).
"""

from __future__ import annotations

from pathlib import Path

from compilemask.workloads import SEED_WORKLOADS, workload

NOMINAL_SIZE = 4096


def main() -> None:
    here = Path(__file__).resolve().parent
    for name in SEED_WORKLOADS:
        w = workload(name, NOMINAL_SIZE)
        path = here / f"{name}.txt"
        path.write_text(
            f"# {name} at nominal size {NOMINAL_SIZE}: N = {w.N} tokens per row, B = {w.B} rows "
            f'(docs/masks.md, "Seed workloads")\n{w.mask}\n'
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
