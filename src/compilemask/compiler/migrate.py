"""Plans from a dense boolean mask or a FlexAttention ``mask_mod`` (migration helpers).

Both evaluate in chunks of query rows, so at most ``_CHUNK_ELEMS`` (query, key) pairs exist at
once (a mask_mod is evaluated twice: once to count each row's intervals, once to build), turn
each chunk into intervals (maximal runs of visible keys) and build the tile schedule from the
intervals; tiles whose rows hold many intervals are stored as bitmasks, and when the intervals
of the whole plan would be larger than a bitmask of every tile, the plan keeps bitmasks only
(``plan.encoding == "bits"``). These plans are
never cached: a closure's captured tensors can change between calls.
"""

from __future__ import annotations

import torch

from ..errors import CompileMaskError
from . import intervals as iv
from .pipeline import positive_int, resolve_device
from .plan import MaskPlan, outside_inference_mode
from .tiles import build_tiles, build_tiles_from_dense

_CHUNK_ELEMS = 1 << 22


@outside_inference_mode
def _build(chunks, q_len, kv_len, batch, heads, block_m, block_n, device, source) -> MaskPlan:
    """``chunks()``: a fresh iterator, per mask, of boolean row blocks ``[rows, Nk]`` (rows a
    multiple of ``block_m`` but the last). Two passes: the first counts each row's intervals;
    the plan stores intervals unless per-tile bitmasks are smaller."""
    runs = torch.stack(
        [torch.cat([_runs(r.to(device)) for r in mask_chunks]) for mask_chunks in chunks()]
    )
    m = runs.shape[0]
    k_max = max(1, int(runs.max()))
    if 8 * k_max > -(-kv_len // 8):  # a row's intervals would take more bytes than its bits
        schedule = build_tiles_from_dense(
            (torch.stack(rows).to(device) for rows in zip(*chunks())),
            m,
            q_len,
            kv_len,
            block_m,
            block_n,
        )
        empty = torch.full((m, q_len, 1), kv_len, dtype=torch.int32, device=device)
        return MaskPlan(
            q_len,
            kv_len,
            batch,
            heads,
            empty,
            empty.clone(),
            torch.zeros_like(runs),
            schedule,
            source=source,
            encoding="bits",
            row_runs=runs,
        )
    los, his, cnts = [], [], []
    for mask_chunks in chunks():
        parts = [iv.from_dense_rows(rows.to(device), kv_len) for rows in mask_chunks]
        padded = [iv.pad_k(p[0], p[1], k_max, kv_len) for p in parts]
        los.append(torch.cat([p[0] for p in padded]))
        his.append(torch.cat([p[1] for p in padded]))
        cnts.append(torch.cat([p[2] for p in parts]))
    lo = torch.stack(los).contiguous()
    hi = torch.stack(his).contiguous()
    count = torch.stack(cnts).contiguous()
    schedule = build_tiles(lo, hi, count, q_len, kv_len, block_m, block_n, use_bits=True)
    return MaskPlan(q_len, kv_len, batch, heads, lo, hi, count, schedule, source=source)


def _runs(rows: torch.Tensor) -> torch.Tensor:
    """Number of maximal runs of True per row."""
    starts = rows.clone()
    starts[:, 1:] &= ~rows[:, :-1]
    return starts.sum(-1, dtype=torch.int32)


def _chunk_rows(nk: int, block_m: int) -> int:
    rows = max(1, _CHUNK_ELEMS // nk)
    return max(block_m, rows // block_m * block_m)


def from_dense(
    mask: torch.Tensor, *, block_m: int = 128, block_n: int = 128, device=None
) -> MaskPlan:
    """Build a plan from a boolean mask.

    Args:
        mask: bool ``[Nq, Nk]`` (broadcasts over batch and heads) or ``[B, H, Nq, Nk]`` where
            ``B`` or ``H`` may be 1 (then the plan broadcasts over that axis).
        block_m, block_n: tile sizes of the default schedule.
        device: where the plan lives (None: the mask's device).

    Raises:
        CompileMaskError: not a boolean tensor, or not 2-D / 4-D, or an empty axis.

    Example::

        >>> import torch, compilemask as cm
        >>> plan = cm.from_dense(torch.ones(4, 4, dtype=torch.bool).tril())
        >>> plan.row_hi[0, :, 0].tolist()
        [1, 2, 3, 4]
    """
    if not isinstance(mask, torch.Tensor):
        raise CompileMaskError(
            f"mask must be a torch.Tensor of dtype bool, got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise CompileMaskError(f"mask must have dtype torch.bool, got {mask.dtype}")
    if mask.dim() not in (2, 4) or 0 in mask.shape:
        raise CompileMaskError(
            f"mask must be [Nq, Nk] or [B, H, Nq, Nk] with no empty axis, got {tuple(mask.shape)}"
        )
    block_m, block_n = positive_int(block_m, "block_m"), positive_int(block_n, "block_n")
    device = resolve_device(device, default=mask.device)
    m4 = mask if mask.dim() == 4 else mask[None, None]
    b, h, nq, nk = m4.shape
    rows = _chunk_rows(nk, block_m)

    def one(bi: int, hi_: int):
        return (m4[bi, hi_, r : r + rows] for r in range(0, nq, rows))

    def chunks():
        return (one(bi, hi_) for bi in range(b) for hi_ in range(h))

    batch = b if b > 1 else None
    heads = h if h > 1 else None
    return _build(chunks, nq, nk, batch, heads, block_m, block_n, device, "from_dense")


def from_mask_mod(
    mask_mod,
    q_len: int,
    kv_len: int | None = None,
    *,
    batch: int | None = None,
    heads: int | None = None,
    block_m: int = 128,
    block_n: int = 128,
    device=None,
) -> MaskPlan:
    """Build a plan from a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``.

    The mask_mod is called with broadcastable int64 index tensors on the plan's device:
    ``q_idx`` ``[rows, 1]``, ``kv_idx`` ``[1, Nk]``, and ``b``, ``h`` as 0-d tensors (with
    ``batch=None`` b is 0 and the plan broadcasts over the batch; likewise ``h``). It must
    return a boolean tensor broadcastable to ``[rows, Nk]``.

    Args:
        mask_mod: the predicate (PyTorch FlexAttention convention).
        q_len, kv_len: lengths (kv_len None: q_len).
        batch, heads: evaluate per batch row / per query head (the plan then depends on them).
        block_m, block_n, device: as in :func:`compilemask.compile` (device None: CPU).

    Raises:
        CompileMaskError: bad lengths, a mask_mod that raises or returns a non-boolean or
            wrongly shaped tensor.
    """
    q_len = positive_int(q_len, "q_len")
    kv_len = q_len if kv_len is None else positive_int(kv_len, "kv_len")
    for v, name in ((batch, "batch"), (heads, "heads")):
        if v is not None:
            positive_int(v, name)
    device = resolve_device(device)
    rows = _chunk_rows(kv_len, block_m)
    kv_idx = torch.arange(kv_len, device=device)[None, :]

    def evaluate(b: int, h: int, r: int):
        q_idx = torch.arange(r, min(q_len, r + rows), device=device)[:, None]
        bt = torch.tensor(b, device=device)
        ht = torch.tensor(h, device=device)
        try:
            out = mask_mod(bt, ht, q_idx, kv_idx)
        except Exception as exc:  # report the user's error as ours, keeping the cause
            raise CompileMaskError(f"mask_mod raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
            got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
            raise CompileMaskError(f"mask_mod must return a bool tensor, got {got}")
        try:
            return torch.broadcast_to(out, (q_idx.shape[0], kv_len))
        except RuntimeError:
            raise CompileMaskError(
                f"mask_mod returned shape {tuple(out.shape)}, not broadcastable to "
                f"{(q_idx.shape[0], kv_len)}"
            ) from None

    def one(b: int, h: int):
        return (evaluate(b, h, r) for r in range(0, q_len, rows))

    def chunks():
        return (one(b, h) for b in range(batch or 1) for h in range(heads or 1))

    return _build(chunks, q_len, kv_len, batch, heads, block_m, block_n, device, "from_mask_mod")
