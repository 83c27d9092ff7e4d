"""Blocked evaluation of a dense mask or a FlexAttention ``mask_mod`` into row intervals.

One pass over the mask in chunks of query rows (at most ``chunk_elems()`` (query, key) pairs
exist at once): each chunk's run boundaries (``rows[k] != rows[k - 1]``, with False outside
the row) are found 8 keys at a time (an int64 word of 8 booleans: only words that are not
uniform or differ from their left neighbour are opened), which lists every interval
``[lo, hi)`` of the chunk in row order; the intervals of all chunks are scattered into the
``[M, Nq, K]`` slots at the end (K, the most intervals of a row, is the one size that depends
on the data). The tile schedule is then built from the intervals. When a row holds so many
intervals that its bits would be smaller (``8 * K > ceil(Nk / 8)`` bytes), the pass stops and a
second pass stores every PARTIAL tile as a bitmask (``plan.encoding == "bits"``).

The plans are admitted as compiler output (``plan.built_plans``: the host-side checks only, as
``compile``'s): the mask_mod decides which pairs are visible, never the plan's structure --
the canonical intervals, the tiles and their bitmasks are built here from whatever booleans it
returns, so they hold by construction for every input. ``plan.verify()`` still runs every check.
"""

from __future__ import annotations

import os

import torch

from ...errors import CompileMaskError
from ..plan import MaskPlan, built_plans
from ..tiles import build_tiles, build_tiles_from_dense, build_tiles_from_key_rows

#: (query, key) pairs evaluated at once on the CPU: 4 Mi booleans (4 MiB, within the last-level
#: cache) amortise each torch operation's threading cost over enough work; at 8K on the 2-core
#: CPU, 2**18 / 2**20 / 2**22 / 2**24 pairs took 3661 / 1573 / 985 / 1298 ms (shared_prompt)
#: and 798 / 727 / 475 / 436 ms (causal), alternating in one process
CPU_CHUNK_ELEMS = 1 << 22
#: on a GPU a chunk is sized for occupancy, not cache
GPU_CHUNK_ELEMS = 1 << 26


def chunk_elems(device: torch.device) -> int:
    env = os.environ.get("COMPILEMASK_CHUNK_ELEMS")
    if env:
        return max(1, int(env))
    return CPU_CHUNK_ELEMS if device.type == "cpu" else GPU_CHUNK_ELEMS


