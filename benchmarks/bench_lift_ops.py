"""Operations and host time of one ``from_mask_mod`` call (lifted or recognised path) beside
``compile`` of the same mask in the region language, on the CPU (no GPU needed).

    PYTHONPATH=src python benchmarks/bench_lift_ops.py \\
        --out benchmarks/results/cpu-lift-ops-<date>.jsonl

On a GPU the path is bound by host work and small device operations, so the operation count
(non-view aten operations, ``tools.op_counts.OpCounter.real``: each launches a kernel there) and the
host reads (``aten._local_scalar_dense``, ``aten.equal``, ``aten.is_nonzero``: scalar reads; and
the whole-tensor copies to the host, ``Tensor.tolist`` / ``.cpu()`` / ``.numpy()``, counted by
wrapping those methods for the count, as no aten operation shows them on the CPU) are its cost
model. Per mask (the mask_mods of ``bench_from_mask_mod.py``) and size: the minimum
wall ms over ``--calls`` calls on one thread (a shared machine varies a lot with two), the
operations and host reads of one call, and the plan's ``source``. ``compilemask-compile`` rows
time ``compile(..., cache=False)`` of the same mask written in the language (causal,
sliding_window, prefix_lm, document, clear). With ``--gym`` the masks are instead the
attention-gym and FlashAttention-4 mask_mods of ``tests/flex_masks.py`` scaled to each size
(``lift_gym_masks.py``: the general lifting, no common form), each row with ``recognised``
(the catalogue mask it is recognised as, or null). Rows carry the commit
(``COMPILEMASK_COMMIT`` or git).

    PYTHONPATH=src python benchmarks/bench_lift_ops.py --gym --out /tmp/gym.jsonl

With ``--rank`` (sizes given by ``--sizes``) one warm build of every seed mask_mod and every
gym mask_mod is counted (``"set"``: ``seed`` / ``gym``) and the rows are printed ranked by
``score = ops + 20 * host_reads``, a proxy of the build's host time on a GPU (an operation
there costs about 5-10 us of host time, a synchronisation tens to hundreds); ``score_sync``
adds ``20 * h2d``. ``score`` counts a repeated call (a plan kept by ``from_mask_mod``'s plan
cache is reused: a mask_mod that captures no tensor, or a recognised one whose tables hold
the same values); ``ops_build`` / ``host_reads_build`` / ``score_build`` count the same call
with ``cache=False``: the build itself. With ``--gym`` the rows carry both too; the seed
rows have a ``compilemask-auto-build`` twin (``cache=False``).
``h2d`` counts the host values made device tensors by ``torch.tensor`` / ``torch.as_tensor``
with a ``device`` (on a GPU a blocking copy from pageable memory, which waits for the stream
like a read); on the CPU nothing is copied, so the count is of the calls.

    PYTHONPATH=src python benchmarks/bench_lift_ops.py --rank --sizes 32768 --calls 1 \\
        --out benchmarks/results/cpu-lift-ops-<date>.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import compilemask as cm
from compilemask.tools.op_counts import OpCounter, counting_host_copies
from compilemask.workloads import CLEAR_RADIUS, CLEAR_TEXT_TOK

sys.path.insert(0, os.path.dirname(__file__))
from bench_from_mask_mod import CLEAR_GRIDS, commit, mask_mod_for  # noqa: E402
from lift_gym_masks import GYM, gym_mask_mod  # noqa: E402

from compilemask.compiler.migrate import lift  # noqa: E402
from compilemask.compiler.migrate.recognise import recognise  # noqa: E402

HOST_READS = ("aten._local_scalar_dense", "aten.equal", "aten.is_nonzero")
MASKS = ("causal", "sliding_window", "document", "prefix_lm", "hstu", "shared_prompt", "clear")


def language_mask(name: str, n: int):
    """The region-language twin of ``mask_mod_for(name, n)`` (None for the seeds' own)."""
    g = torch.Generator().manual_seed(0)
    if name == "causal":
        return cm.masks.causal()
    if name == "sliding_window":
        return cm.masks.sliding_window(n // 8)
    if name == "prefix_lm":
        return cm.masks.prefix_lm(n // 4)
    if name == "document":
        cuts = torch.randperm(n - 1, generator=g)[: n // 16 - 1].sort().values + 1
        lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]))
        return cm.masks.document(lengths.tolist(), causal=True)
    if name == "clear":
        return cm.masks.clear(CLEAR_GRIDS.get(n, (n // 128, 128)), CLEAR_RADIUS, CLEAR_TEXT_TOK)
    return None


def count(fn) -> tuple[int, int, int]:
    """``(ops, host reads, h2d)`` of one call of ``fn``."""
    with OpCounter() as counted, counting_host_copies() as copies:
        fn()
    reads = copies["n"] + sum(n for op, n in counted.ops.items() if op.startswith(HOST_READS))
    return counted.real(), reads, copies["h2d"]


def measure(fn, calls: int, build=None) -> dict:
    """``calls`` 0: counts only (``ms_min`` null). ``build``: the same call with the plan
    cache off (``cache=False``), counted once after ``fn``'s calls (``*_build`` keys)."""
    out = fn()
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    ops, reads, h2d = count(fn)
    source = str(getattr(out, "source", ""))
    row = {"ms_min": round(best * 1e3, 3) if calls else None, "ops": ops, "host_reads": reads,
           "h2d": h2d, "score": ops + 20 * reads, "score_sync": ops + 20 * (reads + h2d),
           "source": source if len(source) <= 60 else source[:57] + "..."}  # fmt: skip
    if build is not None:
        b_ops, b_reads, _ = count(build)
        row.update(ops_build=b_ops, host_reads_build=b_reads, score_build=b_ops + 20 * b_reads)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 32768])
    ap.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    ap.add_argument(
        "--gym",
        nargs="*",
        choices=GYM,
        default=None,
        help="the general lifting's mask_mods (all, or the ones named) instead",
    )
    ap.add_argument("--rank", action="store_true", help="seeds and gym mask_mods, ranked by score")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    base = {"commit": commit(), "device": "cpu", "threads": 1}
    if a.rank:
        return rank(a.sizes, a.calls, a.out, base)
    if a.gym is not None:
        return gym(a.gym or list(GYM), a.sizes, a.calls, a.out, base)
    with open(a.out, "a") as f:
        for n in a.sizes:
            for name in a.masks:
                mm, length = mask_mod_for(name, n, "cpu")
                rows = [("compilemask-auto", lambda: cm.from_mask_mod(mm, length)),  # noqa: B023
                        ("compilemask-auto-build",
                         lambda: cm.from_mask_mod(mm, length, cache=False))]  # noqa: B023  # fmt: skip
                lang = language_mask(name, n)
                if lang is not None:
                    rows.append(
                        ("compilemask-compile", lambda: cm.compile(lang, length, cache=False))  # noqa: B023
                    )
                for system, fn in rows:
                    row = {"mask": name, "n": length, "system": system, **base}
                    row.update(measure(fn, a.calls))
                    print(json.dumps(row), flush=True)
                    f.write(json.dumps(row) + "\n")


def gym(names, sizes, calls: int, out: str, base: dict) -> None:
    with open(out, "a") as f:
        for n in sizes:
            for name in names:
                mm, nq, nk, batch, heads = gym_mask_mod(name, n)
                got = recognise(lift.traced(mm), nq, nk)
                row = {"mask": name, "n": nq, "kv_len": nk, "batch": batch, "heads": heads,
                       "system": "compilemask-auto", **base,
                       "recognised": None if got is None else str(got).split("\n")[0]}  # fmt: skip
                row.update(measure(
                    lambda: cm.from_mask_mod(mm, nq, nk, batch=batch, heads=heads), calls,  # noqa: B023
                    lambda: cm.from_mask_mod(mm, nq, nk, batch=batch, heads=heads, cache=False),  # noqa: B023
                ))  # fmt: skip
                print(json.dumps(row), flush=True)
                f.write(json.dumps(row) + "\n")


def rank(sizes, calls: int, out: str, base: dict) -> None:
    rows = []
    with open(out, "a") as f:
        for n in sizes:
            todo = [("seed", name, *mask_mod_for(name, n, "cpu"), None, None, None)
                    for name in MASKS]  # fmt: skip
            for name in GYM:
                mm, nq, nk, batch, heads = gym_mask_mod(name, n)
                todo.append(("gym", name, mm, nq, nk, batch, heads))
            for kind, name, mm, nq, nk, batch, heads in todo:
                row = {"set": kind, "mask": name, "n": nq, "kv_len": nk or nq, "batch": batch,
                       "heads": heads, "system": "compilemask-auto", **base}  # fmt: skip
                row.update(measure(
                    lambda: cm.from_mask_mod(mm, nq, nk, batch=batch, heads=heads), calls,  # noqa: B023
                    lambda: cm.from_mask_mod(mm, nq, nk, batch=batch, heads=heads, cache=False),  # noqa: B023
                ))  # fmt: skip
                print(json.dumps(row), flush=True)
                f.write(json.dumps(row) + "\n")
                rows.append(row)
    print(f"{'set':5} {'mask':24} {'n':>6} {'ops':>5} {'reads':>5} {'h2d':>4} {'score':>6} "
          f"{'sync':>6} {'build':>6} {'ms':>8}")  # fmt: skip
    for r in sorted(rows, key=lambda r: -r["score"]):
        ms = r["ms_min"] or 0
        print(f"{r['set']:5} {r['mask']:24} {r['n']:6} {r['ops']:5} {r['host_reads']:5} "
              f"{r['h2d']:4} {r['score']:6} {r['score_sync']:6} {r['score_build']:6} "
              f"{ms:8.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
