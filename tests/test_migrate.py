"""from_mask_mod / from_dense against FlexAttention's own mask (``create_mask``), exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm
from compilemask.compiler.intervals import dense_rows, from_dense_rows
from compilemask.compiler.migrate import lift, modeval
from compilemask.compiler.migrate.evaluate import RunCollector
from compilemask.errors import CompileMaskError
from flex_masks import CASES


def flex_dense(mask_mod, q_len, kv_len, batch, heads):
    return create_mask(mask_mod, batch, heads, q_len, kv_len, device="cpu")


def plan_dense(plan, batch, heads):
    d = plan.to_dense()
    if d.dim() == 2:
        d = d[None, None]
    return d.expand(batch or 1, heads or 1, *d.shape[-2:])


def check_plan(plan):
    plan.verify()
    return plan


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("lifting", [False, True], ids=["evaluated", "auto"])
def test_mask_mod_gives_flex_mask(case, lifting):
    name, fn, nq, nk, batch, heads = case
    want = flex_dense(fn, nq, nk, batch, heads)
    plan = cm.from_mask_mod(
        fn, nq, nk, batch=batch, heads=heads, block_m=16, block_n=16, lifting=lifting
    )
    check_plan(plan)
    assert plan.source.startswith("from_mask_mod:")
    assert plan.stats()["source"] == plan.source
    assert torch.equal(plan_dense(plan, batch, heads), want), (name, plan.source)


@pytest.mark.parametrize("name", ["flamingo"])
def test_scalar_only_mask_mod_takes_vmap(name):
    _, fn, nq, nk, b, h = next(c for c in CASES if c[0] == name)
    assert modeval.choose_mode(fn, nq, nk, [(0, 0)], torch.device("cpu")) == "vmap"
    plan = cm.from_mask_mod(fn, nq, nk, lifting=False)
    assert plan.source == "from_mask_mod:vmap"


def test_broadcast_mask_mod_takes_broadcast():
    plan = cm.from_mask_mod(lambda b, h, q, k: q >= k, 40, lifting=False)
    assert plan.source == "from_mask_mod:broadcast"


def test_a_branch_on_index_values_is_refused_not_decided_per_chunk():
    """vmap refuses a Python decision on the indices' values; on broadcast indices it would be
    taken once per chunk of rows (a mask that depends on the chunk size, and FlexAttention
    refuses it): refused with the hint, on every path."""

    def branchy(b, h, q, k):
        if bool((q >= 0).all()):
            return q >= k
        return q < k

    def item(b, h, q, k):
        return k <= q.max().item()

    for fn in (branchy, item):
        for lifting in (True, False):
            with pytest.raises(CompileMaskError, match="torch.where and the tensor operators"):
                cm.from_mask_mod(fn, 30, lifting=lifting)


def test_a_random_mask_mod_is_refused():
    """vmap refuses random operations (FlexAttention too); evaluated on broadcast indices the
    mask would be drawn once per chunk (or, lifted, once)."""

    def coin(b, h, q, k):
        return torch.rand(()) < 0.5

    def noisy(b, h, q, k):
        return (k <= q) & (torch.rand_like(q, dtype=torch.float) < 2)

    for fn in (coin, noisy):
        for lifting in (True, False):
            with pytest.raises(CompileMaskError, match="random operation"):
                cm.from_mask_mod(fn, 64, lifting=lifting)


def test_python_control_flow_on_the_indices_is_refused_with_a_hint():
    def branch(b, h, q, k):
        if q >= k:
            return q >= 0
        return q < 0

    def python_and(b, h, q, k):
        return (q >= k) and (q - k < 8)

    for fn in (branch, python_and):
        with pytest.raises(CompileMaskError, match="torch.where and the tensor operators"):
            cm.from_mask_mod(fn, 40)


def test_mask_mod_chunked_across_rows(monkeypatch):
    """Several chunks (rows split across them) give the same plan as one."""
    monkeypatch.setenv("COMPILEMASK_CHUNK_ELEMS", "300")
    _, fn, nq, nk, b, h = next(c for c in CASES if c[0] == "document_causal")
    plan = cm.from_mask_mod(fn, nq, nk, block_m=4, block_n=16, lifting=False)
    assert torch.equal(plan.to_dense(), flex_dense(fn, nq, nk, None, None)[0, 0])
    d = torch.rand(2, 3, 37, 29, generator=torch.Generator().manual_seed(1)) < 0.7
    assert torch.equal(cm.from_dense(d, block_m=4, block_n=8).to_dense(), d)


@pytest.mark.parametrize("density", [0.0, 0.5, 0.97, 1.0])
@pytest.mark.parametrize(
    "nq,nk,bm,bn", [(300, 257, 64, 64), (130, 1000, 32, 64), (129, 129, 128, 128)]
)
def test_key_mask_mods_are_evaluated_from_one_row(density, nq, nk, bm, bn, monkeypatch):
    """A mask_mod whose value does not depend on q_idx (per batch row and head) is evaluated on
    one row per mask: the plan (intervals, or bitmask tiles shared by every q-tile, the last
    partial q-tile its own) is exactly FlexAttention's mask."""
    import compilemask.compiler.migrate as migrate

    calls = []
    real = migrate.build_key_plan
    monkeypatch.setattr(migrate, "build_key_plan", lambda *a: calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(int(density * 100) + nq)
    keep = torch.rand(2, 3, nk, generator=gen) < density

    def per_head(b, h, q, kv):
        return keep[b, h, kv]

    def shared(b, h, q, kv):
        return keep[0, 0, kv]

    for fn, batch, heads in ((shared, None, None), (per_head, 2, 3)):
        plan = cm.from_mask_mod(
            fn, nq, nk, batch=batch, heads=heads, block_m=bm, block_n=bn, lifting=False
        )
        plan.verify()
        want = flex_dense(fn, nq, nk, batch, heads)
        got = plan.to_dense()
        assert torch.equal(got if got.dim() == 4 else got[None, None], want)
    assert len(calls) == 2  # both took the one-row path


def test_from_dense_many_runs_goes_bits(monkeypatch):
    monkeypatch.setenv("COMPILEMASK_CHUNK_ELEMS", "512")
    d = torch.zeros(40, 512, dtype=torch.bool)
    d[:, ::2] = True
    d[:20] = torch.ones(20, 512, dtype=torch.bool).tril(300)[:20]
    plan = check_plan(cm.from_dense(d, block_m=8, block_n=64))
    assert plan.encoding == "bits"
    assert torch.equal(plan.to_dense(), d)


def test_mask_mod_errors():
    with pytest.raises(CompileMaskError, match="mask_mod raised ZeroDivisionError"):
        cm.from_mask_mod(lambda b, h, q, k: 1 // 0, 8)
    with pytest.raises(CompileMaskError, match="bool"):
        cm.from_mask_mod(lambda b, h, q, k: q - k, 8)
    with pytest.raises(CompileMaskError, match="callable"):
        cm.from_mask_mod("causal", 8)
    with pytest.raises(CompileMaskError, match="block_m"):
        cm.from_mask_mod(lambda b, h, q, k: q >= k, 8, block_m=0)
    with pytest.raises(CompileMaskError, match="lifting must be True or False, got 'no'"):
        cm.from_mask_mod(lambda b, h, q, k: q >= k, 4, lifting="no")


@settings(max_examples=60, deadline=None)
@given(
    nq=st.integers(1, 40),
    nk=st.integers(1, 90),
    runs=st.integers(0, 4),
    seed=st.integers(0, 2**16),
)
def test_run_extraction_matches_dense(nq, nk, runs, seed):
    """Rows of a few runs (8-key words) and noisy rows (every key) both give exact intervals."""
    g = torch.Generator().manual_seed(seed)
    cuts = torch.sort(torch.randint(0, nk + 1, (nq, 2 * runs), generator=g), -1).values
    keys = torch.arange(nk)
    d = torch.zeros(nq, nk, dtype=torch.bool)
    for j in range(runs):
        d |= (keys >= cuts[:, 2 * j, None]) & (keys < cuts[:, 2 * j + 1, None])
    for mask in (d, d ^ (torch.rand(nq, nk, generator=g) < 0.05)):
        col = RunCollector(nq, nk, None, "cpu")
        col.add(mask[: nq // 2])
        col.add(mask[nq // 2 :])
        lo, hi, count = col.finish()
        want_lo, want_hi, want_count = from_dense_rows(mask, nk)
        assert torch.equal(count, want_count)
        assert torch.equal(lo[:, : want_lo.shape[1]], want_lo)
        assert torch.equal(hi[:, : want_hi.shape[1]], want_hi)


LIFTED = {c[0] for c in CASES} - {
    "dilated_sliding_window",  # (q - kv) % d: a residue of a mixed term
    "fa4_dilated",
    "jetspec_tree",  # a 2-D table indexed by q and kv
    "vsa",  # a per-query list compared with every key
    "vsa_sizes",
}


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_lifting_coverage(case):
    name, fn, nq, nk, batch, heads = case
    plan = cm.from_mask_mod(fn, nq, nk, batch=batch, heads=heads, block_m=16, block_n=16)
    assert (plan.source == "from_mask_mod:lifted") == (name in LIFTED), plan.source


# ------------------------------------------------------------------ lifted forms, property tests
_DOC = torch.sort(torch.randint(0, 6, (97,), generator=torch.Generator().manual_seed(3))).values
_OFF = torch.searchsorted(_DOC, torch.arange(8))


def _index_terms(draw):
    c = draw(st.integers(-9, 9))
    d = draw(st.integers(1, 7))
    return draw(
        st.sampled_from(
            [
                lambda i: i,
                lambda i: i + c,
                lambda i: c - i,
                lambda i: i // d,
                lambda i: i % d,
                lambda i: _DOC[i],
                lambda i: i - _OFF[_DOC[i]],
                lambda i: (i * 2 + c).clamp(0, 40),
                lambda i: i < 3 * d,
            ]
        )
    )


@st.composite
def atoms(draw):
    fq = _index_terms(draw)
    fk = _index_terms(draw)
    op = draw(st.sampled_from(["ge", "gt", "le", "lt", "eq", "ne"]))
    shape = draw(st.sampled_from(["plain", "abs", "sum", "const", "rows", "disc"]))
    w = draw(st.integers(0, 40))
    if shape == "disc":
        gq, gk = _index_terms(draw), _index_terms(draw)
        dop = draw(st.sampled_from(["lt", "le", "gt", "ge"]))

        def disc(q, k):
            dy, dx = fq(q) - fk(k), gq(q) - gk(k)
            return getattr(torch, dop)(dy * dy + dx * dx, w)

        return disc
    if shape == "abs":
        return lambda q, k: getattr(torch, op)((fq(q) - fk(k)).abs(), w)
    if shape == "sum":
        return lambda q, k: getattr(torch, op)(fq(q) + 2 * fk(k), w)
    if shape == "const":
        return lambda q, k: getattr(torch, op)(fk(k), w)
    if shape == "rows":  # whole rows: a value of q_idx alone
        return lambda q, k: getattr(torch, op)(fq(q), w)
    return lambda q, k: getattr(torch, op)(fq(q), fk(k))


def _combine(children):
    return st.one_of(
        st.tuples(children, children).map(lambda p: lambda q, k: p[0](q, k) & p[1](q, k)),
        st.tuples(children, children).map(lambda p: lambda q, k: p[0](q, k) | p[1](q, k)),
        children.map(lambda a: lambda q, k: ~a(q, k)),
    )


MASK_EXPRS = st.recursive(atoms(), _combine, max_leaves=5)


@settings(max_examples=150, deadline=None)
@given(expr=MASK_EXPRS, nq=st.integers(1, 97), nk=st.integers(1, 97))
def test_lifted_forms_match_evaluation(expr, nq, nk):
    """Every form the lifter accepts gives exactly the evaluated mask (no probe involved)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return expr(q_idx, kv_idx)

    try:
        lo, hi = lift.lift_intervals(mask_mod, nq, nk, [(0, 0)], "cpu")
    except lift.Unsupported:
        return
    want = create_mask(mask_mod, None, None, nq, nk, device="cpu")[0, 0]
    assert torch.equal(dense_rows(lo[0], hi[0], nk), want)
    k = max(1, int((lo < hi).sum(-1).max()))
    lo, hi = lift.finished(lo, hi, k, nk)
    assert torch.equal(dense_rows(lo[0], hi[0], nk), want)
    assert ((lo < hi) | ((lo == nk) & (hi == nk))).all()  # empty slots padded


@pytest.mark.parametrize("name", ["causal", "sliding_window", "document", "hstu",
                                  "shared_prompt", "clear"])  # fmt: skip
def test_seed_workload_mask_mods_lift(name):
    """The seed workloads written as a Flex user writes them are lifted, and exact."""
    from compilemask.tools.peers import flex_mask_mod

    mask = {
        "causal": cm.masks.causal(),
        "sliding_window": cm.masks.sliding_window(7),
        "document": cm.masks.document([9, 1, 30, 24]),
        "hstu": cm.masks.hstu([30, 25, 9], [3, 2, 1], contextual=2),
        "shared_prompt": cm.masks.shared_prompt([10, 6], [[8, 9], [20, 11]]),
        "clear": cm.masks.clear((6, 9), 3, 10),
    }[name]
    n = 64
    mm = flex_mask_mod(mask, "cpu")
    plan = check_plan(cm.from_mask_mod(mm, n, block_m=16, block_n=16))
    assert plan.source == "from_mask_mod:lifted"
    assert torch.equal(plan.to_dense(), flex_dense(mm, n, n, None, None)[0, 0])
    assert torch.equal(plan.to_dense(), cm.dense(mask, n))


# ------------------------------------------------------------------ BlockMask interop
def _block_mask_dense(bm, batch, heads):
    """The mask a BlockMask applies: full blocks, and partial blocks where mask_mod holds."""
    q_len, kv_len = bm.seq_lengths
    bq, bk = bm.BLOCK_SIZE
    b0, h0 = bm.kv_num_blocks.shape[:2]
    out = torch.zeros(batch or 1, heads or 1, q_len, kv_len, dtype=torch.bool)
    mm = bm.mask_mod
    pairs = [(bm.kv_num_blocks, bm.kv_indices, False)]
    if bm.full_kv_num_blocks is not None:
        pairs.append((bm.full_kv_num_blocks, bm.full_kv_indices, True))
    for b in range(batch or 1):
        for h in range(heads or 1):
            ev = create_mask(mm, None, None, q_len, kv_len, device="cpu")[0, 0] if mm else None
            if mm is not None and (batch or heads):
                fixed = lambda _b, _h, q, k, b=b, h=h: mm(torch.tensor(b), torch.tensor(h), q, k)  # noqa: E731
                ev = create_mask(fixed, None, None, q_len, kv_len, device="cpu")[0, 0]
            for num, idx, full in pairs:
                for i in range(num.shape[2]):
                    for j in idx[b % b0, h % h0, i, : num[b % b0, h % h0, i]].tolist():
                        rows = slice(i * bq, (i + 1) * bq)
                        cols = slice(j * bk, (j + 1) * bk)
                        out[b, h, rows, cols] |= True if full or ev is None else ev[rows, cols]
    return out


@pytest.mark.parametrize("name", ["document_causal", "fa4_document", "natten", "vsa_sizes"])
def test_from_block_mask_is_flex_mask(name):
    from torch.nn.attention.flex_attention import create_block_mask

    _, fn, nq, nk, batch, heads = next(c for c in CASES if c[0] == name)
    bm = create_block_mask(fn, batch, heads, nq, nk, device="cpu", BLOCK_SIZE=16)
    plan = check_plan(cm.from_block_mask(bm))
    assert plan.source.startswith("from_block_mask:")
    assert (plan.block_m, plan.block_n) == (16, 16)
    assert torch.equal(plan_dense(plan, batch, heads), flex_dense(fn, nq, nk, batch, heads))


def test_from_block_mask_keeps_block_sparsity():
    """A hand-made BlockMask (a noop mask_mod over a block list) keeps exactly its blocks."""
    from torch.nn.attention.flex_attention import BlockMask, noop_mask

    num = torch.tensor([[[1, 2, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 1, 2], [2, 0, 1], [1, 0, 2]]]], dtype=torch.int32)
    full_num = torch.tensor([[[0, 1, 0]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[0, 0, 0], [1, 0, 0], [0, 0, 0]]]], dtype=torch.int32)
    causal_mod = lambda b, h, q, k: q >= k  # noqa: E731
    for mm in (noop_mask, causal_mod):
        bm = BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=8,
                                      mask_mod=mm, seq_lengths=(20, 22))  # fmt: skip
        plan = check_plan(cm.from_block_mask(bm))
        assert torch.equal(plan_dense(plan, None, None), _block_mask_dense(bm, None, None))


@pytest.mark.parametrize(
    "make",
    [
        lambda: cm.compile(
            cm.masks.hstu([30, 25, 9], [3, 2, 1], contextual=2), 64, block_m=16, block_n=16
        ),  # fmt: skip
        lambda: cm.from_dense(
            torch.rand(2, 3, 40, 50, generator=torch.Generator().manual_seed(2)) < 0.6,
            block_m=16,
            block_n=16,
        ),  # fmt: skip
        lambda: cm.compile(
            cm.masks.per_head([cm.masks.causal(), cm.masks.sliding_window(5)]),
            45,
            37,
            heads=2,
            block_m=16,
            block_n=8,
        ),  # fmt: skip
    ],
    ids=["hstu", "bits", "per_head"],
)
def test_to_block_mask_round_trip(make):
    plan = make()
    bm = plan.to_block_mask()
    assert bm.BLOCK_SIZE == (plan.block_m, plan.block_n)
    want = plan_dense(plan, plan.batch, plan.heads)
    assert torch.equal(_block_mask_dense(bm, plan.batch, plan.heads), want)
    back = check_plan(cm.from_block_mask(bm))
    assert torch.equal(plan_dense(back, plan.batch, plan.heads), want)


def test_to_block_mask_runs_in_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    plan = cm.compile(cm.masks.document([20, 13, 31], causal=True), 64, block_m=16, block_n=16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g) for _ in range(3))
    want = cm.attention(q, k, v, plan, backend="reference")
    got = flex_attention(q, k, v, block_mask=plan.to_block_mask())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_to_block_mask_refuses_permuted_plans():
    plan = cm.compile(cm.tile_grid(cm.masks.natten2d((8, 8), (3, 3)), (2, 4)), 64)
    with pytest.raises(CompileMaskError, match="in_permuted_order"):
        plan.to_block_mask()
    assert plan.in_permuted_order().to_block_mask().seq_lengths == (64, 64)


def test_plans_persist(tmp_path):
    _, fn, nq, nk, batch, heads = next(c for c in CASES if c[0] == "fa4_document")
    plan = cm.from_mask_mod(fn, nq, nk, batch=batch, heads=heads, block_m=16, block_n=16)
    plan.save(tmp_path / "p.pt")
    back = cm.load_plan(tmp_path / "p.pt")
    assert back.source == plan.source
    assert torch.equal(back.to_dense(), plan.to_dense())


# ------------------------------------------------------------------ GPU (pytest -m gpu)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lifting", [True, False], ids=["lifted", "evaluated"])
def test_gpu_plans_equal_cpu_plans(lifting):
    from compilemask.tools.peers import flex_mask_mod

    g = torch.Generator().manual_seed(0)
    lengths = torch.diff(torch.randint(0, 4096, (40,), generator=g).sort().values,
                         prepend=torch.tensor([0]), append=torch.tensor([4096]))  # fmt: skip
    lengths = [int(x) for x in lengths if x > 0]
    for mask in (cm.masks.causal(), cm.masks.document(lengths), cm.masks.clear((32, 64), 8, 2048)):
        n = 4096
        cpu = cm.from_mask_mod(flex_mask_mod(mask, "cpu"), n, lifting=lifting)
        gpu = cm.from_mask_mod(flex_mask_mod(mask, "cuda"), n, lifting=lifting, device="cuda")
        assert gpu.source == cpu.source
        assert torch.equal(gpu.to_dense().cpu(), cpu.to_dense())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_evaluation_memory_is_bounded_at_128k():
    n = 128 * 1024
    torch.cuda.reset_peak_memory_stats()
    plan = cm.from_mask_mod(lambda b, h, q, k: k <= q, n, lifting=False, device="cuda")
    assert plan.source == "from_mask_mod:broadcast"
    assert torch.cuda.max_memory_allocated() < 3 * 2**30  # the N x N mask would be 16 GiB


# ------------------------------------------------------------------ trace reuse
def _doc_mod(doc):
    return lambda b, h, q, k: (doc[q] == doc[k]) & (k <= q)


def test_trace_reused_and_captured_tensors_read_fresh():
    from compilemask.compiler.migrate import trace

    doc = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)
    mm = _doc_mod(doc)
    first = cm.from_mask_mod(mm, 16)
    assert first.source == "from_mask_mod:lifted"
    one, two = trace.symbolic_trace(mm), trace.symbolic_trace(mm)
    assert isinstance(one, trace.Bound) and one.template is two.template
    assert getattr(one, one.template.graph.find_nodes(op="get_attr")[0].target) is doc
    doc.copy_(torch.tensor([0] * 9 + [1] * 7))  # in place: the same trace, the new values
    again = cm.from_mask_mod(mm, 16)
    assert torch.equal(again.to_dense(), flex_dense(mm, 16, 16, None, None)[0, 0])
    assert not torch.equal(again.to_dense(), first.to_dense())


def test_trace_reads_values_read_by_tolist_again_after_an_in_place_update():
    """``tolist()`` reads a captured tensor without a dispatched operation: the trace holds
    the value, so an in-place update (a new version) must trace again."""
    cfg = torch.tensor([2, 0])

    def hole(b, h, q, k):
        return (k <= q) & (q != cfg.tolist()[0])

    for val in (2, 3, 300):
        cfg[0] = val
        got = cm.from_mask_mod(hole, 512, block_m=16, block_n=16).to_dense()
        assert torch.equal(got, flex_dense(hole, 512, 512, None, None)[0, 0])


def test_trace_rebound_after_rebinding_and_not_reused_when_it_reads_values():
    from compilemask.compiler.migrate import trace

    doc = torch.tensor([0] * 8 + [1] * 8)

    def rebound(b, h, q, k):
        return doc[q] == doc[k]

    trace.symbolic_trace(rebound)
    g1 = trace.symbolic_trace(rebound)
    doc = torch.tensor([0] * 3 + [1] * 13)  # the closure cell now holds another tensor
    again = trace.symbolic_trace(rebound)  # the same trace, bound to the new tensor
    assert again.template is g1.template
    assert [t is doc for t in again.attrs.values()] == [True]
    assert [t is doc for t in g1.attrs.values()] == [False]
    want = flex_dense(rebound, 16, 16, None, None)[0, 0]
    assert torch.equal(cm.from_mask_mod(rebound, 16).to_dense(), want)

    ends = torch.tensor([6])

    def reads(b, h, q, k):  # int(...) runs on real data while tracing: never reused
        return (k <= q) & (q < int(ends[0]))

    assert trace.symbolic_trace(reads) is not trace.symbolic_trace(reads)
    ends[0] = 11
    assert torch.equal(
        cm.from_mask_mod(reads, 16).to_dense(), flex_dense(reads, 16, 16, None, None)[0, 0]
    )

    def uses_torch(b, h, q, k):  # reads a global module: keyed by its identity, reused
        return torch.ge(q, k)

    trace.symbolic_trace(uses_torch)
    assert trace.symbolic_trace(uses_torch).template is trace.symbolic_trace(uses_torch).template


# ------------------------------------------------------------------ partials and defaults
def _doc_window(doc, window, scale, b, h, q, k):
    return (doc[q] == doc[k]) & (k <= q) & (q - k < window * int(scale))


def _doc_window_last(b, h, q, k, doc, window, scale):
    return _doc_window(doc, window, scale, b, h, q, k)


def _same_plan(lifted, evaluated):
    assert lifted.source == "from_mask_mod:lifted"
    assert evaluated.source != lifted.source
    assert torch.equal(lifted.to_dense(), evaluated.to_dense())
    for name in ("row_lo", "row_hi", "row_count"):
        assert torch.equal(getattr(lifted, name), getattr(evaluated, name)), name


@pytest.mark.parametrize("window", [3, torch.tensor(5)], ids=["int", "tensor"])
def test_partial_mask_mods_lift_to_the_evaluated_plan(window):
    """The bound arguments of a ``functools.partial`` (a tensor, an int, a float, by position
    or by keyword) enter the trace as captured values: it lifts to the evaluated plan."""
    import functools

    doc = torch.tensor([0] * 9 + [1] * 14 + [2] * 9)
    for mm in (
        functools.partial(_doc_window, doc, window, 2.0),
        functools.partial(_doc_window_last, doc=doc, window=window, scale=1.5),
    ):
        kw = dict(block_m=16, block_n=16)
        _same_plan(cm.from_mask_mod(mm, 32, **kw), cm.from_mask_mod(mm, 32, lifting=False, **kw))
        assert torch.equal(cm.from_mask_mod(mm, 32).to_dense(), flex_dense(mm, 32, 32, 1, 1)[0, 0])
    from compilemask.compiler.migrate import trace

    other = functools.partial(_doc_window, torch.tensor([0] * 20 + [1] * 12), window, 2.0)
    if isinstance(window, int):  # (window * 2 of a tensor runs on real data: traced anew)
        assert isinstance(trace.symbolic_trace(other), trace.Bound)  # the trace is reused
    _same_plan(cm.from_mask_mod(other, 32), cm.from_mask_mod(other, 32, lifting=False))


def test_mask_mods_with_extra_default_arguments_lift():
    doc = torch.tensor([0] * 7 + [1] * 9)

    def mm(b, h, q, k, doc=doc, window=4):
        return (doc[q] == doc[k]) & (k <= q) & (q - k < window)

    def kw_only(b, h, q, k, *, window=3):
        return (k <= q) & (q - k < window)

    for fn in (mm, kw_only):
        _same_plan(cm.from_mask_mod(fn, 16), cm.from_mask_mod(fn, 16, lifting=False))


def test_reason_for_not_lifting_names_the_form(caplog):
    """A trace whose arguments are not (b, h, q_idx, kv_idx) is refused with a sentence (it
    was an empty StopIteration)."""
    import logging

    def five(b, h, q, k, w):
        return (k <= q) & (q - k < w)

    gm = torch.fx.symbolic_trace(five)
    with pytest.raises(lift.Unsupported, match=r"takes 5 arguments.*\(b, h, q_idx, kv_idx\)"):
        lift.lift_intervals(five, 8, 8, [(0, 0)], torch.device("cpu"), gm)

    def needs_w(b, h, q, k, *, w):  # no default: cannot be called as a mask_mod at all
        return (k <= q) & (q - k < w)

    with caplog.at_level(logging.INFO, logger="compilemask.migrate"):
        with pytest.raises(CompileMaskError):
            cm.from_mask_mod(needs_w, 8)
    reasons = [r.getMessage() for r in caplog.records if "not lifted" in r.getMessage()]
    assert reasons and all("StopIteration" not in m for m in reasons)
    assert "missing 1 required keyword-only argument" in reasons[0]


def test_probe_rejects_wrong_lifted_intervals(monkeypatch):
    """A lifted answer that differs from the mask_mod on the probe is not used."""
    real = lift.lift_intervals

    def off_by_one(*args):
        lo, hi = real(*args)
        return lo, hi + (hi < lo.new_tensor(40)).int()

    monkeypatch.setattr(lift, "lift_intervals", off_by_one)
    monkeypatch.setattr(lift, "recognised_plan", lambda *args: None)  # causal: the general lifting
    plan = cm.from_mask_mod(lambda b, h, q, k: k <= q, 40)
    assert plan.source == "from_mask_mod:broadcast"
    assert torch.equal(plan.to_dense(), torch.ones(40, 40, dtype=torch.bool).tril())


def test_key_terms_beyond_int64_keys_fall_back_and_every_head_is_probed():
    """Document ids of 62 bits on one head of three: the lifter's sort key would leave int64,
    so that mask is evaluated; the plan equals FlexAttention's mask on every head."""
    g = torch.Generator().manual_seed(1)
    n, ndoc = 256, 16
    small = torch.arange(ndoc).repeat_interleave(n // ndoc)
    hashed = torch.randint(0, 2**62, (ndoc,), generator=g).repeat_interleave(n // ndoc)
    seg = torch.stack([small, hashed, small])

    def mm(b, h, q, k):
        return seg[h, q] == seg[h, k]

    plan = cm.from_mask_mod(mm, n, heads=3)
    assert torch.equal(plan.to_dense(), create_mask(mm, None, 3, n, n, device="cpu"))


@pytest.mark.parametrize("n", [1, 2, 3, 36, 37, 38, 50, 1000, 32768])
def test_probe_points_cover_ends_and_spread(n):
    pts = modeval._probe_list(n, modeval._PROBE_Q)
    assert pts == sorted(set(pts)) and all(0 <= p < n for p in pts)
    assert {0, n - 1} <= set(pts) and ({1, n - 2} <= set(pts) or n <= 2)
    assert len(pts) == min(n, modeval._PROBE_Q) or len(pts) <= modeval._PROBE_Q + 2


@pytest.mark.parametrize("bad_part", [0, 2, 5])
def test_lifted_probe_catches_one_wrong_part(bad_part):
    """The probe compares every part at once: one part's wrong row is still found."""
    docs = torch.sort(torch.randint(0, 4, (2, 3, 40), generator=torch.Generator().manual_seed(1)))
    doc = docs.values

    def mm(b, h, q, k):
        return doc[b, h, q] == doc[b, h, k]

    bh = [(b, h) for b in range(2) for h in range(3)]
    lo, hi = lift.lift_intervals(mm, 40, 40, bh, torch.device("cpu"))
    assert modeval.lifted_agrees(mm, lo, hi, 40, 40, bh, torch.device("cpu"))
    hi = hi.clone()
    hi[bad_part, 39] = lo[bad_part, 39]  # the last row (a probe row) left empty
    assert not modeval.lifted_agrees(mm, lo, hi, 40, 40, bh, torch.device("cpu"))


def test_a_mask_mod_answering_on_another_device_is_refused():
    ids = torch.zeros(64, dtype=torch.long, device="meta")
    with pytest.raises(cm.CompileMaskError, match="returned a tensor on meta"):
        cm.from_mask_mod(lambda b, h, q, k: ids[q] == ids[k], 64)


@pytest.mark.parametrize(
    "extra",
    [
        lambda q, kv, t: (q == 157).any(),
        lambda q, kv, t: t[q].any(),
        lambda q, kv, t: (q == 157).sum() > 0,
        lambda q, kv, t: (kv == 3).any() & (q > 200),
    ],
)
@pytest.mark.parametrize("lifting", [True, False])
def test_a_mask_mod_that_reduces_its_indices_is_evaluated_with_scalar_semantics(extra, lifting):
    """On broadcast indices a reduction runs over a whole block of rows; the probe's rows may
    miss the ones that matter, so such a mask_mod is evaluated under vmap: exactly
    create_mask's answer."""
    special = torch.zeros(300, dtype=torch.bool)
    special[157] = True

    def mm(b, h, q_idx, kv_idx):
        dilated = ((q_idx - kv_idx) % 3 == 0) & (kv_idx <= q_idx)
        return dilated | extra(q_idx, kv_idx, special)

    plan = cm.from_mask_mod(mm, 300, lifting=lifting, cache=False)
    want = create_mask(mm, None, None, 300, 300, device="cpu")[0, 0]
    assert torch.equal(plan.to_dense().reshape(300, 300), want)
