"""``backend="cute"``: the lowering of plans to the sm90 kernel's work list and tile lists
(CPU, no ``cutlass`` needed) and the kernel against the float64 reference (GPU, ``-m gpu``;
skipped without ``nvidia-cutlass-dsl`` or an sm90 GPU)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import compilemask as cm
from compilemask.compiler.tiles import FULL
from compilemask.errors import CompileMaskError
from compilemask.kernels.cute.backend import CuteBackend
from compilemask.kernels.cute.lower import dense_from_lowered, lower, thread_layout

M = cm.masks


def _catalogue():
    """(id, plan, B, Hq, Hkv) for the kinds of plan the lowering meets."""
    return [
        ("causal", cm.compile(M.causal(), 300), 2, 2, 1),
        ("causal_kv_longer", cm.compile(M.causal(), 200, 330), 1, 2, 2),
        ("sliding_window", cm.compile(M.sliding_window(40), 410), 1, 4, 2),
        ("shared_prompt", cm.compile(M.shared_prompt(90, [50, 70, 40])), 2, 2, 2),
        ("hstu", cm.compile(M.hstu([200, 140], [30, 20], contextual=2)), 2, 2, 1),
        ("clear", cm.compile(M.clear((6, 8), 3, 50)), 1, 2, 2),
        ("clear_tile_grid", cm.compile(M.tile_grid(M.clear((24, 40), 8, 64))), 1, 1, 1),
        ("clear_tiles_64", cm.compile(M.clear((24, 40), 8, 64), block_m=64, block_n=64), 1, 2, 1),
        (
            "per_head",
            cm.compile(M.per_head([M.causal(), M.sliding_window(30), M.chunked(80)]), 300, heads=3),
            2,
            3,
            1,
        ),  # fmt: skip
        (
            "per_batch",
            cm.compile(M.per_batch([M.causal(), M.prefix_lm(90)]), 290, batch=2),
            2,
            4,
            2,
        ),  # fmt: skip
        ("empty_rows", cm.compile(M.sliding_window(40), 500, 300), 2, 2, 2),
        ("plan_tiles_128", cm.compile(M.causal(), 384, block_m=128, block_n=128), 1, 1, 1),
        ("from_dense_bits", cm.from_dense(_random_dense(200, 260)), 1, 2, 1),
    ]


def _random_dense(q_len: int, kv_len: int) -> torch.Tensor:
    """A random boolean mask (rows of many short runs: a bitmask plan) with a few empty rows."""
    g = torch.Generator().manual_seed(3)
    dense = torch.rand(q_len, kv_len, generator=g) < 0.4
    dense[5:9] = False
    return dense


CATALOGUE = _catalogue()
IDS = [c[0] for c in CATALOGUE]


@pytest.mark.parametrize("name,plan,batch,hq,hkv", CATALOGUE, ids=IDS)
def test_lowered_tiles_rebuild_the_dense_mask(name, plan, batch, hq, hkv):
    """FULL tiles and the PARTIAL entries' thread-order pages, read as the kernel reads them,
    give the dense mask, and no page shows a row past q_len or a key past kv_len."""
    low = lower(plan.in_permuted_order(), batch, hq, hkv)
    dense = plan.in_permuted_order().to_dense()
    dense = dense.view(-1, plan.q_len, plan.kv_len)
    assert name != "from_dense_bits" or plan.encoding == "bits"
    for m in range(dense.shape[0]):
        got = dense_from_lowered(low, plan.q_len, plan.kv_len, m, padded=True)
        assert torch.equal(got[: plan.q_len, : plan.kv_len], dense[m]), f"mask {m}"
        assert not bool(got[plan.q_len :].any()) and not bool(got[:, plan.kv_len :].any())


@pytest.mark.parametrize("name,plan,batch,hq,hkv", CATALOGUE, ids=IDS)
def test_kv_lists_put_full_tiles_first(name, plan, batch, hq, hkv):
    low = lower(plan, batch, hq, hkv)
    assert (low.block_m, low.block_n) == (128, 128)
    from compilemask.kernels.cute.lower import schedule_for_kernel

    kind = schedule_for_kernel(plan).kind
    for m in range(low.kv_list.shape[0]):
        for qt in range(low.kv_list.shape[1]):
            n, nf = int(low.kv_count[m, qt]), int(low.full_count[m, qt])
            tiles = low.kv_list[m, qt, :n].tolist()
            kinds = [int(kind[m, qt, t]) for t in tiles]
            assert all(k == FULL for k in kinds[:nf])
            assert all(k != FULL for k in kinds[nf:])
            assert sorted(tiles) == sorted(set(tiles))  # each touched tile once


@pytest.mark.parametrize("name,plan,batch,hq,hkv", CATALOGUE, ids=IDS)
def test_work_list_covers_every_q_tile_heaviest_first(name, plan, batch, hq, hkv):
    low = lower(plan, batch, hq, hkv)
    tq = low.kv_count.shape[1]
    work = low.work.tolist()
    assert len(work) == batch * hq * tq
    assert sorted((b, h, t) for b, h, t, *_ in work) == [
        (b, h, t) for b in range(batch) for h in range(hq) for t in range(tq)
    ]
    weights = [int(low.kv_count[m, t]) for _, _, t, m, *_ in work]
    assert weights == sorted(weights, reverse=True)
    for b, h, _, m, *_ in work:
        assert m == plan.mask_index(b, h)
    # ties: the heads of one kv group are adjacent
    group = hq // hkv
    for i in range(len(work) - 1):
        (b0, h0, t0, *_), (b1, h1, t1, *_) = work[i], work[i + 1]
        if weights[i] == weights[i + 1] and (b0, h0 // group, t0) == (b1, h1 // group, t1):
            assert h1 == h0 + 1


@pytest.mark.parametrize("name,plan,batch,hq,hkv", CATALOGUE, ids=IDS)
def test_work_and_tile_entries_carry_what_the_kernel_looks_up_through_them(
    name, plan, batch, hq, hkv
):
    """Columns 4, 5 of a work entry are its q-tile's kv count and FULL count; row ``i`` of
    ``tiles[m, qt]`` is ``(kt, page)`` of kv-list entry ``i``: a page for each PARTIAL entry
    (pages distinct, each used), -1 for FULL entries."""
    low = lower(plan, batch, hq, hkv)
    assert low.work.shape[1] == 7 and low.work.dtype == torch.int32
    assert low.tiles.shape == (*low.kv_list.shape, 2) and low.tiles.dtype == torch.int32
    assert low.pages.dtype == torch.int64 and low.pages.shape[1] == 256
    assert low.pages.is_contiguous()
    rows = low.tiles.view(-1, 2)  # as the kernel reads it
    page_of = {}  # (m, qt, i) -> page, over every work entry of the q-tile
    for _, _, qt, m, n, nf, list0 in low.work.tolist():
        assert (n, nf) == (int(low.kv_count[m, qt]), int(low.full_count[m, qt]))
        for i in range(n):
            kt, page = rows[list0 + i].tolist()
            assert kt == int(low.kv_list[m, qt, i])
            assert (page == -1) == (i < nf)
            if page >= 0:
                assert page_of.setdefault((m, qt, i), page) == page
    partial = int((low.kv_count - low.full_count).sum())
    assert len(page_of) == partial
    assert torch.unique(low.pages, dim=0).shape[0] == low.pages.shape[0]  # distinct pages
    if partial == 0:
        assert low.pages.shape[0] == 1 and not bool(low.pages.any())  # the zero page
    else:
        assert sorted(set(page_of.values())) == list(range(low.pages.shape[0]))  # all used


def test_entries_clamp_what_they_read_from_the_plan_to_its_ranges():
    """A schedule out of its ranges (counts past the list, FULL past the count, tiles past
    Tk, pages past P) lowers to entries inside them; the kernel clamps the page again."""
    from compilemask.kernels.cute.lower import tile_entries, work_entries

    order = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 0]], dtype=torch.int32)
    kv_count = torch.tensor([[9, -2]], dtype=torch.int32)
    full_count = torch.tensor([[7, 3]], dtype=torch.int32)
    work = work_entries(order, kv_count, full_count, 3)
    assert work[:, 4:].tolist() == [[3, 3, 0], [0, 0, 3]]
    kv_list = torch.tensor([[[0, 5, -1], [2, 1, 0]]], dtype=torch.int32)
    page = torch.tensor([[[5, -1, -7], [0, 0, 1]]], dtype=torch.int32)
    tiles = tile_entries(kv_list, page, pages=2)
    assert tiles[0, 0].tolist() == [[0, 1], [2, -1], [0, -1]]
    assert tiles[0, 1].tolist() == [[2, 0], [1, 0], [0, 1]]


def test_thread_layout_places_each_tile_position_once():
    """The 256 consumer threads' 64 bits cover the 128 x 128 tile exactly once, and thread
    ``t``'s bit ``32 r + c`` is the accumulator's row ``r`` and column ``c`` (``mn_layout``:
    row ``lane // 4 + 8 r`` of the warp's 16, columns ``8 (c // 2) + 2 (lane % 4) + c % 2``)."""
    lay = thread_layout()
    assert lay.shape == (256, 64)
    assert torch.equal(lay.flatten().sort().values, torch.arange(128 * 128))
    for t in (0, 1, 5, 37, 130, 255):
        lane, warp, cw = t % 32, t % 128 // 32, t // 128
        for r in range(2):
            for c in (0, 1, 2, 7, 30, 31):
                row = 64 * cw + 16 * warp + lane // 4 + 8 * r
                col = 8 * (c // 2) + 2 * (lane % 4) + c % 2
                assert int(lay[t, 32 * r + c]) == row * 128 + col


def test_l2_groups_keep_each_pair_together():
    """B = 32 rows of 1K tokens: the entries of each (batch row, kv head) pair run within
    its group, heaviest first inside the group; at 32K one pair per group."""
    from compilemask.kernels.cute.lower import l2_kv_group, work_order

    l2, kv_key = 50 << 20, 2 * 128 * 2
    group = l2_kv_group(32, 16, 1024, kv_key, l2)
    assert group == 50 and group * 1024 * kv_key <= l2 // 2 < (group + 1) * 1024 * kv_key
    assert l2_kv_group(1, 16, 32768, kv_key, l2) == 1
    assert l2_kv_group(1, 16, 1 << 20, kv_key, l2) == 1  # one pair exceeds L2: still one
    assert l2_kv_group(2, 2, 1024, kv_key, l2) is None  # everything fits: one list
    plan = cm.compile(cm.masks.causal(), 1024, block_m=128, block_n=128)
    q_count = schedule_for_kernel_count(plan)
    work = work_order(q_count, 6, 4, 2, None, None, kv_group=2).tolist()
    assert sorted(map(tuple, work)) == sorted(
        (b, h, t, 0) for b in range(6) for h in range(4) for t in range(8)
    )
    pairs = [(b * 2 + h // 2) // 2 for b, h, _, _ in work]
    assert pairs == sorted(pairs)
    for g in set(pairs):
        weights = [int(q_count[0, t]) for (_, _, t, _), p in zip(work, pairs) if p == g]
        assert weights == sorted(weights, reverse=True)


def schedule_for_kernel_count(plan):
    from compilemask.kernels.cute.lower import schedule_for_kernel

    return schedule_for_kernel(plan).q_count


def test_lowering_is_cached_on_the_plan_and_rejects_bad_input():
    plan = cm.compile(M.causal(), 256)
    call = SimpleNamespace(batch=1, heads_q=2, heads_kv=1, device=plan.device)
    be = CuteBackend()
    assert be.prepare(plan, call) is be.prepare(plan, call)
    with pytest.raises(CompileMaskError, match="heads_q"):
        lower(plan, 1, 3, 2)
    with pytest.raises(CompileMaskError, match="batch"):
        lower(plan, 0, 1, 1)
    for bad in (0, -1, 2.5, True, "2"):  # 0 divided by zero, -1 and 2.5 scrambled the groups
        with pytest.raises(CompileMaskError, match="kv_group must be None or a positive int"):
            lower(plan, 2, 2, 1, kv_group=bad)
    assert lower(plan, 2, 2, 1, kv_group=1).work.shape == (2 * 2 * 2, 7)


_SM = __import__("compilemask").score_mods
_ALIBI = _SM.as_score_mod(_SM.alibi(torch.ones(2)))
_TWO = _SM.as_score_mod([_SM.softcap(20.0), _SM.alibi(torch.ones(2))])


def _call(**over):
    base = dict(
        batch=1, heads_q=2, heads_kv=1, q_len=256, kv_len=256, head_dim=128,
        dtype=torch.bfloat16, device=torch.device("cuda"), requires_grad=False, return_lse=False,
    )  # fmt: skip
    base.update(over)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    "over,reason",
    [
        ({"requires_grad": True}, "forward only"),
        ({"device": torch.device("cpu")}, "CUDA"),
        ({"has_sinks": True}, "no sinks"),
        ({"score_mod": _TWO}, "alibi(slopes) alone"),
        ({"score_mod": _ALIBI, "heads_q": 512, "heads_kv": 1}, "at most 256 query heads"),
    ],
)
def test_supports_names_the_reason(over, reason):
    plan = cm.compile(M.causal(), 256)
    ok, why = CuteBackend().supports(plan, _call(**over))
    assert not ok and reason in why


def test_available_says_why_not():
    ok, why = CuteBackend().available()
    if not ok:
        assert "cute" in why or "sm90" in why or "cutlass" in why


# ------------------------------------------------------- disk cache (CPU, needs cutlass)
_HAS_CUTLASS = importlib.util.find_spec("cutlass") is not None
_SRC = Path(__file__).resolve().parents[1] / "src"
_PRECOMPILE = (
    "import torch\n"
    "from compilemask.kernels.cute import backend as cb\n"
    "cb.precompile(64, torch.float16, 'cpu')\n"
    "print(cb.kernel_origins()[(64, 'float16', 128, 128, 'cpu', '')])\n"
)


def _precompile_in_a_new_process(cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, COMPILEMASK_CACHE_DIR=str(cache), PYTHONPATH=str(_SRC))
    env.setdefault("CUTE_DSL_ARCH", "sm_90a")
    return subprocess.run(
        [sys.executable, "-c", _PRECOMPILE], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.skipif(not _HAS_CUTLASS, reason="needs nvidia-cutlass-dsl (compiles on the CPU)")
def test_a_second_process_loads_the_kernel_from_the_disk_cache(tmp_path):
    first = _precompile_in_a_new_process(tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split()[-1] == "compiled"
    files = list((tmp_path / "cute").glob("*.o"))
    assert len(files) == 1 and "d64_float16" in files[0].name
    assert not [p for p in (tmp_path / "cute").iterdir() if p.name.startswith(".tmp")]
    second = _precompile_in_a_new_process(tmp_path)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split()[-1] == "disk"
    # a damaged entry is a miss: compiled again (with a warning) and replaced
    files[0].write_bytes(b"not an object file")
    third = _precompile_in_a_new_process(tmp_path)
    assert third.returncode == 0, third.stderr
    assert third.stdout.split()[-1] == "compiled"
    assert "does not load" in third.stderr
    assert files[0].stat().st_size > 1000


def test_disk_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    from compilemask.kernels.cute import disk_cache

    monkeypatch.setenv("COMPILEMASK_CACHE_DIR", str(tmp_path))
    assert disk_cache.cache_dir() == tmp_path / "cute"
    monkeypatch.setenv("COMPILEMASK_CACHE_DIR", "off")
    assert disk_cache.cache_dir() is None
    assert disk_cache.load("anything") is None
    monkeypatch.delenv("COMPILEMASK_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert disk_cache.cache_dir() == tmp_path / "compilemask" / "cute"
    a = disk_cache.entry_name(128, "bfloat16", 128, 128, "cuda")
    b = disk_cache.entry_name(64, "bfloat16", 128, 128, "cuda")
    c = disk_cache.entry_name(128, "bfloat16", 128, 128, "cpu")
    d = disk_cache.entry_name(128, "bfloat16", 128, 128, "cuda", "softcap")
    assert len({a, b, c, d}) == 4 and a.isidentifier() and d.isidentifier()


def test_precompile_rejects_bad_arguments():
    from compilemask.kernels.cute.backend import precompile

    with pytest.raises(CompileMaskError, match="head_dim"):
        precompile(96)
    with pytest.raises(CompileMaskError, match="head_dim"):
        precompile(64.0)
    with pytest.raises(CompileMaskError, match="dtype"):
        precompile(128, torch.float32)
    with pytest.raises(CompileMaskError, match="dtype"):
        precompile(64, [])
    with pytest.raises(CompileMaskError, match="modifier"):
        precompile(64, torch.float16, modifier="relative_bias")


def test_precompile_without_the_dsl_names_the_package(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("cutlass") is not None:
        pytest.skip("the CuTe DSL is installed here")
    from compilemask.kernels.cute.backend import precompile

    with pytest.raises(CompileMaskError, match="nvidia-cutlass-dsl"):
        precompile(64, torch.bfloat16, "cpu")


# ---------------------------------------------------------------------------- GPU
_READY, _WHY = CuteBackend().available()
DT = torch.bfloat16

GPU_CASES = {
    # name: (mask, q_len, kv_len, heads of the plan, B, Hq, Hkv)
    "causal": (M.causal(), 1024, 1024, None, 2, 4, 4),
    "hstu": (M.hstu([300, 500, 224], [20, 40, 10]), None, None, None, 2, 4, 4),
    "shared_prompt": (M.shared_prompt(256, [256, 256, 256]), None, None, None, 2, 4, 4),
    "clear": (M.clear((24, 40), 8, 64), None, None, None, 2, 4, 4),
    "clear_tile_grid": (M.tile_grid(M.clear((24, 40), 8, 64)), None, None, None, 2, 4, 4),
    "per_head": (
        M.per_head([M.causal(), M.sliding_window(100), M.chunked(256), M.prefix_lm(300)]),
        1024,
        1024,
        4,
        2,
        4,
        4,
    ),  # fmt: skip
    "gqa": (M.causal(), 1024, 1024, None, 2, 4, 1),
    "empty_rows": (M.sliding_window(64), 1100, 900, None, 2, 4, 2),
    "q_len_lt_kv_len": (M.causal(), 700, 1000, None, 1, 2, 2),
    "from_dense_bits": (_random_dense(600, 760), None, None, None, 2, 4, 2),
}


def check_gpu_case(
    name: str, head_dim: int = 128, dtype: torch.dtype = DT, softcap: float | None = None,
    alibi: bool = False,
) -> str:  # fmt: skip
    """Run one case of :data:`GPU_CASES` on the GPU in ``dtype`` (``softcap``: with a lone
    softcap modifier of that cap; ``alibi``: with a lone ALiBi of the paper's slopes) and
    assert it matches the reference; returns a one-line summary."""
    from compilemask import score_mods as sm
    from compilemask.kernels.reference import reference_attention
    from compilemask.testing import check_close

    mask, nq, nk, heads, b, hq, hkv = GPU_CASES[name]
    if isinstance(mask, torch.Tensor):  # a bitmask plan (from_dense)
        plan = cm.from_dense(mask.cuda())
    else:
        plan = cm.compile(mask, nq, nk, heads=heads, device="cuda").in_permuted_order()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, plan.q_len, head_dim, device="cuda", dtype=dtype, generator=g)
    k, v = (
        torch.randn(b, hkv, plan.kv_len, head_dim, device="cuda", dtype=dtype, generator=g)
        for _ in range(2)
    )
    scale = head_dim**-0.5
    mod = None if softcap is None else sm.as_score_mod(sm.softcap(softcap))
    if alibi:
        mod = sm.as_score_mod(sm.alibi(sm.alibi_slopes(hq, device="cuda")))
    call = _call(
        batch=b, heads_q=hq, heads_kv=hkv, q_len=plan.q_len, kv_len=plan.kv_len,
        head_dim=head_dim, dtype=dtype, device=q.device, score_mod=mod,
    )  # fmt: skip
    be = CuteBackend()
    assert be.supports(plan, call) == (True, "")
    prepared = be.prepare(plan, call)
    assert int((prepared.kv_count - prepared.full_count).sum()) > 0  # PARTIAL tiles run
    out, lse = be.attend(q, k, v, plan, prepared, scale, call, score_mod=mod)
    torch.cuda.synchronize()
    assert out.shape == q.shape and lse.shape == (b, hq, plan.q_len)
    ref64, lse64 = reference_attention(
        q, k, v, plan, scale, compute_dtype=torch.float64, score_mod=mod
    )
    refdt, _ = reference_attention(
        q, k, v, plan, scale, compute_dtype=torch.float32, matmul_dtype=dtype, score_mod=mod
    )
    ok, err, bound = check_close(out, ref64, refdt, dtype)
    assert ok, f"out: {err:.3g} > {bound:.3g}"
    seen = torch.isfinite(lse64)
    assert torch.equal(torch.isneginf(lse), ~seen), "lse -inf exactly on rows that see nothing"
    torch.testing.assert_close(lse[seen], lse64[seen].float(), rtol=0, atol=2e-2)
    assert bool((out[~seen] == 0).all())
    if name == "empty_rows":
        assert bool((~seen).any())
    return (
        f"{name} d={head_dim} {dtype} softcap={softcap} alibi={alibi}: err {err:.3g} <= {bound:.3g}"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not _READY, reason=_WHY)
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_cute_forward_matches_the_reference(name):
    check_gpu_case(name, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not _READY, reason=_WHY)
def test_cute_forward_head_dim_64():
    check_gpu_case("causal", 64)


@pytest.mark.gpu
@pytest.mark.skipif(not _READY, reason=_WHY)
@pytest.mark.parametrize("name,head_dim", [("causal", 64), ("hstu", 128)])
def test_cute_forward_float16(name, head_dim):
    check_gpu_case(name, head_dim, torch.float16)


@pytest.mark.gpu
@pytest.mark.skipif(not _READY, reason=_WHY)
@pytest.mark.parametrize(
    "name,cap", [("causal", 20.0), ("hstu", 5.0), ("clear", 20.0), ("empty_rows", 2.0)]
)
def test_cute_forward_softcap(name, cap):
    """The softcap kernel (capped before the mask: rows that see nothing stay 0 / -inf) and its
    lse, of the capped scores, against the float64 reference with the same modifier."""
    check_gpu_case(name, 128, softcap=cap)
    if name == "causal":
        check_gpu_case(name, 64, torch.float16, softcap=cap)


@pytest.mark.gpu
@pytest.mark.skipif(not _READY, reason=_WHY)
@pytest.mark.parametrize("name", ["causal", "hstu", "clear", "empty_rows", "gqa"])
def test_cute_forward_alibi(name):
    """The ALiBi kernel (``s * scale + slope[h] (kv - q)`` before the mask; per query head
    under GQA; rows that see nothing stay 0 / -inf) and its lse against the float64
    reference with the same modifier."""
    check_gpu_case(name, 128, alibi=True)
    if name == "causal":
        check_gpu_case(name, 64, torch.float16, alibi=True)


_CHECK_IN_A_NEW_PROCESS = (
    "import sys\n"
    "sys.path.insert(0, {tests!r})\n"
    "from test_backend_cute import check_gpu_case\n"
    "from compilemask.kernels.cute import backend as cb\n"
    "print(check_gpu_case('hstu', 128))\n"
    "print(cb.kernel_origins()[(128, 'bfloat16', 128, 128, 'cuda', '')])\n"
)


@pytest.mark.gpu
@pytest.mark.skipif(not _READY, reason=_WHY)
def test_cute_kernel_loaded_from_the_disk_cache_runs(tmp_path):
    """A first process compiles and stores the kernel, a second loads it from disk; both
    match the reference."""
    code = _CHECK_IN_A_NEW_PROCESS.format(tests=str(Path(__file__).resolve().parent))
    path = os.pathsep.join(p for p in (str(_SRC), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, COMPILEMASK_CACHE_DIR=str(tmp_path), PYTHONPATH=path)
    origins = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr
        origins.append(done.stdout.split()[-1])
    assert origins == ["compiled", "disk"]


@pytest.mark.gpu
@pytest.mark.skipif(not _READY, reason=_WHY)
def test_cute_calls_after_the_first_make_no_host_synchronisation():
    """Warm calls through ``compilemask.attention``: no host synchronisation (torch's sync
    debug mode raises on one), the lowering is not rebuilt, and 50 calls give the same output."""
    plan = cm.compile(M.hstu([300, 500, 224], [20, 40, 10]), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, 4, plan.q_len, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(3)
    )
    first = cm.attention(q, k, v, plan, backend="cute")
    torch.cuda.synchronize()
    cached = dict(plan._cache)
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [cm.attention(q, k, v, plan, backend="cute") for _ in range(50)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert plan._cache.keys() == cached.keys()
    assert all(torch.equal(o, first) for o in outs)


def test_lowered_work_is_in_list_order_for_any_cta_count():
    """The kernel's CTAs take the entries in list order through a counter: the lowered work is
    ``work_order``'s for any CTA count, and the CTAs launched never outnumber the entries."""
    plan = cm.compile(cm.masks.causal(), 1024, block_m=128, block_n=128)
    one = lower(plan, 2, 2, 1, kv_group=1, num_ctas=1)
    three = lower(plan, 2, 2, 1, kv_group=1, num_ctas=3)
    assert three.num_ctas == 3 and one.num_ctas == 1
    assert torch.equal(three.work, one.work)
    assert lower(plan, 1, 1, 1, num_ctas=500).num_ctas == 8
    for bad in (0, True, 2.0, None):
        with pytest.raises(CompileMaskError, match="num_ctas"):
            lower(plan, 1, 1, 1, num_ctas=bad)
    with pytest.raises(CompileMaskError, match="plan must be a MaskPlan"):
        lower(cm.masks.causal(), 1, 1, 1)


def test_pages_are_built_once_per_plan_and_lower_refuses_int32_overflow():
    """A new call shape reuses the plan's pages (their build is the lowering's cost); numpy
    integers are taken as ``compile`` takes them; a work list past int32 is refused by name."""
    import numpy as np

    plan = cm.compile(M.causal(), 300)
    a = lower(plan, 1, 2, 1)
    b = lower(plan, np.int64(3), 4, np.int32(2), kv_group=np.int64(1))
    assert b.pages is a.pages and b.work.shape[0] == 3 * 4 * 3
    with pytest.raises(CompileMaskError, match="batch \\* heads_q"):
        lower(plan, 2**30, 2, 1)
    with pytest.raises(CompileMaskError, match="plan must be a MaskPlan"):
        CuteBackend().prepare(None, SimpleNamespace(device=torch.device("cpu")))
