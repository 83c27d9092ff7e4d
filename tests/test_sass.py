"""The compiled sm_90 code of the kernels, read on the CPU (no GPU): multi-stage loops must
pipeline their async copies (a tile-index load as the last copy group of each iteration makes
every loop wait for all copies in flight).

The compilation runs in a child process without ``TRITON_INTERPRET`` (the test suite sets it,
and interpreted kernels cannot be compiled for a GPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from compilemask.kernels.triton import sass as sass_tools

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not sass_tools.available(), reason="this Triton install cannot compile for sm_90 here"
)

_CHILD = """
import json
from compilemask.kernels.triton import sass
from compilemask.kernels.triton.configs import BwdConfig, FwdConfig
from compilemask.workloads import workload
with sass.capture_sm90() as kernels:
    sass.launch_all(workload("causal", 1024), FwdConfig(64, 64, 4, 3),
                    BwdConfig(64, 128, 8, 3, 128, 64, 8, 3))
print(json.dumps({n: sass.async_copy_waits(sass.sass(k)) for n, k in kernels}))
"""


def _run_child(template: str):
    """Run a compile script in a child without TRITON_INTERPRET; its last line as JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", template], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_three_stage_loops_keep_copies_in_flight():
    waits = _run_child(_CHILD)
    assert set(waits) >= {"_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"}
    for name in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"):
        counts = {int(w): n for w, n in waits[name].items()}
        # one pipelined wait per loop (masked tiles, FULL tiles); 0 would wait for every copy
        assert sum(n for w, n in counts.items() if w > 0) >= 2, (name, counts)


_CHILD_SMEM = """
import json
from compilemask.kernels.triton import sass
from compilemask.kernels.triton.configs import BwdConfig, FwdConfig
from compilemask.workloads import workload
with sass.capture_sm90() as kernels:
    sass.launch_all(workload("clear", 1024), FwdConfig(64, 64, 4, 3, 3, 1),
                    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 3, 3, tma=1))
print(json.dumps({n: k.metadata.shared for n, k in kernels}))
"""

# Two programs per SM on sm_90: 2 x (dynamic + 1 KiB reserved per block) <= 228 KiB.
TWO_PER_SM = 228 * 1024 // 2 - 1024


def test_bitmask_forward_keeps_two_programs_per_sm():
    """32-bit bitmask words would be staged through shared memory by the pipeliner (512 bytes
    per stage), which puts the 64x64 forward with 3 stages at one program per SM; the 16-bit
    loads of ``common.bits_tile_mask`` stay in registers. Clear at 1K has bitmask
    tiles in every image row."""
    shared = _run_child(_CHILD_SMEM)
    assert shared["_attn_fwd"] <= TWO_PER_SM, shared
    assert shared["_attn_bwd_dkdv"] <= TWO_PER_SM, shared


_CHILD_PIPELINED = """
import json, re
from compilemask.compiler import pipeline
from compilemask.kernels.triton import sass
from compilemask.kernels.triton.configs import BwdConfig, FwdConfig
from compilemask.workloads import workload
build = pipeline.build_plan  # a GPU build (no host read): K untrimmed, interval tiles only
pipeline.build_plan = lambda *a, **kw: build(*a, **{**kw, "host_sync": False})
with sass.capture_sm90() as kernels:
    sass.launch_all(workload("clear", 4096), FwdConfig(64, 64, 4, 3, 3, 1, prefetch=1, one_slot=1),
                    BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 3, 3, tma=1))
listing = sass.sass(dict(kernels)["_attn_fwd"])
print(json.dumps({"hgmma": listing.count("HGMMA"),
                  "waited": len(re.findall(r"HGMMA[^\\n]*gsb0", listing))}))
"""


def test_interval_forward_loops_stay_pipelined():
    """Clear at 4K from a GPU build (32 slots, interval tiles of slot span 2: MAX_SPAN=2,
    SLOTS=0, HAS_BITS=0, as clear at 32K): the forward's loops stay software-pipelined, one
    wait per group of async MMAs. Clamping the next tile index where it is loaded took both
    loops out of the pipeliner (every HGMMA waited for: clear 32K 8.2 ms against 5.1 on an
    H200)."""
    got = _run_child(_CHILD_PIPELINED)
    assert got["hgmma"] >= 12, got
    assert got["waited"] <= got["hgmma"] // 3, got


_CHILD_DECODE = """
import json, re, torch
from compilemask.kernels.triton import sass
from compilemask.kernels.triton.decode import decode_attention
B, HQ, HKV, D, PAGE, NK = 64, 32, 8, 128, 64, 1024  # ints specialised as at 8K (16 | each)
got = {}
for nq in (1, 4):
    q = torch.empty(B, HQ, nq, D, dtype=torch.bfloat16)
    kc, vc = (torch.empty(B * NK // PAGE, PAGE, HKV, D, dtype=torch.bfloat16) for _ in "kv")
    table = torch.empty(B, NK // PAGE, dtype=torch.int32)
    buf = torch.zeros(3 * B * nq + 2 * B, dtype=torch.int32)  # step_rows: views of one buffer
    n = B * nq
    lo, hi, lens = buf[:n].view(B, nq, 1), buf[n : 2 * n].view(B, nq, 1), buf[3 * n + B :]
    with sass.capture_sm90() as kernels:
        decode_attention(q, kc, vc, lo, hi, table, lens, 0.088, num_splits=1,
                         plan_seqlens=lens, len_limit=NK)
    res = sass.resources(kernels[0][1])
    got[nq] = [int(re.search(k + r":(\\d+)", res).group(1)) for k in ("REG", "STACK")]
print(json.dumps(got))
"""


def test_decode_kernel_keeps_two_programs_per_sm():
    """The split-KV decode kernel (bf16, head_dim 128, 8 warps: 256 threads) of 1 and 4 new
    tokens with 4 query heads per kv head fits two programs per SM: at most 128 registers,
    no spills. One more value live across the key loop (the bad-row flag) put the 4-token
    kernel at 150 registers, one program per SM (causal 8K on an H200: 639 us against 501)."""
    got = _run_child(_CHILD_DECODE)
    for nq, (regs, stack) in got.items():
        assert regs <= 128 and stack == 0, (nq, regs, stack)
