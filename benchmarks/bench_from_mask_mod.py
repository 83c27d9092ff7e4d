"""Time ``from_mask_mod`` beside FlexAttention's ``create_block_mask`` on the same mask_mods, in
the same process.

Mask_mods (as a Flex user writes them, ``compilemask.tools.peers.flex_mask_mod`` for the seed
masks): causal, sliding_window (N/8), document (N/16 random documents, causal), prefix_lm
(N/4), hstu, shared_prompt and clear (the seed workloads' generators at length N). Systems:

* ``flex-create_block_mask``: ``create_block_mask(mask_mod, None, None, N, N, device)``;
* ``compilemask-evaluated``: ``from_mask_mod(mask_mod, N, lifting=False, device)`` (blocked
  evaluation, one pass);
* ``compilemask-auto``: ``from_mask_mod(mask_mod, N, device)`` (lifted when recognised;
  ``path`` says which path was taken).

With ``--gym`` the mask_mods are those of attention-gym and FlashAttention-4's tests
(``lift_gym_masks.py``: the ones ``from_mask_mod`` lowers by its general lifting), their tables
on ``--device``, each with the batch and heads it is written for.

Median of ``--repeat`` warm runs (``time.perf_counter``, a device synchronisation on CUDA), the
systems alternating within each repeat.
Results go to ``benchmarks/results/<cpu|h200>-from-mask-mod-<date>.jsonl``, one JSON line per
(mask, system) with the git commit. ``COMPILEMASK_COMMIT=...`` names the commit without git.

Usage::

    python benchmarks/bench_from_mask_mod.py --sizes 8192
    python benchmarks/bench_from_mask_mod.py --sizes 1024 --masks causal hstu --no-write
    python benchmarks/bench_from_mask_mod.py --device cuda --sizes 32768 --gym
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
from torch.nn.attention.flex_attention import create_block_mask

import compilemask as cm
from compilemask import masks
from compilemask.tools.peers import flex_mask_mod
from compilemask.workloads import CLEAR_RADIUS, CLEAR_TEXT_TOK, hstu_users, shared_prompt_groups

MASKS = ("causal", "sliding_window", "document", "prefix_lm", "hstu", "shared_prompt", "clear")
CLEAR_GRIDS = {1024: (16, 32), 4096: (64, 64), 8192: (64, 128), 16384: (128, 128)}


def mask_mod_for(name: str, n: int, device) -> tuple:
    """``(mask_mod, length)`` of mask ``name`` at about ``n`` tokens."""
    g = torch.Generator().manual_seed(0)
    if name == "prefix_lm":
        p = n // 4
        return (lambda b, h, q, k: (k <= q) | (k < p)), n
    if name == "document":
        cuts = torch.randperm(n - 1, generator=g)[: n // 16 - 1].sort().values + 1
        lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])).tolist()
        return flex_mask_mod(masks.document(lengths), device), n
    if name == "sliding_window":
        return flex_mask_mod(masks.sliding_window(n // 8), device), n
    if name == "hstu":
        lengths, targets = hstu_users(n, g)
        return flex_mask_mod(masks.hstu(lengths, targets, contextual=6), device), n
    if name == "shared_prompt":
        prompts, responses = shared_prompt_groups(n, g)
        return flex_mask_mod(masks.shared_prompt(prompts, responses), device), n
    if name == "clear":
        gh, gw = CLEAR_GRIDS.get(n, (n // 128, 128))
        m = masks.clear((gh, gw), CLEAR_RADIUS, CLEAR_TEXT_TOK)
        return flex_mask_mod(m, device), CLEAR_TEXT_TOK + gh * gw
    return flex_mask_mod(masks.causal(), device), n


def systems_for(mm, n: int, device, kv_len=None, batch=None, heads=None) -> dict:
    nk = n if kv_len is None else kv_len
    kw = {"batch": batch, "heads": heads, "device": device}
    return {
        "flex-create_block_mask": lambda: create_block_mask(mm, batch, heads, n, nk, device=device),
        "compilemask-evaluated": lambda: cm.from_mask_mod(mm, n, nk, lifting=False, **kw),
        "compilemask-auto": lambda: cm.from_mask_mod(mm, n, nk, **kw),
    }


def cases(args, device):
    """``(name, mask_mod, q_len, kv_len, batch, heads)`` per measured mask and size."""
    if args.gym:
        sys.path.insert(0, str(Path(__file__).parent))
        from lift_gym_masks import GYM, gym_mask_mod, to_device

        for n0 in args.sizes:
            for name in GYM:
                mm, nq, nk, batch, heads = gym_mask_mod(name, n0)
                yield name, to_device(mm, device), nq, nk, batch, heads
        return
    for n0 in args.sizes:
        for name in args.masks:
            mm, n = mask_mod_for(name, n0, device)
            yield name, mm, n, n, None, None


def medians_s(systems: dict, device, repeat: int) -> dict:
    """Median seconds per system; the systems alternate within each repeat, so that a change
    of load on a shared machine falls on all of them alike."""
    times = {name: [] for name in systems}
    for fn in systems.values():
        fn()
    for _ in range(repeat):
        for name, fn in systems.items():
            times[name].append(timed(fn, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def timed(fn, device) -> float:
    """Seconds of one call of ``fn``, synchronised before and after on a CUDA ``device``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t


def commit() -> str:
    env = os.environ.get("COMPILEMASK_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192])
    ap.add_argument("--masks", nargs="+", default=list(MASKS), choices=MASKS)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--gym", action="store_true", help="attention-gym / FA4 test mask_mods")
    args = ap.parse_args()
    device = torch.device(args.device)
    sha = commit()
    host = "h200" if device.type == "cuda" else "cpu"
    date = datetime.date.today().isoformat()
    out = Path(__file__).parent / "results" / f"{host}-from-mask-mod-{date}.jsonl"
    rows = []
    for name, mm, n, nk, batch, heads in cases(args, device):
        systems = systems_for(mm, n, device, nk, batch, heads)
        medians = medians_s(systems, device, args.repeat)
        for system, fn in systems.items():
            row = {
                "mode": "plan-from-mask-mod",
                "system": system,
                "mask": name,
                "N": n,
                "median_ms": round(medians[system] * 1e3, 3),
                "repeat": args.repeat,
                "device": torch.cuda.get_device_name(device)
                if device.type == "cuda"
                else platform.processor() or platform.machine(),
                "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "commit": sha,
            }
            if args.gym:
                row.update(kv_len=nk, batch=batch, heads=heads, set="gym")
            if system.startswith("compilemask"):
                row["path"] = fn().source
            rows.append(row)
            print(json.dumps(row), flush=True)
    if not args.no_write:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
