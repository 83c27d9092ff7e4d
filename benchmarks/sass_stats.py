"""Compile the attention kernels for sm_90 on any machine (no GPU) and count their instructions.

    PYTHONPATH=src python3 benchmarks/sass_stats.py --workload causal --n0 4096 \\
        [--fwd 128,128,8,2] [--bwd 64,64,4,2,128,64,8,3] [--dump /tmp/sass]

Launches of the forward and backward kernels are compiled for sm_90 and not run
(``compilemask.kernels.triton.sass``: ``capture_sm90``, ``launch_all``; start it without
``TRITON_INTERPRET``). For
each kernel it prints registers, spills, shared memory, the async-copy waits
(``DEPBAR.LE SB0, N``: N = 0 in a loop means no pipelining) and SASS instruction counts of the
whole kernel and of its loops (HGMMA, LDGSTS, LDG, LDS, MUFU.EX2, BAR, branches, spill loads
LDL): the cheapest way to see what a kernel change did to the code before spending GPU time on
it. ``--dump`` writes the SASS and PTX. ``--inductor-file F`` compiles instead a Triton
template kernel that Inductor generated (e.g. FlexAttention's backward, copied from
``$TORCHINDUCTOR_CACHE_DIR`` on the GPU machine), with its own launch options.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import tempfile

import torch

import compilemask as cm
from compilemask.kernels.triton import configs as cfgs
from compilemask.kernels.triton.sass import (
    COUNTED,
    async_copy_waits,
    capture_sm90,
    instruction_counts,
    launch_all,
    loops,
    resources,
    sass,
)
from compilemask.workloads import workload


def compile_inductor_file(path: str):
    """``(name, CompiledKernel)`` of the Triton template kernel in an Inductor output file:
    its signature, num_warps and num_stages come from the file's ``triton_meta`` header,
    every pointer 16-byte aligned (as Inductor specialises them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    src = open(path).read()
    meta = re.search(r"triton_meta=(\{'signature': \{[^}]*\})", src).group(1) + "}"
    signature = ast.literal_eval(meta)["signature"]
    warps = int(re.search(r"num_warps=(\d+)", src).group(1))
    stages = int(re.search(r"num_stages=(\d+)", src).group(1))
    src = re.sub(r"@triton_heuristics\.template\(.*?\n\)\n", "", src, flags=re.S)
    name = re.search(r"def (triton_\w+)\(", src).group(1)
    with tempfile.TemporaryDirectory() as d:
        module_path = os.path.join(d, "inductor_kernel.py")
        with open(module_path, "w") as f:
            f.write(src)
        spec = importlib.util.spec_from_file_location("inductor_kernel", module_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
        options = backend.parse_options({"num_warps": warps, "num_stages": stages})
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}
        kernel = triton.compile(
            ASTSource(getattr(module, name), signature, {}, attrs),
            target=target,
            options=options.__dict__,
        )
    return name, kernel


def _fmt(c) -> str:
    return " ".join(f"{k}={c[k]}" for k in ("total", *COUNTED) if c[k])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="causal", help="a seed, or clear_tiled (tile_grid)")
    ap.add_argument("--n0", type=int, default=4096)
    ap.add_argument("--fwd", help="block_m,block_n,warps,stages (default: the library's)")
    ap.add_argument("--bwd", help="BwdConfig ints (default: the library's)")
    ap.add_argument("--dump", help="folder for <kernel>.sass and .ptx")
    ap.add_argument("--inductor-file", help="an Inductor-generated Triton kernel to compile")
    a = ap.parse_args()
    dtype = torch.bfloat16
    fwd = cfgs.FwdConfig(*map(int, a.fwd.split(","))) if a.fwd else cfgs.forward_config(128, dtype)
    bwd = cfgs.BwdConfig(*map(int, a.bwd.split(","))) if a.bwd else cfgs.backward_config(128, dtype)
    if a.inductor_file:
        kernels = [compile_inductor_file(a.inductor_file)]
    else:
        with capture_sm90() as kernels:
            if a.workload == "clear_tiled":
                w = workload("clear", a.n0)
                launch_all((cm.tile_grid(w.mask, (8, 16)), w.N), fwd, bwd)
            else:
                launch_all(workload(a.workload, a.n0), fwd, bwd)
    for name, kernel in kernels:
        listing = sass(kernel)
        waits = dict(sorted(async_copy_waits(listing).items()))
        print(
            f"{name}: {resources(kernel)} dynamic smem {kernel.metadata.shared} | "
            f"waits {waits} | {_fmt(instruction_counts(listing.splitlines()))}"
        )
        for lo, hi, c in loops(listing)[:6]:
            print(f"   loop {lo:#06x}-{hi:#06x}: {_fmt(c)}")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            with open(os.path.join(a.dump, f"{name}.sass"), "w") as f:
                f.write(listing)
            with open(os.path.join(a.dump, f"{name}.ptx"), "w") as f:
                f.write(kernel.asm["ptx"])


if __name__ == "__main__":
    main()
