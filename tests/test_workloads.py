"""The seed workloads follow the rules of docs/workloads.md (checked rule by rule, not by stored
outputs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compilemask import masks
from compilemask.errors import CompileMaskError
from compilemask.workloads import NOMINAL_SIZES, SEED_WORKLOADS, Workload, batch_for, workload

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ALL = [(name, n0) for name in SEED_WORKLOADS for n0 in NOMINAL_SIZES]
CLEAR_N = {1024: 1024, 4096: 4608, 16384: 16896, 32768: 33280}


@pytest.mark.parametrize("name,n0", ALL)
def test_shape(name, n0):
    w = workload(name, n0)
    assert isinstance(w, Workload)
    assert (w.name, w.N0) == (name, n0)
    assert w.B == 32768 // n0 == batch_for(n0)
    assert w.N == (CLEAR_N[n0] if name == "clear" else n0)
    assert w.mask.batch_count is None and w.mask.head_count is None  # same mask on every row


@pytest.mark.parametrize("name,n0", ALL)
def test_deterministic(name, n0):
    assert workload(name, n0) == workload(name, n0)


@pytest.mark.parametrize("n0", NOMINAL_SIZES)
def test_causal(n0):
    assert workload("causal", n0).mask == masks.causal()


@pytest.mark.parametrize("n0", NOMINAL_SIZES)
def test_hstu_rules(n0):
    w = workload("hstu", n0)
    assert w.mask.name == "hstu"
    lengths, targets, contextual = w.mask.args
    N, cap = w.N, min(w.N, 4096)
    assert sum(lengths) == N
    assert contextual == 6
    for i, L in enumerate(lengths):
        assert L <= cap
        if i < len(lengths) - 1:
            assert L >= cap // 2  # only the last user is cut to fit
        assert L >= 2, "a user needs at least one history token"
        assert targets[i] == min(256, max(1, L // 8))
    # one generator per (workload, size), consumed user after user
    g = torch.Generator().manual_seed(0)
    pos = 0
    for L in lengths:
        drawn = int(torch.randint(cap // 2, cap + 1, (1,), generator=g))
        assert L == min(drawn, N - pos)
        pos += L


@pytest.mark.parametrize("n0", NOMINAL_SIZES)
def test_shared_prompt_rules(n0):
    w = workload("shared_prompt", n0)
    assert w.mask.name == "shared_prompt"
    prompts, responses = w.mask.args
    G = min(w.N, 16384)
    P, K = {1024: (384, 2), 4096: (1024, 4)}.get(G, (G // 8, 8))
    assert len(prompts) == len(responses) == w.N // G
    g = torch.Generator().manual_seed(0)  # consumed group after group
    for p, r in zip(prompts, responses):
        assert p == P and len(r) == K
        assert p + sum(r) == G
        assert all(x >= 1 for x in r)
        weights = 1 + 0.6 * (torch.rand(K, generator=g) - 0.5)
        floors = torch.floor(weights / weights.sum() * (G - P)).long().tolist()
        assert list(r[:-1]) == floors[:-1]  # the last response takes the remainder
    assert sum(prompts) + sum(map(sum, responses)) == w.N


@pytest.mark.parametrize("n0", NOMINAL_SIZES)
def test_clear_rules(n0):
    w = workload("clear", n0)
    grids = {1024: (16, 32), 4096: (64, 64), 16384: (128, 128), 32768: (128, 256)}
    assert w.mask == masks.clear(grids[n0], 16, 512)
    h, wd = grids[n0]
    assert w.N == 512 + h * wd


def test_small_hstu_dense_rows():
    """Spot-check the hstu rule on the dense evaluator for the first user at N0 = 1024."""
    from compilemask.language.semantics import dense

    w = workload("hstu", 1024)
    lengths, targets, C = w.mask.args
    d = dense(w.mask, w.N)
    L, T = lengths[0], targets[0]
    hist = L - T
    assert d[0, :hist].all() and not d[0, hist:].any()  # contextual row sees all history
    assert d[C, : C + 1].all() and not d[C, C + 1 :].any()  # first non-contextual history row
    assert d[hist, :hist].all() and d[hist, hist] and not d[hist, hist + 1 :].any()  # a target
    assert not d[L:, :L].any()  # never across users


@pytest.mark.parametrize("bad", ["causal2", "CLEAR", ""])
def test_unknown_name(bad):
    with pytest.raises(CompileMaskError, match="shared_prompt"):
        workload(bad, 4096)


@pytest.mark.parametrize("bad", [0, 2048, 4096.0, True])
def test_unknown_size(bad):
    with pytest.raises(CompileMaskError, match="16384"):
        workload("causal", bad)


@pytest.mark.parametrize("name", SEED_WORKLOADS)
def test_example_files_parse_to_the_workload(name):
    path = EXAMPLES / f"{name}.txt"
    if not path.exists():
        pytest.skip(f"{path.name} not generated yet (python examples/make_examples.py)")
    from compilemask.language.parser import parse

    assert parse(path.read_text()) == workload(name, 4096).mask
