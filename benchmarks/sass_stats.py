"""Compile the attention kernels for sm_90 on any machine (no GPU) and count their instructions.

    PYTHONPATH=src python3 benchmarks/sass_stats.py --workload causal --n0 4096 \\
        [--fwd 128,128,8,2] [--bwd 64,128,8,3,128,128,8,2] [--dump /tmp/sass]

Launches of the forward and backward kernels are intercepted before they reach a driver: the
arguments are specialised as a real launch would be (Triton's own binder), compiled with the
CUDA backend for ``GPUTarget("cuda", 90, 32)`` (the bundled ptxas), and not run. For each kernel
it prints registers, spills, shared memory, and SASS instruction counts of the whole kernel and
of its loops (HGMMA, LDGSTS, LDG, LDS, MUFU.EX2, BAR, branches): the cheapest way to see what a
kernel change did to the code before spending GPU time on it. ``--dump`` writes the SASS and PTX.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime import jit as triton_jit

import compilemask as cm
from compilemask.kernels.triton import configs as cfgs
from compilemask.kernels.triton.backward import attention_backward
from compilemask.kernels.triton.forward import attention_forward
from compilemask.kernels.triton.schedule import dkdv_schedule, forward_schedule
from compilemask.workloads import workload

_TARGET = GPUTarget("cuda", 90, 32)
_BACKEND = make_backend(_TARGET)
_COMPILED: list[tuple[str, object]] = []


def _compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
    kwargs["debug"] = False
    binder = triton_jit.create_function_from_signature(self.signature, self.params, _BACKEND)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = self._pack_args(
        _BACKEND, kwargs, bound_args, specialization, options
    )
    kernel = triton.compile(
        ASTSource(self, signature, constexprs, attrs), target=_TARGET, options=options.__dict__
    )
    _COMPILED.append((self.fn.__name__, kernel))


_COUNTED = (
    "HGMMA",
    "LDGSTS",
    "UTMALDG",
    "LDG",
    "LDS",
    "STS",
    "MUFU.EX2",
    "BAR",
    "BRA",
    "STL",
    "LDL",
)


def _cuobjdump(kernel, flag: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        return subprocess.run([tool, flag, path], capture_output=True, text=True).stdout


def _resources(kernel) -> str:
    """'REG:255 STACK:0 SHARED:0 LOCAL:0 ...' of cuobjdump -res-usage (LOCAL > 0: spills)."""
    m = re.search(r"REG:\d+.*", _cuobjdump(kernel, "-res-usage"))
    return m.group(0).strip() if m else "?"


def _counts(lines: list[str]) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    for line in lines:
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if not m:
            continue
        op = m.group(2)
        c["total"] += 1
        for name in _COUNTED:
            if op == name or op.startswith(name + "."):
                c[name] += 1
    return c


def _loops(sass: str) -> list[tuple[int, int, collections.Counter]]:
    """(start, end, counts) of every backward branch (a loop body), innermost first."""
    lines = sass.splitlines()
    addr = {}
    for i, line in enumerate(lines):
        m = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if m:
            addr[int(m.group(1), 16)] = i
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"/\*([0-9a-f]{4,})\*/.*BRA\s.*`?\(?\.L_x_\d+\)?|BRA\s+0x([0-9a-f]+)", line)
        t = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", line)
        here = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if not (m and t and here and t.group(1)):
            continue
        target = int(t.group(1), 16)
        if target < int(here.group(1), 16) and target in addr:
            loops.append((target, int(here.group(1), 16), _counts(lines[addr[target] : i + 1])))
    return sorted(loops, key=lambda x: x[1] - x[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="causal")
    ap.add_argument("--n0", type=int, default=4096)
    ap.add_argument("--fwd", help="block_m,block_n,warps,stages (default: the library's)")
    ap.add_argument("--bwd", help="BwdConfig ints (default: the library's)")
    ap.add_argument("--dump", help="folder for <kernel>.sass and .ptx")
    a = ap.parse_args()
    triton_jit.JITFunction.run = _compile_instead_of_launch
    os.environ.pop("TRITON_INTERPRET", None)

    w = workload(a.workload, a.n0)
    plan = cm.compile(w.mask, w.N)
    q, k, v, do = (torch.randn(1, 2, w.N, 128, dtype=torch.bfloat16) for _ in range(4))
    fwd = (
        cfgs.FwdConfig(*map(int, a.fwd.split(","))) if a.fwd else cfgs.forward_config(128, q.dtype)
    )
    bwd = (
        cfgs.BwdConfig(*map(int, a.bwd.split(","))) if a.bwd else cfgs.backward_config(128, q.dtype)
    )
    strides = dict(mask_stride_b=0, mask_stride_h=0)
    out, lse = attention_forward(
        q, k, v, plan.row_lo, plan.row_hi, forward_schedule(plan, fwd.block_m, fwd.block_n),
        scale=0.088, cfg=fwd, **strides,
    )  # fmt: skip
    attention_backward(
        q, k, v, out, lse, do, plan.row_lo, plan.row_hi,
        dkdv_schedule(plan, bwd.dkdv_block_m, bwd.dkdv_block_n),
        forward_schedule(plan, bwd.dq_block_m, bwd.dq_block_n),
        scale=0.088, cfg=bwd, **strides,
    )  # fmt: skip
    for name, kernel in _COMPILED:
        sass = _cuobjdump(kernel, "-sass")
        total = _counts(sass.splitlines())
        print(
            f"{name}: {_resources(kernel)} dynamic smem {kernel.metadata.shared} | "
            + " ".join(f"{k}={total[k]}" for k in ("total",) + _COMPILED_KEYS(total))
        )
        for lo, hi, c in _loops(sass)[:6]:
            print(
                f"   loop {lo:#06x}-{hi:#06x}: "
                + " ".join(f"{k}={c[k]}" for k in ("total",) + _COMPILED_KEYS(c))
            )
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            with open(os.path.join(a.dump, f"{name}.sass"), "w") as f:
                f.write(sass)
            with open(os.path.join(a.dump, f"{name}.ptx"), "w") as f:
                f.write(kernel.asm["ptx"])


def _COMPILED_KEYS(c) -> tuple[str, ...]:  # noqa: N802
    return tuple(k for k in _COUNTED if c[k])


if __name__ == "__main__":
    main()
