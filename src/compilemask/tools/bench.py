"""``compilemask bench``: CompileMask beside its peers on the seed workloads, on one GPU.

For each seed workload at each nominal size (one *case*), in one process: compile the plan,
draw random normal bf16 inputs (B = 32768 // N0 rows, 16 heads, head_dim 128, the same for
every system), then for each mode (``fwd``, ``fwd+bwd``) and each system of :data:`SYSTEMS`:

1. skip it, with the reason, when it does not import, needs another GPU, or does not apply
   (FA4 / SDPA run dense causal only; the reference runs only up to N = 4096);
2. prepare it (Flex: ``create_block_mask`` on the natural ``mask_mod``; cuDNN: its plan from our
   intervals) and check it against the float64 reference on the first 2 heads by the measure of
   docs/design.md (forward output; in ``fwd+bwd`` also dq, dk, dv); a failing system is
   reported and not timed;
3. time it with ``triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")``
   (``fwd+bwd``: ``out = fn(); out.backward(dout)``, gradients reset between steps).

Mode ``plan`` times plan building (:mod:`compilemask.tools.bench_plan`); mode ``fresh`` a
training step on a mask drawn anew every step (:mod:`compilemask.tools.bench_fresh`).

Rows go to JSON lines (:mod:`compilemask.tools.bench_report`) as they are measured.

Legend: B batch rows, H heads (Hq = Hkv), N tokens per row, D head_dim; BHSD = [B, H, N, D]
(ours, Flex, SDPA), BSHD = [B, N, H, D] (cuDNN-frontend, FA4).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

from ..testing import check_close
from .bench_report import effective_tflops, result_row
from .bench_systems import (  # noqa: F401 - re-exported: the registry lives there
    CHECK_HEADS,
    DTYPE,
    DTYPE_NAMES,
    HEAD_DIM,
    HEADS,
    REFERENCE_MAX_N,
    SMOKE_ENV,
    SYSTEM_NAMES,
    SYSTEMS,
    Case,
    Runner,
    System,
    _bhsd_leaves,
    _bshd_leaves,
    _compilemask,
    _sync,
    availability,
    case_options,
    flex_block_mask,
    make_case,
    score_mod_of,
    visible_pairs,
)

# ------------------------------------------------------------------------------ checking


def references(case: Case, bwd: bool, score_mod: str | None = None) -> dict:
    """float64 and same-dtype references on the first :data:`CHECK_HEADS` heads (cached):
    ``out64, outdt`` and, with ``bwd``, ``grads64, gradsdt`` (dq, dk, dv); with
    ``score_mod`` (a :data:`~.bench_systems.SCORE_MODS` name) those of the modified scores."""
    from ..kernels.reference import reference_attention, reference_attention_backward

    h = CHECK_HEADS if case.plan.heads is None else case.q.shape[1]
    if score_mod is not None:
        return _modded_references(case, bwd, score_mod, h)
    refs = case.cache.setdefault("refs", {})
    dtype = case.q.dtype
    q, k, v, do = (t[:, :h] for t in (case.q, case.k, case.v, case.dout))
    if "out64" not in refs:
        refs["out64"] = reference_attention(q, k, v, case.plan, compute_dtype=torch.float64)[0]
        refs["outdt"] = reference_attention(
            q, k, v, case.plan, compute_dtype=torch.float32, matmul_dtype=dtype
        )[0]
    if bwd and "grads64" not in refs:
        refs["grads64"] = reference_attention_backward(
            q, k, v, case.plan, do, compute_dtype=torch.float64
        )
        refs["gradsdt"] = reference_attention_backward(
            q, k, v, case.plan, do, compute_dtype=torch.float32, matmul_dtype=dtype
        )
    refs["heads"], refs["dtype"] = h, dtype
    return refs


def _modded_references(case: Case, bwd: bool, name: str, h: int) -> dict:
    """:func:`references` with the score modifier ``name``, through torch autograd of the
    reference (its explicit backward takes no modifier)."""
    from ..kernels.reference import reference_attention

    refs = case.cache.setdefault(("refs", name), {})
    dtype = case.q.dtype
    mod = score_mod_of(name, case.q.shape[1], case.device, first=h)
    for tag, cd, mm in (("64", torch.float64, None), ("dt", torch.float32, dtype)):
        if f"out{tag}" in refs and (not bwd or f"grads{tag}" in refs):
            continue
        leaf = torch.float64 if cd == torch.float64 else dtype  # float64 gradients for ref64
        q, k, v = (t[:, :h].detach().to(leaf).requires_grad_(bwd) for t in (case.q, case.k, case.v))
        with torch.set_grad_enabled(bwd):
            out, _ = reference_attention(
                q, k, v, case.plan, compute_dtype=cd, matmul_dtype=mm, score_mod=mod
            )
        refs[f"out{tag}"] = out.detach()
        if bwd:
            refs[f"grads{tag}"] = torch.autograd.grad(
                out, (q, k, v), case.dout[:, :h].to(out.dtype)
            )
    refs["heads"], refs["dtype"] = h, dtype
    return refs


def check_runner(runner: Runner, refs: dict, bwd: bool) -> tuple[bool, float, float, dict]:
    """Run ``runner`` once (forward, or forward+backward) and apply docs/design.md's check.

    Returns:
        (ok, err, bound, detail): the worst error over out (and dq, dk, dv), its bound, and
        ``{name: [err, bound]}`` per checked tensor.
    """
    h = refs["heads"]
    checks = {}
    if bwd:
        for t in runner.leaves:
            t.grad = None
        out = runner.fn()
        out.backward(runner.dout)
        _sync(out.device)
        tensors = {"out": out.detach()}
        tensors.update(zip(("dq", "dk", "dv"), (t.grad for t in runner.leaves)))
        wanted = {"out": (refs["out64"], refs["outdt"])}
        wanted.update(zip(("dq", "dk", "dv"), zip(refs["grads64"], refs["gradsdt"])))
    else:
        with torch.no_grad():
            tensors = {"out": runner.fn()}
        wanted = {"out": (refs["out64"], refs["outdt"])}
    verdicts = []
    for name, got in tensors.items():
        r64, rdt = wanted[name]
        ok, err, bound = check_close(runner.to_bhsd(got)[:, :h], r64, rdt, refs["dtype"])
        checks[name] = [err, bound]
        badness = math.inf if math.isnan(err) else err / bound
        verdicts.append((not ok, badness, ok, err, bound))
    if bwd:
        for t in runner.leaves:
            t.grad = None
    _, _, _, err, bound = max(verdicts)  # a failing tensor first, then the closest to its bound
    return all(v[2] for v in verdicts), err, bound, checks


def time_ms(runner: Runner, bwd: bool) -> float:
    """Median milliseconds of one call (``triton.testing.do_bench``, warmup 25, rep 100; on
    the CPU smoke run the median of 3 ``perf_counter`` calls)."""
    if runner.leaves[0].device.type != "cuda":
        return _time_cpu(runner, bwd)
    from triton.testing import do_bench

    if not bwd:

        def call():
            with torch.no_grad():
                runner.fn()

        return float(do_bench(call, warmup=25, rep=100, return_mode="median"))

    def step():
        runner.fn().backward(runner.dout)

    grads = list(runner.leaves)
    return float(do_bench(step, warmup=25, rep=100, grad_to_none=grads, return_mode="median"))


def _time_cpu(runner: Runner, bwd: bool) -> float:
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        if bwd:
            runner.fn().backward(runner.dout)
        else:
            with torch.no_grad():
                runner.fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------------ measuring


def measure(system: System, case: Case, mode: str, env: dict, check: bool = True) -> dict:
    """One results row: ``system`` on ``case`` in ``mode`` (skipped, failed, error or timed)."""
    shape, bwd = case.shape, mode == "fwd+bwd"

    def row(**kw):
        return result_row(env, shape, mode, system.name, kind="speed", **kw)

    for probe in (
        lambda: system.applies(case.workload.name, case.workload.N),
        lambda: (system.supports_bwd or not bwd, "has no backward"),
        lambda: availability((system,))[system.name],
    ):
        ok, why = probe()
        if not ok:
            return row(status="skipped", reason=why)
    extra = {"pairs": case.pairs}
    if system.name.startswith("compilemask"):
        extra["plan_bytes"] = int(case.plan.nbytes)
    runner = None
    try:
        refs = (
            references(case, bwd, system.score_mod) if check else None
        )  # shared by the systems of a case
        t0 = time.perf_counter()
        runner = system.prepare(case, bwd)
        err = bound = None
        if refs is not None:
            ok, err, bound, detail = check_runner(runner, refs, bwd)
            extra.update(bound=bound, errors=detail)
            if not ok:
                return row(rel_err=err, status="failed", **extra)
        else:
            check_runner_free(runner, bwd)
        extra["prepare_s"] = round(time.perf_counter() - t0, 2)
        ms = time_ms(runner, bwd)
        B, H, _, D = case.q.shape
        tflops = effective_tflops(B, H, D, case.pairs, ms, mode)
        return row(ms=ms, tflops=tflops, rel_err=err, status="ok", **extra)
    except Exception as err:  # noqa: BLE001 - one system's failure must not stop the others
        reason = f"{type(err).__name__}: {err}"
        return row(status="error", reason=" ".join(reason.split())[:500], **extra)
    finally:
        del runner
        torch.cuda.empty_cache()


def check_runner_free(runner: Runner, bwd: bool) -> None:
    """One unchecked call (compiles and warms up) for ``--no-check`` runs."""
    if bwd:
        runner.fn().backward(runner.dout)
        for t in runner.leaves:
            t.grad = None
    else:
        with torch.no_grad():
            runner.fn()
    _sync(runner.leaves[0].device)


def run_case(
    name: str,
    N0: int,
    modes: tuple[str, ...],
    systems: tuple[System, ...],
    env: dict,
    emit: Callable[[dict], None],
    check: bool = True,
) -> None:
    """Measure one (workload, size) in this process; ``emit`` receives each row as it is
    made (the caller writes and prints it)."""
    from .bench_fresh import fresh_rows
    from .bench_plan import plan_rows

    if "fresh" in modes:
        for r in fresh_rows(name, N0, systems, env, case_options()):
            emit(r)
        if not set(modes) - {"fresh"}:
            return
    case = make_case(name, N0, **case_options())
    if "plan" in modes:
        for r in plan_rows(case, env):
            emit(r)
    for mode in ("fwd", "fwd+bwd"):
        if mode not in modes:
            continue
        for system in systems:
            emit(measure(system, case, mode, env, check))
