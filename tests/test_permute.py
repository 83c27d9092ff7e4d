"""The token-permutation pass (tile_grid): the tiled plan is the permuted mask, and attention
through it equals attention through the row-major mask (q, k, v in the original order)."""

from __future__ import annotations

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.errors import CompileMaskError
from compilemask.language.permutation import grid_permutation, tiled_order
from conftest import DEVICE

CASES = [
    (masks.clear((6, 10), 3, 7), (2, 4), 67),
    (masks.clear((8, 16), 4, 0), (4, 8), 128),
    (masks.natten2d((7, 9), (3, 5)), (2, 3), 63),
    (
        cm.parse(
            "layout t:5 img:grid(4, 6) rest:*\nimg -> img : disc(2)\nt -> * : full\n* -> t : full"
        ),
        (2, 2),
        40,
    ),
]


@pytest.mark.parametrize("mask,tile,n", CASES, ids=lambda x: str(x)[:24])
def test_tiled_plan_is_the_permuted_mask(mask, tile, n):
    tiled = masks.tile_grid(mask, tile)
    assert cm.parse(str(tiled)) == tiled
    plan = cm.compile(tiled, n, block_m=16, block_n=32, cache=False)
    perm = grid_permutation(mask, n, tile)
    assert sorted(perm.tolist()) == list(range(n))
    want = cm.dense(mask, n)[perm][:, perm]
    assert torch.equal(cm.dense(tiled, n), want)
    assert torch.equal(plan.to_dense(), want)
    plan.verify()
    assert torch.equal(plan.permutation, perm)
    assert plan.in_permuted_order().permutation is None


@pytest.mark.parametrize("trim", [True, False])
@pytest.mark.parametrize(
    "grid,kernel,tile",
    [
        ((6, 8), (1, 1), (2, 4)),
        ((6, 8), (1, 3), (2, 4)),
        ((12, 16), (3, 7), (4, 8)),
        ((8, 12), (5, 3), (8, 4)),
        ((12, 16), (1, 7), (3, 8)),
        ((6, 16), (3, 5), (6, 8)),
    ],
    ids=str,
)
def test_tiled_natten_closed_form_equals_the_permuted_rows(grid, kernel, tile, trim):
    """tile_grid(natten2d) built in closed form (a window smaller than a tile) is, bit for bit,
    what the permutation pass makes of the row-major rows: trimmed (K the largest count) and
    untrimmed (K = 2 kh, [N, N) in the unused slots)."""
    from compilemask.compiler.lower import lower
    from compilemask.compiler.permute import permute_rows, tiled_natten_fits, tiled_natten_rows

    n = grid[0] * grid[1]
    inner = masks.natten2d(grid, kernel)
    assert tiled_natten_fits(grid, kernel, tile, n, n)
    lo, hi, _ = lower(inner, n, n, "cpu", trim=trim)
    want = permute_rows(lo.view(1, n, -1), hi.view(1, n, -1), grid_permutation(inner, n, tile), n)
    got = tiled_natten_rows(grid, kernel, tile, "cpu", trim=trim)
    k = want[0].shape[-1]
    assert got[0].shape[-1] == (k if trim else 2 * kernel[0])
    assert torch.equal(got[2], want[2])
    assert torch.equal(got[0][..., :k], want[0]) and torch.equal(got[1][..., :k], want[1])
    assert bool((got[0][..., k:] == n).all() and (got[1][..., k:] == n).all())
    plan = cm.compile(masks.tile_grid(inner, tile), n, block_m=16, block_n=32, cache=False)
    plan.verify()
    perm = grid_permutation(inner, n, tile)
    assert torch.equal(plan.to_dense(), cm.dense(inner, n)[perm][:, perm])


def test_tiled_natten_closed_form_declines_windows_as_wide_as_a_tile():
    """A window as wide (or high) as a tile can make two pieces touch: the permutation pass."""
    from compilemask.compiler.permute import tiled_natten_fits

    assert not tiled_natten_fits((8, 16), (3, 7), (4, 7), 128, 128)  # tw does not divide w
    assert not tiled_natten_fits((8, 16), (3, 9), (4, 8), 128, 128)  # kw > tw
    assert not tiled_natten_fits((8, 16), (3, 8), (4, 8), 128, 128)  # kw == tw
    assert not tiled_natten_fits((8, 16), (5, 3), (4, 8), 128, 128)  # kh > th
    assert not tiled_natten_fits((8, 16), (3, 3), (4, 8), 120, 128)  # not the whole axis


