"""Warm time of ``from_mask_mod`` on the seed and gym mask_mods, with FlexAttention's
``create_block_mask`` of the same mask_mod in the same process as the measure of the machine's
speed: a lean loop for comparing two source trees one after the other on one machine.

Cases: the seed mask_mods of ``bench_from_mask_mod.py`` (causal, sliding_window, document,
prefix_lm, hstu, shared_prompt, clear) and the attention-gym / FlashAttention-4 mask_mods of
``lift_gym_masks.py``, at about ``--size`` tokens, their tables on ``--device``. Per case: the
median of ``--repeat`` warm calls of each system (the two alternating; a device
synchronisation before and after each call on CUDA), after one call of each not timed. One
JSON line per case on stdout, flushed (a run cut short keeps the lines it printed), with
``--label`` and the commit (``COMPILEMASK_COMMIT`` or git). Where ``from_mask_mod`` keeps
plans (its ``cache`` argument), a repeated call of a mask_mod without tensors or of a
recognised one reuses its plan: ``compilemask_ms`` is that repeated call and
``compilemask_build_ms`` the build (``cache=False``), timed alternating with the others.

    PYTHONPATH=src python benchmarks/time_from_mask_mod.py --device cuda --label new
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys

import torch
from torch.nn.attention.flex_attention import create_block_mask

import compilemask as cm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_from_mask_mod import MASKS, commit, mask_mod_for, timed  # noqa: E402
from lift_gym_masks import GYM, gym_mask_mod, to_device  # noqa: E402


def cases(n: int, device, only):
    for name in MASKS:
        if not only or name in only:
            mm, length = mask_mod_for(name, n, device)
            yield "seed", name, mm, length, length, None, None
    for name in GYM:
        if not only or name in only:
            mm, nq, nk, batch, heads = gym_mask_mod(name, n)
            yield "gym", name, to_device(mm, device), nq, nk, batch, heads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=32768)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("--masks", nargs="*", default=None, help="only these (seed or gym names)")
    a = ap.parse_args()
    device = torch.device(a.device)
    sha = commit()
    keeps = "cache" in inspect.signature(cm.from_mask_mod).parameters
    for kind, name, mm, nq, nk, batch, heads in cases(a.size, device, a.masks):
        systems = {
            "compilemask": lambda: cm.from_mask_mod(mm, nq, nk, batch=batch, heads=heads,  # noqa: B023
                                                    device=device),
            "flex": lambda: create_block_mask(mm, batch, heads, nq, nk, device=device),  # noqa: B023
        }  # fmt: skip
        if keeps:
            systems["compilemask_build"] = lambda: cm.from_mask_mod(mm, nq, nk, batch=batch,  # noqa: B023
                heads=heads, device=device, cache=False)  # noqa: B023  # fmt: skip
        times = {s: [] for s in systems}
        row = {"label": a.label, "commit": sha, "set": kind, "mask": name, "N": nq,
               "kv_len": nk, "batch": batch, "heads": heads, "device": str(device)}  # fmt: skip
        try:
            row["path"] = systems["compilemask"]().source
            for s in list(systems)[1:]:
                systems[s]()
            for _ in range(a.repeat):
                for s, fn in systems.items():
                    times[s].append(timed(fn, device))
        except Exception as exc:  # noqa: BLE001 - one failing case does not stop the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        for s, ts in times.items():
            row[f"{s}_ms"] = round(statistics.median(ts) * 1e3, 3) if ts else None
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