def chunk_rows(nk: int, block_m: int, device: torch.device) -> int:
    """Rows per chunk: a multiple of ``block_m`` (the bitmask pass tiles whole chunks)."""
    rows = max(1, chunk_elems(device) // max(nk, 1))
    return max(block_m, rows // block_m * block_m)


class _TooManyRuns(Exception):
    """A row holds more intervals than its bits take: switch to the bitmask encoding."""


class RunCollector:
    """Collects the intervals of boolean row chunks ``[rows, Nk]`` of one mask, in order."""

    def __init__(self, q_len: int, kv_len: int, k_limit: int | None, device):
        self.q_len, self.kv_len, self.k_limit = q_len, kv_len, k_limit
        self.device = device
        self.rows, self.los, self.his = [], [], []
        self.buf = None
        self.next_row = 0

    def add(self, rows: torch.Tensor) -> None:
        r, nk = rows.shape
        width = (nk + 8) // 8 * 8  # at least one False column after the row
        if self.buf is None or self.buf.shape[0] < r or self.buf.shape[1] != width:
            self.buf = torch.zeros((r, width), dtype=torch.bool, device=rows.device)
        row, col = _edges_by_words(rows, self.buf[:r])
        if row is None:  # most 8-key words hold a boundary: scan every key
            row, col = _edges_by_keys(rows)
        row = row[0::2]
        if self.k_limit is not None and row.numel() > self.k_limit:
            if int(torch.bincount(row).max()) > self.k_limit:
                raise _TooManyRuns
        self.rows.append((row + self.next_row).to(self.device))
        self.los.append(col[0::2].to(self.device))
        self.his.append(col[1::2].to(self.device))
        self.next_row += r

    def finish(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Canonical ``(lo, hi, count)``: int32 ``[Nq, K]``, ``[Nq, K]``, ``[Nq]``."""
        row = torch.cat(self.rows)
        count = torch.bincount(row, minlength=self.q_len)
        k = max(1, int(count.max())) if row.numel() else 1
        if self.k_limit is not None and k > self.k_limit:
            raise _TooManyRuns
        first = torch.cumsum(count, 0) - count
        slot = torch.arange(row.numel(), device=row.device) - first[row]
        lo = torch.full((self.q_len, k), self.kv_len, dtype=torch.int32, device=row.device)
        hi = lo.clone()
        lo[row, slot] = torch.cat(self.los).to(torch.int32)
        hi[row, slot] = torch.cat(self.his).to(torch.int32)
        return lo, hi, count.to(torch.int32)


_ONES = 0x0101010101010101  # eight True bytes as one int64


def _edges_by_words(rows: torch.Tensor, buf: torch.Tensor):
    """Run boundaries ``(row, col)`` of boolean ``rows`` ``[r, nk]`` in row-major order (a
    boundary at ``col`` when ``rows[col] != rows[col - 1]``, False outside the row), looking
    at 8 keys at once: only the int64 words that are not uniform, or differ from the word
    before, are opened. ``buf``: bool ``[r, W * 8]``, ``W * 8 > nk``, False after ``nk``.
    Returns ``(None, None)`` when too many words need opening (then scan every key)."""
    r, nk = rows.shape
    buf[:, :nk].copy_(rows)
    w = buf.view(torch.int64)  # [r, W]
    cand = (w != 0) & (w != _ONES)
    cand[:, 0] |= w[:, 0] != 0
    cand[:, 1:] |= w[:, 1:] != w[:, :-1]
    cr, cj = cand.nonzero(as_tuple=True)
    if cr.numel() * 16 > w.numel():
        return None, None
    n_words = w.shape[1]
    flat = buf.view(-1).view(torch.uint8)
    first = cr * (8 * n_words) + cj * 8  # the word's first key
    keys = flat[first[:, None] + torch.arange(8, device=rows.device)]  # [C, 8]
    before = torch.where(cj > 0, flat[(first - 1).clamp(min=0)], 0)[:, None]
    hit = torch.cat([before, keys], 1)
    ci, ii = (hit[:, 1:] != hit[:, :-1]).nonzero(as_tuple=True)
    return cr[ci], cj[ci] * 8 + ii


def _edges_by_keys(rows: torch.Tensor):
    r, nk = rows.shape
    edge = torch.empty((r, nk + 1), dtype=torch.bool, device=rows.device)
    edge[:, 0] = rows[:, 0]
    torch.ne(rows[:, 1:], rows[:, :-1], out=edge[:, 1:nk])
    edge[:, nk] = rows[:, nk - 1]
    return edge.nonzero(as_tuple=True)


def runs_per_row(rows: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Number of maximal runs of True per row of ``[..., rows, Nk]`` (a run starts where a key
    is True and the one before it is not). ``scratch``: a bool tensor of ``rows``' shape to
    use for the starts (kept from chunk to chunk by the caller), else one is allocated."""
    if scratch is None:
        scratch = torch.empty_like(rows)
    scratch[..., :1] = rows[..., :1]
    torch.gt(rows[..., 1:], rows[..., :-1], out=scratch[..., 1:])  # True after False
    return scratch.sum(-1, dtype=torch.int32)


def build_plan(chunks, q_len, kv_len, batch, heads, block_m, block_n, device, source) -> MaskPlan:
    """A plan from ``chunks()``: a fresh iterator, per mask, of boolean row blocks
    ``[rows, Nk]`` (rows a multiple of ``block_m`` but the last), evaluated in one pass (two
    for masks whose rows hold too many intervals)."""
    k_limit = max(1, -(-kv_len // 8) // 8)
    try:
        parts = []
        for mask_chunks in chunks():
            col = RunCollector(q_len, kv_len, k_limit, device)
            for rows in mask_chunks:
                col.add(rows)
            parts.append(col.finish())
    except _TooManyRuns:
        return _bits_plan(chunks, q_len, kv_len, batch, heads, block_m, block_n, device, source)
    return _interval_plan(parts, q_len, kv_len, batch, heads, block_m, block_n, source)


def _interval_plan(parts, q_len, kv_len, batch, heads, block_m, block_n, source) -> MaskPlan:
    """The plan of the masks' intervals ``parts``: per mask ``(lo, hi, count)`` of
    :meth:`RunCollector.finish`, its rows ``Nq`` or one (repeated for every query)."""
    k = max(p[0].shape[1] for p in parts)
    device = parts[0][0].device
    lo = torch.full((len(parts), q_len, k), kv_len, dtype=torch.int32, device=device)
    hi = lo.clone()
    for i, (lo_i, hi_i, _) in enumerate(parts):
        lo[i, :, : lo_i.shape[1]] = lo_i
        hi[i, :, : hi_i.shape[1]] = hi_i
    count = torch.stack([p[2].expand(q_len) for p in parts])
    schedule = build_tiles(lo, hi, count, q_len, kv_len, block_m, block_n, use_bits=True)
    with built_plans():  # see the module docstring: admitted as compiler output
        return MaskPlan(q_len, kv_len, batch, heads, lo, hi, count, schedule, source=source)


def build_key_plan(keys, q_len, kv_len, batch, heads, block_m, block_n, source) -> MaskPlan:
    """The plan of masks whose rows are all alike (a key-only mask_mod): mask ``m`` shows every
    query the keys ``keys[m]`` (bool ``[M, Nk]``). The intervals of one row per mask, repeated
    for every query; or, when a row holds more intervals than its bits take, the bitmask
    encoding with every q-tile's tiles those of one tile of such rows
    (:func:`~compilemask.compiler.tiles.build_tiles_from_key_rows`): O(M Nk) work either way,
    where :func:`build_plan` would read O(M Nq Nk) pairs."""
    device = keys.device
    try:
        parts = []
        for row in keys:
            col = RunCollector(1, kv_len, max(1, -(-kv_len // 8) // 8), device)
            col.add(row[None])
            parts.append(col.finish())
    except _TooManyRuns:
        schedule = build_tiles_from_key_rows(keys, q_len, kv_len, block_m, block_n)
        m = keys.shape[0]
        empty = torch.full((m, q_len, 1), kv_len, dtype=torch.int32, device=device)
        row_runs = runs_per_row(keys)[:, None].expand(m, q_len).contiguous()
        with built_plans():
            return MaskPlan(
                q_len, kv_len, batch, heads, empty, empty.clone(), torch.zeros_like(row_runs),
                schedule, source=source, encoding="bits", row_runs=row_runs,
            )  # fmt: skip
    return _interval_plan(parts, q_len, kv_len, batch, heads, block_m, block_n, source)


def _bits_plan(chunks, q_len, kv_len, batch, heads, block_m, block_n, device, source):
    m = (batch or 1) * (heads or 1)
    row_runs = torch.zeros((m, q_len), dtype=torch.int32, device=device)

    def counted():
        # the chunk, the run count's scratch and the counts in buffers allocated once:
        # allocations kept chunk after chunk between the chunk's temporaries fragment the host
        # allocator's heap (gigabytes at 32K keys)
        block = scratch = None
        row = 0
        for rows in zip(*chunks()):
            shape = (len(rows), *rows[0].shape)
            if block is None or block.shape != shape:
                block = torch.empty(shape, dtype=torch.bool, device=device)
                scratch = torch.empty_like(block)
            torch.stack([r.to(device) for r in rows], out=block)
            row_runs[:, row : row + shape[1]] = runs_per_row(block, scratch)
            row += shape[1]
            yield block

    schedule = build_tiles_from_dense(counted(), m, q_len, kv_len, block_m, block_n)
    empty = torch.full((m, q_len, 1), kv_len, dtype=torch.int32, device=device)
    with built_plans():
        return MaskPlan(
            q_len,
            kv_len,
            batch,
            heads,
            empty,
            empty.clone(),
            torch.zeros_like(row_runs),
            schedule,
            source=source,
            encoding="bits",
            row_runs=row_runs,
        )


def check_dense(mask) -> None:
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
