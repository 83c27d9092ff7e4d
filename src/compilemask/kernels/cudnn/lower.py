"""A :class:`~compilemask.MaskPlan` lowered to cuDNN-frontend's interval endpoints (pure torch).

cuDNN's ``create_mask_plan`` reads ``mask_func``: contiguous int32 ``[Hmask, nfunc, B * Nq]``,
``nfunc`` odd; row ``r = b * Nq + q`` of mask head ``h`` sees the keys

    [0, F[0]) U [F[1], F[2]) U [F[3], F[4]) U ...      (F = mask_func[h, :, r])

(key positions local to the batch row; each endpoint is clamped to ``[0, Nk]`` and a piece
whose end is below its start is empty). ``Hmask`` is 1 (shared by every query head) or ``Hq``.

A plan row holds sorted, disjoint intervals ``[lo_j, hi_j)`` (``j < count``; unused slots
``lo == hi == Nk``), so its endpoints are ``[0, lo_0, hi_0, lo_1, hi_1, ...]``: the first
piece ``[0, 0)`` is empty. A row whose first interval starts at key 0 drops that empty piece
and reads ``[hi_0, lo_1, hi_1, ...]``. Endpoints past a row's last interval repeat its last
endpoint, so every row's F is non-decreasing and the padded pieces are empty. A row needs
``2 * count + 1`` endpoints (``2 * count - 1`` when it starts at key 0).

Example::

    >>> import compilemask as cm
    >>> plan = cm.compile(cm.masks.causal(), 4, block_m=2, block_n=2)
    >>> endpoints(plan, batch=1, heads_q=2)[0].T.tolist()  # row q: [0, q + 1), then empty
    [[1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4]]
    >>> endpoints(plan, batch=1, heads_q=2, trim=True).shape  # the smallest nfunc: 1
    torch.Size([1, 1, 4])
"""

from __future__ import annotations

import torch

from ...compiler.intervals import from_dense_rows, pad_k
from ...compiler.plan import MaskPlan
from ...errors import CompileMaskError

#: rows of a bitmask plan expanded to dense at once (bounds the memory of the expansion)
_DENSE_CHUNK_PAIRS = 1 << 22


