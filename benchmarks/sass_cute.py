"""Compile the cute forward (``kernels/cute/forward_sm90.py``) for sm_90a on any machine (no
GPU) and count its SASS instructions, whole and per loop: the cheapest look at what a kernel
change did to the code before timing it.

    PYTHONPATH=src CUTE_DSL_ARCH=sm_90a python benchmarks/sass_cute.py --label new \\
        [--modifier ""] [--dtype bfloat16] [--head-dim 128] [--out rows.jsonl]

It imports whatever ``compilemask`` is on the path, so two versions compare by running it
once with each ``src`` (``--label`` names the version in the rows). The kernel is compiled
afresh (disk cache off) with ``CUTE_DSL_KEEP=cubin``, disassembled with Triton's
``cuobjdump``, and one JSON row printed (and appended to ``--out``): registers, spills, the
whole kernel's instruction counts, and per loop (a backward branch; shortest first) its
instruction count, HGMMA, LDG, MUFU.EX2, BAR and branches. The consumers' two ``kv_steps``
loops are the longest ones holding HGMMA: the FULL tiles' (no mask) and the PARTIAL tiles'.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", required=True)
    p.add_argument("--modifier", default="", choices=("", "softcap", "alibi"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default=None, help="JSON-lines file the row is appended to")
    args = p.parse_args(argv)
    dump = tempfile.mkdtemp(prefix="cute-sass-")
    os.environ.update(COMPILEMASK_CACHE_DIR="off", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=dump)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

    import torch

    from compilemask.kernels.cute.backend import precompile
    from compilemask.kernels.triton.sass import _tool, instruction_counts, loops

    precompile(args.head_dim, getattr(torch, args.dtype), "cpu", args.modifier)
    (cubin,) = glob.glob(os.path.join(dump, "*.cubin"))
    run = [_tool("cuobjdump"), "-sass", cubin]
    listing = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    res = subprocess.run(
        [_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True, check=True
    ).stdout
    usage = re.search(r"REG:\d+.*", res)
    keep = ("total", "HGMMA", "LDG", "MUFU.EX2", "BAR", "BRA")
    found = [
        {k: c.get(k, 0) for k in keep} | {"span": end - start} for start, end, c in loops(listing)
    ]
    row = {
        "commit": args.commit, "label": args.label, "modifier": args.modifier,
        "dtype": args.dtype, "head_dim": args.head_dim,
        "resources": usage.group(0) if usage else None,
        "kernel": dict(instruction_counts(listing.splitlines())),
        # the innermost three: the PARTIAL and FULL tiles' kv_steps loops and the wait loop
        "gemm_loops": [x for x in found if x["HGMMA"]][:3],
    }  # fmt: skip
    line = json.dumps(row)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
