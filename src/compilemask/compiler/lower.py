"""Lowering: mask IR -> exact per-row key intervals, analytically and vectorised over rows.

``lower(mask, q_len, kv_len, device, trim)`` returns canonical intervals (see
:mod:`.intervals`) with leading axes ``[Bm, Hm, Nq, K]`` (``Bm``/``Hm`` = 1 unless the mask
depends on the batch row / head). Every catalogue mask has a closed form for its intervals; a
rule ``Q -> K : REL`` gives, per query row, one interval per paired key part (one per grid row
for the 2-D relations). No (query, key) pair is ever evaluated. Lengths are validated before
lowering (``language.semantics.accepted_lengths``).

Masks of packed parts (``document``, ``shared_prompt``, ``hstu``) are piecewise affine: the rows
split into pieces (runs of rows) in which every interval end is ``q + b`` or a constant ``b``.
Their canonical form is worked out per piece on the host and expanded on the device by a few
operations (:meth:`_Ctx.pieces`), whatever the number of parts: on a GPU every operation is a
launch, and the build is launch-bound (``compilemask.tools.op_counts``). ``clear`` is built
the same way: every row's intervals are clamps of ``x + a`` with ``a`` and the bounds worked out
on the host (:func:`.grids.clear_table`), evaluated on the device by a few broadcast operations.
"""

from __future__ import annotations

import array
import functools
from typing import NamedTuple

import numpy as np
import torch

from ..errors import LayoutError
from ..language.ast import (
    GRID_RELATIONS,
    Builtin,
    Combine,
    Mask,
    PerBatch,
    PerHead,
    RuleMask,
    TiledGrid,
)
from ..language.resolve import resolve, span_ranges
from . import intervals as iv
from .global_local import global_local_rows
from .grids import I32_MAX, clear_table, grid_may_touch, grid_window

I32 = torch.int32
_I32_CODE = "i" if array.array("i").itemsize == 4 else "l"  # array typecode of int32


class _Canonical(NamedTuple):
    """Intervals a closed form built canonical already (but for the padding of unused slots)."""

    lo: torch.Tensor
    hi: torch.Tensor


class _Rows(NamedTuple):
    """Canonical intervals and counts, padded and sized (K) already: returned as they are."""

    lo: torch.Tensor
    hi: torch.Tensor
    count: torch.Tensor


def lower(mask: Mask, q_len: int, kv_len: int, device, *, trim: bool = True):
    """Canonical ``(lo, hi, count)`` with shapes ``[Bm, Hm, Nq, K]`` / ``[Bm, Hm, Nq]``."""
    ctx = _Ctx(q_len, kv_len, torch.device(device), trim)
    return ctx.lower(mask)


#: Catalogue masks lowered as piecewise-affine rows (:meth:`_Ctx.pieces`): their device table
#: is kept per (mask, Nq, Nk, trim, device) (:data:`_TABLES`).
PIECEWISE = frozenset({"document", "shared_prompt", "hstu"})
#: Catalogue masks with a piece table (:func:`piece_table`): the piecewise ones and ``causal``
#: (whose own lowering is a closed form of three operations).
TABLED = PIECEWISE | {"causal"}
_CACHED = 32  # entries kept in each of _TABLES and _ROWS (least recently made dropped first)
# (context class, name, args, Nq, Nk, trim, device) -> the device table of :meth:`_Ctx.table` (the
# host :class:`PieceTable` of :meth:`_TableCtx.table`);
# the query rows (Nq, device) -> arange. Both read only (never returned or written), shared.
_TABLES: dict[tuple, tuple] = {}
_ROWS: dict[tuple, torch.Tensor] = {}


def _keep(cache: dict, key, value):
    if len(cache) >= _CACHED:
        cache.pop(next(iter(cache)))
    cache[key] = value
    return value


def clear_tables() -> None:
    """Forget the device tables and query rows kept between lowerings."""
    _TABLES.clear()
    _ROWS.clear()


