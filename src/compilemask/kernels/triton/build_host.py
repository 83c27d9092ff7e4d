"""The host side of the tile builder's launch on a GPU: Triton launches through the compiled
launcher.

On an H200 host a plan build is host-bound (``docs/perf-notes.md``, "Plan building"): the
device work of a 32K build is one launch of about 0.1 ms, the host's Python about 0.15 ms.
``kernel[grid](...)`` (Triton's ``JITFunction.run``) binds and specialises every argument and
builds launch metadata on every call, about 17 us of host time, against 6 us for the compiled
kernel's launcher called directly (:func:`launch`). The first launch of a specialisation goes
through Triton (which compiles it if need be); later ones call the launcher it returned.
"""

from __future__ import annotations

import torch
import triton

# (kernel, current device, specialisation, constants) -> (launcher, function, metadata)
_LAUNCHERS: dict[tuple, tuple] = {}


def launch_hooks() -> bool:
    """Whether a Triton launch hook is set (then every launch goes through Triton's own path,
    which calls it)."""
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    if rt is None:  # a Triton without knobs: taken as hooked (its own launch path)
        return True
    hooks = (getattr(rt, "launch_enter_hook", None), getattr(rt, "launch_exit_hook", None))
    return any(getattr(h, "calls", h) for h in hooks)


def launch(kernel, grid: tuple, device: torch.device, values: tuple, consts: tuple) -> None:
    """``kernel[grid](*values, **dict(consts))``: ``values`` its runtime arguments (tensors and
    ints below 2**63), ``consts`` its ``(name, value)`` constants in the kernel's parameter
    order, after the runtime ones. On a CUDA device without launch hooks, the first launch of
    a specialisation goes through Triton and keeps the compiled kernel's launcher; later ones
    call it with what Triton passes. The key is at least as fine as Triton's specialisation:
    each tensor's 16-byte alignment, each int's value 1, divisibility by 16 and width."""
    if device.type != "cuda" or launch_hooks():
        kernel[grid](*values, **dict(consts))
        return
    index = torch.cuda.current_device()
    key = (kernel, index, consts, *(
        v.data_ptr() % 16 == 0 if isinstance(v, torch.Tensor)
        else (v == 1) + 2 * (v % 16 == 0) + 4 * (v >= 1 << 31)
        for v in values
    ))  # fmt: skip
    hit = _LAUNCHERS.get(key)
    if hit is not None:
        run, function, metadata = hit
        stream = torch._C._cuda_getCurrentRawStream(index)
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
            function, metadata, None, None, None, *values, *(v for _, v in consts))  # fmt: skip
        return
    compiled = kernel[grid](*values, **dict(consts))
    if not isinstance(kernel, triton.runtime.jit.JITFunction):  # a stand-in (a counter, ...)
        return
    try:
        _LAUNCHERS[key] = (compiled.run, compiled.function, compiled.packed_metadata)
    except AttributeError:  # another Triton: its own launch path every time
        pass
