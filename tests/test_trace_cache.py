"""The structural trace cache of ``from_mask_mod`` (``compiler/migrate/trace.py``): a new
closure over new tensors of the same kind reuses the trace and gives the mask a fresh trace
gives; different captured scalars, code, dtypes or aliasing do not share an entry."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import and_masks, create_mask, or_masks

import compilemask as cm
import flex_masks as fm
from compilemask.compiler.migrate import trace


def flex_dense(mask_mod, n):
    return create_mask(mask_mod, None, None, n, n, device="cpu")[0, 0]


@pytest.fixture(autouse=True)
def empty_cache():
    trace.clear()
    yield
    trace.clear()


def _key(fn):
    state = trace.structure(fn)
    assert state is not None
    return state[0]


def _window(w):
    return lambda b, h, q, k: (q - k).abs() <= w


def test_captured_scalars_are_part_of_the_key():
    assert _key(_window(128)) != _key(_window(256))
    assert _key(_window(128)) == _key(_window(128))
    assert _key(_window(2)) != _key(_window(2.0))  # an int and a float are two entries
    a, b = _window(3), _window(5)
    got_a = cm.from_mask_mod(a, 64, block_m=16, block_n=16)
    got_b = cm.from_mask_mod(b, 64, block_m=16, block_n=16)
    assert torch.equal(got_a.to_dense(), flex_dense(a, 64))
    assert torch.equal(got_b.to_dense(), flex_dense(b, 64))
    assert len(trace._CACHE) == 2


def test_tensors_keyed_by_kind_and_aliasing():
    def gather(t, u):
        return lambda b, h, q, k: t[q] == u[k]

    x, y = torch.zeros(8, dtype=torch.int64), torch.ones(8, dtype=torch.int64)
    assert _key(gather(x, y)) == _key(gather(y, x))
    assert _key(gather(x, x)) != _key(gather(x, y))  # one tensor twice vs two tensors
    assert _key(gather(x, y)) != _key(gather(x.int(), y))
    assert _key(gather(x, y)) != _key(gather(x[None], y))


def test_nested_mask_mods_in_and_masks_and_or_masks():
    causal = fm.causal
    assert _key(and_masks(causal, _window(4))) == _key(and_masks(causal, _window(4)))
    assert _key(and_masks(causal, _window(4))) != _key(and_masks(causal, _window(8)))
    assert _key(and_masks(causal, _window(4))) != _key(or_masks(causal, _window(4)))
    assert _key(and_masks(causal, _window(4))) != _key(and_masks(_window(4), _window(4)))


def _docs(lengths):
    return fm.document(fm.causal, fm.lengths_to_offsets(lengths))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(0, 2**31))
def test_new_closure_over_new_tensors_reuses_the_trace_and_is_exact(first, seed):
    n = sum(first)
    lengths = torch.randint(1, 9, (n,), generator=torch.Generator().manual_seed(seed))
    second = lengths[torch.cumsum(lengths, 0) <= n].tolist()
    second.append(n - sum(second)) if sum(second) < n else None
    one, two = _docs(first), _docs(second)
    assert _key(one) == _key(two)
    trace.clear()  # per example
    p1 = cm.from_mask_mod(one, n, block_m=16, block_n=16)
    traced_one = trace.symbolic_trace(one)
    p2 = cm.from_mask_mod(two, n, block_m=16, block_n=16)
    assert p1.source == p2.source == "from_mask_mod:lifted"
    bound = trace.symbolic_trace(two)
    assert len(trace._CACHE) == 1
    assert isinstance(traced_one, trace.Bound) and bound.template is traced_one.template
    assert torch.equal(p1.to_dense(), flex_dense(one, n))
    assert torch.equal(p2.to_dense(), flex_dense(two, n))


def test_recognised_document_form_rebinds_its_table():
    def doc_mod(doc):
        return lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q)

    a = doc_mod(torch.tensor([0] * 5 + [1] * 7 + [2] * 4))
    b = doc_mod(torch.tensor([0] * 9 + [1] * 7))
    pa, pb = cm.from_mask_mod(a, 16), cm.from_mask_mod(b, 16)
    assert isinstance(trace.symbolic_trace(b), trace.Bound)
    assert torch.equal(pa.to_dense(), flex_dense(a, 16))
    assert torch.equal(pb.to_dense(), flex_dense(b, 16))


def test_values_or_shapes_read_while_tracing_are_not_cached():
    def by_tolist(cfg):
        return lambda b, h, q, k: (k <= q) & (q != cfg.tolist()[0])

    def by_len(t):
        return lambda b, h, q, k: (k <= q) & (q < len(t))

    for make, vals in ((by_tolist, ([2, 0], [7, 0])), (by_len, ([1] * 5, [1] * 11))):
        for v in vals:
            mm = make(torch.tensor(v))
            assert trace.symbolic_trace(mm) is not trace.symbolic_trace(mm)
            got = cm.from_mask_mod(mm, 16, block_m=16, block_n=16).to_dense()
            assert torch.equal(got, flex_dense(mm, 16))
    assert not trace._CACHE


def test_unrecognised_captures_are_traced_every_call():
    table = {"w": 3}

    def reads_dict(b, h, q, k):
        return (q - k).abs() <= table["w"]

    assert trace.structure(reads_dict) is None
    assert trace.symbolic_trace(reads_dict) is not trace.symbolic_trace(reads_dict)


def test_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(trace, "MAX_ENTRIES", 2)
    for w in (1, 2, 3):
        trace.symbolic_trace(_window(w))
    assert len(trace._CACHE) == 2
    assert _key(_window(1)) not in trace._CACHE  # the least recently used went first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_new_mask_mod_over_new_cuda_tables_reuses_the_trace():
    dev = torch.device("cuda")
    plans = []
    for lengths in ([300, 200, 524], [1000, 24], [1024]):
        off = fm.lengths_to_offsets(lengths).to(dev)
        mm = fm.document(fm.causal, off)
        got = cm.from_mask_mod(mm, 1024, device=dev)
        assert got.source == "from_mask_mod:lifted"
        cpu = fm.document(fm.causal, off.cpu())
        assert torch.equal(got.to_dense().cpu(), flex_dense(cpu, 1024))
        plans.append(got)
    assert len(trace._CACHE) == 1


# state a trace would freeze: read through a module, a function attribute or a builtin
_CFG = type(torch)("mask_config")
_CFG.WINDOW = 128


def _helper(q):
    return q


def test_reads_through_modules_builtins_and_attributes_are_never_cached():
    """A value reached through another module (a config module, ``os.environ``, ``random``),
    a function's attribute, ``globals()`` / ``getattr`` or an impure torch function has no
    key: every call traces afresh and gets the mask of its own values."""
    import os
    import random

    cfg = _CFG

    def by_module(b, h, q, k):
        return (q - k < cfg.WINDOW) & (k <= q)

    def by_environ(b, h, q, k):
        return (q - k < int(os.environ["CM_TEST_WINDOW"])) & (k <= q)

    def by_attribute(b, h, q, k):
        return (q - k < _helper.w) & (k <= q)

    def by_globals(b, h, q, k):
        return (q - k < globals()["_G_WINDOW"]) & (k <= q)

    def by_random(b, h, q, k):
        return (q - k < random.randint(1, 100)) & (k <= q)

    def by_torch_state(b, h, q, k):
        return (q - k < torch.get_num_threads() * 10) & (k <= q)

    for fn in (by_module, by_environ, by_attribute, by_globals, by_random, by_torch_state):
        assert trace.structure(fn) is None, fn.__name__
    os.environ["CM_TEST_WINDOW"] = "128"
    _helper.w = 100
    globals()["_G_WINDOW"] = 100
    for fn, change in (
        (by_module, lambda: setattr(cfg, "WINDOW", 129)),
        (by_environ, lambda: os.environ.__setitem__("CM_TEST_WINDOW", "256")),
        (by_attribute, lambda: setattr(_helper, "w", 200)),
        (by_globals, lambda: globals().__setitem__("_G_WINDOW", 200)),
    ):
        first = cm.from_mask_mod(fn, 300)
        assert torch.equal(first.to_dense(), flex_dense(fn, 300)), fn.__name__
        change()
        second = cm.from_mask_mod(fn, 300)
        assert torch.equal(second.to_dense(), flex_dense(fn, 300)), fn.__name__
        assert not torch.equal(first.to_dense(), second.to_dense()), fn.__name__
    assert not trace._CACHE
    os.environ.pop("CM_TEST_WINDOW")


def test_attributes_set_on_functions_partials_and_tensors_are_never_cached():
    """Settings kept as attributes of a function, a partial or a captured tensor and read
    through a local name, a list element or a helper's argument (not right after a global or
    closure name) have no key: each call, cached or not, gets the mask of the values now."""
    import functools

    def cfg():
        pass

    def helper():
        pass

    def spec():
        pass

    cfg.window, helper.w, spec.size = 4, 3, 4
    t = torch.zeros(64, dtype=torch.long)
    t.window = 4
    holders = [helper]

    def through_local(b, h, q, k):
        c = cfg
        return (q - k < c.window) & (k <= q)

    def tensor_attribute(b, h, q, k):
        return (q - k < t.window) & (k <= q) & (t[q] == t[k])

    def list_element(b, h, q, k):
        return (q - k < holders[0].w) & (k <= q)

    def window_of(s, q, k):
        return (q - k < s.size) & (k <= q)

    by_argument = functools.partial(lambda b, h, q, k, s: window_of(s, q, k), s=spec)
    cases = (
        (through_local, lambda: setattr(cfg, "window", 16)),
        (tensor_attribute, lambda: setattr(t, "window", 20)),
        (list_element, lambda: setattr(helper, "w", 20)),
        (by_argument, lambda: setattr(spec, "size", 32)),
    )
    for fn, change in cases:
        assert trace.structure(fn) is None
        first = cm.from_mask_mod(fn, 64)
        assert torch.equal(first.to_dense(), flex_dense(fn, 64))
        change()
        for cache in (True, False):
            again = cm.from_mask_mod(fn, 64, cache=cache)
            assert torch.equal(again.to_dense(), flex_dense(fn, 64))
            assert not torch.equal(again.to_dense(), first.to_dense())


def test_torch_pure_functions_and_math_keep_the_cache():
    import math

    def mm(b, h, q, k):
        return torch.logical_and(q - k < math.ceil(2.5) * 40, k <= q)

    assert trace.structure(mm) is not None
    got = cm.from_mask_mod(mm, 200)
    assert torch.equal(got.to_dense(), flex_dense(mm, 200))
    assert len(trace._CACHE) == 1


def test_cached_trace_does_not_keep_captured_tensors_alive():
    """The cache holds the graph and stand-ins for its tensors, not the tensors of the
    mask_mod it was traced from: once the plan is built and the user's references are
    dropped, a captured tensor is freed; a second closure of the same structure still hits."""
    import gc
    import weakref

    def doc_mod(doc):
        return lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q)

    def window_mod(doc, w):
        return lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q) & (q - k < w)

    for make in (doc_mod, lambda d: window_mod(d, 3)):
        trace.clear()
        doc = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)
        freed = weakref.ref(doc)
        mm = make(doc)
        first = cm.from_mask_mod(mm, 16)
        assert first.source == "from_mask_mod:lifted"
        assert len(trace._CACHE) == 1
        del doc, mm
        gc.collect()
        assert freed() is None, gc.get_referrers(freed())

        other = torch.tensor([0] * 9 + [1] * 7)
        mm2 = make(other)
        assert isinstance(trace.symbolic_trace(mm2), trace.Bound)  # the cache still hits
        second = cm.from_mask_mod(mm2, 16)
        assert torch.equal(second.to_dense(), flex_dense(mm2, 16))
        assert len(trace._CACHE) == 1
        freed2 = weakref.ref(other)
        del other, mm2
        gc.collect()
        assert freed2() is None


class _Window:
    """A mask_mod written as an object with ``__call__`` (its setting an attribute)."""

    def __init__(self, w):
        self.w = w

    def __call__(self, b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= self.w) & (kv_idx <= q_idx)

    def method(self, b, h, q_idx, kv_idx):
        return kv_idx <= q_idx - self.w


class _DocModule(torch.nn.Module):
    def __init__(self, doc):
        super().__init__()
        self.doc = doc

    def forward(self, b, h, q_idx, kv_idx):
        return (self.doc[q_idx] == self.doc[kv_idx]) & (kv_idx <= q_idx)


def _dense(plan):
    d = plan.to_dense()
    return d.reshape(-1, *d.shape[-2:])[0]


@pytest.mark.parametrize("cache", [True, False])
def test_callable_objects_bound_methods_and_modules_are_lifted_and_never_stale(cache):
    n = 96
    doc = torch.repeat_interleave(torch.arange(4), torch.tensor([30, 20, 40, 6]))
    window = _Window(9)
    for mod in (window, window.method, _DocModule(doc)):
        plan = cm.from_mask_mod(mod, n, cache=cache)
        assert plan.stats()["source"] == "from_mask_mod:lifted"
        # (create_mask counts a bound method's self as a score_mod's fifth argument)
        want = create_mask(lambda b, h, q, kv, f=mod: f(b, h, q, kv), None, None, n, n, "cpu")
        assert torch.equal(_dense(plan), want[0, 0])
    window.w = 3  # the object's setting changed: the next plan has it
    plan = cm.from_mask_mod(window, n, cache=cache)
    assert torch.equal(_dense(plan), create_mask(window, None, None, n, n, device="cpu")[0, 0])
    assert trace.structure(window) is None and trace.structure(window.method) is None