def row_intervals(plan: MaskPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's row intervals ``(lo, hi)``: int32 ``[M, Nq, K]``, unused slots ``Nk``.

    An intervals plan answers with ``plan.row_lo`` / ``plan.row_hi`` (no work, no host read).
    A bitmask plan (``encoding == "bits"``, from ``from_dense`` / ``from_mask_mod``) keeps its
    rows in the tile bitmasks: they are expanded to dense rows in chunks and read back as
    intervals, which reads the largest interval count back to the host once.
    """
    if plan.encoding != "bits":
        return plan.row_lo, plan.row_hi
    runs = plan.row_runs
    k_slots = max(1, int(runs.max())) if runs is not None and runs.numel() else 1
    rows = max(1, _DENSE_CHUNK_PAIRS // plan.kv_len)
    los, his = [], []
    for start in range(0, plan.q_len, rows):
        dense = plan.dense_rows(start, min(plan.q_len, start + rows))
        lo, hi, _ = from_dense_rows(dense, plan.kv_len, trim=False)
        lo, hi = lo[..., :k_slots], hi[..., :k_slots]
        lo, hi = pad_k(lo, hi, k_slots, plan.kv_len)
        los.append(lo)
        his.append(hi)
    return torch.cat(los, 1), torch.cat(his, 1)


def _row_endpoints(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Endpoints ``[..., 2K + 1]`` of rows ``lo, hi [..., K]`` (padded by repeating each row's
    last endpoint) and the count each row needs ``[...]`` (odd)."""
    k_slots = lo.shape[-1]
    zero = torch.zeros_like(lo[..., :1])
    pairs = torch.stack((lo, hi), -1).flatten(-2)  # lo_0, hi_0, lo_1, hi_1, ...
    full = torch.cat((zero, pairs), -1)  # 0, lo_0, hi_0, ...
    count = (lo < hi).sum(-1, dtype=torch.int32)
    starts_at_zero = (lo[..., 0] == 0) & (count > 0)
    shifted = torch.cat((pairs[..., 1:], pairs[..., -2:]), -1)  # hi_0, lo_1, ... (2K + 1)
    f = torch.where(starts_at_zero[..., None], shifted, full)
    needed = 2 * count + 1 - 2 * starts_at_zero.to(torch.int32)
    last = f.gather(-1, (needed - 1).long()[..., None])
    slot = torch.arange(2 * k_slots + 1, device=lo.device, dtype=torch.int32)
    f = torch.where(slot >= needed[..., None], last, f)
    return f, needed


def endpoints(plan: MaskPlan, batch: int, heads_q: int, *, trim: bool = False) -> torch.Tensor:
    """cuDNN ``mask_func`` of ``plan`` for ``batch`` rows and ``heads_q`` query heads.

    Args:
        plan: a MaskPlan, read in its own (tiled) token order (the permutation of a
            ``tile_grid`` plan is applied to q, k, v by the caller).
        batch: ``B``; must equal ``plan.batch`` for a per-batch plan.
        heads_q: ``Hq``; must equal ``plan.heads`` for a per-head plan.
        trim: False: ``nfunc = 2 * K + 1`` with ``K`` the plan's slot count (no host read);
            True: the smallest odd ``nfunc`` that holds every row (one host read; a plan built
            on a GPU keeps ``K`` at its static bound, often above the largest row's count, and
            every row starting at key 0 saves two more).

    Returns:
        int32 ``[Hmask, nfunc, B * Nq]``, contiguous, on the plan's device: ``Hmask = Hq`` for a
        per-head plan, else 1; per-batch plans vary along ``B * Nq``, the others repeat their
        rows over ``B``. Built with vectorised torch ops (a bitmask plan reads one number back,
        see :func:`row_intervals`).

    Raises:
        CompileMaskError: ``batch`` / ``heads_q`` not positive ints or contradicting the plan.
    """
    for name, value in (("batch", batch), ("heads_q", heads_q)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CompileMaskError(f"{name} must be a positive int, got {value!r}")
    if plan.batch is not None and plan.batch != batch:
        raise CompileMaskError(f"batch={batch} but the plan is per-batch for {plan.batch} rows")
    if plan.heads is not None and plan.heads != heads_q:
        raise CompileMaskError(f"heads_q={heads_q} but the plan is per-head for {plan.heads}")
    lo, hi = row_intervals(plan)
    f, needed = _row_endpoints(lo, hi)  # [M, Nq, 2K + 1], [M, Nq]
    nfunc = f.shape[-1]
    if trim and needed.numel():
        nfunc = int(needed.max())
        f = f[..., :nfunc]
    b_mask, h_mask = plan.batch or 1, plan.heads or 1
    f = f.reshape(b_mask, h_mask, plan.q_len, nfunc).expand(batch, h_mask, plan.q_len, nfunc)
    # [B, Hmask, Nq, nfunc] -> [Hmask, nfunc, B, Nq] -> [Hmask, nfunc, B * Nq]
    return f.permute(1, 3, 0, 2).reshape(h_mask, nfunc, batch * plan.q_len).contiguous()


def expand_endpoints(mask_func: torch.Tensor, batch: int, kv_len: int) -> torch.Tensor:
    """Boolean ``[B, Hmask, Nq, Nk]`` of a ``mask_func`` (cuDNN's rule, clamping included):
    the inverse of :func:`endpoints`, for tests and pictures. O(B * Hmask * Nq * Nk)."""
    h_mask, nfunc, total_q = mask_func.shape
    f = mask_func.long().clamp(0, kv_len)
    starts = torch.cat((torch.zeros_like(f[:, :1]), f[:, 1::2]), 1)  # [Hmask, pieces, B*Nq]
    ends = f[:, 0::2]
    key = torch.arange(kv_len, device=mask_func.device)
    seen = ((starts[..., None] <= key) & (key < ends[..., None])).any(1)  # [Hmask, B*Nq, Nk]
    return seen.view(h_mask, batch, total_q // batch, kv_len).transpose(0, 1)
