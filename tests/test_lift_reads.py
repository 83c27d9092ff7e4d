"""Host reads of ``from_mask_mod``'s lifted path (each one a synchronisation on a GPU), counted
on the CPU: the probe's verdict and the slot count come back in one read, the run's own ``b`` /
``h`` index tables without a read, and sets of a few slots are not trimmed on the way. Host
values made device tensors by ``torch.tensor`` / ``torch.as_tensor`` count too: on a GPU that
copy from pageable memory waits for the stream like a read (the lifting makes none)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import compilemask as cm
from compilemask.tools.op_counts import OpCounter, counting_host_copies
from flex_masks import CASES

READS = ("aten._local_scalar_dense", "aten.equal", "aten.is_nonzero")


def host_reads(fn) -> int:
    with OpCounter() as counted, counting_host_copies() as copies:
        fn()
    reads = sum(n for op, n in counted.ops.items() if op.startswith(READS))
    return reads + copies["n"] + copies["h2d"]


# at most this many host reads and blocking copies to the device per build (the tile
# schedule's own included); fa4_document (6 (b, h) parts): the key-term profiles of every
# part in one read, the probe's verdict in another (its mask_mod's ``doc[b, h, q_idx]`` by
# ``aten.index``: no read of the 0-d ``b`` and ``h``)
BOUNDS = {"noop": 1, "document_causal": 2, "block_diffusion": 6, "fa4_document": 2}


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_lifted_host_reads(name):
    """The lifted plan equals FlexAttention's mask, within the read budget."""
    _, fn, nq, nk, b, h = next(c for c in CASES if c[0] == name)

    def build():
        return cm.from_mask_mod(fn, nq, nk, batch=b, heads=h, block_m=16, block_n=16)

    plan = build()
    assert plan.source == "from_mask_mod:lifted"
    want = create_mask(fn, b, h, nq, nk, device="cpu")
    got = plan.to_dense()
    assert torch.equal(
        got.expand_as(want) if got.dim() == 4 else got[None, None].expand_as(want), want
    )
    assert host_reads(build) <= BOUNDS[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lifting_waits_for_nothing_on_cuda():
    """The lifting of a sliding window (key terms ``+-kv + c``: no profile read) neither reads
    back nor makes a blocking copy to the device: CUDA's sync debug mode raises on either."""
    from compilemask.compiler.migrate import lift

    def mm(b, h, q, k):
        return (k <= q) & (q - k < 64)

    dev = torch.device("cuda")
    lift.lift_intervals(mm, 1024, 1024, [(0, 0)], dev)  # warm: the trace, CUDA's context
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lift.lift_intervals(mm, 1024, 1024, [(0, 0)], dev)
    finally:
        torch.cuda.set_sync_debug_mode(0)
