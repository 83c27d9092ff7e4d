"""Compile the Triton kernels for sm_90 on any machine (no GPU) and read their SASS.

Launches made inside :func:`capture_sm90` are not run: Triton's own binder specialises the
arguments as a real launch would (alignment, ``== 1``, divisibility by 16, constexprs), the
kernel is compiled by the CUDA backend for ``GPUTarget("cuda", 90, 32)`` with the ptxas that
ships in the Triton wheel, and the compiled kernel is recorded. :func:`launch_all` launches
every attention kernel once; ``benchmarks/sass_stats.py`` prints instruction counts from
them; ``tests/test_sass.py`` checks that pipelined loops really pipeline (an index load as
the last copy group of an iteration makes every loop wait for all async copies:
``DEPBAR.LE SB0, 0x0``).

Example::

    >>> with capture_sm90() as kernels:
    ...     attention_forward(q, k, v, ...)      # CPU tensors are fine: nothing runs
    >>> name, kernel = kernels[0]
    >>> async_copy_waits(sass(kernel))           # Counter({0: 2, 2: 2})
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def available() -> bool:
    """Whether this Triton install can compile for sm_90 here (ptxas and cuobjdump present)."""
    return all(os.path.exists(_tool(t)) for t in ("ptxas", "cuobjdump"))


@contextlib.contextmanager
def capture_sm90() -> Iterator[list[tuple[str, object]]]:
    """Within the block, Triton launches compile for sm_90 and return without running; yields
    the list of ``(kernel name, CompiledKernel)`` it fills.

    Needs kernels decorated without ``TRITON_INTERPRET=1`` in the environment (under it
    ``@triton.jit`` makes interpreted functions that this cannot compile): run it in a
    process started without that variable.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime import jit as triton_jit

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    compiled: list[tuple[str, object]] = []
    original = triton_jit.JITFunction.run

    def compile_instead_of_launch(self, *args, grid, warmup, **kwargs):
        kwargs["debug"] = False
        binder = triton_jit.create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound_args, specialization, options
        )
        src = ASTSource(self, signature, constexprs, attrs)
        kernel = triton.compile(src, target=target, options=options.__dict__)
        compiled.append((self.fn.__name__, kernel))

    interpret = os.environ.pop("TRITON_INTERPRET", None)
    triton_jit.JITFunction.run = compile_instead_of_launch
    try:
        yield compiled
    finally:
        triton_jit.JITFunction.run = original
        if interpret is not None:
            os.environ["TRITON_INTERPRET"] = interpret


def launch_all(w, fwd, bwd, heads: int = 2) -> None:
    """One forward and one backward launch of every kernel on CPU tensors (inside
    :func:`capture_sm90` they compile and do not run): bf16, head_dim 128, the launch
    configurations ``fwd`` (``FwdConfig``) and ``bwd`` (``BwdConfig``). ``w`` is a workload
    (``compilemask.workloads.workload``) or a ``(mask, N)`` pair."""
    import torch

    from ...compiler.pipeline import compile as compile_mask
    from .backward import attention_backward
    from .configs import replace
    from .forward import attention_forward
    from .schedule import dkdv_schedule, ds_slots, forward_schedule

    mask, n = (w.mask, w.N) if hasattr(w, "mask") else w
    plan = compile_mask(mask, n)
    q, k, v, do = (torch.randn(1, heads, n, 128, dtype=torch.bfloat16) for _ in range(4))
    strides = dict(mask_stride_b=0, mask_stride_h=0)
    fwd_sched = forward_schedule(plan, fwd.block_m, fwd.block_n)
    out, lse = attention_forward(
        q, k, v, plan.row_lo, plan.row_hi, fwd_sched, scale=0.088, cfg=fwd, **strides
    )
    s1 = dkdv_schedule(plan, bwd.dkdv_block_m, bwd.dkdv_block_n)
    s2 = forward_schedule(plan, bwd.dq_block_m, bwd.dq_block_n)
    slots = None
    if bwd.ds_dq:  # dQ from stored dS: a buffer of the most touched dQ tiles of one mask
        slots = ds_slots(s1["kind"])
        bwd = replace(bwd, ds_dq=int((s2["kind"] != 0).sum()))
    attention_backward(
        q, k, v, out, lse, do, plan.row_lo, plan.row_hi, s1, s2,
        scale=0.088, cfg=bwd, ds_slots=slots, **strides,
    )  # fmt: skip


def _cuobjdump(kernel, flag: str) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run(
            [_tool("cuobjdump"), flag, path], capture_output=True, text=True, check=True
        ).stdout


def sass(kernel) -> str:
    """The kernel's SASS listing (``cuobjdump -sass``)."""
    return _cuobjdump(kernel, "-sass")


def resources(kernel) -> str:
    """``REG:.. STACK:.. SHARED:.. LOCAL:..`` of ``cuobjdump -res-usage`` (STACK > 0: spills)."""
    m = re.search(r"REG:\d+.*", _cuobjdump(kernel, "-res-usage"))
    return m.group(0).strip() if m else "?"


def async_copy_waits(listing: str) -> collections.Counter:
    """How often each ``DEPBAR.LE SB0, N`` (wait until at most N async-copy groups are in
    flight) occurs: a pipelined loop waits with N > 0; N = 0 waits for every copy."""
    return collections.Counter(
        int(n, 16) for n in re.findall(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", listing)
    )


COUNTED = (
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


def instruction_counts(lines: list[str]) -> collections.Counter:
    """Instructions in ``lines`` of a SASS listing: ``total`` and each opcode of COUNTED."""
    c: collections.Counter = collections.Counter()
    for line in lines:
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if not m:
            continue
        op = m.group(2)
        c["total"] += 1
        for name in COUNTED:
            if op == name or op.startswith(name + "."):
                c[name] += 1
    return c


def loops(listing: str) -> list[tuple[int, int, collections.Counter]]:
    """``(start, end, instruction_counts)`` of every backward branch (a loop body), shortest
    first."""
    lines = listing.splitlines()
    addr = {}
    for i, line in enumerate(lines):
        m = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if m:
            addr[int(m.group(1), 16)] = i
    found = []
    for i, line in enumerate(lines):
        here = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        t = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", line)
        if not (here and t and t.group(1)):
            continue
        target, at = int(t.group(1), 16), int(here.group(1), 16)
        if target < at and target in addr:
            found.append((target, at, instruction_counts(lines[addr[target] : i + 1])))
    return sorted(found, key=lambda x: x[1] - x[0])
