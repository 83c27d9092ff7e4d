"""Where the host time of one attention step goes, piece by piece (needs a CUDA GPU).

    PYTHONPATH=src python benchmarks/launch_cost.py --workload shared_prompt --out launch.jsonl

Runs at B = 1 and a short length (``--n``, default 1024), so the GPU work of a step is far
shorter than its host time and a loop of calls without synchronisation measures the host: each
row is the wall time per call of ``--calls`` calls issued back to back (best of ``--rounds``
rounds). Rows:

- ``step fwd+bwd``, ``fwd no_grad``, ``fwd with grad``: ``compilemask.attention`` as a user
  calls it (the backward through ``Tensor.backward``);
- ``attention_forward`` / ``attention_backward``: the kernel modules' launch functions alone
  (no validation, no autograd);
- ``jit <kernel>``: each Triton launch of one step replayed through ``JITFunction.run`` with the
  same arguments (Triton's binder, cache lookup, descriptor encoding and launch);
- ``compiled <kernel>``: the same launch through the compiled kernel's launcher directly
  (``CompiledKernel.run``: no binder or cache lookup; descriptor encoding and launch only);
- ``tma_descriptors``: building the two host TMA descriptors of one launch.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from triton.runtime.jit import JITFunction

import compilemask as cm
from compilemask.kernels.triton import backward as bwd_mod
from compilemask.kernels.triton import forward as fwd_mod
from compilemask.tools.bench_report import environment
from compilemask.workloads import workload


def _per_call_us(fn, calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / calls * 1e6)
    return best


def _record_launches(step) -> list[tuple[JITFunction, tuple, dict]]:
    """The (kernel, args, kwargs) of every Triton launch ``step`` makes."""
    seen = []
    orig = JITFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        seen.append((self, args, dict(kwargs, grid=grid, warmup=warmup)))
        return orig(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = spy
    try:
        step()
        torch.cuda.synchronize()
    finally:
        JITFunction.run = orig
    return seen


def _compiled_launcher(jit: JITFunction, args: tuple, kwargs: dict):
    """A closure launching ``jit``'s compiled kernel for these arguments through
    ``CompiledKernel.run`` (what ``JITFunction.run`` does after its cache lookup)."""
    from triton import knobs
    from triton.runtime.driver import driver

    kw = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
    grid = kwargs["grid"]
    kernel = jit.run(*args, grid=grid, warmup=False, **kw)
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    kw["debug"] = kw.get("debug", jit.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = jit.device_caches[device][4]
    bound_args, _, _ = binder(*args, **kw)
    vals = tuple(bound_args.values())
    g = tuple(grid) + (1, 1)

    def launch():
        md = kernel.launch_metadata(grid, stream, *vals)
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, md,
                   None, None, *vals)  # fmt: skip

    return launch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="shared_prompt")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="append JSON lines here")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="also print cProfile (cumulative) and torch.profiler CPU tables, top N",
    )
    a = ap.parse_args()

    w = workload(a.workload, a.n)
    plan = cm.compile(w.mask, w.N, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, a.heads, w.N, 128)
    q, k, v, do = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
    )
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def step():
        qg.grad = kg.grad = vg.grad = None
        cm.attention(qg, kg, vg, plan, backend="triton").backward(do)

    def fwd_nograd():
        with torch.no_grad():
            cm.attention(q, k, v, plan, backend="triton")

    def fwd_grad():
        cm.attention(qg, kg, vg, plan, backend="triton")

    rows: list[tuple[str, float]] = []
    for name, fn in (("step fwd+bwd", step), ("fwd no_grad", fwd_nograd),
                     ("fwd with grad", fwd_grad)):  # fmt: skip
        fn()
        rows.append((name, _per_call_us(fn, a.calls, a.rounds)))

    # the step with its backward timed from inside the engine (the Function's backward and
    # the launch function it calls), to split the step's backward into engine and our code
    import threading

    from compilemask.api import functional as fmod

    spent = {"backward": 0.0, "impl": 0.0, "n": 0, "thread": None}
    orig_bwd, orig_impl = fmod._EagerAttention.backward, fmod._attention_bwd_impl

    def timed_bwd(ctx, *grads):
        t0 = time.perf_counter()
        res = orig_bwd(ctx, *grads)
        spent["backward"] += time.perf_counter() - t0
        spent["n"] += 1
        spent["thread"] = threading.current_thread() is threading.main_thread()
        return res

    def timed_impl(*args):
        t0 = time.perf_counter()
        res = orig_impl(*args)
        spent["impl"] += time.perf_counter() - t0
        return res

    fmod._EagerAttention.backward, fmod._attention_bwd_impl = staticmethod(timed_bwd), timed_impl
    try:
        step_us = _per_call_us(step, a.calls, 1)
    finally:
        fmod._EagerAttention.backward, fmod._attention_bwd_impl = staticmethod(orig_bwd), orig_impl
    n = max(spent["n"], 1)
    rows.append(("step fwd+bwd (timed inside)", step_us))
    rows.append((f"  Function.backward inside the step (main thread: {spent['thread']})",
                 spent["backward"] / n * 1e6))  # fmt: skip
    rows.append(("  _attention_bwd_impl inside the step", spent["impl"] / n * 1e6))

    # the autograd engine alone: Functions that launch nothing (empty outputs and gradients),
    # with one output (out) or two (out, lse unused: materialised as zeros unless disabled),
    # with q, k, v or 26 tensors saved for the backward
    extra = [torch.empty(64, device="cuda") for _ in range(21)]
    for n_out, n_saved, materialize in ((1, 3, True), (2, 3, True), (2, 3, False),
                                        (2, 26, False)):  # fmt: skip

        class _Null(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, n_out=n_out, n_saved=n_saved, materialize=materialize):
                ctx.set_materialize_grads(materialize)
                ctx.save_for_backward(q, k, v, *extra[: n_saved - 3])
                out = torch.empty_like(q)
                if n_out == 1:
                    return out
                return out, torch.empty(q.shape[:-1], device=q.device)

            @staticmethod
            def backward(ctx, *grads):
                q, k, v, *_ = ctx.saved_tensors
                return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

        def null_step(f=_Null, n_out=n_out):
            qg.grad = kg.grad = vg.grad = None
            o = f.apply(qg, kg, vg)
            (o if n_out == 1 else o[0]).backward(do)

        null_step()
        what = f"null Function step: {n_out} out, {n_saved} saved, materialize {materialize}"
        rows.append((what, _per_call_us(null_step, a.calls, a.rounds)))

    # the kernel modules' launch functions alone, with the arguments of one step
    captured = {}
    orig_f, orig_b = fwd_mod.attention_forward, bwd_mod.attention_backward

    def cap_f(*args, **kwargs):
        captured["fwd"] = (args, kwargs)
        return orig_f(*args, **kwargs)

    def cap_b(*args, **kwargs):
        captured["bwd"] = (args, kwargs)
        return orig_b(*args, **kwargs)

    import compilemask.api.autograd as ag
    import compilemask.api.functional as fn_mod

    patched = [(mod, name, new) for mod in (fwd_mod, bwd_mod, fn_mod, ag)
               for name, new in (("attention_forward", cap_f), ("attention_backward", cap_b))
               if hasattr(mod, name)]  # fmt: skip
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patched]
    for mod, name, new in patched:
        setattr(mod, name, new)
    try:
        step()
    finally:
        for mod, name, old in saved:
            setattr(mod, name, old)
    for key, f in (("fwd", orig_f), ("bwd", orig_b)):
        if key in captured:
            args, kwargs = captured[key]
            rows.append((f"attention_{'forward' if key == 'fwd' else 'backward'}",
                         _per_call_us(lambda f=f, args=args, kwargs=kwargs: f(*args, **kwargs),
                                      a.calls, a.rounds)))  # fmt: skip

    # the same launch function from other threads: a plain Python thread, and the autograd
    # engine's device thread (inside a Function's backward that launches nothing else)
    if "bwd" in captured:
        args, kwargs = captured["bwd"]

        def bwd_once(args=args, kwargs=kwargs):
            orig_b(*args, **kwargs)

        box = {}

        def in_thread():
            box["us"] = _per_call_us(bwd_once, a.calls, a.rounds)

        th = threading.Thread(target=in_thread)
        th.start()
        th.join()
        rows.append(("attention_backward in a Python thread", box["us"]))

        probe = {"t": 0.0, "n": 0}

        class _Probe(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, g):
                t0 = time.perf_counter()
                bwd_once()
                probe["t"] += time.perf_counter() - t0
                probe["n"] += 1
                return g

        def probe_step():
            qg.grad = None
            _Probe.apply(qg).backward(do)

        probe_step()
        probe["t"], probe["n"] = 0.0, 0
        rows.append(("step of a Function whose backward is attention_backward",
                     _per_call_us(probe_step, a.calls, a.rounds)))  # fmt: skip
        rows.append(("  attention_backward inside it (engine thread)",
                     probe["t"] / max(probe["n"], 1) * 1e6))  # fmt: skip

    for jit, args, kwargs in _record_launches(step):
        name = jit.fn.__name__
        kw = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        n_args = len(args) + len(kw)
        rows.append((f"jit {name} ({n_args} args)", _per_call_us(
            lambda jit=jit, args=args, kw=kw, grid=kwargs["grid"]: jit.run(
                *args, grid=grid, warmup=False, **kw), a.calls, a.rounds)))  # fmt: skip
        try:
            launch = _compiled_launcher(jit, args, kwargs)
            rows.append((f"compiled {name}", _per_call_us(launch, a.calls, a.rounds)))
        except Exception as exc:  # report, keep going
            rows.append((f"compiled {name} failed: {str(exc)[:80]}", float("nan")))

    rows.append(("tma_descriptors(k, v)", _per_call_us(
        lambda: fwd_mod.tma_descriptors(k, v, 64, 128), a.calls, a.rounds)))  # fmt: skip
    rows.append(("torch.empty_like(q)", _per_call_us(
        lambda: torch.empty_like(q), a.calls, a.rounds)))  # fmt: skip

    # a step under sync checking: a device-to-host read would show up here
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        sync_note = "no synchronisation"
    except RuntimeError as exc:
        sync_note = f"synchronises: {str(exc).splitlines()[0][:160]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

    if a.profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            step()
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(a.profile)
        print(buf.getvalue())
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as tp:
            for _ in range(20):
                step()
            torch.cuda.synchronize()
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.profile))

    env = environment()
    print(f"# step: {sync_note}")
    print(f"# {a.workload} N={w.N} B=1 H={a.heads} D=128 bf16, host us per call "
          f"(best of {a.rounds} rounds of {a.calls}); {env}")  # fmt: skip
    for name, us in rows:
        print(f"{name:<48} {us:9.1f} us")
    if a.out:
        with open(a.out, "a") as out:
            for name, us in rows:
                out.write(
                    json.dumps(
                        {
                            **env,
                            "workload": a.workload,
                            "N": w.N,
                            "B": 1,
                            "Hq": a.heads,
                            "D": 128,
                            "dtype": "bf16",
                            "kind": "launch_cost",
                            "what": name,
                            "us": us,
                        }
                    )
                    + "\n"
                )


if __name__ == "__main__":
    main()
