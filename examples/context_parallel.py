"""Context parallelism: one packed-document sequence trained over several processes.

Every rank holds a shard of the sequence chosen by ``compilemask.distributed.balance`` (token
chunks assigned so that each rank holds about the same number of visible pairs); a small
attention layer (projections, masked attention, output projection) takes a few SGD steps on its
shard. The attention fetches from the other ranks exactly the key chunks its rows see and
sends their dK/dV back; the projections' gradients are averaged with an all-reduce, as data
parallelism does. Rank 0 checks the first step's output and gradients against the same layer
run on the whole sequence in one process.

Launch (NCCL with one GPU per rank when CUDA is there, else gloo on the CPU)::

    torchrun --nproc_per_node=2 examples/context_parallel.py
    torchrun --nproc_per_node=4 examples/context_parallel.py --tokens 8192

(``PYTHONPATH=src torchrun ...`` without installing.)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import compilemask as cm
from compilemask import distributed as cp


class Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x, attend):
        B, N, _ = x.shape
        q = self.q(x).view(B, N, self.heads, -1).transpose(1, 2)
        k, v = self.kv(x).view(B, N, 2, self.kv_heads, -1).permute(2, 0, 3, 1, 4)
        out = attend(q, k, v)
        return self.o(out.transpose(1, 2).reshape(B, N, -1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--documents", type=int, default=24)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.set_device(device)

    # the same mask, plan, data and weights on every rank (seeded)
    g = torch.Generator().manual_seed(0)
    cuts = torch.randperm(args.tokens - 1, generator=g)[: args.documents - 1] + 1
    bounds = [0, *sorted(cuts.tolist()), args.tokens]
    mask = cm.masks.document([b - a for a, b in zip(bounds, bounds[1:])])
    plan = cm.compile(mask, args.tokens, block_m=64, block_n=64, device=device)
    shard = cp.balance(plan, world)
    if rank == 0:
        rep = shard.report()
        print(f"{world} ranks: visible pairs per rank {rep['work']}, max/mean "
              f"{rep['imbalance']:.4f}; key tokens received per rank {rep['recv_tokens']} "
              f"(ring attention: {rep['ring_recv_tokens']})")  # fmt: skip
    torch.manual_seed(0)
    layer = Attention(256, heads=4, kv_heads=2).to(device, dtype)
    x = torch.randn(1, args.tokens, 256, generator=g).to(device, dtype)
    target = torch.randn(1, args.tokens, 256, generator=g).to(device, dtype)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)

    x_r = shard.shard(x, rank, dim=1)  # this rank's tokens
    t_r = shard.shard(target, rank, dim=1)
    for step in range(args.steps):
        y_r = layer(x_r, lambda q, k, v: cp.attention(q, k, v, shard))
        loss = ((y_r.float() - t_r.float()) ** 2).sum() / target.numel()
        opt.zero_grad()
        loss.backward()
        if step == 0:
            check(layer, plan, x, target, y_r, shard, rank)
        for w in layer.parameters():  # the data-parallel part: average the weights' gradients
            dist.all_reduce(w.grad)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step}: loss {float(total):.6f}")
    dist.destroy_process_group()


def check(layer, plan, x, target, y_r, shard, rank) -> None:
    """Rank 0: the sharded step's output and weight gradients against one process."""
    y = cp.gather(y_r.detach(), shard, dim=1)
    grads = [w.grad.clone() for w in layer.parameters()]
    for gr in grads:
        dist.all_reduce(gr)
    if rank != 0:
        return
    ref = Attention(256, heads=4, kv_heads=2).to(x.device, x.dtype)
    ref.load_state_dict(layer.state_dict())
    y_ref = ref(x, lambda q, k, v: cm.attention(q, k, v, plan))
    (((y_ref.float() - target.float()) ** 2).sum() / target.numel()).backward()
    tol = 2e-2 if x.dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y, y_ref.detach(), rtol=tol, atol=tol)
    for gr, w in zip(grads, ref.parameters()):
        torch.testing.assert_close(gr, w.grad, rtol=tol, atol=tol)
    print("first step: output and weight gradients equal the single-process step")


if __name__ == "__main__":
    main()
