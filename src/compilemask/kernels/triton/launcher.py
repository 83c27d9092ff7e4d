"""Launch our Triton kernels through their compiled launcher once their specialization is known.

``kernel[grid](*args, **kwargs)`` runs ``JITFunction.run``: Triton's binder specializes every
argument, builds a cache key from the result, looks the compiled kernel up, builds launch
metadata and only then calls the compiled kernel's launcher (18-87 us per launch on an H200
host against 7-28 us for the launcher alone: ``docs/perf-notes.md``, "Host overhead").

:func:`install` gives a kernel a per-kernel table from a launch key to the compiled kernel
that ``JITFunction.run`` picked for arguments of that key; a later launch with the same key
calls that kernel's launcher directly, with the same arguments ``JITFunction.run`` would pass.
The launch key (:func:`launch_key`) is at least as strict as Triton 3.6's specialization
(``create_function_from_signature`` / ``native_specialize_impl`` in ``triton/runtime/jit.py``):

- an int that is not a constexpr: its value (Triton: its width class i32 / i64 / u64,
  divisibility by 16 and value == 1, all functions of the value);
- a tensor: its dtype and whether its data pointer is 16-byte aligned (Triton: the dtype, and
  the alignment unless ``do_not_specialize_on_alignment``);
- a float: its type (Triton: ``fp32``, not specialized on the value); a bool: its value;
  None: None; any other object (a host TMA descriptor): Triton's own ``native_specialize_impl``
  with every specialization on;
- a constexpr: its value (ints, floats, bools, strings, None only; anything else launches
  through ``JITFunction.run``);
- the keyword names, the current device, ``knobs.runtime.debug`` and the kernel's ``debug``,
  ``knobs.compilation.instrumentation_mode`` (Triton's options besides the keywords).

Two launches with equal keys therefore get the same specialization from Triton
(``tests/test_launcher.py`` checks this against Triton's binder over a matrix of inputs).
Everything else goes through ``JITFunction.run`` unchanged: warmups, callable grids, pre-run
hooks, launch enter / exit hooks, a changed global of the kernel (Triton raises), a kernel
still compiling asynchronously, calls while ``torch.compile`` traces, and the interpreter
(``TRITON_INTERPRET=1`` makes kernels ``InterpretedFunction``: :func:`install` leaves them).
``COMPILEMASK_TRITON_LAUNCHER=0`` in the environment at install time keeps Triton's path.
"""

from __future__ import annotations

import itertools
import operator
import os

import torch
from triton import knobs
from triton.compiler import CompiledKernel
from triton.knobs import HookChain
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

ENV = "COMPILEMASK_TRITON_LAUNCHER"
#: entries per kernel before its table is cleared (keys hold int arguments by value)
MAX_ENTRIES = 256
_Tensor = torch.Tensor


def launch_key(kernel: JITFunction, args: tuple, kwargs: dict, device: int = 0) -> tuple | None:
    """The launch key of ``kernel[grid](*args, **kwargs)`` on CUDA device ``device``, or None
    when an argument has no key (the launch then goes through ``JITFunction.run``).

    The argument types (and keyword names) select a layout, made once per kernel and types,
    that splits the arguments by kind with C-level getters, so a key costs a few tuple
    builds instead of a Python step per argument."""
    layouts = kernel.__dict__.get("_launch_layouts")
    if layouts is None:
        layouts = kernel._launch_layouts = {}
    sig = (tuple(map(type, args)), tuple(kwargs), tuple(map(type, kwargs.values())))
    layout = layouts.get(sig, _MISSING)
    if layout is _MISSING:
        layout = layouts[sig] = _layout(kernel, *sig)
    if layout is None:
        return None
    values, tensors_of, others, kw_tensors, kw_others = layout
    tensors = tensors_of(args)
    kw = tuple(kwargs.values())
    specs = [_other(args[i], kernel, device) for i in others]
    specs += [_other(kw[j], kernel, device) for j in kw_others]
    if _MISSING in specs:
        return None
    if kw_tensors or kw_others:  # keyed like positional ones, not by value
        tensors = (*tensors, *(kw[j] for j in kw_tensors))
        kw = tuple(None if j in kw_tensors or j in kw_others else x for j, x in enumerate(kw))
    rt = knobs.runtime
    return (
        device, rt.debug, kernel.debug, knobs.compilation.instrumentation_mode, sig,
        values(args), tuple(map(_DTYPE, tensors)),
        tuple(map(operator.and_, map(_DATA_PTR, tensors), _FIFTEEN)), kw, *specs,
    )  # fmt: skip


_MISSING = object()
_DTYPE = operator.attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr
_FIFTEEN = itertools.repeat(15)
_SCALARS = (int, float, bool, str, type(None))


def _getter(positions: list[int]):
    if not positions:
        return lambda a: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda a: (a[i],)
    return operator.itemgetter(*positions)


