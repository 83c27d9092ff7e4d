"""Packed-sequence mask_mods with per-row tables (``migrate/packed.py``) against FlexAttention's
``create_mask``: the hstu and shared_prompt forms recognised as their catalogue masks, and
tables that break a condition of the form left to the general lifting, exact either way."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm
from compilemask.compiler.migrate import lift
from compilemask.compiler.migrate.recognise import recognise

INT_DTYPES = [torch.int64, torch.int32]


def recognised(mm, n):
    return recognise(lift.traced(mm), n, n)


def check(mm, n, expect=None):
    """The plan equals FlexAttention's mask; ``expect``: the catalogue name it is recognised
    as (``""``: not recognised; None: either)."""
    plan = cm.from_mask_mod(mm, n, block_m=16, block_n=16)
    plan.verify()
    assert torch.equal(plan.to_dense(), create_mask(mm, None, None, n, n, device="cpu")[0, 0])
    if expect is not None:
        got = recognised(mm, n)
        assert (got.name if got is not None else "") == expect


def hstu_tables(lengths, targets, contextual, dtype=torch.int64):
    """Per-token user ids, history ends and contextual ends, as a Flex user builds them."""
    ls = torch.tensor(lengths)
    user = torch.repeat_interleave(torch.arange(len(lengths)), ls)
    starts = torch.cumsum(ls, 0) - ls
    hist_end = starts + ls - torch.tensor(targets)
    ctx_end = starts + torch.minimum(torch.full_like(hist_end, contextual), hist_end - starts)
    return (user * 5).to(dtype), hist_end[user].to(dtype), ctx_end[user].to(dtype)


def hstu_mods(u, he, ce):
    return [
        lambda b, h, q, k: (
            (u[q] == u[k]) & (((k < he[q]) & ((k <= q) | (q < ce[q]) | (q >= he[q]))) | (k == q))
        ),
        lambda b, h, q, k: (
            ((k == q) | (((q >= he[q]) | (q >= k) | (ce[q] > q)) & (he[q] > k))) & (u[k] == u[q])
        ),
        lambda b, h, q, k: (
            (u[q] == u[k])
            & (((k <= he[q] - 1) & ((k <= q) | (q <= ce[q] - 1) | (q > he[q] - 1))) | (k == q))
        ),
    ]


users = st.lists(st.integers(1, 12), min_size=1, max_size=6).flatmap(
    lambda ls: st.tuples(st.just(ls), st.tuples(*[st.integers(0, n - 1) for n in ls]))
)


@settings(max_examples=40, deadline=None)
@given(users=users, contextual=st.integers(0, 14), dtype=st.sampled_from(INT_DTYPES))
def test_hstu(users, contextual, dtype):
    lengths, targets = users
    u, he, ce = hstu_tables(lengths, list(targets), contextual, dtype)
    n = sum(lengths)
    he1 = he + 1  # the ``- 1`` forms above read ``he[q] - 1``: a row bound shifted by 1
    for mm in hstu_mods(u, he, ce):
        check(mm, n, "hstu")
    check(lambda b, h, q, k: (u[q] == u[k])
          & (((k <= he1[q]) & ((k <= q) | (q <= ce[q]) | (q > he[q]))) | (k == q)), n)  # fmt: skip
    plan = cm.from_mask_mod(hstu_mods(u, he, ce)[0], n)
    want = cm.compile(cm.masks.hstu(lengths, list(targets), contextual), n, cache=False)
    assert torch.equal(plan.row_lo, want.row_lo) and torch.equal(plan.row_hi, want.row_hi)


@settings(max_examples=40, deadline=None)
@given(users=users, contextual=st.integers(0, 8), seed=st.integers(0, 999))
def test_hstu_perturbed_tables_exact(users, contextual, seed):
    """One table entry moved: recognised only when the tables still have the form."""
    lengths, targets = users
    u, he, ce = hstu_tables(lengths, list(targets), contextual)
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    t = [u, he, ce][seed % 3].clone()
    t[int(torch.randint(n, (1,), generator=g))] += int(torch.randint(-2, 3, (1,), generator=g))
    tables = [t if i == seed % 3 else x for i, x in enumerate((u, he, ce))]
    check(hstu_mods(*tables)[0], n)


def test_hstu_shifted_bound_of_a_narrow_table_not_recognised():
    """``he[q] - 1`` of an int8 / uint8 table wraps in FlexAttention's arithmetic (uint8 0 - 1
    is 255): such a shifted bound is left to the general lifting, exact either way."""
    for dtype in (torch.uint8, torch.int8):
        u, he, ce = hstu_tables([3, 4, 2], [1, 0, 1], 1, dtype)
        check(hstu_mods(u, he, ce)[2], 9, "")
        check(hstu_mods(u, he, ce)[0], 9, "hstu")


def test_hstu_inconsistent_contextual_not_recognised():
    u, he, ce = hstu_tables([6, 6], [1, 1], 2)
    ce[6:] += 1  # 2 contextual rows in the first user, 3 in the second
    check(hstu_mods(u, he, ce)[0], 12, "")
    u, he, ce = hstu_tables([6, 6], [1, 1], 2)
    ce[6:] += 9  # past the second user's history: all of it contextual, clipped
    check(hstu_mods(u, he, ce)[0], 12, "")
    u, he, ce = hstu_tables([6, 6], [1, 4], 2)
    ce[6:] = 6 + 2 + 9  # past a history of 2 rows: min(contextual, 2) rows, as hstu
    check(hstu_mods(u, he, ce)[0], 12, "hstu")


def test_hstu_history_end_outside_the_user_not_recognised():
    u, he, ce = hstu_tables([6, 6], [1, 1], 2)
    he[:6] = 0  # no history: only the diagonal
    check(hstu_mods(u, he, ce)[0], 12, "")
    u, he, ce = hstu_tables([6, 6], [1, 1], 2)
    he[:6] = 8  # past the user's end
    check(hstu_mods(u, he, ce)[0], 12, "")


def shared_tables(prompts, responses, shift=0, dtype=torch.int64):
    """Per-token group ids, response ids (-1 on prompts, from ``shift`` on) and prompt ends."""
    group, resp, pend, rid, pos = [], [], [], shift, 0
    for gi, (p, rs) in enumerate(zip(prompts, responses)):
        group += [gi] * (p + sum(rs))
        resp += [-1] * p
        pend += [pos + p] * (p + sum(rs))
        for m in rs:
            resp += [rid] * m
            rid += 1
        pos += p + sum(rs)
    return (torch.tensor(x, dtype=dtype) for x in (group, resp, pend))


def shared_mods(g, r, p):
    return [
        lambda b, h, q, k: (k <= q) & (g[q] == g[k]) & ((k < p[q]) | (r[k] == r[q])),
        lambda b, h, q, k: ((r[q] == r[k]) | (p[q] > k)) & (g[k] == g[q]) & (q >= k),
    ]


groups = st.lists(
    st.tuples(st.integers(0, 6), st.lists(st.integers(1, 5), min_size=1, max_size=4)),
    min_size=1,
    max_size=4,
)


@settings(max_examples=40, deadline=None)
@given(groups=groups, shift=st.integers(-3, 3), dtype=st.sampled_from(INT_DTYPES))
def test_shared_prompt(groups, shift, dtype):
    prompts, responses = [x[0] for x in groups], [x[1] for x in groups]
    g, r, p = shared_tables(prompts, responses, shift, dtype)
    n = len(g)
    for mm in shared_mods(g, r, p):
        check(mm, n, "shared_prompt")
    p0 = p - 1
    check(lambda b, h, q, k: (k <= q) & (g[q] == g[k]) & ((k <= p0[q]) | (r[k] == r[q])), n,
          "shared_prompt")  # fmt: skip
    plan = cm.from_mask_mod(shared_mods(g, r, p)[0], n)
    want = cm.compile(cm.masks.shared_prompt(prompts, responses), n, cache=False)
    assert torch.equal(plan.row_lo, want.row_lo) and torch.equal(plan.row_hi, want.row_hi)


@settings(max_examples=40, deadline=None)
@given(groups=groups, seed=st.integers(0, 999))
def test_shared_prompt_perturbed_tables_exact(groups, seed):
    prompts, responses = [x[0] for x in groups], [x[1] for x in groups]
    g, r, p = shared_tables(prompts, responses)
    gen = torch.Generator().manual_seed(seed)
    n = len(g)
    t = [g, r, p][seed % 3].clone()
    t[int(torch.randint(n, (1,), generator=gen))] += int(torch.randint(-2, 3, (1,), generator=gen))
    tables = [t if i == seed % 3 else x for i, x in enumerate((g, r, p))]
    check(shared_mods(*tables)[0], n)


def test_shared_prompt_response_ids():
    g, r, p = shared_tables([2, 3], [[2, 3, 2], [1, 2]])
    r2 = r.clone()
    r2[7:9] = r[2]  # the third response reuses the first one's id: not recognised
    check(shared_mods(g, r2, p)[0], len(g), "")
    r3 = r.clone()
    r3[14:] = r[2]  # an id of the other group: recognised
    check(shared_mods(g, r3, p)[0], len(g), "shared_prompt")
    r4 = r.clone()
    r4[:2] = r[2]  # prompt ids do not matter
    check(shared_mods(g, r4, p)[0], len(g), "shared_prompt")


@pytest.mark.parametrize("case", ["float", "kv_gather", "no_causal", "prompt_at_end"])
def test_other_packed_forms_not_recognised(case):
    g, r, p = shared_tables([2, 3], [[2, 3], [1, 2]])
    n = len(g)
    if case == "float":
        pf = p.double()
        mm = lambda b, h, q, k: (k <= q) & (g[q] == g[k]) & ((k < pf[q]) | (r[k] == r[q]))  # noqa: E731
    elif case == "kv_gather":
        mm = lambda b, h, q, k: (k <= q) & (g[q] == g[k]) & ((q < p[k]) | (r[k] == r[q]))  # noqa: E731
    elif case == "no_causal":
        mm = lambda b, h, q, k: (g[q] == g[k]) & ((k < p[q]) | (r[k] == r[q]))  # noqa: E731
    else:
        pe = torch.where(g == 0, 7, p)  # the first group's prompt covers it: no response
        mm = lambda b, h, q, k: (k <= q) & (g[q] == g[k]) & ((k < pe[q]) | (r[k] == r[q]))  # noqa: E731
    check(mm, n, "")


def test_tables_read_on_every_call():
    """The trace and its formula are reused; the tables' values are read on every call."""
    g, r, p = shared_tables([2, 3], [[2, 3], [1, 2]])
    mm = shared_mods(g, r, p)[0]
    check(mm, len(g), "shared_prompt")
    p[:7] = 1  # the first group's prompt is one token
    check(mm, len(g), "shared_prompt")
    r[2:4] = r[4]  # its two responses share an id: one response of five tokens
    check(mm, len(g), "shared_prompt")
    p[0] = 3  # not one prompt end per group: lifted
    check(mm, len(g), "")


