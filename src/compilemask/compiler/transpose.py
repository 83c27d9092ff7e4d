"""Column intervals (which query rows see key ``k``) from row intervals, by a sweep.

For rows ``r - 1`` and ``r``, the keys in ``S_r - S_{r-1}`` start a run of rows at ``r`` and the
keys in ``S_r - S_{r+1}`` end a run at ``r + 1`` (interval differences, vectorised over rows).
Expanding those difference intervals into their keys gives exactly one start event and one end
event per (key, run) -- the size of the output -- and a stable sort by key pairs the k-th start
of a key with its k-th end. No N x N matrix is formed.
"""

from __future__ import annotations

import torch

from .intervals import difference


def _events(lo: torch.Tensor, hi: torch.Tensor):
    """Expand intervals ``[N, K]`` into (key, row) events, rows ascending."""
    n, k = lo.shape
    length = (hi - lo).clamp(min=0).reshape(-1).to(torch.int64)
    total = int(length.sum())
    dev = lo.device
    rows = torch.arange(n, device=dev).repeat_interleave(k)
    row_ev = torch.repeat_interleave(rows, length, output_size=total)
    base = torch.repeat_interleave(lo.reshape(-1).to(torch.int64), length, output_size=total)
    first = torch.cumsum(length, 0) - length
    offset = torch.arange(total, device=dev) - torch.repeat_interleave(
        first, length, output_size=total
    )
    return base + offset, row_ev


def column_intervals(lo: torch.Tensor, hi: torch.Tensor, q_len: int, kv_len: int):
    """Column intervals of canonical row intervals ``[M, Nq, K]``.

    Returns ``(col_lo, col_hi, col_count)``: ``[M, Nk, Kc]``, ``[M, Nk, Kc]``, ``[M, Nk]``, int32,
    in the same canonical form (rows ascending, unused slots ``q_len``).
    """
    outs = []
    for m in range(lo.shape[0]):
        cur = (lo[m], hi[m])
        empty = torch.full_like(lo[m][:1], q_len + kv_len)
        prev = (torch.cat([empty, lo[m][:-1]]), torch.cat([empty, hi[m][:-1]]))
        nxt = (torch.cat([lo[m][1:], empty]), torch.cat([hi[m][1:], empty]))
        s_lo, s_hi, _ = difference(cur, prev, kv_len)
        e_lo, e_hi, _ = difference(cur, nxt, kv_len)
        key_s, row_s = _events(s_lo, s_hi)
        key_e, row_e = _events(e_lo, e_hi)
        key_s, order_s = torch.sort(key_s, stable=True)
        key_e, order_e = torch.sort(key_e, stable=True)
        start_row, end_row = row_s[order_s], row_e[order_e] + 1
        count = torch.bincount(key_s, minlength=kv_len).to(torch.int32)
        kc = max(1, int(count.max()) if count.numel() else 1)
        first = torch.cumsum(count, 0, dtype=torch.int64) - count
        slot = torch.arange(key_s.numel(), device=lo.device) - first[key_s]
        col_lo = torch.full((kv_len, kc), q_len, dtype=torch.int32, device=lo.device)
        col_hi = col_lo.clone()
        col_lo[key_s, slot] = start_row.to(torch.int32)
        col_hi[key_s, slot] = end_row.to(torch.int32)
        outs.append((col_lo, col_hi, count))
    kc = max(o[0].shape[1] for o in outs)
    pad = [
        torch.nn.functional.pad(o[i], (0, kc - o[i].shape[1]), value=q_len)
        for o in outs
        for i in (0, 1)
    ]
    col_lo = torch.stack(pad[0::2])
    col_hi = torch.stack(pad[1::2])
    return col_lo, col_hi, torch.stack([o[2] for o in outs])
