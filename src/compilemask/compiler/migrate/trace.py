"""``torch.fx`` traces of mask_mods, kept per function while nothing they depend on changed.

A trace is reused only when it provably depends on nothing but what :func:`_state` records:

* ``mask_mod`` is a plain Python function without defaults whose code (and nested code) reads
  no global name (``LOAD_GLOBAL``/``LOAD_NAME``/``IMPORT_NAME``): it sees only its arguments
  and its closure;
* its closure holds only ``None``, bools, ints, floats, strings and plain (non-inference)
  tensors; the state is the code object, each closure object by identity (held by the entry,
  so an identity cannot be reused) and, for a tensor, its shape, dtype, device and version
  counter (an in-place update traces again: ``tolist()`` reads values without a dispatched
  operation, so a trace may hold them);
* the trace ran no tensor operation on real data (a dispatch mode watches it): the graph
  reads each captured tensor itself (its ``get_attr`` nodes hold the very objects), so no
  value of a captured tensor -- nor anything computed from one -- is kept; a tensor updated in
  place is read fresh by the next call.

Anything else is traced on every call. Entries live as long as their function (weak keys).
"""

from __future__ import annotations

import dis
import functools
import threading
import types
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL",
                         "IMPORT_NAME", "STORE_NAME", "DELETE_NAME"})  # fmt: skip
_SCALARS = (type(None), bool, int, float, str)
_TRACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


#: random functions and methods as an fx graph records them (a mask is a function of the
#: indices: FlexAttention's vmap refuses these, so does the evaluation here)
_RANDOM = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "bernoulli", "bernoulli_", "normal", "normal_", "uniform_", "multinomial", "poisson",
    "dropout", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
})  # fmt: skip


class _RealOps(TorchDispatchMode):
    """Counts tensor operations run on real data (proxies of the trace do not dispatch) and
    notes random ones."""

    def __init__(self):
        super().__init__()
        self.n = 0
        self.random = False

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.n += 1
        self.random |= torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


def _has_random(gm) -> bool:
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            name = node.target if isinstance(node.target, str) else node.target.__name__
            if name in _RANDOM:
                return True
    return False


@functools.lru_cache(maxsize=1024)  # code objects are immutable (a scan costs ~0.2 ms)
def _reads_globals(code: types.CodeType) -> bool:
    if any(ins.opname in _GLOBAL_OPS for ins in dis.get_instructions(code)):
        return True
    return any(isinstance(c, types.CodeType) and _reads_globals(c) for c in code.co_consts)


def _state(fn):
    """``(key, objects)`` of what a trace of ``fn`` depends on, or None (not cacheable)."""
    if type(fn) is not types.FunctionType or fn.__defaults__ or fn.__kwdefaults__:
        return None
    code = fn.__code__
    if _reads_globals(code):
        return None
    key, objs = [code], []
    for cell in fn.__closure__ or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            return None
        if type(v) in _SCALARS:
            key.append((type(v), v))
        elif type(v) is torch.Tensor and not v.is_inference():
            # the version counter too: a value read outside the dispatcher (``tolist()``) is
            # frozen into the trace, so an in-place update must trace again
            key.append((tuple(v.shape), v.dtype, v.device, v._version))
        else:
            return None
        objs.append(v)
    return tuple(key), objs


def symbolic_trace(fn):
    """``torch.fx.symbolic_trace(fn)``, reused for ``fn`` while :func:`_state` is unchanged.

    Raises:
        whatever ``torch.fx.symbolic_trace`` raises; RuntimeError: the mask_mod draws random
            numbers (a trace would freeze one draw).
    """
    import torch.fx

    state = _state(fn)
    if state is not None:
        with _LOCK:
            hit = _TRACES.get(fn)
        if hit is not None and hit[0] == state[0] and all(a is b for a, b in zip(hit[1], state[1])):
            return hit[2]
    watch = _RealOps()
    with watch:
        gm = torch.fx.symbolic_trace(fn)
    if watch.random or _has_random(gm):
        raise RuntimeError("the mask_mod draws random numbers")
    if state is not None and watch.n == 0:
        with _LOCK:
            _TRACES[fn] = (state[0], state[1], gm)
    return gm
