"""``MaskPlan``: the compiled, device-resident descriptor that attention kernels read."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch

from ..errors import CompileMaskError
from .intervals import dense_rows, from_dense_rows
from .tiles import (
    EMPTY,
    FULL,
    PARTIAL,
    PARTIAL_BITS,
    TileSchedule,
    build_tiles,
    build_tiles_from_dense,
    dense_from_tiles,
)
from .transpose import column_intervals


def outside_inference_mode(fn):
    """Run ``fn`` with inference mode off: what it builds outlives the call (plans, the plan
    cache, cached tilings), and a later training step must be able to save it for backward
    (inference tensors cannot be). Reading inference tensors stays allowed."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.inference_mode(False):
            return fn(*args, **kwargs)

    return wrapper


#: ``MaskPlan._cache`` key of the largest number of intervals of a row (an int, set by the
#: kernels' first host read of the plan, ``kernels/triton/configs.tile_efficiency_128``).
MAX_ROW_SLOTS = "max_row_slots"


@dataclass(frozen=True, eq=False)
class MaskPlan:
    """The exact visible key intervals of every query row, plus tile schedules.

    Legend: ``M`` masks = ``(batch or 1) * (heads or 1)`` (mask index
    ``m = b' * (heads or 1) + h'`` with ``b' = b`` if the plan depends on the batch row else 0,
    and likewise ``h'`` for the query head); ``Nq``/``Nk`` query/key lengths in tokens; ``K``
    interval slots per row; ``Kc`` slots per key column.

    Attributes:
        q_len, kv_len: ``Nq``, ``Nk`` (tokens).
        batch, heads: the batch / head count the mask depends on, or None when it is shared by
            every batch row / head (then it broadcasts over any B / Hq).
        row_lo, row_hi: int32 ``[M, Nq, K]``: row ``q`` sees keys ``[row_lo[m, q, j],
            row_hi[m, q, j])`` for every slot ``j``; the first ``row_count[m, q]`` slots hold
            sorted, disjoint, non-touching intervals inside ``[0, Nk)``; the rest are empty
            (``lo == hi == Nk``).
        row_count: int32 ``[M, Nq]``.
        schedule: the :class:`TileSchedule` at ``block_m x block_n`` (``plan.tiles(bm, bn)``
            derives and caches others from the same intervals).
        col_lo, col_hi, col_count: the same for key columns (which query rows see key ``k``),
            ``[M, Nk, Kc]``, computed on first use by a sweep (the kernels do not need them).
        source: the mask text (or ``"from_dense"`` / ``"from_mask_mod"``).
        encoding: ``"intervals"`` (the default), or ``"bits"`` for plans from ``from_dense`` /
            ``from_mask_mod`` whose rows hold so many intervals that per-tile bitmasks are
            smaller: then every PARTIAL tile is a PARTIAL_BITS tile, ``row_lo``/``row_hi`` hold
            one empty slot per row, and ``row_runs`` [M, Nq] counts each row's intervals.
        permutation: int64 ``[Nq]`` for plans of ``tile_grid`` masks (tiled position ->
            original position; the intervals are in tiled order), else None. ``attention``
            takes q, k, v in the original order and applies it; :meth:`in_permuted_order`
            gives the same plan without it, for models that keep their tokens tiled.

    The dense mask is rebuilt as ``visible[m, q, k] = any(row_lo[m, q, j] <= k < row_hi[m, q, j])``
    (:meth:`to_dense`).
    """

    q_len: int
    kv_len: int
    batch: int | None
    heads: int | None
    row_lo: torch.Tensor
    row_hi: torch.Tensor
    row_count: torch.Tensor
    schedule: TileSchedule
    source: str = ""
    encoding: str = "intervals"
    row_runs: torch.Tensor | None = None
    permutation: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)
    #: the plan's shape class: ``(key, value)`` pairs of constants that backends derive from
    #: the plan's data and that select kernel configurations (buckets, not raw numbers; see
    #: :meth:`set_class_value`). Under ``torch.compile`` it is the one thing read from the
    #: plan besides its tensors and sizes, so a compiled graph serves every plan of the same
    #: shapes and class.
    shape_class: tuple = field(default=(), repr=False, compare=False)

    # ------------------------------------------------------------------ backend state
    def cached(self, key, fn):
        """``self._cache[key]``, made by ``fn()`` on first use (outside inference mode, so a
        later training step can save it). While ``torch.compile`` traces, ``fn()`` is traced
        and not kept: a compiled graph reads the plan's tensors, never its cache."""
        if torch.compiler.is_compiling():
            return fn()
        hit = self._cache.get(key, _MISSING)
        if hit is _MISSING:
            with torch.inference_mode(False):
                hit = self._cache[key] = fn()
        return hit

    def class_value(self, key, default=None):
        """The value of ``key`` in :attr:`shape_class` (``default`` when unset)."""
        for k, v in self.shape_class:
            if k == key:
                return v
        return default

    def set_class_value(self, key, value) -> None:
        """Set ``key`` of :attr:`shape_class` (eager calls only: a backend's host read of the
        plan, bucketed to a few values so that plans of one class share compiled graphs)."""
        if torch.compiler.is_compiling() or self.class_value(key, _MISSING) == value:
            return
        rest = tuple((k, v) for k, v in self.shape_class if k != key)
        object.__setattr__(self, "shape_class", (*rest, (key, value)))

    # ------------------------------------------------------------------ basic facts
    @property
    def device(self) -> torch.device:
        return self.row_lo.device

    @property
    def block_m(self) -> int:
        return self.schedule.block_m

    @property
    def block_n(self) -> int:
        return self.schedule.block_n

    @property
    def num_masks(self) -> int:
        return self.row_lo.shape[0]

    @property
    def max_intervals(self) -> int:
        return self.row_lo.shape[-1]

    def mask_index(self, b: int, h: int) -> int:
        """Mask index ``m`` of batch row ``b`` and query head ``h``."""
        return (b if self.batch else 0) * (self.heads or 1) + (h if self.heads else 0)

    # ------------------------------------------------------------------ derived views
    def tiles(self, block_m: int, block_n: int, *, bits: bool = False) -> TileSchedule:
        """The tile schedule for ``block_m x block_n`` tiles (derived from the intervals and
        cached). Derived tilings store wide PARTIAL tiles as bitmasks, which reads one number
        back from the device the first time; the default schedule of a GPU build has none (it
        never reads back). ``bits=True`` asks for bitmask tiles at the default tiling too
        (what the kernels read: without them, tiles whose rows hold many intervals run a slow
        loop over those intervals)."""
        key = ("tiles", block_m, block_n)
        if (block_m, block_n) == (self.block_m, self.block_n):
            own = self.schedule
            if not bits:
                return own
            if key in self._cache:  # rebuilt with bitmasks by an earlier eager call
                return self._cache[key]
            if torch.compiler.is_compiling():  # bitmasks need a host read: keep intervals
                return own
            if not (self._bits_plan() and own.bits.shape[0] == 0):
                return own
        for name, v in (("block_m", block_m), ("block_n", block_n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CompileMaskError(f"{name} must be a positive int, got {v!r}")
        if key not in self._cache:
            self._build_tiles(key, block_m, block_n)
            if torch.compiler.is_compiling():
                # built while tracing: not kept (it has no bitmasks, and under inference_mode
                # its tensors would be inference tensors); an eager call builds its own
                return self._cache.pop(key)
        return self._cache[key]

    def _bits_plan(self) -> bool:
        """An intervals plan with more than ``BITS_MIN_SLOTS`` slots per row: its schedules
        may hold bitmask tiles (see ``compiler.tiles``). The slot count is the largest row's
        when known (``_cache[MAX_ROW_SLOTS]``), else the static bound ``row_lo.shape[-1]`` (a
        GPU build does not trim it)."""
        from .tiles import BITS_MIN_SLOTS

        slots = self._cache.get(MAX_ROW_SLOTS, self.row_lo.shape[-1])
        return self.encoding == "intervals" and slots > BITS_MIN_SLOTS

    @outside_inference_mode
    def _build_tiles(self, key, block_m: int, block_n: int) -> None:
        if key not in self._cache and self.encoding == "bits":
            rows = max(1, (1 << 22) // self.kv_len) // block_m * block_m or block_m
            chunks = (
                self.dense_rows(r, min(self.q_len, r + rows)) for r in range(0, self.q_len, rows)
            )
            self._cache[key] = build_tiles_from_dense(
                chunks, self.num_masks, self.q_len, self.kv_len, block_m, block_n
            )
        if key not in self._cache:
            self._cache[key] = build_tiles(
                self.row_lo,
                self.row_hi,
                self.row_count,
                self.q_len,
                self.kv_len,
                block_m,
                block_n,
                use_bits=True,  # one host read per tiling (kernels derive theirs on first use)
            )

    def _columns(self):
        if "cols" not in self._cache and self.encoding == "bits":  # O(Nq * Nk) for bits plans
            cols = self.dense_rows(0, self.q_len).transpose(1, 2)
            self._cache["cols"] = from_dense_rows(cols, self.q_len)
        if "cols" not in self._cache:
            self._cache["cols"] = column_intervals(
                self.row_lo, self.row_hi, self.q_len, self.kv_len
            )
        return self._cache["cols"]

    @property
    def col_lo(self) -> torch.Tensor:
        return self._columns()[0]

    @property
    def col_hi(self) -> torch.Tensor:
        return self._columns()[1]

    @property
    def col_count(self) -> torch.Tensor:
        return self._columns()[2]

    def dense_rows(self, start: int, end: int) -> torch.Tensor:
        """Boolean mask of query rows ``[start, end)``: ``[M, end - start, Nk]``."""
        if self.encoding == "bits":
            return dense_from_tiles(self.schedule, start, end)
        return dense_rows(self.row_lo[:, start:end], self.row_hi[:, start:end], self.kv_len)

    def to_dense(self) -> torch.Tensor:
        """Boolean ``[Nq, Nk]`` when the plan broadcasts, else ``[B or 1, H or 1, Nq, Nk]``.
        Memory O(Nq * Nk): for tests and pictures at small sizes.

        A ``tile_grid`` plan answers in its tiled token order (the order its kernels run in);
        the mask in the original order, the one ``attention`` applies to q, k, v, is
        ``d[..., inv[:, None], inv[None, :]]`` with ``inv = plan.inverse_permutation``."""
        d = self.dense_rows(0, self.q_len)
        if self.batch is None and self.heads is None:
            return d[0]
        return d.view(self.batch or 1, self.heads or 1, self.q_len, self.kv_len)

    # ------------------------------------------------------------------ reports
    @property
    def nbytes(self) -> int:
        """Bytes of the tensors kernels read: row intervals and the default tile schedule."""
        t = (self.row_lo, self.row_hi, self.row_count)
        return sum(x.numel() * x.element_size() for x in t) + self.schedule.nbytes

    def stats(self) -> dict:
        """Numbers about the plan, over all its masks.

        Returns:
            A dict: ``density`` (visible pairs / (M * Nq * Nk)), ``visible_pairs``,
            ``intervals_per_row_max`` / ``_mean``, ``tiles_full`` / ``tiles_partial``
            (``tiles_partial_bits`` of them as bitmasks) / ``tiles_empty`` at the default
            tiling, ``tile_efficiency`` (visible pairs / pairs inside touched tiles, clipped to
            the lengths), ``bytes`` (:attr:`nbytes`), ``encoding`` and the sizes.

        Example::

            >>> import compilemask as cm
            >>> cm.compile(cm.masks.causal(), 256, block_m=64, block_n=64).stats()["tiles_full"]
            6
        """
        s = self.schedule
        visible = int(s.pairs.sum())
        runs = self.row_runs if self.encoding == "bits" else self.row_count
        total = self.num_masks * self.q_len * self.kv_len
        rows = (self.q_len - torch.arange(s.num_q_tiles, device=self.device) * s.block_m).clamp(
            max=s.block_m
        )
        cols = (self.kv_len - torch.arange(s.num_kv_tiles, device=self.device) * s.block_n).clamp(
            max=s.block_n
        )
        box = rows[:, None] * cols[None, :]
        touched_pairs = int((box[None] * (s.kind > EMPTY)).sum())
        counts = s.counts()
        return {
            "q_len": self.q_len,
            "kv_len": self.kv_len,
            "masks": self.num_masks,
            "density": visible / total if total else 0.0,
            "visible_pairs": visible,
            "intervals_per_row_max": int(runs.max()),
            "intervals_per_row_mean": float(runs.float().mean()),
            "encoding": self.encoding,
            "block_m": s.block_m,
            "block_n": s.block_n,
            "tiles_full": counts["full"],
            "tiles_partial": counts["partial"],
            "tiles_partial_bits": counts["partial_bits"],
            "tiles_empty": counts["empty"],
            "tile_efficiency": visible / touched_pairs if touched_pairs else 1.0,
            "bytes": self.nbytes,
        }

    def __repr__(self) -> str:
        s = self.stats()
        dep = []
        if self.batch:
            dep.append(f"batch={self.batch}")
        if self.heads:
            dep.append(f"heads={self.heads}")
        src = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        if self.permutation is not None:
            dep.append("tiled (permuted) token order")
        return (
            f"MaskPlan(q_len={self.q_len}, kv_len={self.kv_len}"
            f"{', ' if dep else ''}{', '.join(dep)}, device={self.device}, "
            f"density={s['density']:.4f}, intervals/row<={s['intervals_per_row_max']}, "
            f"tiles {s['block_m']}x{s['block_n']}: "
            f"full={s['tiles_full']} partial={s['tiles_partial']} "
            f"empty={s['tiles_empty']}, {s['bytes'] / 1024:.1f} KiB, mask={src!r})"
        )

    # ------------------------------------------------------------------ checks and moves
    def to(self, device) -> MaskPlan:
        """The same plan with every tensor on ``device``."""
        device = torch.device(device)
        if device == self.device:
            return self
        return self._to(device)

    @outside_inference_mode
    def _to(self, device: torch.device) -> MaskPlan:
        return MaskPlan(
            self.q_len,
            self.kv_len,
            self.batch,
            self.heads,
            self.row_lo.to(device),
            self.row_hi.to(device),
            self.row_count.to(device),
            self.schedule.to(device),
            self.source,
            self.encoding,
            None if self.row_runs is None else self.row_runs.to(device),
            None if self.permutation is None else self.permutation.to(device),
            shape_class=self.shape_class,
        )

    def in_permuted_order(self) -> MaskPlan:
        """This plan without its permutation: q, k, v are expected in tiled order."""
        if self.permutation is None:
            return self
        return dataclasses.replace(self, permutation=None, _cache=self._cache)

    @property
    def inverse_permutation(self) -> torch.Tensor | None:
        """int64 ``[Nq]``: original position -> tiled position (None without a permutation)."""
        if self.permutation is None:
            return None
        if "inverse" in self._cache:
            return self._cache["inverse"]
        inverse = _inverse(self.permutation)
        if not (torch.compiler.is_compiling() or torch.is_inference_mode_enabled()):
            self._cache["inverse"] = inverse  # never an inference tensor, never a traced one
        return inverse

    def verify(self) -> None:
        """Check every invariant (intervals sorted, disjoint, in bounds; tile classes and lists
        consistent with the intervals). Raises :class:`CompileMaskError` on the first violation.
        Cost O(N*K + Tq*Tk)."""
        if self.encoding == "bits":
            return self._verify_bits()
        lo, hi, cnt = self.row_lo, self.row_hi, self.row_count
        m, n, k = lo.shape
        _require(n == self.q_len and lo.shape == hi.shape, "row interval shapes")
        _require(lo.dtype == torch.int32 and hi.dtype == torch.int32, "row intervals must be int32")
        slot = torch.arange(k, device=lo.device)
        used = slot < cnt[..., None]
        _require(bool(((lo < hi) == used).all()), "used slots non-empty, unused slots empty")
        _require(bool((lo[used] >= 0).all() and (hi[used] <= self.kv_len).all()), "in bounds")
        if k > 1:
            gap = used[..., 1:]
            _require(bool((hi[..., :-1][gap] < lo[..., 1:][gap]).all()), "sorted, disjoint")
        s = self.schedule
        fresh = build_tiles(
            lo,
            hi,
            cnt,
            self.q_len,
            self.kv_len,
            s.block_m,
            s.block_n,
            use_bits=bool((s.kind == PARTIAL_BITS).any()),
        )
        _require(torch.equal(fresh.pairs, s.pairs), "tile pair counts")
        _require(torch.equal(fresh.kind > EMPTY, s.kind > EMPTY), "touched tiles")
        _require(torch.equal(fresh.kind == FULL, s.kind == FULL), "FULL tiles")
        _require(
            torch.equal(fresh.q_list, s.q_list) and torch.equal(fresh.kv_list, s.kv_list),
            "tile lists",
        )
        bad = (s.kind == PARTIAL) & ((s.jlo > fresh.jlo) | (s.jhi < fresh.jhi))
        _require(not bool(bad.any()), "PARTIAL slot ranges")

    def _verify_bits(self) -> None:
        s = self.schedule
        _require(not bool((s.kind == PARTIAL).any()), "bits plans have no interval tiles")
        rows = max(1, (1 << 22) // self.kv_len) // s.block_m * s.block_m or s.block_m
        chunks = (self.dense_rows(r, min(self.q_len, r + rows)) for r in range(0, self.q_len, rows))
        fresh = build_tiles_from_dense(
            chunks, self.num_masks, self.q_len, self.kv_len, s.block_m, s.block_n
        )
        _require(torch.equal(fresh.pairs, s.pairs), "tile pair counts")
        _require(torch.equal(fresh.kind, s.kind), "tile kinds")
        _require(
            torch.equal(fresh.q_list, s.q_list) and torch.equal(fresh.kv_list, s.kv_list),
            "tile lists",
        )


_MISSING = object()


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise CompileMaskError(f"MaskPlan.verify failed: {what}")


@outside_inference_mode
def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(len(inv), device=inv.device)
    return inv