def _layout(kernel: JITFunction, types: tuple, names: tuple, kwtypes: tuple):
    """``(values getter, tensors getter, positions of other objects, positions of keyword
    tensors, positions of other keyword objects)`` for launches with these argument types, or
    None (no key: a constexpr given an object that is not a scalar).

    Keyed by value: ints (Triton specializes on their width, divisibility by 16 and == 1),
    bools, constexprs (ints, floats, bools, strings, None) and every keyword (constexprs and
    options). Keyed by type alone: floats and None that are not constexprs (Triton: ``fp32``
    and ``constexpr None``, no value). Tensors: dtype and data pointer mod 16. Other objects
    (host TMA descriptors): Triton's ``native_specialize_impl``."""
    kw_tensors = frozenset(j for j, t in enumerate(kwtypes) if t is _Tensor)
    kw_others = tuple(j for j, t in enumerate(kwtypes) if t not in _SCALARS and t is not _Tensor)
    constexpr_names = {kernel.params[i].name for i in kernel.constexprs}
    if any(names[j] in constexpr_names for j in (*kw_tensors, *kw_others)):
        return None
    constexprs = set(kernel.constexprs)
    values, tensors, others = [], [], []
    for i, t in enumerate(types):
        if i in constexprs:
            if t not in _SCALARS:
                return None
            values.append(i)
        elif t is int or t is bool:
            values.append(i)
        elif t is _Tensor:
            tensors.append(i)
        elif t is not float and t is not type(None):
            others.append(i)
    return _getter(values), _getter(tensors), tuple(others), kw_tensors, frozenset(kw_others)


def _other(a, kernel: JITFunction, device: int):
    """Triton's own specialization of ``a`` (every kind on), or ``_MISSING`` when Triton
    cannot specialize it (no key: ``JITFunction.run`` raises its own error)."""
    from triton._C.libtriton import native_specialize_impl

    try:
        return native_specialize_impl(kernel.device_caches[device][3], a, False, True, True)
    except Exception:
        return _MISSING


class CachedLaunchJIT(JITFunction):
    """A :class:`JITFunction` whose ``run`` launches through the compiled kernel's launcher
    when the launch key was seen before (:func:`install` makes a kernel one)."""

    def run(self, *args, grid, warmup, **kwargs):
        table = self.__dict__.get("_launches")
        if (
            warmup
            or table is None
            or self.pre_run_hooks
            or callable(grid)
            or torch.compiler.is_compiling()
        ):
            return JITFunction.run(self, *args, grid=grid, warmup=warmup, **kwargs)
        rt = knobs.runtime
        enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
        if (
            type(enter) is not HookChain
            or enter.calls
            or type(leave) is not HookChain
            or leave.calls
        ):
            return JITFunction.run(self, *args, grid=grid, warmup=warmup, **kwargs)
        device = driver.active.get_current_device()
        key = launch_key(self, args, kwargs, device)
        entry = None if key is None else table.get(key)
        if entry is None or not _globals_unchanged(self):
            kernel = JITFunction.run(self, *args, grid=grid, warmup=warmup, **kwargs)
            if key is not None and type(kernel) is CompiledKernel:
                if len(table) >= MAX_ENTRIES:
                    table.clear()
                table[key] = (kernel, self._tail(len(args)))
            return kernel
        kernel, tail = entry
        stream = driver.active.get_current_stream(device)
        n = len(grid)
        kernel.run(
            grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, kernel.function,
            kernel.packed_metadata, None, None, None, *args, *tail(kwargs),
        )  # fmt: skip
        return kernel

    def _tail(self, n_args: int):
        """A function of the launch's keywords giving the values of the parameters after the
        ``n_args`` positional ones, in signature order (defaults where not given), as Triton's
        binder does; options (num_warps, ...) are not parameters and are left out."""
        rest = [(p.name, p.default) for p in self.params[n_args:]]
        names = [n for n, _ in rest]

        def tail(kw: dict) -> list:
            return [kw[n] if n in kw else d for n, d in rest]

        if len(names) < 2:
            return tail
        get = operator.itemgetter(*names)

        def given(kw: dict):  # every parameter given by keyword: one C-level getter
            try:
                return get(kw)
            except KeyError:
                return tail(kw)

        return given


def _globals_unchanged(kernel: JITFunction) -> bool:
    """Triton's check that the globals the kernel read at compile time still hold."""
    missing = object()
    for (name, _), (val, globals_dict) in kernel.used_global_vals.items():
        if globals_dict.get(name, missing) != val:
            return False
    return True


def install(kernel) -> bool:
    """Make the plain :class:`JITFunction` ``kernel`` launch through its compiled launcher on
    later launches of a seen key (in place: every ``kernel[grid](...)`` site uses it). Leaves
    interpreted, autotuned or heuristics-wrapped kernels alone, and every kernel when
    ``COMPILEMASK_TRITON_LAUNCHER=0``. Returns whether ``kernel`` launches through the table."""
    if type(kernel) is CachedLaunchJIT:
        return True
    if type(kernel) is not JITFunction or os.environ.get(ENV, "1") == "0":
        return False
    kernel.__class__ = CachedLaunchJIT
    kernel._launches = {}
    return True
