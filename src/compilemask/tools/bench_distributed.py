"""``compilemask bench --distributed``: context parallelism's balance and per-rank times.

Two parts (docs/context-parallel.md):

* balance (always; the CPU suffices): for each workload at ``--tokens`` and each rank count of
  ``--ranks``, the plan is compiled and balanced (:func:`compilemask.distributed.balance`);
  one row per (workload, ranks): visible pairs per rank, max / mean, and the k/v bytes each
  rank receives in the forward beside ring attention's;
* ``--time R``: R processes (gloo on the CPU, NCCL with one GPU each), or the processes of a
  ``torchrun`` launch, run forward and backward of every workload at ``--time-tokens`` and
  report each rank's median time, beside the whole sequence on rank 0's device alone (same
  backend) and the speedup (one device / slowest rank).

Workloads: the seed workloads (at any length: ``hstu`` and ``shared_prompt`` pack users /
groups as ``compilemask.workloads`` does at every size, ``clear`` takes a ``512 + h * w``
image grid) and ``document``: 1,000 causal documents with Pareto(1.2) lengths.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from .. import masks
from .. import workloads as wl
from ..compiler.pipeline import compile as compile_plan
from ..errors import CompileMaskError

WORKLOADS = (*wl.SEED_WORKLOADS, "document")
DOCUMENTS = 1000
PARETO_ALPHA = 1.2
#: k and v bytes per token in the traffic columns: 16 heads x head_dim 128, bf16, k and v
KV_BYTES_PER_TOKEN = 2 * 16 * 128 * 2


def workload_mask(name: str, n: int):
    """The mask of workload ``name`` over ``n`` tokens (see the module docstring)."""
    g = torch.Generator().manual_seed(0)
    if name == "causal":
        return masks.causal()
    if name == "hstu":
        lengths, targets = wl.hstu_users(n, g)
        return masks.hstu(lengths, targets, contextual=wl.HSTU_CONTEXTUAL)
    if name == "shared_prompt":
        prompts, responses = wl.shared_prompt_groups(n, g)
        if len(prompts) == 1:
            return masks.shared_prompt(prompts[0], responses[0])
        return masks.shared_prompt(prompts, responses)
    if name == "clear":
        pixels = n - wl.CLEAR_TEXT_TOK
        h = 1 << int(math.log2(math.sqrt(max(pixels, 1))))
        while h > 1 and pixels % h:
            h //= 2
        if pixels < 1:
            raise CompileMaskError(f"clear needs more than {wl.CLEAR_TEXT_TOK} tokens, got {n}")
        return masks.clear((h, pixels // h), wl.CLEAR_RADIUS, wl.CLEAR_TEXT_TOK)
    if name == "document":
        return masks.document(document_lengths(n, DOCUMENTS, g))
    raise CompileMaskError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")


def document_lengths(n: int, docs: int, g: torch.Generator) -> list[int]:
    """``docs`` lengths >= 1 summing to ``n``, drawn from Pareto(``PARETO_ALPHA``)."""
    docs = min(docs, n)
    u = torch.rand(docs, generator=g, dtype=torch.float64)
    x = (1 - u) ** (-1 / PARETO_ALPHA)
    lengths = (x / x.sum() * (n - docs)).floor().long() + 1
    lengths[int(torch.argmax(lengths))] += n - int(lengths.sum())
    return lengths.tolist()


def balance_rows(
    names, tokens: int, ranks, block: int = 64, chunk: int | None = None
) -> list[dict]:
    """One row per (workload, rank count): the :meth:`ShardMap.report` and the plan's facts."""
    from ..distributed import balance

    rows = []
    for name in names:
        t0 = time.perf_counter()
        plan = compile_plan(workload_mask(name, tokens), tokens, block_m=block, block_n=block)
        build = time.perf_counter() - t0
        longest = 0
        if name == "document":
            longest = max(document_lengths(tokens, DOCUMENTS, torch.Generator().manual_seed(0)))
        for r in ranks:
            t0 = time.perf_counter()
            shard = balance(plan, r, chunk=chunk)
            row = {"mode": "cp-balance", "workload": name, **shard.report(KV_BYTES_PER_TOKEN)}
            row["balance_s"] = round(time.perf_counter() - t0, 3)
            row["plan_s"] = round(build, 3)
            row["kv_bytes_per_token"] = KV_BYTES_PER_TOKEN
            if longest:
                row["longest_document"] = longest
            rows.append(row)
    return rows


