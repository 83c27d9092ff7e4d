"""``torch.fx`` traces of mask_mods, cached by the structure of the function, not its identity.

Users build a new mask_mod per batch (a new closure over new document-id tensors), so a trace
is kept under a key of what it can depend on (:func:`structure`), walked recursively through
the function's closure cells, defaults and the global names its code reads:

* a Python function: its code object (nested code included) and the key of each closure cell,
  default and global it reads (a global not found: a builtin, by identity);
* ``None``, bools, ints, floats (by ``repr``), strings, dtypes, devices: by type and value, so
  a window of 128 and one of 256 are two entries;
* a tensor (exactly ``torch.Tensor``): by dtype, number of dimensions and device -- its values
  and shape are not in the key; the tensor itself is a *leaf*, bound at call time (and which
  leaves are the same object);
* tuples and lists (e.g. the mask_mods of attention-gym's ``and_masks``): element by element;
  ``functools.partial``: its function, arguments and keywords; the modules ``torch`` (its
  names of :data:`TORCH_PURE` only) and ``math``, the builtins of :data:`PURE_BUILTINS` and
  torch's pure functions: by identity.

Anything else has no key and is traced on every call: an object, a dict, a bound method,
another module (``os.environ``, ``random``, a config module: what a trace reads from it would
be frozen), another builtin (``getattr``, ``globals``), an attribute of a function or of a
value other than a tensor, a Python attribute of a tensor (one that ``torch.Tensor`` does not
define), a function, partial or tensor with attributes set on it (read through a local name
they would be frozen), a function that writes a global or imports. A trace is kept only
when it provably reads nothing but its leaves, and those only as inputs of the graph:

* no tensor operation ran on real data while tracing (a dispatch mode counts them), and no
  torch function was called on real tensors alone (a torch-function mode: ``tolist()``,
  ``.shape``, ``len()``, ``.numel()`` of a captured tensor would freeze a value or a shape);
* every ``get_attr`` node of the graph reads a leaf (by identity).

A call whose key is cached gets :class:`Bound`: the cached graph with its ``get_attr`` targets
bound to this call's leaves (the very tensors, read fresh; an in-place update is seen). The
cache is an LRU of :data:`MAX_ENTRIES` keys; an entry (:class:`Template`) holds a copy of the
graph and stand-ins for its tensors, never the tensors of a mask_mod (they are freed when the
caller drops them).
"""

from __future__ import annotations

import builtins
import copy
import dis
import functools
import inspect
import math
import threading
import types
from collections import OrderedDict

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

#: the most traces kept (least recently used dropped first)
MAX_ENTRIES = 128
#: the deepest nesting of closures / containers walked for a key
_MAX_DEPTH = 16

_WRITES = frozenset({"STORE_GLOBAL", "DELETE_GLOBAL", "IMPORT_NAME", "IMPORT_FROM",
                     "STORE_NAME", "DELETE_NAME"})  # fmt: skip
_READS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
_VALUES = (type(None), bool, int, str, torch.dtype, torch.device, torch.layout)
_IDENTITY = (types.ModuleType, types.BuiltinFunctionType)
_CACHE: OrderedDict = OrderedDict()
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


