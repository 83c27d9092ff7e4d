"""The compiled sm_90 code of the kernels, read on the CPU (no GPU): multi-stage loops must
pipeline their async copies (session 3: every loop waited for all copies in flight because the
tile-index load was the last copy group of each iteration; H200 fwd+bwd 5-9% faster once fixed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from compilemask.kernels.triton.configs import BwdConfig, FwdConfig
from compilemask.tools import sass as sass_tools
from compilemask.workloads import workload

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = pytest.mark.skipif(
    not sass_tools.available(), reason="this Triton install cannot compile for sm_90 here"
)


def test_three_stage_loops_keep_copies_in_flight():
    from sass_stats import launch_all

    with sass_tools.capture_sm90() as kernels:
        launch_all(
            workload("causal", 1024),
            FwdConfig(64, 64, 4, 3),
            BwdConfig(64, 128, 8, 3, 128, 64, 8, 3),
        )
    by_name = dict(kernels)
    assert set(by_name) >= {"_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"}
    for name in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq"):
        waits = sass_tools.async_copy_waits(sass_tools.sass(by_name[name]))
        # one pipelined wait per loop (masked tiles, FULL tiles); 0 would wait for every copy
        assert sum(n for w, n in waits.items() if w > 0) >= 2, (name, waits)
