"""Plans are validated data: every way a plan enters (constructor, ``dataclasses.replace``,
copies, unpickling, ``MaskPlan.load``) checks it; a plan modified afterwards is refused; a fuzz
of edits never reaches a kernel with a bad plan. Also: the thread-safe plan cache, the memory
bound of ``compile``, the reference backend under ``torch.func``, and the length check under
``torch.compile``.

On a machine without CUDA the module sets TRITON_INTERPRET=1 before Triton is imported.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import operator
import os
import pickle
import random
import threading

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import compilemask as cm  # noqa: E402
from compilemask.api import validate  # noqa: E402
from compilemask.compiler import pipeline  # noqa: E402
from compilemask.compiler.tiles import FULL, PARTIAL_BITS  # noqa: E402
from compilemask.errors import CompileMaskError, InputError, PlanError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_TRITON = importlib.util.find_spec("triton") is not None
BM = BN = 64  # the Triton forward's tiling for head_dim 32 on the CPU: it reads plan.schedule


def _plans() -> dict[str, cm.MaskPlan]:
    c = {"block_m": BM, "block_n": BN, "device": DEVICE}
    dense = torch.rand(1, 2, 90, 100, generator=torch.Generator().manual_seed(1)) < 0.5
    clear = cm.tile_grid(cm.masks.clear((6, 8), 3, 20), (2, 4))
    two_heads = cm.masks.per_head([cm.masks.causal(), cm.masks.sliding_window(17)])
    many = cm.masks.global_local(8, [0, 5, 10, 15, 20, 25, 30])
    return {  # not cached: the fuzz edits plans in place
        "causal": cm.compile(cm.masks.causal(), 100, cache=False, **c),
        "document": cm.compile(cm.masks.document([50, 20, 30]), cache=False, **c),
        "tile_grid_clear": cm.compile(clear, cache=False, **c),
        "per_head": cm.compile(two_heads, 90, heads=2, cache=False, **c),
        "from_dense_bits": cm.from_dense(dense, **c),
        "global_local_bits": cm.compile(many, 100, cache=False, **c),
    }


@pytest.fixture(scope="module")
def plans():
    return _plans()


def _qkv(plan, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = plan.heads or 1
    b = plan.batch or 1
    shapes = [(b, h, plan.q_len, 32), (b, h, plan.kv_len, 32), (b, h, plan.kv_len, 32)]
    return [torch.randn(s, generator=g, dtype=dtype).to(DEVICE) for s in shapes]


def _replace_tensor(plan, name: str, new: torch.Tensor) -> cm.MaskPlan:
    if name.startswith("schedule."):
        sched = dataclasses.replace(plan.schedule, **{name[9:]: new})
        return dataclasses.replace(plan, schedule=sched)
    return dataclasses.replace(plan, **{name: new})


def _get(plan, name: str):
    return getattr(plan.schedule, name[9:]) if name.startswith("schedule.") else getattr(plan, name)


# ------------------------------------------------------------------ plans that enter are checked
def test_compiled_plans_are_valid_and_bitmask_plans_are_covered(plans):
    assert cm.PlanError is PlanError and issubclass(PlanError, CompileMaskError)
    for plan in plans.values():
        plan.verify()
    assert plans["from_dense_bits"].encoding == "bits"
    striped = plans["global_local_bits"]
    assert striped.encoding == "intervals"
    assert bool((striped.schedule.kind == PARTIAL_BITS).any())
    assert plans["tile_grid_clear"].permutation is not None


def _sched(plan, name, index, value):
    return f"schedule.{name}", _set(getattr(plan.schedule, name), index, value)


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def _bump_bits_index(plan):
    t = plan.schedule.bits_index.clone()
    sel = t >= 0
    t[sel] = t[sel] + 1000
    return "schedule.bits_index", t


@pytest.mark.parametrize(
    "name, edit, field",
    [
        ("causal", lambda p: ("row_hi", _set(p.row_hi, (0, 5, 0), p.kv_len + 1)), "row_lo/row_hi"),
        ("causal", lambda p: ("row_lo", _set(p.row_lo, (0, 5, 0), 7)), "row_lo/row_hi"),
        ("causal", lambda p: ("row_lo", _set(p.row_lo, (0, 5, 0), -1)), "row_lo/row_hi"),
        ("causal", lambda p: ("row_count", _set(p.row_count, (0, 3), 2)), "row_count"),
        ("causal", lambda p: ("schedule.kind", p.schedule.kind.clone().fill_(FULL)), "kind"),
        ("causal", lambda p: _sched(p, "q_count", (0, 0), 3), "q_count"),
        ("causal", lambda p: _sched(p, "q_list", (0, 1, 0), 9), "q_list"),
        ("causal", lambda p: _sched(p, "kv_list", (0, 0, 1), -5), "kv_list"),
        ("causal", lambda p: _sched(p, "q_order", (0, 0), 99), "q_order"),
        ("causal", lambda p: _sched(p, "jhi", (0, 1, 1), 50), "jlo/jhi"),
        ("causal", lambda p: _sched(p, "pairs", (0, 0, 0), 1), "pairs"),
        ("causal", lambda p: ("row_lo", p.row_lo.long()), "torch.int32"),
        ("causal", lambda p: ("row_lo", p.row_lo[:, :-1]), "shape"),
        ("causal", lambda p: ("row_lo", p.row_lo.to("meta")), "device"),
        ("from_dense_bits", _bump_bits_index, "bits_index"),
        ("from_dense_bits", lambda p: ("schedule.bits", p.schedule.bits ^ 1), "schedule."),
        ("from_dense_bits", lambda p: ("row_runs", p.row_runs + 1), "row_runs"),
        ("global_local_bits", lambda p: ("schedule.bits", p.schedule.bits ^ 4), "schedule.bits"),
        ("tile_grid_clear", lambda p: ("permutation", _set(p.permutation, (0,), 1)), "permutation"),
    ],
)  # fmt: skip
def test_malformed_plans_are_refused_naming_the_field(plans, name, edit, field):
    plan = plans[name]
    attr, new = edit(plan)
    with pytest.raises(PlanError, match=field.replace("/", ".")):
        _replace_tensor(plan, attr, new)


def test_plain_fields_are_checked(plans):
    plan = plans["causal"]
    for changes, field in [
        ({"q_len": 101}, "row_lo"),
        ({"kv_len": 0}, "kv_len"),
        ({"heads": 2}, "row_lo"),
        ({"encoding": "dense"}, "encoding"),
        ({"source": 3}, "source"),
        ({"schedule": "tiles"}, "schedule"),
        ({"row_runs": plan.row_count}, "row_runs"),
    ]:
        with pytest.raises(PlanError, match=field):
            dataclasses.replace(plan, **changes)
    sched = dataclasses.replace(plan.schedule, block_m=32)
    with pytest.raises(PlanError, match="schedule.kind"):
        dataclasses.replace(plan, schedule=sched)


def test_non_contiguous_tensors_are_made_contiguous(plans):
    plan = plans["causal"]
    lo = plan.row_lo.transpose(0, 2).contiguous().transpose(0, 2)  # same values, other strides
    kind = plan.schedule.kind.transpose(1, 2).contiguous().transpose(1, 2)
    assert not lo.is_contiguous() or lo.shape[2] == 1
    sched = dataclasses.replace(plan.schedule, kind=kind)
    assert not kind.is_contiguous()
    twin = dataclasses.replace(plan, row_lo=lo, schedule=sched)
    assert twin.row_lo.is_contiguous() and twin.schedule.kind.is_contiguous()
    q, k, v = _qkv(plan)
    want = cm.attention(q, k, v, plan, backend="reference")
    torch.testing.assert_close(cm.attention(q, k, v, twin, backend="reference"), want)


def test_replace_does_not_reuse_derived_tilings(plans):
    plan = cm.compile(cm.masks.causal(), 150, block_m=BM, block_n=BN, device=DEVICE, cache=False)
    plan.tiles(32, 32)  # cached in plan._cache
    window = cm.compile(cm.masks.sliding_window(5), 150, block_m=BM, block_n=BN, device=DEVICE)
    other = dataclasses.replace(
        plan, row_lo=window.row_lo, row_hi=window.row_hi, row_count=window.row_count,
        schedule=window.schedule,
    )  # fmt: skip
    assert torch.equal(other.tiles(32, 32).kind, window.tiles(32, 32).kind)
    same = plan.in_permuted_order() if plan.permutation is None else plan
    assert same.tiles(32, 32) is plan.tiles(32, 32)


def test_copies_pickles_and_files_are_checked(plans, tmp_path):
    for name, plan in plans.items():
        for twin in (copy.copy(plan), copy.deepcopy(plan), pickle.loads(pickle.dumps(plan))):
            assert twin is not plan and torch.equal(twin.to_dense(), plan.to_dense())
            twin.verify()
        path = tmp_path / f"{name}.plan"
        plan.save(path)
        loaded = cm.MaskPlan.load(path)
        assert torch.equal(loaded.to_dense(), plan.to_dense()), name
        assert loaded.encoding == plan.encoding and loaded.heads == plan.heads

    plan = plans["causal"]
    state = plan.__getstate__()
    state["row_hi"] = _set(plan.row_hi, (0, 2, 0), plan.kv_len + 3)
    bad = cm.MaskPlan.__new__(cm.MaskPlan)
    with pytest.raises(PlanError, match="row_lo/row_hi"):
        bad.__setstate__(state)
    with pytest.raises(PlanError, match="row_lo"):
        cm.MaskPlan.__new__(cm.MaskPlan).__setstate__({"q_len": 3})

    path = tmp_path / "bad.plan"
    plan.save(path)
    obj = torch.load(path, weights_only=True)
    obj["tensors"]["schedule.q_list"] = _set(obj["tensors"]["schedule.q_list"], (0, 0, 0), 77)
    torch.save(obj, path)
    with pytest.raises(PlanError, match="q_list"):
        cm.MaskPlan.load(path)
    torch.save({"weights": torch.zeros(3)}, path)
    with pytest.raises(PlanError, match="does not hold a MaskPlan"):
        cm.MaskPlan.load(path)
    path.write_bytes(b"not a file torch wrote")
    with pytest.raises(PlanError, match="cannot read"):
        cm.MaskPlan.load(path)
    path.write_bytes(b"hello")  # torch.load's legacy reader fails with a bare KeyError
    with pytest.raises(PlanError, match="not a file torch.save wrote"):
        cm.MaskPlan.load(path)


def test_a_file_changed_into_another_valid_plan_is_refused(tmp_path):
    """A saved plan whose ``kv_len`` was changed (300 -> 301 keeps every tile count) passes
    the plan's own checks; the file's checksum refuses it, and a version 2 file without one.
    A version 1 file (written before checksums) still loads."""
    plan = cm.compile(cm.masks.causal(), 300, block_m=BM, block_n=BN, cache=False)
    path = tmp_path / "p.plan"
    plan.save(path)
    obj = torch.load(path, weights_only=True)
    assert "checksum" in obj
    obj["meta"]["kv_len"] = 301
    torch.save(obj, path)
    with pytest.raises(PlanError, match="checksum does not match"):
        cm.MaskPlan.load(path)
    del obj["checksum"]
    torch.save(obj, path)
    with pytest.raises(PlanError, match="has no checksum"):
        cm.MaskPlan.load(path)
    obj["version"] = 1
    torch.save(obj, path)
    assert cm.MaskPlan.load(path).kv_len == 301
    obj["tensors"]["extra"] = torch.zeros(1, dtype=torch.bfloat16)
    torch.save(obj, path)
    with pytest.raises(PlanError, match="'extra'"):
        cm.MaskPlan.load(path)
    raw = tmp_path / "whole.plan"
    plan.save(raw)
    (tmp_path / "cut.plan").write_bytes(raw.read_bytes()[:5000])
    with pytest.raises(PlanError, match="cannot read"):
        cm.MaskPlan.load(tmp_path / "cut.plan")
    fn, (pickled,) = plan.__reduce__()
    pickled["tensors"]["row_count"] = pickled["tensors"]["row_count"].clone()
    pickled["meta"]["source"] = "edited"
    with pytest.raises(PlanError, match="checksum"):
        fn(pickled)


def test_a_plan_written_in_place_is_neither_saved_nor_handed_to_flex(tmp_path):
    tiled = cm.compile(cm.tile_grid(cm.masks.clear((8, 12), 3, 10), (4, 4)), 106, block_m=16,
                       block_n=16, cache=False)  # fmt: skip
    tiled.row_hi.add_(0)
    with pytest.raises(PlanError, match="written in place"):
        tiled.in_permuted_order()
    plan = cm.compile(cm.masks.causal(), 150, block_m=BM, block_n=BN, cache=False)
    plan.row_hi[0, 5, 0] = 3
    for write in (lambda: plan.save(tmp_path / "p.plan"), lambda: torch.save(plan, tmp_path /
                  "p.pt"), lambda: copy.deepcopy(plan), plan.to_block_mask):  # fmt: skip
        with pytest.raises(PlanError, match=r"row_hi \(written in place\)"):
            write()
    assert not (tmp_path / "p.plan").exists()


def test_torch_save_of_a_plan_loads_with_weights_only(plans, tmp_path):
    """torch.save(plan) / torch.load(weights_only=True): the plan (alone or inside a dict)
    comes back through the checked restore, and a tampered pickled plan is refused."""
    for name, plan in plans.items():
        path = tmp_path / f"{name}.pt"
        torch.save({"plan": plan, "step": 3}, path)
        loaded = torch.load(path, weights_only=True)
        assert loaded["step"] == 3 and torch.equal(loaded["plan"].to_dense(), plan.to_dense())
        assert loaded["plan"].permutation is None or torch.equal(
            loaded["plan"].permutation.cpu(), plan.permutation.cpu()
        )
    plan = plans["causal"]
    path = tmp_path / "meta.pt"
    torch.save(plan, path)
    with pytest.raises(PlanError, match="meta tensors hold no data"):
        torch.load(path, map_location="meta")
    fn, (obj,) = plan.__reduce__()
    obj["tensors"]["row_hi"] = _set(plan.row_hi, (0, 2, 0), plan.kv_len + 3)
    with pytest.raises(PlanError, match="row_lo/row_hi"):
        fn(obj)


# ------------------------------------------------------------------ modified after the build
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_plans_modified_after_the_build_are_refused(backend):
    if backend == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    plan = cm.compile(cm.masks.causal(), 150, block_m=BM, block_n=BN, device=DEVICE, cache=False)
    q, k, v = _qkv(plan)
    cm.attention(q, k, v, plan, backend=backend)
    plan.row_hi[0, 3, 0] = plan.kv_len + 10  # in place
    with pytest.raises(PlanError, match=r"row_hi \(written in place\)"):
        cm.attention(q, k, v, plan, backend=backend)
    with pytest.raises(PlanError, match="row_hi"):
        plan.verify()

    plan = cm.compile(cm.masks.causal(), 150, block_m=BM, block_n=BN, device=DEVICE, cache=False)
    object.__setattr__(plan.schedule, "kind", plan.schedule.kind.clone().fill_(FULL))
    with pytest.raises(PlanError, match=r"schedule.kind \(the attribute was replaced\)"):
        cm.attention(q, k, v, plan, backend=backend)
    plan = cm.compile(cm.masks.causal(), 150, block_m=BM, block_n=BN, device=DEVICE, cache=False)
    object.__setattr__(plan, "row_lo", plan.row_lo.clone())  # even with the same values
    with pytest.raises(PlanError, match="row_lo"):
        cm.attention(q, k, v, plan, backend=backend)


def test_tensors_given_to_the_constructor_stay_watched(plans):
    plan = plans["causal"]
    lo = plan.row_lo.clone()
    twin = dataclasses.replace(plan, row_lo=lo)
    lo[0, 0, 0] = 1  # the caller's reference is the plan's tensor
    q, k, v = _qkv(plan)
    with pytest.raises(PlanError, match="row_lo"):
        cm.attention(q, k, v, twin, backend="reference")


def test_full_checks_on_every_call(plans, monkeypatch):
    plan = plans["document"]
    q, k, v = _qkv(plan)
    calls = []
    real = cm.MaskPlan.verify

    def counting(self):
        calls.append(self)
        return real(self)

    monkeypatch.setattr(cm.MaskPlan, "verify", counting)
    validate.check_plan(q, k, plan)
    assert calls == []
    validate.check_plan(q, k, plan, full=True)
    assert calls == [plan]
    monkeypatch.setenv("COMPILEMASK_CHECK_PLAN", "1")
    cm.attention(q, k, v, plan, backend="reference")
    cm.attention(q, k, v, plan, backend="reference")
    assert len(calls) == 3


# ------------------------------------------------------------------ the fuzz
def _edit(plan, rng: random.Random):
    """A randomly edited plan: returns a callable that builds / mutates it (it may raise)."""
    names = [n for n in _tensor_names(plan)]
    name = rng.choice(names)
    t = _get(plan, name)
    how = rng.choice(
        ["value", "value", "value", "dtype", "shape", "stride", "inplace", "setattr", "field"]
    )
    if how == "field":
        field, value = rng.choice(
            [("q_len", plan.q_len + rng.choice([-1, 1])), ("kv_len", plan.kv_len - 1),
             ("batch", 2), ("heads", rng.choice([None, 1, 2, 3])),
             ("encoding", "bits" if plan.encoding == "intervals" else "intervals"),
             ("permutation", None), ("source", "x")]
        )  # fmt: skip
        return lambda: dataclasses.replace(plan, **{field: value})
    if how == "dtype":
        dtype = rng.choice([torch.int64, torch.int16, torch.float32, torch.uint8])
        return lambda: _replace_tensor(plan, name, t.to(dtype))
    if how == "shape":
        shapes = [t[..., :-1], t[:1], torch.cat([t, t], -1), t.unsqueeze(0), t.flatten()]
        new = rng.choice([s for s in shapes if s.shape != t.shape] or [t.flatten()[:1]])
        return lambda: _replace_tensor(plan, name, new)
    if how == "stride":  # same values, other strides
        if t.dim() >= 2:
            new = t.transpose(-1, -2).contiguous().transpose(-1, -2)
        else:
            new = torch.stack([t, t], -1)[..., 0]
        return lambda: _replace_tensor(plan, name, new)
    if t.numel() == 0:
        return lambda: plan
    new = t.clone()
    flat = new.view(-1)
    for _ in range(rng.choice([1, 1, 1, 2, 5])):
        i = rng.randrange(flat.numel())
        old = int(flat[i])
        choices = [old, old + 1, old - 1, -1, 0, plan.kv_len, plan.kv_len + 1, plan.q_len,
                   2**31 - 1, -(2**31), rng.randrange(-5, 300), FULL, PARTIAL_BITS]  # fmt: skip
        if name == "schedule.q_order" or name == "schedule.kv_order" or name == "permutation":
            j = rng.randrange(flat.numel())
            flat[i], flat[j] = flat[j].clone(), flat[i].clone()  # a valid permutation stays one
            continue
        value = rng.choice(choices)
        lim = 2**63 - 1 if new.dtype == torch.int64 else 2**31 - 1
        flat[i] = max(-lim - 1, min(lim, value))
    if how == "inplace":
        return lambda: (t.copy_(new), plan)[1]
    if how == "setattr":

        def setattr_edit():
            owner = plan.schedule if name.startswith("schedule.") else plan
            object.__setattr__(owner, name.split(".")[-1], new)
            return plan

        return setattr_edit
    return lambda: _replace_tensor(plan, name, new)


def _tensor_names(plan):
    names = ["row_lo", "row_hi", "row_count"]
    names += [n for n in ("row_runs", "permutation") if getattr(plan, n) is not None]
    return names + [f"schedule.{n}" for n in plan.schedule.tensors()]


def _fuzz(n_edits: int, seed: int, backends) -> dict:
    rng = random.Random(seed)
    outcome = {"refused": 0, "ran": 0, "triton": 0}
    plans = _plans()
    names = list(plans)
    for i in range(n_edits):
        name = rng.choice(names)
        plan = plans[name]
        q, k, v = _qkv(plan, seed=i)
        try:
            edited = _edit(plan, rng)()
        except CompileMaskError as err:
            assert isinstance(err, PlanError), (name, err)
            outcome["refused"] += 1
            continue
        results = {}
        for backend in backends:
            try:
                results[backend] = cm.attention(q, k, v, edited, backend=backend)
            except CompileMaskError as err:
                assert isinstance(err, (PlanError, InputError)), (name, backend, err)
                results[backend] = None
        if "reference" in results and results["reference"] is not None:
            ref = results["reference"]
            assert torch.isfinite(ref).all(), name
            if results.get("triton") is not None:
                torch.testing.assert_close(results["triton"], ref, atol=2e-4, rtol=2e-4)
                outcome["triton"] += 1
            outcome["ran"] += 1
        else:
            assert all(r is None for r in results.values()), (name, results.keys())
            outcome["refused"] += 1
        if edited is plan:  # mutated in place or by setattr: fresh plans from here on
            plans = _plans()
    return outcome


def _backends():
    return ["reference", "triton"] if HAS_TRITON else ["reference"]


def test_fuzzed_plans_are_refused_or_exact():
    out = _fuzz(1000, seed=0, backends=_backends())
    assert (
        out["refused"] > 200 and out["ran"] > 50 and out["triton"] == out["ran"] or not HAS_TRITON
    ), out


@pytest.mark.slow
def test_fuzzed_plans_are_refused_or_exact_5000():
    out = _fuzz(5000, seed=1, backends=_backends())
    assert out["refused"] > 1000 and out["ran"] > 250, out


# ------------------------------------------------------------------ plan cache under threads
def test_plan_cache_is_thread_safe(monkeypatch):
    monkeypatch.setattr(pipeline, "_CACHE_SIZE", 3)
    cm.clear_cache()
    errors = []
    masks = [cm.masks.causal(), cm.masks.sliding_window(7), cm.masks.prefix_lm(4)]
    barrier = threading.Barrier(16)

    def work(t: int) -> None:
        try:
            barrier.wait()
            for i in range(12):
                n = 40 + (t + i) % 5  # same keys across threads, and evictions
                plan = cm.compile(masks[(t * 7 + i) % 3], n, block_m=16, block_n=16)
                assert plan.q_len == n
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(pipeline._CACHE) <= 3
    a = cm.compile(cm.masks.causal(), 41, block_m=16, block_n=16)
    assert cm.compile(cm.masks.causal(), 41, block_m=16, block_n=16) is a
    cm.clear_cache()


# ------------------------------------------------------------------ smaller items
def test_compile_refuses_plans_larger_than_memory(monkeypatch):
    with pytest.raises(CompileMaskError, match=r"needs about .* GiB .* free"):
        cm.compile(cm.masks.causal(), 50_000_000, cache=False)
    monkeypatch.setattr(pipeline, "available_memory", lambda device: 10_000)
    with pytest.raises(CompileMaskError, match="block_m"):
        cm.compile(cm.masks.causal(), 4096, block_m=16, block_n=16, cache=False)
    monkeypatch.setattr(pipeline, "available_memory", lambda device: None)  # unknown: build
    assert cm.compile(cm.masks.causal(), 64, block_m=16, block_n=16, cache=False).q_len == 64


def test_small_gpu_plans_skip_the_memory_query(monkeypatch):
    asked = []
    monkeypatch.setattr(pipeline, "available_memory", lambda device: asked.append(device) or 0)
    cuda = torch.device("cuda")
    pipeline.check_plan_size(1, 32768, 32768, 128, 128, cuda)  # 4 MiB: no query
    assert asked == []
    with pytest.raises(CompileMaskError, match="block_m"):  # 1 GiB: asked, refused
        pipeline.check_plan_size(1, 32768, 32768, 16, 16, cuda)
    assert asked == [cuda]
    with pytest.raises(CompileMaskError, match="block_m"):  # the CPU always asks
        pipeline.check_plan_size(1, 1024, 1024, 128, 128, torch.device("cpu"))


def test_mask_text_is_kept_per_mask_object():
    mask = cm.masks.hstu([30, 25, 15], [3, 2, 4], contextual=2)
    text = pipeline.mask_text(mask)
    assert text == str(mask) and pipeline.mask_text(mask) is text
    other = cm.masks.hstu([30, 25, 16], [3, 2, 4], contextual=2)
    assert pipeline.mask_text(other) == str(other) != text


def test_cli_stats_refuses_a_huge_length():
    click_testing = pytest.importorskip("click.testing")
    from compilemask.tools.cli import cli

    result = click_testing.CliRunner().invoke(cli, ["stats", "causal()", "--q-len", "50000000"])
    assert result.exit_code != 0
    assert "GiB" in result.output and "block_m" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_plan_to_cuda_without_cuda(plans):
    with pytest.raises(CompileMaskError, match="no CUDA"):
        plans["causal"].to("cuda")
    with pytest.raises(CompileMaskError, match="device"):
        plans["causal"].to("nonsense")
    assert plans["causal"].to("cpu") is plans["causal"]


def test_reference_backend_under_torch_func(plans):
    plan = plans["tile_grid_clear"]
    q, k, v = (t.double() for t in _qkv(plan))

    def loss(q, k, v):
        return (cm.attention(q, k, v, plan, backend="reference") ** 2).sum()

    grads = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(*leaves).backward()
    for g, leaf in zip(grads, leaves):
        torch.testing.assert_close(g, leaf.grad)
    out, vjp_fn = torch.func.vjp(lambda q: cm.attention(q, k, v, plan, backend="reference"), q)
    (dq,) = vjp_fn(2 * out)
    torch.testing.assert_close(dq, leaves[0].grad)


def test_length_mismatch_under_torch_compile(plans):
    plan = plans["causal"]
    q, k, v = _qkv(plan)
    q = q[:, :, :70]
    torch._dynamo.reset()
    fn = torch.compile(
        lambda q, k, v: cm.attention(q, k, v, plan, backend="reference"), fullgraph=True
    )
    with pytest.raises(Exception) as info:  # Dynamo reports the InputError it traced
        fn(q, k, v)
    text = str(info.value)
    assert "Failed to trace builtin operator" not in text
    assert "InputError" in text and "compiled for q_len=100, kv_len=100" in text
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: cm.attention(q, k, v, plan, backend="reference"))
    with pytest.raises(InputError, match="q_len=100"):
        fn(q, k, v)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_plans_check_on_the_device_and_refuse_on_first_call():
    plan = cm.compile(cm.masks.causal(), 300, device="cuda", cache=False)
    q, k, v = _qkv(plan)
    cm.attention(q, k, v, plan)
    bad = _replace_tensor(plan, "row_hi", _set(plan.row_hi, (0, 7, 0), plan.kv_len + 5))
    assert bad._pending  # queued on the device, not read yet
    with pytest.raises(PlanError, match="row_lo/row_hi"):
        cm.attention(q, k, v, bad)
    with pytest.raises(PlanError, match="row_lo/row_hi"):
        cm.attention(q, k, v, bad)


def test_meta_device_is_refused_with_a_reason():
    with pytest.raises(cm.CompileMaskError, match="meta"):
        cm.compile(cm.masks.causal(), 16, device="meta", cache=False)
    with pytest.raises(cm.CompileMaskError, match="meta"):
        cm.compile(cm.masks.causal(), 16, cache=False).to("meta")


@pytest.mark.parametrize("device_style", [False, True])
@pytest.mark.parametrize("inference", [False, True])
def test_compiled_plans_meet_the_structure_checks_they_skip(monkeypatch, device_style, inference):
    """``compile`` admits its plans without the structure checks and the contiguity pass (it
    made every tensor itself): they must hold anyway, for CPU builds and device-style ones (K
    untrimmed, no bitmasks, the Triton tile builder: what a GPU build makes), in inference
    mode too."""
    from compilemask.compiler import plan_check
    from compilemask.kernels.triton import tile_builder

    builder = tile_builder.using(True) if device_style else contextlib.nullcontext()
    if device_style:
        build_plan = pipeline.build_plan

        def untrimmed(*args, host_sync, **kwargs):
            return build_plan(*args, host_sync=False, **kwargs)

        monkeypatch.setattr(pipeline, "build_plan", untrimmed)
    M = cm.masks
    masks = [
        (M.causal(), 70), (M.sliding_window(9), 90), (M.document([30, 40, 20]), None),
        (M.shared_prompt(9, [5, 7, 4]), None), (M.hstu([20, 14], [3, 2], contextual=2), None),
        (M.tile_grid(M.clear((6, 8), 3, 20), (2, 4)), None),
        (M.per_head([M.causal(), M.chunked(8)]), 40), (M.causal() - M.sliding_window(3), 50),
    ]  # fmt: skip
    with builder:
        for mask, n in masks:
            with torch.inference_mode(inference):
                plan = cm.compile(mask, n, block_m=16, block_n=32, cache=False)
            plan_check.check_structure(plan)
            for name, t in plan_check.plan_tensor_fields(plan):
                if t is not None:
                    assert t.is_contiguous() and not t.is_inference(), (mask, name)


@pytest.mark.parametrize("permuted", [False, True])
def test_built_plans_have_the_state_of_constructed_ones(permuted):
    """``MaskPlan._built`` (the builders' constructor, without the dataclass ``__init__``) makes
    the state the constructor makes inside ``built_plans(own_tensors=True)``: the same fields,
    the same recorded state and cache basis, registered as checked (a copy of its tensors
    skips the value checks), and refused once a tensor is written."""
    from compilemask.compiler.plan import _BASIS, _VERIFIED, MaskPlan, built_plans

    mask = (
        cm.masks.tile_grid(cm.masks.clear((4, 8), 2, 0), (2, 4)) if permuted else cm.masks.causal()
    )
    ref = cm.compile(mask, 32, block_m=16, block_n=16, cache=False)
    assert (ref.permutation is not None) == permuted
    fields = {f.name: getattr(ref, f.name) for f in dataclasses.fields(ref) if f.init}
    fields.pop("_cache"), fields.pop("shape_class"), fields.pop("encoding")
    fields.pop("row_runs")
    with built_plans(own_tensors=True):
        made = MaskPlan(**fields)
    plan = MaskPlan._built(**fields)
    assert list(vars(plan)) == list(vars(made))
    for name in vars(made):
        if name not in ("_verified", "_cache"):
            assert getattr(plan, name) is getattr(made, name), name
    assert plan._verified[0] == made._verified[0]
    assert all(map(operator.is_, plan._verified[1], made._verified[1]))
    assert plan._verified[2] == made._verified[2]
    assert plan._cache == made._cache == {_BASIS: plan._core_state()}
    assert plan._pending is None and _VERIFIED.get(plan._core_state()) in (plan, made)
    plan.check_unchanged()
    plan.row_count.add_(0)
    with pytest.raises(PlanError, match="row_count"):
        plan.check_unchanged()