def test_tiled_permutation_is_kept_per_shape_and_each_plan_owns_its_copy():
    """New plans of one tile_grid mask and length reuse its permutation's values, each plan
    with its own tensor: a write into one plan's permutation reaches no other plan."""
    mask = masks.tile_grid(masks.clear((8, 16), 4, 0), (4, 8))
    a = cm.compile(mask, 128, block_m=16, block_n=32, cache=False)
    b = cm.compile(mask, 128, block_m=16, block_n=32, cache=False)
    assert b.permutation is not a.permutation and torch.equal(b.permutation, a.permutation)
    a.permutation[:2] = a.permutation[:2].flip(0)  # a user's write into a plan's tensor
    b.verify()
    c = cm.compile(mask, 128, block_m=16, block_n=32, cache=False)
    assert torch.equal(c.permutation, grid_permutation(mask.mask, 128, (4, 8)))
    c.verify()


def test_tiled_order_edge_tiles():
    order = tiled_order(3, 5, (2, 2))
    # tiles row-major, row-major inside: first tile holds cells (0,0) (0,1) (1,0) (1,1)
    assert order[:4].tolist() == [0, 1, 5, 6]
    assert sorted(order.tolist()) == list(range(15))


def test_attention_through_a_tiled_plan_equals_the_row_major_one():
    mask = masks.clear((8, 12), 3, 16)
    n = 16 + 96
    plan = cm.compile(mask, n)
    tiled = cm.compile(masks.tile_grid(mask, (4, 4)), n)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g, dtype=torch.float64) for _ in range(3))
    q.requires_grad_(True)
    a, lse_a = cm.attention(q, k, v, plan, backend="reference", return_lse=True)
    b, lse_b = cm.attention(q, k, v, tiled, backend="reference", return_lse=True)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(lse_a, lse_b)
    (ga,) = torch.autograd.grad(a.sum(), q)
    (gb,) = torch.autograd.grad(b.sum(), q)
    torch.testing.assert_close(ga, gb)
    assert tiled.stats()["tiles_full"] >= plan.stats()["tiles_full"]


def test_tile_grid_errors():
    with pytest.raises(CompileMaskError, match="2-D grid"):
        cm.compile(masks.tile_grid(masks.causal()), 16)
    with pytest.raises(CompileMaskError, match="q_len == kv_len"):
        cm.compile(masks.tile_grid(masks.natten2d((4, 4), (3, 3))), 16, 20)
    with pytest.raises(CompileMaskError, match="outermost"):
        cm.compile(masks.tile_grid(masks.natten2d((4, 4), (3, 3))) | masks.causal(), 16)
    with pytest.raises(CompileMaskError, match="tile"):
        masks.tile_grid(masks.causal(), (0, 4))


def test_reference_functions_apply_a_tiled_plan_permutation():
    from compilemask.kernels.reference import reference_attention, reference_attention_backward

    mask = masks.clear((6, 8), 2, 5)
    n = 5 + 48
    plan = cm.compile(mask, n)
    tiled = cm.compile(masks.tile_grid(mask, (2, 4)), n)
    g = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for _ in range(4))
    dlse = torch.randn(1, 2, n, generator=g, dtype=torch.float64)
    for a, b in zip(reference_attention(q, k, v, plan), reference_attention(q, k, v, tiled)):
        torch.testing.assert_close(a, b)
    ga = reference_attention_backward(q, k, v, plan, do, dlse=dlse)
    gb = reference_attention_backward(q, k, v, tiled, do, dlse=dlse)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("compiled", [False, True])
def test_tiled_plan_gradients_in_q_k_v_and_through_lse(compiled):
    """The permutations are gathers both ways (their gradients too), eager and compiled."""
    mask = masks.clear((8, 12), 3, 16)
    n = 16 + 96
    plan = cm.compile(mask, n)
    tiled = cm.compile(masks.tile_grid(mask, (4, 4)), n)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, n, 32, generator=g, dtype=torch.float64) for _ in range(3))
    w_out, w_lse = torch.randn(2, 2, n, 32, generator=g), torch.randn(2, 2, n, generator=g)

    def grads(p):
        x = [t.clone().requires_grad_(True) for t in (q, k, v)]

        def f(q, k, v):
            return cm.attention(q, k, v, p, backend="reference", return_lse=True)

        fn = torch.compile(f, fullgraph=True, backend="aot_eager") if compiled else f
        out, lse = fn(*x)
        ((out * w_out).sum() + (lse * w_lse).sum()).backward()
        return [t.grad for t in x]

    for a, b in zip(grads(plan), grads(tiled)):
        torch.testing.assert_close(a, b)


