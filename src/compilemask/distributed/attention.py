"""Context-parallel attention on ``torch.distributed`` under a :class:`ShardMap`.

Forward, on every rank (``local.RankWork``):

1. point-to-point, all at once: each rank sends every peer the key/value chunks of its shard
   that the peer's rows see (k and v stacked in one message per peer) and receives, from every
   owner, the chunks its own rows see; nothing else moves;
2. while those messages fly, the local piece (its rows against its own keys) runs;
3. then one piece per owner, each against the received chunks, with its exact sub-plan;
4. the pieces' partial outputs are merged with their LSEs:
   ``lse = logsumexp_i lse_i``, ``out = sum_i exp(lse_i - lse) * out_i``.

Backward: the merge's backward gives every piece the gradients of its out and lse; the
pieces' q/k/v gradients come from the backend's own autograd through them. The received
pieces run first; their dK/dV go back to their owners point-to-point while the local piece's
backward runs, and are added to the owner's dK/dV in rank order (deterministic).

Legend: B batch, Hq / Hkv heads, n tokens per rank, D head_dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..api import validate
from ..api.functional import attention as single_attention
from ..errors import InputError
from ..kernels.reference import reference_attention
from .balance import ShardMap
from .local import RankWork, rank_work


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    shard: ShardMap,
    *,
    group=None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Masked attention of one sequence sharded over the ranks of ``group`` by ``shard``.

    Every rank calls it with its own shard (``shard.shard(x, rank)``); the result is that
    rank's shard of what ``compilemask.attention`` gives on the whole sequence (gather it with
    :func:`gather`). Differentiable in q, k and v (a ``torch.autograd.Function``: a training
    step is the single-device one with sharded inputs).

    Args:
        q: [B, Hq, n, D], this rank's query rows (``n = shard.local_len``).
        k, v: [B, Hkv, n, D], this rank's keys and values (same tokens as q), Hq % Hkv == 0.
        shard: the :class:`ShardMap` of :func:`~compilemask.distributed.balance`, built for
            this group's size (every rank builds the same one).
        group: the process group (None: the default group).
        scale: softmax scale, default 1 / sqrt(D).
        return_lse: also return the LSE of the rank's rows (float32 [B, Hq, n]).
        backend: the single-device backend that runs the pieces ("auto", "reference",
            "triton", ...). It must support a gradient through lse (reference, triton) when a
            backward is taken. With "reference" the merge runs in the pieces' precision
            (float64 for float64 inputs).

    Returns:
        out [B, Hq, n, D] in q's dtype; with ``return_lse``, ``(out, lse)``.

    Raises:
        InputError: a group whose size or rank does not match ``shard``, shapes that are not
            this rank's shard, or what ``compilemask.attention`` refuses.
    """
    if not isinstance(shard, ShardMap):
        raise InputError(f"shard must be a ShardMap (distributed.balance), got {type(shard)}")
    validate.check_tensors(q, k, v)
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world != shard.world_size:
        raise InputError(f"shard was balanced for {shard.world_size} ranks, the group has {world}")
    n = shard.local_len
    if q.shape[2] != n or k.shape[2] != n:
        raise InputError(
            f"q, k, v must hold this rank's {n} tokens (shard.shard(x, rank)), got "
            f"q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    plan = shard.plan
    for name, dep, size in (("batch", plan.batch, q.shape[0]), ("heads", plan.heads, q.shape[1])):
        if dep is not None and dep != size:
            raise InputError(f"the plan's mask depends on {name}={dep}, got {size} in q")
    scale = validate.check_scale(scale, q.shape[-1])
    work = rank_work(shard, rank)
    _first_use(group)
    peers = [_global(group, r) for r in range(world)]
    runner = _Runner(work, peers, group, scale, backend)
    out, lse = _ContextParallel.apply(q, k, v, runner)
    return (out, lse) if return_lse else out


def gather(x: torch.Tensor, shard: ShardMap, *, group=None, dim: int = 2) -> torch.Tensor:
    """The full sequence, in the caller's token order, from every rank's shard ``x`` (an
    all-gather; every rank gets it). Not differentiable (for outputs and checks)."""
    parts = [torch.empty_like(x) for _ in range(shard.world_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return shard.unshard(parts, dim)


_USED_GROUPS: set = set()


def _first_use(group) -> None:
    """A barrier on a group's first call: NCCL wants every rank in a group's first batched
    point-to-point call, and some ranks may have nothing to send or receive."""
    key = dist.group.WORLD if group is None else group  # a new object after a re-init
    if key not in _USED_GROUPS:
        dist.barrier(group=group)
        _USED_GROUPS.add(key)


def _global(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


class _Runner:
    """One call's forward and backward on this rank (state kept between them)."""

    def __init__(self, work: RankWork, peers: list[int], group, scale: float, backend: str):
        self.work, self.peers, self.group = work, peers, group
        self.scale, self.backend = scale, backend

    # ------------------------------------------------------------------ communication
    def _exchange(self, sends: list, recvs: list):
        """Start ``(peer, tensor)`` sends and receives; returns the pending works."""
        ops = [dist.P2POp(dist.isend, t, self.peers[p], self.group) for p, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.peers[p], self.group) for p, t in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    # ------------------------------------------------------------------ forward
    def forward(self, q, k, v, needs_grad: bool):
        B, Hkv, _, D = k.shape
        pieces = self.work.pieces
        kv = torch.stack([k.detach(), v.detach()])  # [2, B, Hkv, n, D]
        sends = [(p, kv.index_select(3, pos.to(kv.device))) for p, pos in self.work.sends]
        remote = [pc for pc in pieces if pc.owner != self.work.rank]
        bufs = [kv.new_empty((2, B, Hkv, len(pc.positions), D)) for pc in remote]
        pending = self._exchange(sends, [(pc.owner, b) for pc, b in zip(remote, bufs)])
        with torch.enable_grad() if needs_grad else torch.no_grad():
            qd, kd, vd = (t.detach().requires_grad_(needs_grad) for t in (q, k, v))
            outs, lses = [], []
            local = pieces[0] if pieces and pieces[0].owner == self.work.rank else None
            if local is not None:
                if len(local.positions) == kd.shape[2]:  # every local key: no copy
                    kl, vl = kd, vd
                else:
                    pos = local.positions.to(k.device)
                    kl, vl = kd.index_select(2, pos), vd.index_select(2, pos)
                self._piece(qd, kl, vl, local.plan, outs, lses)
            for w in pending:
                w.wait()
            inputs = [(qd, kd, vd)] if local is not None else []
            for pc, b in zip(remote, bufs):
                kr, vr = (b[i].requires_grad_(needs_grad) for i in (0, 1))
                inputs.append((qd, kr, vr))
                self._piece(qd, kr, vr, pc.plan, outs, lses)
            out, lse = _merge(outs, lses, qd)
        if needs_grad:
            self.saved = (qd, kd, vd, out, lse, outs, lses, inputs, local is not None)
        return out.detach(), lse.detach()

    def _piece(self, q, k, v, plan, outs, lses):
        if self.backend == "reference":  # the oracle, LSE in its own precision
            validate.check_plan(q, k, plan)
            out, lse = reference_attention(q, k, v, plan, self.scale)
            out = out.to(q.dtype)
        else:
            out, lse = single_attention(
                q, k, v, plan, scale=self.scale, return_lse=True, backend=self.backend
            )
        outs.append(out)
        lses.append(lse)

    # ------------------------------------------------------------------ backward
    def backward(self, dout, dlse):
        """dq, dk, dv of this rank: the merge's gradients to every piece's out and lse, then
        the received pieces' backward, whose dK/dV go back to their owners while the local
        piece's backward runs."""
        qd, kd, vd, out, lse, outs, lses, inputs, has_local = self.saved
        self.saved = None
        dq, dk, dv = torch.zeros_like(qd), torch.zeros_like(kd), torch.zeros_like(vd)
        pieces = _piece_grads(out, lse, dout, dlse, outs, lses)
        sends = []
        for i in range(1 if has_local else 0, len(outs)):
            dqi, dki, dvi = _grads(pieces[i], inputs[i])
            if dqi is not None:
                dq += dqi
            owner = self.remote_owners[i - (1 if has_local else 0)]
            sends.append((owner, torch.stack([dki, dvi])))
        B, Hkv, _, D = kd.shape
        recvs = [(p, kd.new_empty((2, B, Hkv, len(pos), D))) for p, pos in self.work.sends]
        pending = self._exchange(sends, recvs)
        if has_local:
            dqi, dki, dvi = _grads(pieces[0], inputs[0])
            dq, dk, dv = (x if g is None else x + g for x, g in ((dq, dqi), (dk, dki), (dv, dvi)))
        for w in pending:
            w.wait()
        if recvs:
            acc = torch.float32 if kd.dtype in (torch.float16, torch.bfloat16) else kd.dtype
            dkv = torch.stack([dk, dv]).to(acc)
            for (_, buf), (_, pos) in zip(recvs, self.work.sends):
                dkv.index_add_(3, pos.to(dkv.device), buf.to(acc))
            dk, dv = dkv[0].to(kd.dtype), dkv[1].to(kd.dtype)
        return dq, dk, dv

    @property
    def remote_owners(self) -> list[int]:
        return [pc.owner for pc in self.work.pieces if pc.owner != self.work.rank]


def _piece_grads(out, lse, dout, dlse, outs, lses) -> list[tuple]:
    """Per piece, ``((out_i, lse_i), (d out_i, d lse_i))`` of those that get a gradient: the
    merge's backward (elementwise; the graph is kept for the pieces' own backward)."""
    outputs, grads = [], []
    for t, g in ((out, dout), (lse, dlse)):
        if g is not None and t.requires_grad:
            outputs.append(t)
            grads.append(g.to(t.dtype))
    tensors = [t for pair in zip(outs, lses) for t in pair]
    wanted = [t for t in tensors if t.requires_grad]
    got = iter(
        torch.autograd.grad(outputs, wanted, grads, allow_unused=True, retain_graph=True)
        if outputs and wanted
        else [None] * len(wanted)
    )
    flat = [next(got) if t.requires_grad else None for t in tensors]
    pairs = []
    for i in range(len(outs)):
        keep = [
            (t, g) for t, g in ((outs[i], flat[2 * i]), (lses[i], flat[2 * i + 1])) if g is not None
        ]
        pairs.append(tuple(zip(*keep)) if keep else ((), ()))
    return pairs


def _grads(piece, inputs) -> tuple:
    """Gradients of one piece's (out, lse) to ``inputs`` (q, k, v): zeros for k and v when
    the piece gets no gradient or does not reach them, None for q then."""
    (tensors, grads), (q, k, v) = piece, inputs
    got = (
        torch.autograd.grad(tensors, (q, k, v), grads, allow_unused=True, retain_graph=True)
        if tensors
        else (None, None, None)
    )
    dk = torch.zeros_like(k) if got[1] is None else got[1]
    dv = torch.zeros_like(v) if got[2] is None else got[2]
    return got[0], dk, dv


def _merge(outs: list, lses: list, q: torch.Tensor):
    """``(out, lse)`` of the pieces merged: lse in the pieces' precision, out in q's dtype.
    Rows that see no key at all: out 0, lse -inf."""
    B, Hq, n, D = q.shape
    if not outs:
        return q.new_zeros((B, Hq, n, D)), q.new_full((B, Hq, n), float("-inf"))
    if len(outs) == 1:
        return outs[0], lses[0]
    dtype = torch.promote_types(lses[0].dtype, torch.float32)
    lse_all = torch.stack([x.to(dtype) for x in lses])
    # a row that sees no key in any piece: its lse is -inf, and the gradient of logsumexp
    # there would be 0 * exp(-inf - -inf) = NaN; such rows are merged from zeros instead
    empty = torch.isneginf(lse_all).all(0)
    lse = torch.logsumexp(torch.where(empty, torch.zeros_like(lse_all), lse_all), 0)
    lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse)
    base = torch.where(empty, torch.zeros_like(lse), lse)
    weights = torch.exp(lse_all - base)  # 0 for pieces where the row sees nothing
    acc = torch.promote_types(dtype, q.dtype)
    out = sum(w[..., None] * o.to(acc) for w, o in zip(weights, outs))
    return out.to(q.dtype), lse


class _ContextParallel(torch.autograd.Function):
    """``(out, lse)`` of this rank's rows; gradients to its q, k, v (dK/dV of the keys other
    ranks read come back from them)."""

    @staticmethod
    def forward(ctx, q, k, v, runner):
        needs = any(ctx.needs_input_grad[:3])
        out, lse = runner.forward(q, k, v, needs)
        ctx.runner = runner
        ctx.set_materialize_grads(False)
        return out, lse.to(torch.float32) if lse.dtype != torch.float32 else lse

    @staticmethod
    def backward(ctx, dout, dlse):
        runner = ctx.runner
        ctx.runner = None
        dq, dk, dv = runner.backward(dout, dlse)
        return dq, dk, dv, None
