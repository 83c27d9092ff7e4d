"""Mode ``plan`` of ``compilemask bench``: plan building timed as docs/benchmarking.md defines it.

Ours is ``compile(mask, N, device="cuda", cache=False)`` plus the forward and dK/dV tile
schedules at 128 x 128 (everything the kernels read); Flex's baseline is
``create_block_mask(mask_mod, None, None, N, N, device="cuda")`` on the natural ``mask_mod``
(eager). Each is the median of 20 warm synchronised runs; a
``torch.cuda.set_sync_debug_mode("error")`` build checks that ours does not synchronise with the
host; both report their size in bytes (``plan.nbytes``; the BlockMask's tensors).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ..compiler.pipeline import compile as compile_mask
from .bench import Case, _sync
from .bench_report import Shape, result_row

PLAN_BLOCK = 128
PLAN_REPEATS = 20
PLAN_WARMUP = 3


def blockmask_nbytes(block_mask) -> int:
    """Bytes of the tensors a FlexAttention BlockMask holds."""
    from torch.nn.attention.flex_attention import BlockMask

    names = getattr(BlockMask, "_TENSOR_ATTRS", ())
    tensors = [getattr(block_mask, n, None) for n in names]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _median_ms(fn: Callable[[], object], device: torch.device) -> float:
    for _ in range(PLAN_WARMUP):
        fn()
    times = []
    for _ in range(PLAN_REPEATS):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def plan_rows(case: Case, env: dict) -> list[dict]:
    """Mode ``plan``: our plan build vs Flex's ``create_block_mask`` on the case's device (see
    the module docstring), with ``sync_free``, ``plan_bytes`` and ``blockmask_bytes``."""
    w, dev = case.workload, case.device
    shape = Shape(w.name, w.N0, w.N, w.B)
    rows = []

    def failed(system: str, err: Exception) -> dict:
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:500]
        return result_row(env, shape, "plan", system, kind="plan", status="error", reason=reason)

    try:
        rows.append(_our_plan_row(case, env, shape))
    except Exception as err:  # noqa: BLE001 - report it and time Flex anyway
        rows.append(failed(f"compilemask-{dev.type}", err))
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        from .peers import flex_mask_mod

        mm = flex_mask_mod(w.mask, dev)

        def flex_build():
            return create_block_mask(mm, None, None, w.N, w.N, device=dev)

        ms = _median_ms(flex_build, dev)
        rows.append(
            result_row(
                env,
                shape,
                "plan",
                "flex-create_block_mask",
                ms=ms,
                kind="plan",
                status="ok",
                blockmask_bytes=blockmask_nbytes(flex_build()),
            )
        )
    except Exception as err:  # noqa: BLE001
        rows.append(failed("flex-create_block_mask", err))
    return rows


def _our_plan_row(case: Case, env: dict, shape: Shape) -> dict:
    from ..kernels.triton.schedule import dkdv_schedule, forward_schedule

    w, dev = case.workload, case.device

    def compile_only():
        return compile_mask(w.mask, w.N, device=dev, cache=False)

    def build():
        plan = compile_only()
        forward_schedule(plan, PLAN_BLOCK, PLAN_BLOCK)
        dkdv_schedule(plan, PLAN_BLOCK, PLAN_BLOCK)
        return plan

    ms = _median_ms(build, dev)
    sync_free, sync_error = None, None
    if dev.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            build()
            sync_free = True
        except RuntimeError as err:
            sync_free, sync_error = False, " ".join(str(err).split())[:200]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    compact = compile_only().compact()  # the compact descriptor (compiler/segments.py)
    return result_row(
        env,
        shape,
        "plan",
        f"compilemask-{dev.type}",
        ms=ms,
        kind="plan",
        status="ok",
        compile_only_ms=_median_ms(compile_only, dev),
        sync_free=sync_free,
        sync_error=sync_error,
        plan_bytes=int(build().nbytes),
        compact_bytes=int(compact.nbytes),
        compact_rows=compact.rows,
        includes=f"compile + forward and dK/dV schedules, {PLAN_BLOCK}x{PLAN_BLOCK}",
    )