def _seed_mods(device):
    """The seed mask_mods with tables (``tools.peers.flex_mask_mod``) built on ``device``."""
    from compilemask.tools.peers import flex_mask_mod

    return {  # name -> (mask_mod, its length)
        "document": (flex_mask_mod(cm.masks.document([5, 9, 2, 8]), device), 24),
        "hstu": (flex_mask_mod(cm.masks.hstu([9, 6, 9], [2, 1, 3], contextual=2), device), 24),
        "shared_prompt": (
            flex_mask_mod(cm.masks.shared_prompt([3, 2, 1], [[4, 2], [3], [2, 1, 3]]), device),
            21,
        ),
    }


def _no_general_lifting(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the general lifting ran: the form was not recognised")

    monkeypatch.setattr(lift, "lift_intervals", refuse)


@pytest.mark.parametrize("name", ["document", "hstu", "shared_prompt"])
def test_recognised_whatever_the_device_is_called(name, monkeypatch):
    """Recognition does not compare the tables' device with the plan's: a plan asked on
    ``cpu:0`` with tables on ``cpu`` (as ``cuda`` against ``cuda:0``) is still recognised."""
    mm, n = _seed_mods("cpu")[name]
    want = create_mask(mm, None, None, n, n, device="cpu")[0, 0]
    _no_general_lifting(monkeypatch)
    plan = cm.from_mask_mod(mm, n, block_m=16, block_n=16, device=torch.device("cpu", 0))
    assert plan.source == "from_mask_mod:lifted"
    assert torch.equal(plan.to_dense().cpu(), want)


def test_tables_on_two_devices_not_recognised():
    u, he, ce = hstu_tables([3, 4], [1, 1], 1)
    he = he.to("meta")  # no data: never read
    assert recognised(hstu_mods(u, he, ce)[0], len(u)) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["document", "hstu", "shared_prompt"])
def test_recognised_with_tables_on_cuda(name, monkeypatch):
    """Tables on ``cuda`` (``cuda:0``) and a plan on ``"cuda"``: recognised, one host copy."""
    mm, n = _seed_mods("cuda")[name]
    want = create_mask(mm, None, None, n, n, device="cuda")[0, 0]
    _no_general_lifting(monkeypatch)
    plan = cm.from_mask_mod(mm, n, block_m=16, block_n=16, device="cuda")
    assert torch.equal(plan.to_dense(), want)