@pytest.mark.kernel
def test_triton_token_gather_is_index_select():
    """The Triton row copy of tile_grid plans on CUDA (here through the interpreter)."""
    pytest.importorskip("triton", reason="the Triton row copy needs triton installed")
    from compilemask.kernels.triton.permute import gather_tokens

    dev = DEVICE
    g = torch.Generator().manual_seed(2)
    for shape, d in (((2, 3, 70), 32), ((1, 2, 9), 96)):
        x = torch.randn(*shape, d, generator=g).to(dev, torch.float16)
        x = x.transpose(1, 2).contiguous().transpose(1, 2)  # strided heads
        index = torch.randperm(shape[2], generator=g).to(dev)
        got = gather_tokens(x, index)
        assert got.is_contiguous()
        assert torch.equal(got, x.index_select(2, index))
        assert torch.equal(gather_tokens(x, index[:5]), x.index_select(2, index[:5]))
        assert torch.equal(gather_tokens(x, index[::2]), x.index_select(2, index[::2]))


def test_every_backend_permutes_with_the_triton_row_copy_where_triton_runs():
    """tile_grid plans on backends without a gather of their own (cudnn, fa4, cute, the
    reference) permute with the Triton backend's row copy, not ``index_select``."""
    from compilemask.kernels import registry

    triton_backend = registry.get("triton")
    for name in registry.names():
        backend = registry.get(name)
        got = registry.token_gather(backend)
        if hasattr(backend, "gather_tokens"):
            assert got == backend.gather_tokens
        elif triton_backend.available()[0]:
            assert got == triton_backend.gather_tokens
        else:
            assert got is None


def _clear_plans():
    mask = masks.clear((6, 8), 2, 5)
    return cm.compile(mask, 53), cm.compile(masks.tile_grid(mask, (2, 4)), 53)


def test_tiled_plan_forward_mode_ad():
    plain, tiled = _clear_plans()
    g = torch.Generator().manual_seed(1)
    q, k, v, t = (torch.randn(1, 2, 53, 32, generator=g, dtype=torch.float64) for _ in range(4))
    got = [
        torch.func.jvp(lambda x, p=p: cm.attention(x, k, v, p, backend="reference"), (q,), (t,))
        for p in (plain, tiled)
    ]
    torch.testing.assert_close(got[0][1], got[1][1])


@pytest.mark.parametrize("triton_gather", [False, pytest.param(True, marks=pytest.mark.kernel)])
def test_tiled_plan_second_order_gradients(monkeypatch, triton_gather):
    """Gradients of gradients through the token permutations, also with the Triton row copy
    that CUDA runs in eager mode (here through the interpreter)."""

    if triton_gather:
        pytest.importorskip("triton", reason="the Triton row copy needs triton installed")
        from compilemask.kernels import registry
        from compilemask.kernels.triton.permute import gather_tokens

        # the reference backend with the Triton row copy as its token gather
        monkeypatch.setattr(
            registry.get("reference"), "gather_tokens", gather_tokens, raising=False
        )
    plain, tiled = _clear_plans()
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 53, 32, generator=g, dtype=torch.float32) for _ in range(3))

    def second(plan):
        x = q.clone().requires_grad_(True)
        out = cm.attention(x, k, v, plan, backend="reference")
        (gq,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(gq.pow(2).sum(), x)[0]

    torch.testing.assert_close(second(tiled), second(plain), atol=1e-4, rtol=1e-4)


def test_a_permutation_swapped_by_replace_gets_its_own_inverse():
    """``dataclasses.replace(plan, permutation=...)`` keeps the plan's derived cache (its
    basis is the other tensors) but not the inverse of the old permutation."""
    import dataclasses

    plan = cm.compile(cm.tile_grid(cm.masks.clear((8, 16), 3, 16), (4, 8)), block_m=16, block_n=16)
    n = plan.q_len
    q, k, v = (torch.randn(1, 1, n, 32, dtype=torch.float64) for _ in range(3))
    cm.attention(q, k, v, plan, backend="reference")  # caches the inverse
    perm2 = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    p2 = dataclasses.replace(plan, permutation=perm2)
    assert torch.equal(p2.inverse_permutation, torch.argsort(perm2))
    base = plan.in_permuted_order()
    want = cm.attention(*(t.index_select(2, perm2) for t in (q, k, v)), base, backend="reference")
    want = want.index_select(2, torch.argsort(perm2))
    torch.testing.assert_close(cm.attention(q, k, v, p2, backend="reference"), want)