class _RealReads(TorchFunctionMode):
    """Counts torch functions called on real tensors and no proxy (``tolist``, ``.shape``,
    ``len``: reads that do not dispatch)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(type(x) is torch.Tensor or isinstance(x, torch.Tensor) for x in leaves) and not any(
            isinstance(x, torch.fx.Proxy) for x in leaves
        ):
            self.n += 1
        return func(*args, **kwargs)


def _has_random(gm) -> bool:
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            name = node.target if isinstance(node.target, str) else node.target.__name__
            if name in _RANDOM:
                return True
    return False


class _NoKey(Exception):
    pass


#: torch attributes a cached trace may use: tensor operations whose result depends only on
#: their arguments, and dtypes (``torch.get_num_threads()`` or ``torch.nn...`` are not: a
#: trace would freeze what they return)
TORCH_PURE = frozenset({
    "where", "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and",
    "bitwise_or", "bitwise_not", "bitwise_xor", "bitwise_left_shift", "bitwise_right_shift",
    "ones_like", "zeros_like", "full_like", "minimum", "maximum", "min", "max", "abs", "clamp",
    "div", "floor_divide", "remainder", "fmod", "eq", "ne", "lt", "le", "gt", "ge", "add", "sub",
    "mul", "neg", "sign", "searchsorted", "bucketize", "gather", "index_select", "isin",
    "tensor", "as_tensor", "full", "zeros", "ones", "arange", "int8", "int16", "int32", "int64",
    "uint8", "bool", "long", "int", "float", "float16", "bfloat16", "float32", "float64",
})  # fmt: skip
#: builtins a cached trace may call (their result depends only on their arguments)
PURE_BUILTINS = frozenset({
    "abs", "all", "any", "bool", "divmod", "enumerate", "float", "int", "isinstance", "len",
    "list", "max", "min", "pow", "range", "reversed", "round", "sorted", "sum", "tuple", "zip",
})  # fmt: skip
_PURE_MODULES = {"torch": TORCH_PURE, "math": None}  # None: every attribute


@functools.lru_cache(maxsize=1024)  # code objects are immutable (a scan costs ~0.2 ms)
def _code_reads(code: types.CodeType):
    """``(names, attrs)``: the global names ``code`` (nested code included) reads, and per
    global or closure name the attributes loaded right after it (``cfg.W``, ``torch.where``);
    None when it writes a global, imports, or loads an attribute of a name in nested code."""
    names, attrs, prev = [], {}, None
    for ins in dis.get_instructions(code):
        if ins.opname in _WRITES:
            return None
        if ins.opname in _READS:
            names.append(ins.argval)
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and prev is not None:
            attrs.setdefault(prev, set()).add(ins.argval)
        prev = ins.argval if ins.opname in _READS or ins.opname == "LOAD_DEREF" else None
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            inner = _code_reads(c)
            if inner is None or inner[1]:
                return None
            names.extend(inner[0])
    return tuple(dict.fromkeys(names)), {k: frozenset(v) for k, v in attrs.items()}


def _check_use(v, attrs) -> None:
    """Raise :class:`_NoKey` unless reading ``attrs`` of ``v`` (a global or closure value)
    gives the same thing whatever the call: a pure module's allowed names, or anything of a
    tensor (value reads of tensors are caught while tracing)."""
    if not attrs:
        return
    if type(v) is torch.Tensor:  # its methods and properties, not Python attributes of its own
        if all(hasattr(torch.Tensor, a) for a in attrs):
            return
        raise _NoKey
    if isinstance(v, types.ModuleType):
        allowed = _PURE_MODULES.get(v.__name__, ())
        if allowed is None or (allowed and attrs <= allowed):
            return
    raise _NoKey


def _pure(v) -> bool:
    """A module or builtin function whose use does not depend on state: ``torch``, ``math``
    and its functions, :data:`PURE_BUILTINS`, ``torch`` functions of :data:`TORCH_PURE`."""
    if isinstance(v, types.ModuleType):
        return v.__name__ in _PURE_MODULES
    name = getattr(v, "__name__", None)
    if getattr(v, "__module__", None) == "math":  # math.floor, ... imported by name
        return getattr(math, name, None) is v
    return (name in PURE_BUILTINS and getattr(builtins, name, None) is v) or (
        name in TORCH_PURE and getattr(torch, name, None) is v
    )


def _walk(v, leaves: list, depth: int):
    if depth > _MAX_DEPTH:
        raise _NoKey
    t = type(v)
    if t in _VALUES:
        return (t, v)
    if t is float:
        return (t, repr(v))
    if t is torch.Tensor:
        if v.__dict__:  # Python attributes set on it: a trace would freeze what it reads there
            raise _NoKey
        same = next((i for i, x in enumerate(leaves) if x is v), -1)
        leaves.append(v)
        return ("tensor", v.dtype, v.dim(), v.device, same)
    if t is tuple or t is list:
        return (t, tuple(_walk(x, leaves, depth + 1) for x in v))
    if t is types.FunctionType:
        reads = _code_reads(v.__code__)
        # attributes set on the function (``cfg.window = 4`` on a function used as a settings
        # holder): read through a local name they would be frozen into the trace
        if reads is None or v.__dict__:
            raise _NoKey
        names, attrs = reads
        key = [v.__code__, _walk(v.__defaults__, leaves, depth + 1)]
        kw = v.__kwdefaults__ or {}
        key.append(tuple((k, _walk(kw[k], leaves, depth + 1)) for k in sorted(kw)))
        for name, cell in zip(v.__code__.co_freevars, v.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                raise _NoKey from None
            _check_use(value, attrs.get(name))
            key.append(_walk(value, leaves, depth + 1))
        g = v.__globals__
        for name in names:
            if name in g:
                _check_use(g[name], attrs.get(name))
                key.append(_walk(g[name], leaves, depth + 1))
            elif hasattr(builtins, name) and _pure(getattr(builtins, name)) and not attrs.get(name):
                key.append(("builtin", name))
            else:
                raise _NoKey
        return tuple(key)
    if t is functools.partial:
        if getattr(v, "__dict__", None):  # attributes set on the partial, as on a function
            raise _NoKey
        kw = v.keywords
        return ("partial", _walk(v.func, leaves, depth + 1), _walk(v.args, leaves, depth + 1),
                tuple((k, _walk(kw[k], leaves, depth + 1)) for k in sorted(kw)))  # fmt: skip
    if isinstance(v, _IDENTITY) and _pure(v):
        return ("same", v)
    raise _NoKey


def structure(fn):
    """``(key, leaves)``: the hashable key of what a trace of ``fn`` may depend on and the
    tensors it captures (in walk order), or None when something in it has no key."""
    if type(fn) is not types.FunctionType and type(fn) is not functools.partial:
        return None
    leaves: list = []
    try:
        key = _walk(fn, leaves, 0)
        hash(key)
    except (_NoKey, TypeError, RecursionError):
        return None
    return key, leaves


def _attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


class Template:
    """A cached trace without the tensors of the mask_mod it was traced from: a copy of its
    ``graph`` (not owned by the traced module, which holds those tensors) and, per
    ``get_attr`` target, a stand-in of the same dtype, shape and device (one element,
    expanded; never read). A call binds its own tensors (:class:`Bound`)."""

    def __init__(self, gm, targets: dict):
        self.graph = copy.deepcopy(gm.graph)
        self.stand_ins = {}
        for t in targets:
            real = _attr(gm, t)
            one = torch.empty((), dtype=real.dtype, device=real.device)
            self.stand_ins[t] = one.expand(real.shape)

    def __getattr__(self, name):  # only for names not set in __init__
        stand_ins = self.__dict__.get("stand_ins", {})
        if name in stand_ins:
            return stand_ins[name]
        raise AttributeError(name)


class Bound:
    """A cached trace ``template`` (:class:`Template`) with its ``get_attr`` targets bound to
    this call's tensors: ``graph`` is the template's, ``getattr(bound, target)`` the tensor of
    this call; ``swap`` maps ``id`` of a template stand-in to this call's tensor."""

    def __init__(self, template, attrs: dict, swap: dict):
        self.template, self.graph, self.attrs, self.swap = template, template.graph, attrs, swap

    def __getattr__(self, name):  # only for names not set in __init__
        attrs = self.__dict__["attrs"]
        if name in attrs:
            return attrs[name]
        return getattr(self.__dict__["template"], name)