class PieceTable(NamedTuple):
    """The rows of a piecewise-affine mask as one int32 host tensor ``flat`` (pinned for a
    CUDA device, so that its copy does not block): a zero word, then ``ends [P]`` (ascending,
    the last one ``Nq``), ``ab [2, 2, P, K]`` (``lo_a, hi_a, lo_b, hi_b``: row ``q`` of piece
    ``p`` has ``[lo_a q + lo_b, hi_a q + hi_b)`` in slot ``j``; unused slots ``[Nk, Nk)``) and
    ``counts [P]``, back to back (:meth:`_Ctx.host_values`). The device builder copies it as
    it is into its own allocation, its first word being the launch's ordering ticket (zero
    before the launch): the table's copy is the one operation before the launch. Read only
    (kept per mask, :data:`_TABLES`)."""

    flat: torch.Tensor
    pieces: int
    k: int


def piece_table(mask: Mask, q_len: int, kv_len: int, device, *, trim: bool = False):
    """The :class:`PieceTable` of a :data:`TABLED` catalogue mask (its host table, made once
    per (mask, Nq, Nk, trim, device) and kept), or None for any other mask. A device builder
    that evaluates the table itself (``kernels/triton/tile_builder.py``) makes the rows
    :func:`lower` would, bit for bit, without its ``searchsorted``, gathers and ``addcmul``."""
    if not isinstance(mask, Builtin) or mask.name not in TABLED:
        return None
    if device.__class__ is not torch.device:
        device = torch.device(device)
    hit = _TABLES.get((_TableCtx, mask.name, mask.args, q_len, kv_len, trim, device))
    return hit if hit is not None else _TableCtx(q_len, kv_len, device, trim)._table_of(mask)


