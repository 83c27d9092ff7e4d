"""Context parallelism (``compilemask.distributed``): the balancer, the ranks' sub-plans, and
forward and backward over gloo process groups against the single-process computation.

The distributed cases run in processes spawned once per world size (2 and 4) with the
reference backend in float64: every case compares each rank's output, LSE and gradients with
the single-process reference of the whole sequence.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask.distributed import balance
from compilemask.distributed.local import rank_work
from compilemask.errors import InputError
from compilemask.workloads import SEED_WORKLOADS, workload

TILE = 32
N = 512


def _plans():
    """``(name, plan, B, Hq, Hkv)`` of the distributed cases (tiny shapes)."""
    out = []
    for name in SEED_WORKLOADS:
        w = workload(name, 1024)
        out.append((name, cm.compile(w.mask, w.N, block_m=64, block_n=64), 1, 2, 1))
    doc = masks.document([150, 40, 200, 122])
    out.append(("document", cm.compile(doc, N, block_m=TILE, block_n=TILE), 2, 2, 2))
    sw = masks.sliding_window(48)
    out.append(("sliding_window", cm.compile(sw, N, block_m=TILE, block_n=TILE), 1, 4, 2))
    heads = masks.per_head([masks.causal(), masks.sliding_window(20), doc, masks.prefix_lm(64)])
    out.append(("per_head", cm.compile(heads, N, heads=4, block_m=TILE, block_n=TILE), 1, 4, 2))
    batch = masks.per_batch([masks.causal(), doc])
    out.append(("per_batch", cm.compile(batch, N, batch=2, block_m=TILE, block_n=TILE), 2, 2, 1))
    grid = masks.tile_grid(masks.natten2d((16, 32), (5, 7)), (8, 16))
    out.append(("tile_grid", cm.compile(grid, N, block_m=TILE, block_n=TILE), 1, 2, 2))
    return out


# ------------------------------------------------------------------ balancer and sub-plans
@pytest.mark.parametrize("world", [2, 4])
def test_sub_plans_are_the_plan_restricted(world):
    for name, plan, *_ in _plans():
        shard = balance(plan, world)
        dense = plan.in_permuted_order().to_dense()
        dense = dense.reshape(plan.num_masks, plan.q_len, plan.kv_len)
        total = 0
        for r in range(world):
            rows = shard.positions(r)
            work = rank_work(shard, r)
            assert [p.owner for p in work.pieces][0] == r or not shard.needed[
                r, shard.owner == r
            ].any()
            for piece in work.pieces:
                piece.plan.verify()
                keys = torch.tensor(piece.chunks)
                kpos = (keys[:, None] * shard.chunk + torch.arange(shard.chunk)).reshape(-1)
                want = dense[:, rows][:, :, kpos]
                got = piece.plan.to_dense().reshape(want.shape)
                assert torch.equal(got, want), (name, r, piece.owner)
            seen = int(dense[:, rows].sum())
            assert seen == int(shard.work[r])
            assert sum(int(p.plan.schedule.pairs.sum()) for p in work.pieces) == seen
            total += seen
        assert total == int(plan.schedule.pairs.sum())


def test_balance_is_a_partition_with_equal_shards():
    plan = cm.compile(masks.causal(), 4096, block_m=64, block_n=64)
    for world in (2, 4, 8):
        shard = balance(plan, world)
        assert shard.imbalance < 1.01
        allpos = torch.cat([shard.positions(r) for r in range(world)])
        assert torch.equal(allpos.sort().values, torch.arange(4096))
        assert {len(c) for c in shard.chunks} == {4096 // 64 // world}
        rep = shard.report(bytes_per_token=4)
        assert rep["recv_bytes"] == [t * 4 for t in rep["recv_tokens"]]


def test_chunks_finer_than_the_tiles():
    """Chunks of 16 tokens on a plan of 64-token tiles: pairs from a derived tiling; a mask
    whose first rows see every key balances where whole tiles cannot."""
    plan = cm.compile(masks.clear((16, 16), 4, 256), 512, block_m=64, block_n=64)
    coarse, fine = balance(plan, 4), balance(plan, 4, chunk=16)
    assert fine.imbalance < coarse.imbalance
    assert fine.imbalance < 1.05
    dense = plan.to_dense()
    for r in range(4):
        rows = fine.positions(r)
        assert int(dense[rows].sum()) == int(fine.work[r])
        for piece in rank_work(fine, r).pieces:
            keys = torch.tensor(piece.chunks)
            kpos = (keys[:, None] * 16 + torch.arange(16)).reshape(-1)
            assert torch.equal(piece.plan.to_dense(), dense[rows][:, kpos])
        seen = dense[rows].any(0).view(-1, 16).any(1)
        assert torch.equal(fine.needed[r], seen)


def test_shard_and_unshard_round_trip_in_the_callers_order():
    plan = cm.compile(masks.tile_grid(masks.natten2d((16, 32), (5, 7)), (8, 16)), N,
                      block_m=TILE, block_n=TILE)  # fmt: skip
    shard = balance(plan, 4)
    x = torch.randn(1, 2, N, 3)
    parts = [shard.shard(x, r) for r in range(4)]
    assert torch.equal(shard.unshard(parts), x)
    tiled = plan.permutation[shard.positions(1)]
    assert torch.equal(parts[1], x[:, :, tiled])


def test_balance_refuses_bad_input():
    with pytest.raises(InputError, match="q_len == kv_len"):
        balance(cm.compile(masks.causal(), 256, 512, block_m=32, block_n=32), 2)
    plan = cm.compile(masks.causal(), 256, block_m=32, block_n=32)
    with pytest.raises(InputError, match="multiple of world_size"):
        balance(plan, 3)
    with pytest.raises(InputError, match="chunk"):
        balance(plan, 2, chunk=0)
    with pytest.raises(InputError, match="world_size"):
        balance(plan, 0)
    dense = torch.rand(256, 256) < 0.5
    bits = cm.from_dense(dense, block_m=32, block_n=32)
    if bits.encoding == "bits":
        with pytest.raises(InputError, match="bitmasks"):
            balance(bits, 2)
    shard = balance(plan, 2)
    with pytest.raises(InputError, match="rank"):
        shard.positions(2)
    with pytest.raises(InputError, match="tokens along dim"):
        shard.shard(torch.zeros(1, 1, 100, 4), 0)


# ------------------------------------------------------------------ distributed runs
def _cases():
    """Per case: the plan, the inputs, and the single-process reference's outputs and
    gradients (float64), computed once in the parent process."""
    from compilemask.kernels.reference import reference_attention

    cases = []
    for name, plan, B, Hq, Hkv in _plans():
        g = torch.Generator().manual_seed(7)
        shapes = ((B, Hq), (B, Hkv), (B, Hkv), (B, Hq))
        q, k, v, dout = (
            torch.randn(*s, plan.q_len, 32, generator=g, dtype=torch.float64) for s in shapes
        )
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = reference_attention(*full, plan)
        ((out * dout).sum() + 0.5 * lse.masked_fill(lse.isinf(), 0).sum()).backward()
        want = (out.detach(), lse.detach(), *(t.grad for t in full))
        cases.append((name, plan, (q, k, v, dout), want))
    return cases


def _worker(rank: int, world: int, init: str, cases) -> None:
    import torch.distributed as dist

    from compilemask.distributed import attention, gather

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        plan = cases[0][1]
        x = torch.zeros(1, 2, plan.q_len // world, 32)
        with pytest.raises(InputError, match="balanced for"):
            attention(x, x, x, balance(plan, 2 * world))
        with pytest.raises(InputError, match="this rank's"):
            attention(x[:, :, 1:], x[:, :, 1:], x[:, :, 1:], balance(plan, world))
        for name, plan, (q, k, v, dout), (ref_out, ref_lse, *ref_grads) in cases:
            shard = balance(plan, world)
            mine = [shard.shard(t, rank).requires_grad_() for t in (q, k, v)]
            out, lse = attention(*mine, shard, return_lse=True, backend="reference")
            loss = (out * shard.shard(dout, rank)).sum()
            (loss + 0.5 * lse.masked_fill(lse.isinf(), 0).sum()).backward()
            tol = dict(rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(out, shard.shard(ref_out, rank), **tol, msg=name)
            torch.testing.assert_close(
                lse, shard.shard(ref_lse, rank).float(), rtol=1e-6, atol=1e-6, msg=name
            )
            for t, want, what in zip(mine, ref_grads, ("dq", "dk", "dv")):
                torch.testing.assert_close(
                    t.grad, shard.shard(want, rank), **tol, msg=f"{name} {what}"
                )
            whole = gather(out.detach(), shard)
            torch.testing.assert_close(whole, ref_out, **tol, msg=name)
        # the per-rank timing of `compilemask bench --distributed --time` in this group
        from compilemask.tools.bench_distributed import _time_ranks

        opts = dict(workloads=["hstu"], tokens=512, block=64, backend="reference")
        rows = _time_ranks(rank, world, None, dict(opts, reps=1, warmup=0))
        if rank == 0:
            assert len(rows) == 1 and len(rows[0]["fwd_bwd_ms"]) == world
            assert rows[0]["single_ms"] > 0 and rows[0]["speedup"] > 0
        else:
            assert rows is None
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cases():
    return _cases()


@pytest.mark.parametrize("world", [2, 4])
def test_distributed_matches_single_process(world, cases):
    import multiprocessing

    import torch.multiprocessing as mp

    # children forked from a server that imported torch once (a spawned child imports it
    # anew: seconds per process on a busy machine); compilemask is not preloaded (the
    # server may resolve it before it has the parent's sys.path)
    multiprocessing.get_context("forkserver").set_forkserver_preload(["torch", "torch.distributed"])
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        mp.start_processes(
            _worker, args=(world, init, cases), nprocs=world, start_method="forkserver"
        )


# ------------------------------------------------------------------ other backends, one process
def _simulate(plan, world, q, k, v, dout, backend):
    """Every rank's forward and backward run in this process, the exchanges served from the
    whole tensors (forward) and a mailbox (backward): ``(out, dq, dk, dv)`` of the whole
    sequence, for backends that need a device of their own per rank."""
    from compilemask.distributed.attention import _ContextParallel, _Runner

    shard = balance(plan, world)
    mailbox = []

    class Simulated(_Runner):
        def _exchange(self, sends, recvs):
            if getattr(self, "forwarded", False):  # backward: dK/dV to their owners
                mailbox.extend((self.work.rank, peer, t) for peer, t in sends)
                for _, buf in recvs:
                    buf.zero_()
                return []
            self.forwarded = True
            remote = [pc for pc in self.work.pieces if pc.owner != self.work.rank]
            for pc, (_, buf) in zip(remote, recvs):
                for i, t in enumerate((k, v)):
                    pos = pc.positions.to(t.device)
                    buf[i].copy_(shard.shard(t, pc.owner).index_select(2, pos))
            return []

    outs, grads = [], []
    for r in range(world):
        mine = [shard.shard(t, r).detach().requires_grad_() for t in (q, k, v)]
        runner = Simulated(rank_work(shard, r), list(range(world)), None, 1 / 32**0.5, backend)
        out, _ = _ContextParallel.apply(*mine, runner)
        out.backward(shard.shard(dout, r))
        outs.append(out.detach())
        grads.append([t.grad for t in mine])
    for src, dst, t in mailbox:
        pos = dict(rank_work(shard, dst).sends)[src].to(t.device)
        grads[dst][1].index_add_(2, pos, t[0])
        grads[dst][2].index_add_(2, pos, t[1])
    whole = [shard.unshard(parts) for parts in (outs, *zip(*grads))]
    return whole


def _check_simulated(device, dtype, n, backend):
    """The pieces on ``backend`` against one process's call of it: each of out, dq, dk, dv
    within twice the single call's error (relative, against float64) plus a floor (1e-5 in
    float32, 2e-3 in 16 bits: the pieces' outputs are rounded before the merge)."""
    from compilemask.kernels.reference import reference_attention
    from compilemask.testing import relative_error

    heads = masks.per_head([masks.causal(), masks.document([n // 4, n // 2, n // 4])])
    plan = cm.compile(heads, n, heads=2, block_m=32, block_n=32, device=device)
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(1, 2, n, 32, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, 1, n, 32, generator=g).to(device, dtype) for _ in range(2))
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    ref64, _ = reference_attention(*wide, plan)
    ref64.backward(dout.double())
    single = [t.clone().requires_grad_() for t in (q, k, v)]
    out = cm.attention(*single, plan, backend=backend)
    out.backward(dout)
    got = _simulate(plan, 4, q, k, v, dout, backend)
    refs = (ref64.detach(), *(t.grad for t in wide))
    floor = 1e-5 if dtype == torch.float32 else 2e-3
    for what, a, one, want in zip(
        ("out", "dq", "dk", "dv"), got, (out.detach(), *(t.grad for t in single)), refs
    ):
        err, bound = relative_error(a, want), 2 * relative_error(one, want) + floor
        assert err <= bound, (what, err, bound)


@pytest.mark.kernel
def test_triton_pieces_match_one_process():
    _check_simulated("cpu", torch.float32, 256, "triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_pieces_match_one_process_on_the_gpu():
    _check_simulated("cuda", torch.bfloat16, 4096, "triton")


def test_bench_distributed_rows(tmp_path):
    from compilemask.tools.bench_distributed import main

    out = tmp_path / "rows.jsonl"
    argv = ["--distributed", "--tokens", "4096", "--ranks", "2", "4", "--workloads", "hstu"]
    assert main([*argv, "document", "--out", str(out)]) == 0
    import json

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["workload"], r["world_size"]) for r in rows] == [
        ("hstu", 2), ("hstu", 4), ("document", 2), ("document", 4)
    ]  # fmt: skip
    for r in rows:
        assert r["imbalance"] == pytest.approx(
            max(r["work"]) / (sum(r["work"]) / len(r["work"])), abs=1e-4
        )
        assert max(r["recv_tokens"]) <= r["ring_recv_tokens"]


def test_bench_distributed_bad_input_is_one_line():
    from click.testing import CliRunner

    from compilemask.tools.cli import cli

    argv = ["bench", "--distributed", "--tokens", "1000", "--ranks", "3", "--workloads", "causal"]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2
    assert "multiple of world_size * chunk" in result.output
    assert "Traceback" not in result.output


def test_merging_pieces_keeps_rows_that_see_nothing_free_of_nan():
    """A row that sees no key in any piece: out 0, lse -inf, and finite gradients to every
    piece (logsumexp's backward at -inf would give NaN)."""
    from compilemask.distributed.attention import _merge, _piece_grads
    from compilemask.distributed.local import sub_plan

    plan = cm.compile(cm.masks.causal() - cm.masks.sliding_window(1), 64)  # row 0: nothing
    rows = torch.arange(64)
    pieces = [sub_plan(plan, rows, torch.tensor(own), 32) for own in ([True, False], [False, True])]
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 2, 64, 32, generator=g, dtype=torch.float64).requires_grad_()
        for _ in range(3)
    )
    outs, lses = [], []
    for i, p in enumerate(pieces):
        ks, vs = k[:, :, 32 * i : 32 * (i + 1)], v[:, :, 32 * i : 32 * (i + 1)]
        o, lse = cm.attention(q, ks, vs, p, return_lse=True, backend="reference")
        outs.append(o)
        lses.append(lse)
    out, lse = _merge(outs, lses, q)
    assert bool(torch.isneginf(lse[..., 0]).all()) and bool((out[..., 0, :] == 0).all())
    pieces_grads = _piece_grads(out, lse, torch.ones_like(out), None, outs, lses)
    grads = [t for _, piece_grads in pieces_grads for t in piece_grads]
    assert grads and all(bool(torch.isfinite(t).all()) for t in grads)