def _targets(gm, leaves: list) -> dict | None:
    """``{get_attr target: leaf index}``, or None when a target is not a leaf."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            obj = _attr(gm, node.target)
            i = next((i for i, x in enumerate(leaves) if x is obj), None)
            if i is None:
                return None
            out[node.target] = i
    return out


def _bind(entry, leaves: list) -> Bound:
    template, targets = entry
    attrs = {t: leaves[i] for t, i in targets.items()}
    swap = {id(template.stand_ins[t]): attrs[t] for t in targets}
    return Bound(template, attrs, swap)


def _four_positional(fn) -> bool:
    """``fn`` is a plain function of exactly ``(b, h, q_idx, kv_idx)``: no other parameter,
    no ``*args`` / ``**kwargs``."""
    code = fn.__code__
    varargs = code.co_flags & (inspect.CO_VARARGS | inspect.CO_VARKEYWORDS)
    return code.co_argcount == 4 and not code.co_kwonlyargcount and not varargs


def _has_hooks(module) -> bool:
    return any(
        getattr(module, name, None)
        for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")
    ) or bool(getattr(torch.nn.modules.module, "_global_forward_hooks", None))


def as_traced_function(fn):
    """What ``torch.fx`` traces for ``fn``: ``fn`` itself when it is a plain function of
    ``(b, h, q_idx, kv_idx)``, else (a ``functools.partial``, a function with more parameters
    that have defaults, an object with ``__call__``, a bound method) a function of those four
    that calls it, so the trace has the four placeholders of a mask_mod and the bound values
    (an object's attributes too) enter it as captured ones. Only plain functions and
    partials have a :func:`structure` key: the others are traced again on every call."""
    if type(fn) is types.FunctionType and _four_positional(fn):
        return fn
    call = fn
    if isinstance(fn, torch.nn.Module) and not _has_hooks(fn):
        call = fn.forward  # torch.fx records a call of a module outside its root as a failure

    def mask_mod(b, h, q_idx, kv_idx):
        return call(b, h, q_idx, kv_idx)

    return mask_mod


def symbolic_trace(fn, state=False):
    """``torch.fx.symbolic_trace(fn)``, or the cached trace of a mask_mod of the same
    structure (:func:`structure`) bound to ``fn``'s tensors (:class:`Bound`). A
    ``functools.partial`` or a function with extra parameters that have defaults is traced
    as a function of ``(b, h, q_idx, kv_idx)`` calling it (:func:`as_traced_function`).

    ``state``: ``structure(fn)`` when the caller has it already.

    Raises:
        whatever ``torch.fx.symbolic_trace`` raises; RuntimeError: the mask_mod draws random
            numbers (a trace would freeze one draw).
    """
    import torch.fx

    state = structure(fn) if state is False else state
    if state is not None:
        with _LOCK:
            entry = _CACHE.get(state[0])
            if entry is not None:
                _CACHE.move_to_end(state[0])
        if entry is not None:
            return _bind(entry, state[1])
    ops, reads = _RealOps(), _RealReads()
    with ops, reads:
        gm = torch.fx.symbolic_trace(as_traced_function(fn))
    if ops.random or _has_random(gm):
        raise RuntimeError("the mask_mod draws random numbers")
    if state is not None and ops.n == 0 and reads.n == 0:
        targets = _targets(gm, state[1])
        if targets is not None:
            with _LOCK:
                _CACHE[state[0]] = (Template(gm, targets), targets)
                while len(_CACHE) > MAX_ENTRIES:
                    _CACHE.popitem(last=False)
    return gm


def is_cached(key) -> bool:
    """Whether a trace is cached under structural ``key`` (``structure(fn)[0]``)."""
    with _LOCK:
        return key in _CACHE


def clear() -> None:
    """Drops every cached trace."""
    with _LOCK:
        _CACHE.clear()
