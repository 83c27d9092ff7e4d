"""Mode ``fresh`` of ``compilemask bench``: a training step on a mask drawn anew every step.

A user of a generative recommender or a reward model sees a new mask every batch: the users of
an ``hstu`` row and the responses of a ``shared_prompt`` row are drawn again (the workload
generator with seed ``1, 2, 3, ...``). One step is what that user pays per attention call:

- ours (``compilemask-<backend>``): ``compile(mask, N, device="cuda", cache=False)``, then
  ``attention(q, k, v, plan, backend=...)`` and its backward;
- Flex (``flex-triton``, ``flex-fa4``): ``create_block_mask`` on the natural ``mask_mod``,
  then the compiled ``flex_attention`` and its backward;
- cuDNN-frontend (``cudnn-fe``): ``create_mask_plan`` on the row endpoints (which a user of it
  writes by hand; here they are derived from our plan before the step starts, untimed), then
  ``flex_attn_func`` and its backward.

Each system runs ``FRESH_WARMUP`` untimed steps (compiles), then ``FRESH_STEPS`` timed steps,
each synchronised and timed with the host clock; the row holds the median in ``ms``. One more
step runs under ``torch.cuda.set_sync_debug_mode("warn")`` and the row's ``syncs`` is the
number of host synchronisations torch reported in it (copies to the host, ``.item()``, ...;
synchronisations inside a library's own C++ code are not seen by torch and not counted).
Correctness of every system is checked in modes ``fwd`` / ``fwd+bwd``; this mode times only.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable

import torch

from .. import workloads as wl
from ..compiler.pipeline import compile as compile_mask
from .bench_report import Shape, result_row
from .bench_systems import DTYPE_NAMES, HEAD_DIM, HEADS, _sync, availability

FRESH_WORKLOADS = ("hstu", "shared_prompt")
FRESH_WARMUP = 2
FRESH_STEPS = 8
#: the systems this mode runs (each must also be available)
FRESH_SYSTEMS = (
    "compilemask-triton", "compilemask-cudnn", "compilemask-fa4", "compilemask-auto",
    "flex-triton", "flex-fa4", "cudnn-fe",
)  # fmt: skip


def _ours(backend: str):
    def setup(w, dev):
        return w

    def step(w, q, k, v, dout):
        from ..api.functional import attention

        plan = compile_mask(w.mask, w.N, device=q.device, cache=False)
        attention(q, k, v, plan, backend=backend).backward(dout)

    return setup, step, False


def _flex(kernel_options: dict | None):
    def setup(w, dev):
        from .peers import flex_mask_mod

        return w, flex_mask_mod(w.mask, dev)

    def step(state, q, k, v, dout):
        from torch.nn.attention.flex_attention import create_block_mask

        from .bench_systems import _flex_compiled

        w, mm = state
        bm = create_block_mask(mm, None, None, w.N, w.N, device=q.device)
        flex = _flex_compiled()
        if kernel_options:
            out = flex(q, k, v, block_mask=bm, kernel_options=dict(kernel_options))
        else:
            out = flex(q, k, v, block_mask=bm)
        out.backward(dout)

    return setup, step, False


def _cudnn_fe():
    def setup(w, dev):
        from .peers import cudnn_endpoints

        plan = compile_mask(w.mask, w.N, device=dev, cache=False)
        return cudnn_endpoints(plan, w.B)

    def step(ends, q, k, v, dout):
        from .bench_systems import _cudnn_api

        create_mask_plan, flex_attn_func = _cudnn_api()
        cplan = create_mask_plan(ends, q, k, v, build_backward=True)
        flex_attn_func(q, k, v, mask_plan=cplan).backward(dout)

    return setup, step, True


#: what one step of each system runs (recorded in its row)
NOTES = {
    "compilemask-triton": "compile(cache=False) + attention(backend=triton) + backward",
    "compilemask-cudnn": "compile(cache=False) + attention(backend=cudnn) + backward",
    "compilemask-fa4": "compile(cache=False) + attention(backend=fa4) + backward",
    "compilemask-auto": "compile(cache=False) + attention(backend=auto) + backward",
    "flex-triton": "create_block_mask (eager) + compiled flex_attention + backward",
    "flex-fa4": "create_block_mask (eager) + compiled flex_attention (FLASH) + backward",
    "cudnn-fe": "create_mask_plan on given endpoints + flex_attn_func + backward",
}

STEPS: dict[str, Callable] = {
    "compilemask-triton": lambda: _ours("triton"),
    "compilemask-cudnn": lambda: _ours("cudnn"),
    "compilemask-fa4": lambda: _ours("fa4"),
    "compilemask-auto": lambda: _ours("auto"),
    "flex-triton": lambda: _flex(None),
    "flex-fa4": lambda: _flex({"BACKEND": "FLASH"}),
    "cudnn-fe": _cudnn_fe,
}


def _count_syncs(fn: Callable[[], None]) -> int:
    """Host synchronisations torch reports while ``fn`` runs (``set_sync_debug_mode``)."""
    if not torch.cuda.is_available():
        return 0
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    return sum("synchroniz" in str(c.message) for c in caught)


def fresh_rows(name: str, N0: int, systems, env: dict, options: dict) -> list[dict]:
    """Mode ``fresh`` for workload ``name`` at ``N0`` (see the module docstring): one row per
    system of :data:`FRESH_SYSTEMS` that is among ``systems`` (status ``ok``, ``skipped`` or
    ``error``)."""
    dev = torch.device(options.get("device", "cuda"))
    heads = options.get("heads", HEADS)
    head_dim = options.get("head_dim", HEAD_DIM)
    dtype = options.get("dtype", torch.bfloat16)
    w0 = wl.workload(name, N0)
    shape = Shape(name, N0, w0.N, w0.B, heads, heads, head_dim, DTYPE_NAMES[dtype])
    rows = []
    names = [s.name for s in systems if s.name in FRESH_SYSTEMS]
    avail = availability(tuple(s for s in systems if s.name in names))
    for system in names:

        def row(system=system, **kw):
            return result_row(env, shape, "fresh", system, kind="fresh", **kw)

        if name not in FRESH_WORKLOADS:
            rows.append(row(status="skipped", reason="the mask of this workload draws nothing"))
            continue
        ok, why = avail[system]
        if not ok:
            rows.append(row(status="skipped", reason=why))
            continue
        try:
            rows.append(row(status="ok", **_time_system(system, name, N0, shape, dev, dtype)))
        except Exception as err:  # noqa: BLE001 - one system's failure must not stop the others
            reason = " ".join(f"{type(err).__name__}: {err}".split())[:500]
            rows.append(row(status="error", reason=reason))
        finally:
            torch.cuda.empty_cache() if dev.type == "cuda" else None
    return rows


def _time_system(system: str, name: str, N0: int, shape: Shape, dev, dtype) -> dict:
    setup, step, bshd = STEPS[system]()
    g = torch.Generator(device=dev).manual_seed(0)
    full = (shape.B, shape.Hq, shape.N, shape.D)
    q, k, v, dout = (torch.randn(full, device=dev, dtype=dtype, generator=g) for _ in range(4))
    if bshd:
        q, k, v, dout = (t.transpose(1, 2).contiguous() for t in (q, k, v, dout))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    seed = 0
    times = []
    syncs = None
    for i in range(FRESH_WARMUP + FRESH_STEPS + 1):
        seed += 1
        state = setup(wl.workload(name, N0, seed=seed), dev)  # untimed: drawing the workload
        for t in leaves:
            t.grad = None
        _sync(dev)
        if i == FRESH_WARMUP:  # one step with the synchronisation counter, untimed
            syncs = _count_syncs(lambda s=state: step(s, *leaves, dout))
            _sync(dev)
            continue
        t0 = time.perf_counter()
        step(state, *leaves, dout)
        _sync(dev)
        if i > FRESH_WARMUP:
            times.append((time.perf_counter() - t0) * 1e3)
    return {
        "ms": statistics.median(times), "syncs": syncs, "steps": len(times),
        "step": NOTES.get(system, ""),
    }  # fmt: skip