# ------------------------------------------------------------------ timing
def _time_ranks(rank: int, world: int, init: str | None, args: dict) -> list[dict] | None:
    """Forward and backward of every workload on this rank; rank 0 returns the rows."""
    import torch.distributed as dist

    from ..distributed import attention, balance

    cuda = torch.cuda.is_available()
    if init is not None:  # spawned here (else: torchrun set the environment)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank,
                                world_size=world)  # fmt: skip
    elif not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    heads, dim = (16, 128) if cuda else (2, 32)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    try:
        for name in args["workloads"]:
            n = args["tokens"]
            plan = compile_plan(workload_mask(name, n), n, block_m=args["block"],
                                block_n=args["block"], device=device)  # fmt: skip
            shard = balance(plan, world)
            g = torch.Generator().manual_seed(rank)
            q, k, v, dout = (
                torch.randn(1, heads, shard.local_len, dim, generator=g).to(device, dtype)
                for _ in range(4)
            )
            for t in (q, k, v):
                t.requires_grad_()

            times = []
            for i in range(args["warmup"] + args["reps"]):
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                attention(q, k, v, shard, backend=args["backend"]).backward(dout)
                if cuda:
                    torch.cuda.synchronize()
                if i >= args["warmup"]:
                    times.append((time.perf_counter() - t0) * 1e3)
                for t in (q, k, v):
                    t.grad = None
            mine = statistics.median(times)
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
            single = _time_single(plan, heads, dim, dtype, device, args) if rank == 0 else None
            dist.barrier()
            if rank == 0:
                rows.append({
                    "mode": "cp-time", "workload": name, "tokens": n, "world_size": world,
                    "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                    "backend": args["backend"], "dtype": str(dtype).replace("torch.", ""),
                    "heads": heads, "head_dim": dim, "fwd_bwd_ms": [round(t, 3) for t in everyone],
                    "imbalance": round(shard.imbalance, 4), "single_ms": round(single, 3),
                    "speedup": round(single / max(everyone), 3),
                })  # fmt: skip
    finally:
        if init is not None:
            dist.destroy_process_group()
    return rows if rank == 0 else None


def _time_single(plan, heads: int, dim: int, dtype, device, args: dict) -> float:
    """Median forward+backward ms of the whole sequence on this device alone (same backend)."""
    from ..api.functional import attention as single_attention

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, heads, plan.q_len, dim, generator=g).to(device, dtype) for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_()
    times = []
    for i in range(args["warmup"] + args["reps"]):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        single_attention(q, k, v, plan, backend=args["backend"]).backward(dout)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= args["warmup"]:
            times.append((time.perf_counter() - t0) * 1e3)
        for t in (q, k, v):
            t.grad = None
    return statistics.median(times)


def _spawned(rank: int, world: int, init: str, args: dict, out: str) -> None:
    rows = _time_ranks(rank, world, init, args)
    if rows is not None:
        Path(out).write_text("".join(json.dumps(r) + "\n" for r in rows))


def time_rows(world: int, args: dict) -> list[dict]:
    """Spawn ``world`` processes here, or join the running ``torchrun`` group when
    ``world == 0``; the rows of rank 0 (none on the other ranks of a torchrun launch)."""
    if world == 0:
        return _time_ranks(0, 0, None, args) or []
    import tempfile

    import torch.multiprocessing as mp

    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        raise CompileMaskError(
            f"--time {world} needs {world} GPUs (one per rank), this machine has "
            f"{torch.cuda.device_count()}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        out = os.path.join(tmp, "rows.jsonl")
        mp.spawn(_spawned, args=(world, init, args, out), nprocs=world, join=True)
        return [json.loads(line) for line in Path(out).read_text().splitlines()]


# ------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="compilemask bench --distributed",
        description="Context parallelism: balance per rank count, and per-rank times.",
    )
    p.add_argument("--distributed", action="store_true", help="this mode (required)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS,
                   metavar="NAME", help=f"default: all of {', '.join(WORKLOADS)}")  # fmt: skip
    p.add_argument("--tokens", type=int, default=131072, help="balance: tokens (128K)")
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8], help="balance: ranks")
    p.add_argument("--chunk", type=int, default=None, help="balance: chunk tokens (default: tiles)")
    p.add_argument("--block", type=int, default=64,
                   help="plan tiles (block_m = block_n), the balance's chunk")  # fmt: skip
    p.add_argument("--time", type=int, default=None, metavar="R",
                   help="also time forward+backward on R spawned ranks (0: this torchrun "
                   "launch)")  # fmt: skip
    p.add_argument("--time-tokens", type=int, default=4096, help="tokens of the timed runs")
    p.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "reference", "triton", "cudnn", "fa4", "cute"),
        help="single-device backend of the pieces",
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="JSON-lines file rows are appended to")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the mode; returns the exit status."""
    from .bench_report import environment

    args = build_parser().parse_args(argv)
    timing = args.time is not None
    torchrun_rank = int(os.environ.get("RANK", "0")) if args.time == 0 else 0
    rows = []
    if torchrun_rank == 0:
        rows += balance_rows(args.workloads, args.tokens, args.ranks, args.block, args.chunk)
        for r in rows:
            _echo(
                f"{r['workload']:>14} {r['tokens']:>8} tokens {r['world_size']} ranks: "
                f"max/mean {r['imbalance']:.4f}, tokens received per rank: max "
                f"{max(r['recv_tokens'])}, mean {sum(r['recv_tokens']) // len(r['recv_tokens'])} "
                f"(ring: {r['ring_recv_tokens']})"
            )
    if timing:
        opts = {
            "workloads": args.workloads, "tokens": args.time_tokens, "block": args.block,
            "backend": args.backend, "reps": args.reps, "warmup": args.warmup,
        }  # fmt: skip
        timed = time_rows(args.time, opts)
        for r in timed:
            ms = ", ".join(f"{t:.2f}" for t in r["fwd_bwd_ms"])
            _echo(
                f"{r['workload']:>14} {r['world_size']} ranks fwd+bwd ms per rank: {ms}; "
                f"one device {r['single_ms']:.2f} ms, speedup {r['speedup']:.2f}x"
            )
        rows += timed
    if args.out is not None and rows:
        env = environment()
        rows = [{**env, **r} for r in rows]
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0


def _echo(text: str) -> None:
    print(text, file=sys.stdout, flush=True)