class _Ctx:
    def __init__(self, q_len: int, kv_len: int, device: torch.device, trim: bool):
        self.q_len, self.kv_len, self.device, self.trim = q_len, kv_len, device, trim

    @functools.cached_property
    def q(self) -> torch.Tensor:
        """The query rows ``0 .. Nq - 1`` (int32), made once per (Nq, device): read only."""
        key = (self.q_len, self.device)
        q = _ROWS.get(key)
        if q is None:
            with torch.inference_mode(False):
                q = torch.arange(self.q_len, device=self.device, dtype=I32)
            _keep(_ROWS, key, q)
        return q

    def t(self, values) -> torch.Tensor:
        """A small host table (layout lengths, half-widths) on the plan's device. On CUDA the
        copy goes through pinned memory without blocking, so the build never waits for the
        device (a copy from pageable memory would synchronise)."""
        if isinstance(values, np.ndarray):  # int32, built on the host with numpy
            host = torch.from_numpy(values)
        elif values and isinstance(values[0], int):  # a flat list: 3-4x faster than as_tensor
            host = torch.frombuffer(array.array(_I32_CODE, values), dtype=I32)
        else:
            host = torch.as_tensor(values, dtype=I32)
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host.to(self.device)

    def lower(self, mask: Mask):
        pad = self.kv_len
        if isinstance(mask, Builtin):
            if mask.name in PIECEWISE:
                out = self.expand(*self._table_of(mask))
            else:
                out = getattr(self, "_b_" + mask.name)(*mask.args)
            if isinstance(out, _Rows):
                return out.lo[None, None], out.hi[None, None], out.count[None, None]
            if isinstance(out, _Canonical):  # compact and in bounds by construction
                lo, hi, cnt = iv.finish_compact(out.lo, out.hi, pad, trim=self.trim)
            else:
                lo, hi = iv.clip(*out, self.kv_len)
                lo, hi, cnt = iv.compact_sorted(lo, hi, pad, trim=self.trim)
            return lo[None, None], hi[None, None], cnt[None, None]
        if isinstance(mask, RuleMask):
            lo, hi, cnt = self._rules(mask)
            return lo[None, None], hi[None, None], cnt[None, None]
        if isinstance(mask, Combine):
            a = self.lower(mask.left)
            b = self.lower(mask.right)
            op = {"|": iv.union, "&": iv.intersection, "-": iv.difference}[mask.op]
            if mask.op == "|":
                return op([a[:2], b[:2]], pad, trim=self.trim)
            return op(a[:2], b[:2], pad, trim=self.trim)
        if isinstance(mask, (PerHead, PerBatch)):
            parts = [self.lower(m) for m in mask.masks]
            k = max(p[0].shape[-1] for p in parts)
            padded = [iv.pad_k(p[0], p[1], k, pad) + (p[2],) for p in parts]
            axis = 1 if isinstance(mask, PerHead) else 0
            other = max(p[0].shape[1 - axis] for p in padded)  # broadcast the other axis
            shape = [-1, -1]
            shape[1 - axis] = other
            return tuple(
                torch.cat([p[i].expand(*shape, *p[i].shape[2:]) for p in padded], dim=axis)
                for i in range(3)
            )
        if isinstance(mask, TiledGrid):
            raise LayoutError(
                "tile_grid reorders the whole token axis: it must be the outermost mask "
                "(write tile_grid(a | b, ...), not tile_grid(a, ...) | b)"
            )
        raise LayoutError(f"cannot lower {type(mask).__name__}")

    # ----------------------------------------------------------------- catalogue (closed forms)
    def _b_causal(self):
        # [0, min(q + 1, Nk)): never empty, so canonical as it is (three operations)
        n, dev = self.q_len, self.device
        hi = torch.arange(1, n + 1, device=dev, dtype=I32)
        if self.kv_len < n:
            hi = hi.clamp_(max=self.kv_len)
        ones = torch.ones(n, device=dev, dtype=I32)
        return _Rows(torch.zeros((n, 1), device=dev, dtype=I32), hi[:, None], ones)

    # Parameters larger than the axis act like the axis length: clamp them first, so that the
    # int32 arithmetic below cannot overflow.
    def _axis(self) -> int:
        return max(self.q_len, self.kv_len) + 1

    # One interval per row: canonical by construction (an empty row has lo = hi = Nk, the
    # padding), in four operations or so instead of a clip and a compaction.
    def _arange(self, start: int, step: int = 1) -> torch.Tensor:
        """``start + q * step`` for the query rows (int32)."""
        end = start + self.q_len * step
        return torch.arange(start, end, step, device=self.device, dtype=I32)

    def _steps(self, start: int, step: int) -> torch.Tensor:
        """``start + q // step * step`` for the query rows (int32): an arange over the steps,
        each repeated ``step`` times (two operations)."""
        m = -(-self.q_len // step)
        firsts = torch.arange(start, start + m * step, step, device=self.device, dtype=I32)
        return firsts[:, None].expand(m, step).contiguous().view(-1)[: self.q_len]

    def _one(self, lo: torch.Tensor, hi: torch.Tensor, last_lo: int) -> _Rows:
        """Rows ``[lo, min(hi, Nk))`` with ``lo`` in ``[0, Nk]`` and ``hi > lo`` before the cut,
        the largest ``lo`` being ``last_lo``: a row is empty exactly when ``lo = Nk``."""
        if self.q_len > self.kv_len:
            hi = hi.clamp_(max=self.kv_len)
        if last_lo < self.kv_len:
            count = torch.ones(self.q_len, device=self.device, dtype=I32)
        else:
            count = torch.lt(lo, hi, out=torch.empty_like(lo))
        return _Rows(lo[:, None], hi[:, None], count)

    def _b_sliding_window(self, window):
        # [q - W + 1, q + 1) clipped
        w = min(window, self._axis())
        lo = self._arange(1 - w).clamp_(0, self.kv_len)
        return self._one(lo, self._arange(1), self.q_len - w)

    def _t_document(self, lengths, causal):
        # a document [s, e): its rows see [s, q + 1) (causal) or [s, e)
        records, s = [], 0  # (a piece without rows, ending where the last one ended: none)
        for n in lengths:
            e = s + n
            if e > s:
                records += (e, 1, 0, 1, s, 1) if causal else (e, 1, 0, 0, s, e)
                s = e
        return self.table_of(records, 1)

    def _t_causal(self):
        # [0, q + 1) up to Nk, then [0, Nk): the rows of _b_causal as a table
        nq, nk = self.q_len, self.kv_len
        return self.table([(min(nq, nk), (0,), (0,), (1,), (1,)), (nq, (0,), (0,), (0,), (nk,))], 1)

    def _b_prefix_lm(self, prefix_len):
        # [0, max(q + 1, P)) clipped
        zeros = torch.zeros(self.q_len, device=self.device, dtype=I32)
        hi = self._arange(1).clamp_(min(prefix_len, self._axis()), self.kv_len)
        return self._one(zeros, hi, 0)

    def _b_chunked(self, chunk):
        # [q // c * c, q + 1) clipped
        chunk = min(chunk, self._axis())
        lo, last = self._steps(0, chunk), (self.q_len - 1) // chunk * chunk
        if last > self.kv_len:
            lo = lo.clamp_(max=self.kv_len)
        return self._one(lo, self._arange(1), last)

    def _b_block_causal(self, block):
        # [0, (q // b + 1) * b) clipped
        block = min(block, self._axis())
        zeros = torch.zeros(self.q_len, device=self.device, dtype=I32)
        hi = self._steps(block, block)
        if (self.q_len - 1) // block * block + block > self.kv_len:
            hi = hi.clamp_(max=self.kv_len)
        return self._one(zeros, hi, 0)

    def _t_shared_prompt(self, prompts, responses):
        # a group starting at gs, its prompt ending at pe: the prompt's rows and those of the
        # response starting at pe (the first) see [gs, q + 1); a later response starting at s
        # sees [gs, pe) and [s, q + 1), or only [s, q + 1) when the prompt is empty
        nk, records, pos, start = self.kv_len, [], 0, 0  # start: where the last piece ended
        for p, resp in zip(prompts, responses):
            gs = pos
            pe = pos = gs + p
            if pe > start:
                records += (pe, 1, 0, 0, 1, 0, gs, nk, 1, nk)
                start = pe
            for n in resp:
                s, pos = pos, pos + n
                if pos <= start:  # no rows
                    continue
                if s == pe:
                    records += (pos, 1, 0, 0, 1, 0, gs, nk, 1, nk)
                elif p:
                    records += (pos, 2, 0, 0, 0, 1, gs, s, pe, 1)
                else:
                    records += (pos, 1, 0, 0, 1, 0, s, nk, 1, nk)
                start = pos
        return self.table_of(records, 2)

    def _t_hstu(self, lengths, num_targets, contextual):
        # a user [s, e), its history ending at h = e - targets (h > s): the first
        # c = min(contextual, h - s) rows see [s, h); later history rows and the first target
        # see [s, q + 1); later targets see [s, h) and [q, q + 1)
        nk, records, s, start = self.kv_len, [], 0, 0  # start: where the last piece ended
        for n, t in zip(lengths, num_targets):
            e = s + n
            h = e - t
            end = s + min(contextual, h - s)
            if end > start:
                records += (end, 1, 0, 0, 0, 0, s, nk, h, nk)
                start = end
            end = min(h + 1, e)
            if end > start:
                records += (end, 1, 0, 0, 1, 0, s, nk, 1, nk)
                start = end
            if e > start:
                records += (e, 2, 0, 1, 0, 1, s, 0, h, 1)
                start = e
            s = e
        return self.table_of(records, 2)

    def pieces(self, pieces, k: int) -> _Rows:
        """Canonical intervals of piecewise-affine rows.

        Args:
            pieces: ``(end, lo_a, lo_b, hi_a, hi_b)`` per piece, ends ascending, the last one
                ``Nq``: each row ``q`` in ``[previous end, end)`` (pieces without rows are
                skipped) has the intervals ``[lo_a[j] * q + lo_b[j], hi_a[j] * q + hi_b[j])``
                (``a`` 0 or 1; tuples of one length, its interval count), canonical for every
                such row already: non-empty, sorted, not touching, inside ``[0, Nk]``.
            k: the static bound on intervals per row (the K of an untrimmed lowering).

        Returns:
            :class:`_Rows` ``[Nq, K]`` (K = ``k``, or the largest count when trimming, which
            needs no readback here: the counts are known on the host).

        One host table and six device operations (an arange, the copy, a ``searchsorted``, two
        gathers, an ``addcmul``), whatever the number of pieces; four for a catalogue mask
        lowered before (:meth:`_table_of` keeps its table on the device, :attr:`q` its rows).
        ``lo`` and ``hi`` are the two halves of one tensor (nothing writes into a plan's
        intervals).
        """
        return self.expand(*self.table(pieces, k))

    def _table_of(self, mask: Builtin) -> tuple:
        """The device table of a :data:`TABLED` catalogue mask, made once per (mask, Nq, Nk,
        trim, device) and context class (a decoding context restates some): causal's pieces
        end at ``min(Nq, Nk)`` and ``Nq``."""
        key = (type(self), mask.name, mask.args, self.q_len, self.kv_len, self.trim, self.device)
        table = _TABLES.get(key)
        if table is None:
            if torch.is_inference_mode_enabled():
                with torch.inference_mode(False):
                    table = getattr(self, "_t_" + mask.name)(*mask.args)
            else:
                table = getattr(self, "_t_" + mask.name)(*mask.args)
            _keep(_TABLES, key, table)
        return table

    def table(self, pieces, k: int) -> tuple:
        """``(ends [P], ab [2, 2, P, K], counts [P])`` on the device, one host-to-device copy:
        the pieces of :meth:`pieces` with rows, their coefficients padded to ``K`` slots
        (views of one tensor, :meth:`host_values`)."""
        return self.table_of(self.records(pieces, k), k)

    def table_of(self, records: list, k: int) -> tuple:
        """:meth:`table` of :meth:`records` (what the catalogue's tables write directly)."""
        values, n, k = self.host_values(records, k)
        host = self.t(values)  # one host-to-device copy
        return host[:n], host[n : n + 4 * n * k].view(2, 2, n, k), host[-n:]

    def records(self, pieces, k: int) -> list:
        """The pieces with rows (a piece ending at or before the previous one has none) as one
        flat list of records ``end, count, lo_a, hi_a, lo_b, hi_b`` of ``2 + 4 k`` ints, the
        coefficients padded to ``k`` slots (unused slots ``[Nk, Nk)``: ``a = 0``, ``b = Nk``)."""
        zeros = [(0,) * (k - c) for c in range(k + 1)]
        fills = [(self.kv_len,) * (k - c) for c in range(k + 1)]
        records, start = [], 0
        for end, la, lb, ha, hb in pieces:
            if end > start:
                c = len(la)
                z, f = zeros[c], fills[c]
                records += (end, c, *la, *z, *ha, *z, *lb, *f, *hb, *f)
                start = end
        return records

    def host_values(self, records: list, k: int, lead: tuple = ()) -> tuple:
        """``(values, P, K)``: the table of :meth:`table` as one flat list of ints, ``[ends |
        a of lo, hi | b of lo, hi | counts]`` after the ints ``lead``, from :meth:`records`
        of ``k`` slots (``K = k``, or the largest count when trimming: the slots past it are
        padding), one strided slice per column and slot."""
        width = 2 + 4 * k
        n = len(records) // width
        counts = records[1::width]
        kk = max(1, max(counts)) if self.trim else k
        values = [*lead, *records[0::width]]
        for base in range(2, width, k):  # lo_a, hi_a, lo_b, hi_b
            if kk == 1:
                values += records[base::width]
            else:
                column = [0] * (n * kk)
                for j in range(kk):
                    column[j::kk] = records[base + j :: width]
                values += column
        values += counts
        return values, n, kk

    def expand(self, ends: torch.Tensor, ab: torch.Tensor, counts: torch.Tensor) -> _Rows:
        """The rows of a :meth:`table`: a ``searchsorted``, two gathers, an ``addcmul``."""
        idx = self._piece_of_row(ends)
        a, b = ab.index_select(2, idx)  # [lo / hi, Nq, K] each
        lo, hi = torch.addcmul(b, a, self.q[:, None])  # two contiguous halves of one tensor
        return _Rows(lo, hi, counts.index_select(0, idx))

    def _piece_of_row(self, ends: torch.Tensor) -> torch.Tensor:
        """The piece of every query row (``ends`` ascending, the last one ``Nq``)."""
        return torch.searchsorted(ends, self.q, right=True)

    def _b_clear(self, grid, radius, text_len):
        if not grid_may_touch(grid, "disc", (radius,)) and 2 * self.kv_len < I32_MAX:
            return self._clear_rows(grid, radius, text_len)
        # disc rows may span the grid's width and touch: merge them generically
        is_text = self.q < text_len
        lo, hi = grid_window(
            self.q, text_len, text_len, grid, "disc", (radius,), self.t, skip=is_text
        )
        text_hi = torch.where(is_text, self.kv_len, text_len).to(I32)[:, None]
        return torch.cat([torch.zeros_like(text_hi), lo], -1), torch.cat([text_hi, hi], -1)

    def _clear_rows(self, grid, radius, text_len) -> _Rows:
        """Canonical intervals of ``clear`` when no two disc rows touch: the host works out
        every row's intervals as clamps of ``x + a`` (:func:`.grids.clear_table`), and the device
        evaluates them: with text, one copy, an add, a clamp, a compare and two ``where`` (the
        variant in which the text and the first disc row merge, and the counts); without, one
        copy, an add, a clamp and the counts' copy. ``lo`` and ``hi`` are two halves of one
        buffer (nothing writes into a plan's intervals)."""
        h, w = grid
        n, dev = self.kv_len, self.device
        tab = clear_table(h, w, radius, text_len, self.trim)
        hp, rows, k, o, nt, top = tab.view_rows, tab.rows, tab.k, tab.prefix, tab.text_rows, tab.top
        host = self.t(tab.table)  # one host-to-device copy
        f = host[: 6 * rows * k].view(6, rows, 1, k)  # [field, row, x, slot]
        x = host[6 * rows * k : 6 * rows * k + w].view(w, 1)
        per_row = host[6 * rows * k + w : 6 * rows * k + w + 3 * hp].view(3, hp, 1, 1)
        buf = torch.empty((2, o + rows * w, k), dtype=I32, device=dev)
        out = buf[:, o:].view(2, rows, w, k)  # [lo / hi, row, x, slot]
        torch.add(x, f[1:3], out=out).clamp_(f[3::2], f[0::4])
        count = torch.empty(n, dtype=I32, device=dev)
        if text_len:
            merge = torch.le(x, per_row[0])  # [row, x, 1]: the text and the first disc row touch
            plain = out[:, nt:top]
            torch.where(merge[nt:top], out[:, hp:], plain, out=plain)
            torch.where(merge, per_row[2], per_row[1], out=count[o:].view(hp, w, 1))
        else:
            count.view(hp, w, 1).copy_(per_row[1].expand(hp, w, 1))
        if o:  # text rows before the first view row
            buf[:, :o] = host[-2 * k :].view(2, 1, k)
            count[:o].fill_(1)
        return _Rows(buf[0, :n], buf[1, :n], count)

    def _b_global_local(self, window, global_tokens):
        out = global_local_rows(self, window, global_tokens)
        return out if isinstance(out, _Rows) else _Rows(*out)

    def _b_tree(self, parents, prefix_len):
        n = len(parents)
        depth = [0] * n
        for i, p in enumerate(parents):
            depth[i] = depth[p] + 1 if p >= 0 else 0
        par = self.t(list(parents) + [-1])  # index n: the "no node" sentinel
        chain = [torch.arange(n, device=self.device, dtype=I32)]
        for _ in range(max(depth)):
            prev = chain[-1]
            chain.append(par[torch.where(prev >= 0, prev, n)])
        nodes = torch.stack(chain[::-1], -1)  # ascending: root ... node, -1 padding first
        lo = torch.where(nodes >= 0, prefix_len + nodes, 0)
        hi = torch.where(nodes >= 0, prefix_len + nodes + 1, 0)
        prefix = (torch.zeros_like(lo[:, :1]), torch.full_like(lo[:, :1], prefix_len))
        return torch.cat([prefix[0], lo], -1), torch.cat([prefix[1], hi], -1)

    def _b_natten2d(self, grid, kernel):
        lo, hi = grid_window(self.q, 0, 0, grid, "natten", kernel, self.t)
        return (lo, hi) if grid_may_touch(grid, "natten", kernel) else _Canonical(lo, hi)

    def _b_dilated(self, window, dilation):
        window, dilation = min(window, self._axis()), min(dilation, self._axis())
        steps = window // dilation
        m = torch.arange(-steps, steps + 1, device=self.device, dtype=I32) * dilation
        k = self.q[:, None] + m[None, :]
        return k, k + 1

    # ----------------------------------------------------------------- rule blocks
    def _rules(self, mask: RuleMask):
        axis = max(self.q_len, self.kv_len)
        segs = resolve(mask.layout, axis)
        sets = [self._rule(rule, segs, axis) for rule in mask.rules]
        pad = self.kv_len
        if not sets:
            z = torch.full((self.q_len, 1), pad, dtype=I32, device=self.device)
            return z, z.clone(), torch.zeros(self.q_len, dtype=I32, device=self.device)
        if len(sets) == 1:
            return iv.compact_sorted(*sets[0], pad, trim=self.trim)
        return iv.union(sets, pad, trim=self.trim)

    def _rule(self, rule, segs, axis):
        rel = rule.relation
        qparts = span_ranges(rule.query, segs, axis)
        kparts = span_ranges(rule.key, segs, axis)
        paired = isinstance(rule.query.index, str) and rule.query.index == rule.key.index
        if rel.kind != "full":
            for sp, parts in ((rule.query, qparts), (rule.key, kparts)):
                if sp.index is None and len(parts) > 1:
                    raise LayoutError(
                        f"relation {rel.kind} needs contiguous spans; {'|'.join(sp.names)} is not"
                    )
        if paired:
            if len(qparts) != len(kparts):
                raise LayoutError(
                    f"{rule.query.names[0]}[{rule.query.index}] has {len(qparts)} parts but "
                    f"{rule.key.names[0]}[{rule.key.index}] has {len(kparts)}"
                )
            if rel.kind != "full":
                for p, (a, b) in enumerate(zip(qparts, kparts)):
                    if a[1] != b[1]:
                        raise LayoutError(
                            f"{rel.kind} pairs part {p} of lengths {a[1]} and {b[1]}; an indexed "
                            "family needs equal lengths unless the relation is full"
                        )
            table = [[kp] for kp in kparts]
        else:
            table = [list(kparts) for _ in qparts]
        if rel.kind in GRID_RELATIONS:
            qs, ql, qg = qparts[0]
            if len(qparts) != 1 or len(kparts) != 1 or qg is None or kparts[0][2] != qg:
                raise LayoutError(
                    f"relation {rel.kind} needs a query grid and a key grid of the same shape"
                )
            ks = kparts[0][0]
            q = self.q
            inside = (q >= qs) & (q < qs + ql)
            lo, hi = grid_window(q, qs, ks, qg, rel.kind, rel.params, self.t)
            zero = torch.zeros_like(lo)
            lo, hi = torch.where(inside[:, None], lo, zero), torch.where(inside[:, None], hi, zero)
            return iv.clip(lo, hi, self.kv_len)
        # 1-D relations, vectorised over query parts
        starts = self.t([p[0] for p in qparts])
        ends = self.t([p[0] + p[1] for p in qparts])
        pidx = torch.searchsorted(ends, self.q, right=True).clamp(max=len(qparts) - 1)
        inside = (self.q >= starts[pidx]) & (self.q < ends[pidx])
        qp = self.q - starts[pidx]
        width = max(len(row) for row in table)
        ks = self.t([[kp[0] for kp in row] + [0] * (width - len(row)) for row in table])[pidx]
        kl = self.t([[kp[1] for kp in row] + [0] * (width - len(row)) for row in table])[pidx]
        qp = qp[:, None]
        if rel.kind == "full":
            a, b = ks * 0, kl
        elif rel.kind == "causal":
            a, b = ks * 0, qp + 1
        elif rel.kind == "diag":
            a, b = qp, qp + 1
        elif rel.kind == "band":
            lo_, hi_ = (max(-axis - 1, min(axis + 1, p)) for p in rel.params)
            a, b = qp + lo_, qp + hi_ + 1
        else:  # chunk
            c = min(rel.params[0], axis + 1)
            a, b = qp // c * c, (qp // c + 1) * c
        a, b = a.clamp(0), torch.minimum(b, kl)
        b = torch.maximum(b, a)
        a, b = ks + a, ks + b
        zero = torch.zeros_like(a)
        a, b = torch.where(inside[:, None], a, zero), torch.where(inside[:, None], b, zero)
        return iv.clip(a.to(I32), b.to(I32), self.kv_len)


class _TableCtx(_Ctx):
    """Makes the :class:`PieceTable` of a :data:`TABLED` mask instead of its rows (kept apart
    from :class:`_Ctx`'s tables: the context class is part of :data:`_TABLES`' key)."""

    def table_of(self, records: list, k: int) -> PieceTable:
        values, n, k = self.host_values(records, k, lead=(0,))
        host = torch.frombuffer(array.array(_I32_CODE, values), dtype=I32)
        if self.device.type == "cuda":  # copied without blocking by the builder
            host = host.pin_memory()
        return PieceTable(host, n, k)
