"""``MaskPlan``: the compiled, device-resident descriptor that attention kernels read."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import threading
import weakref
from dataclasses import dataclass, field

import torch

from ..errors import CompileMaskError, PlanError
from . import plan_check
from . import tiles as tiles_mod
from .intervals import dense_rows, from_dense_rows
from .tiles import (
    EMPTY,
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
        # already off: no context to enter (Dynamo does not trace the query: it takes the
        # context)
        if not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False):
            return fn(*args, **kwargs)

    return wrapper


#: ``MaskPlan._cache`` key of the largest number of intervals of a row (an int, set by the
#: kernels' first host read of the plan, ``kernels/triton/configs.tile_efficiency_128``).
MAX_ROW_SLOTS = "max_row_slots"

# Verified live plans by their core state (``MaskPlan._core_state``: the ids and versions of
# their tensors, and their plain fields): a plan built from the very tensors of a verified live
# plan (a copy, ``in_permuted_order``, a rebuild from its fields) skips the value checks.
_VERIFIED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_VERIFIED_LOCK = threading.Lock()
# Set (per thread) while the library's own builders construct a plan (``built_plans``).
_BUILDING = threading.local()
#: ``MaskPlan._cache`` key of the core state the cached entries were derived from
_BASIS = "basis"
_FIELDS = ("q_len", "kv_len", "batch", "heads", "row_lo", "row_hi", "row_count", "schedule")
_ROW_TENSORS = ("row_lo", "row_hi", "row_count", "row_runs", "permutation")
_SCHEDULE_TENSORS = tuple(
    f.name for f in dataclasses.fields(TileSchedule) if f.name not in tiles_mod._INTS
)


@contextlib.contextmanager
def built_plans(*, own_tensors: bool = False):
    """Plans constructed inside are the output of the library's builders (``compile``,
    ``MaskPlan.to``): their values hold by construction, so only the host-side checks of
    their fields, dtypes, devices and shapes run (the value checks would double a GPU build's
    kernel launches). Plans from anywhere else get every check.

    ``own_tensors``: the builder made every tensor itself, contiguous, outside inference mode
    and of the shapes the plan's fields give (``pipeline.build_plan``; its fields checked by
    ``compile``): the structure checks and the contiguity pass are skipped too
    (``tests/test_plan_validation.py`` holds built plans to them)."""
    before = getattr(_BUILDING, "on", False)
    _BUILDING.on = "own" if own_tensors else True
    try:
        yield
    finally:
        _BUILDING.on = before


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
        source: the mask text (or ``"from_dense"``, ``"from_mask_mod:<path>"``,
            ``"from_block_mask:<path>"``).
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

    Plans are validated where they enter: the constructor (also through
    ``dataclasses.replace``), copies, unpickling and :meth:`load` make the tensors contiguous
    and run the checks of :meth:`verify` (a :class:`~compilemask.errors.PlanError` names the
    broken field; plans of ``compile`` and :meth:`to`, correct by construction, get the
    host-side checks only). On a GPU the value checks are queued on the device and read back by the
    plan's first ``attention`` call (:meth:`check_unchanged`). Plans are immutable: a plan
    whose tensors were modified afterwards (in place, or by replacing an attribute) is
    refused on its next eager call. Two limits: writes that bypass the tensors' version
    counters (``.data``, ``.numpy()``, raw storage) are caught only by ``verify()`` /
    ``attention(..., check_plan=True)``, and calls traced by ``torch.compile`` check shapes
    only (verify a plan before handing it to compiled code). The Triton kernels clamp every
    index they read from a plan, so such a plan gives wrong numbers, never an out-of-bounds
    access.
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
    #: (plain fields, objects, tensor versions) recorded when the plan was checked (_record)
    _verified: tuple | None = field(init=False, default=None, repr=False, compare=False)
    #: value checks queued on the device, not yet read back (GPU plans)
    _pending: list | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if torch.compiler.is_compiling():  # made while tracing, from a checked plan's tensors
            return
        self._admit(keep_cache=True)

    @classmethod
    def _built(
        cls, q_len, kv_len, batch, heads, row_lo, row_hi, row_count, schedule, *, source,
        permutation=None,
    ) -> MaskPlan:  # fmt: skip
        """The plan of a builder that made every tensor itself (``pipeline.build_plan``):
        what the constructor makes inside ``built_plans(own_tensors=True)``, without its
        generated ``__init__`` and the checks it skips for such plans (no structure, value or
        contiguity checks, no lookup of a live plan with these tensors); the state recorded,
        the plan registered as checked. Only for tensors fresh from the library's builders:
        contiguous, outside inference mode, of the shapes the fields give."""
        if torch.compiler.is_compiling():
            with built_plans(own_tensors=True):
                return cls(q_len, kv_len, batch, heads, row_lo, row_hi, row_count, schedule,
                           source=source, permutation=permutation)  # fmt: skip
        plan = object.__new__(cls)
        plan.__dict__.update(
            q_len=q_len, kv_len=kv_len, batch=batch, heads=heads, row_lo=row_lo,
            row_hi=row_hi, row_count=row_count, schedule=schedule, source=source,
            encoding="intervals", row_runs=None, permutation=permutation, _cache=None,
            shape_class=(), _pending=None,
        )  # fmt: skip
        s = schedule
        objs = (
            row_lo, row_hi, row_count, None, permutation, s, s.kind, s.pairs, s.jlo, s.jhi,
            s.bits_index, s.bits, s.q_count, s.q_list, s.kv_count, s.kv_list, s.q_order,
            s.kv_order,
        )  # fmt: skip
        own = [t._version for t in objs[6:]]
        versions = (
            row_lo._version, row_hi._version, row_count._version, None,
            None if permutation is None else permutation._version, None, *own,
        )  # fmt: skip
        scalars = (
            q_len, kv_len, batch, heads, "intervals", s.block_m, s.block_n, s.q_len, s.kv_len,
        )  # fmt: skip
        core = (  # _core_state: no permutation; the versions of the tensors
            *scalars, *map(id, objs[:4]), *map(id, objs[5:]), *versions[:3], *own,
        )  # fmt: skip
        plan.__dict__["_cache"] = {_BASIS: core}
        plan.__dict__["_verified"] = (scalars, objs, versions)
        with _VERIFIED_LOCK:
            _VERIFIED[core] = plan
        return plan

    # (copies and unpickled plans are checked again; their derived caches are rebuilt)
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for name in ("_verified", "_pending", "_cache"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise PlanError(
                f"invalid MaskPlan: a pickled state must be a dict, got {type(state).__name__}"
            )
        missing = [f.name for f in dataclasses.fields(self) if f.init and f.name not in state]
        missing = [n for n in missing if n in _FIELDS]
        if missing:
            raise PlanError(f"invalid MaskPlan: the pickled plan has no {', '.join(missing)}")
        defaults = {"source": "", "encoding": "intervals", "row_runs": None, "permutation": None}
        self.__dict__.update(defaults)
        self.__dict__.update(state)
        self.__dict__.setdefault("shape_class", ())
        self.__dict__.update(_verified=None, _pending=None, _cache={})
        self._admit(keep_cache=False)

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

    # ------------------------------------------------------------------ validation
    @outside_inference_mode
    def _admit(self, *, keep_cache: bool) -> None:
        """Make the tensors contiguous, check the plan (values: at once on the CPU, queued on
        a GPU), record its state, and keep ``_cache`` only when it was derived from these
        very tensors."""
        building = getattr(_BUILDING, "on", False)
        if building != "own":
            self._make_contiguous()
            plan_check.check_structure(self)
        objs = self._objects()
        versions = tuple(t._version if isinstance(t, torch.Tensor) else None for t in objs)
        core = self._core_state(objs, versions)
        with _VERIFIED_LOCK:
            prior = _VERIFIED.get(core)
        if building:
            pending, checks = [], []
        elif prior is not None:  # the same tensors as a checked live plan
            pending = list(prior._pending or [])
            checks = plan_check.permutation_checks(self)
        else:
            pending, checks = [], plan_check.value_checks(self)
        if self.device.type != "cuda":
            plan_check.raise_failed(pending + checks)
            pending = []
        else:
            pending += checks
        object.__setattr__(self, "_pending", pending or None)
        cache = self._cache
        if not (keep_cache and isinstance(cache, dict) and cache.get(_BASIS) == core):
            object.__setattr__(self, "_cache", {_BASIS: core})
        self._record(objs, versions)
        with _VERIFIED_LOCK:
            _VERIFIED[core] = self

    def _make_contiguous(self) -> None:
        for name in _ROW_TENSORS:
            t = getattr(self, name)
            if isinstance(t, torch.Tensor) and (t.is_inference() or not t.is_contiguous()):
                object.__setattr__(self, name, t.clone(memory_format=torch.contiguous_format))
        s = self.schedule
        if isinstance(s, TileSchedule):
            changed = {}
            for name in _SCHEDULE_TENSORS:
                t = getattr(s, name)
                if isinstance(t, torch.Tensor) and (t.is_inference() or not t.is_contiguous()):
                    changed[name] = t.clone(memory_format=torch.contiguous_format)
            if changed:
                object.__setattr__(self, "schedule", dataclasses.replace(s, **changed))

    def _objects(self) -> tuple:
        """The schedule and every tensor, in ``plan_check.plan_tensor_fields`` order."""
        s = self.schedule
        return (
            self.row_lo, self.row_hi, self.row_count, self.row_runs, self.permutation, s,
            s.kind, s.pairs, s.jlo, s.jhi, s.bits_index, s.bits, s.q_count, s.q_list,
            s.kv_count, s.kv_list, s.q_order, s.kv_order,
        )  # fmt: skip

    def _core_state(self, objs: tuple | None = None, versions: tuple | None = None) -> tuple:
        """Plain fields, and ids and versions of every object but the permutation (``objs``
        and ``versions``: :meth:`_objects` and their versions, when the caller has them)."""
        if objs is None:
            objs = self._objects()
            versions = tuple(t._version if isinstance(t, torch.Tensor) else None for t in objs)
        s = objs[5]
        core, core_versions = objs[:4] + objs[5:], versions[:4] + versions[5:]
        return (
            self.q_len, self.kv_len, self.batch, self.heads, self.encoding,
            s.block_m, s.block_n, s.q_len, s.kv_len,
            *map(id, core),
            *(v for v in core_versions if v is not None),
        )  # fmt: skip

    def _scalars(self) -> tuple:
        s = self.schedule
        return (
            self.q_len, self.kv_len, self.batch, self.heads, self.encoding,
            s.block_m, s.block_n, s.q_len, s.kv_len,
        )  # fmt: skip

    def _record(self, objs: tuple | None = None, versions: tuple | None = None) -> None:
        # the objects are kept: their ids cannot be reused while the plan lives
        if objs is None:
            objs = self._objects()
            versions = tuple(t._version if isinstance(t, torch.Tensor) else None for t in objs)
        object.__setattr__(self, "_verified", (self._scalars(), objs, versions))

    def _changed(self) -> bool:
        """Whether a field was replaced or a tensor written since :meth:`_record` (about 3 us:
        identity and version compares)."""
        scalars, objs, versions = self._verified
        try:
            now = self._objects()
        except AttributeError:
            return True
        if any(map(operator.is_not, now, objs)) or self._scalars() != scalars:
            return True
        return any(v is not None and t._version != v for t, v in zip(now, versions))

    def check_unchanged(self) -> None:
        """Raise :class:`~compilemask.errors.PlanError` when the plan's tensors were modified
        since it was checked (in place, or by replacing an attribute), or when its queued
        device-side checks fail (read back once). Cheap: integer compares per call."""
        ver = self._verified
        if ver is None:  # made while tracing and now used eagerly
            self._admit(keep_cache=True)
        elif self._changed():
            self._raise_changed()
        if self._pending is not None:
            pending = self._pending
            object.__setattr__(self, "_pending", None)
            try:
                plan_check.raise_failed(pending)
            except PlanError:
                object.__setattr__(self, "_pending", pending)
                raise

    def _raise_changed(self) -> None:
        names = ["row_lo", "row_hi", "row_count", "row_runs", "permutation", "schedule"]
        names += [f"schedule.{f.name}" for f in dataclasses.fields(TileSchedule)]
        names = [
            n for n in names if n.split(".")[-1] not in ("block_m", "block_n", "q_len", "kv_len")
        ]
        _, old_objs, old_versions = self._verified
        what = "q_len, kv_len, batch, heads, encoding or the schedule's sizes"
        try:
            now = self._objects()
        except AttributeError:
            now = (None,) * len(old_objs)
        for name, old, ver, new in zip(names, old_objs, old_versions, now):
            if old is not new:
                what = f"{name} (the attribute was replaced)"
                break
            if ver is not None and new._version != ver:
                what = f"{name} (written in place)"
                break
        raise PlanError(
            f"invalid MaskPlan: {what} was modified after the plan was built; plans are "
            f"immutable: build a new one (compilemask.compile, or dataclasses.replace with new "
            f"tensors)"
        )

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
        if key in self._cache:  # built by an earlier eager call (bitmasks included)
            return self._cache[key]
        if torch.compiler.is_compiling():
            # built while tracing and not kept: nothing is written to the cache while tracing
            # (a traced write makes every entry a guard), and an eager call builds its own
            return self._build_tiles(block_m, block_n)
        if key not in self._cache:
            self._cache[key] = self._build_tiles(block_m, block_n)
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
    def _build_tiles(self, block_m: int, block_n: int):
        if self.encoding == "bits":
            rows = max(1, (1 << 22) // self.kv_len) // block_m * block_m or block_m
            chunks = (
                self.dense_rows(r, min(self.q_len, r + rows)) for r in range(0, self.q_len, rows)
            )
            return build_tiles_from_dense(
                chunks, self.num_masks, self.q_len, self.kv_len, block_m, block_n
            )
        return build_tiles(
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
        if "cols" not in self._cache and torch.compiler.is_compiling():
            return self._build_columns()  # traced, not kept (see tiles)
        if "cols" not in self._cache:
            self._cache["cols"] = self._build_columns()
        return self._cache["cols"]

    def _build_columns(self):
        if self.encoding == "bits":  # O(Nq * Nk) for bits plans
            cols = self.dense_rows(0, self.q_len).transpose(1, 2)
            return from_dense_rows(cols, self.q_len)
        return column_intervals(self.row_lo, self.row_hi, self.q_len, self.kv_len)

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

    def nbytes_by_part(self) -> dict[str, int]:
        """Bytes of the plan by part: ``row_lo``, ``row_hi``, ``row_count``, ``row_runs`` and
        ``permutation`` (0 when absent), ``schedule`` (the default tiling's tables, bitmask
        tiles included), ``tilings`` (the other tilings derived and cached so far: the kernels'
        own and the backward's), and ``total`` (their sum; :attr:`nbytes` is the first four
        without the cached tilings)."""

        def size(t) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        parts = {name: size(getattr(self, name)) for name in _ROW_TENSORS}
        parts["schedule"] = self.schedule.nbytes
        parts["tilings"] = sum(
            v.nbytes
            for v in self._cache.values()
            if isinstance(v, TileSchedule) and v is not self.schedule
        )
        parts["total"] = sum(parts.values())
        return parts

    def compact(self):
        """The compact descriptor at the default tiling (:class:`compiler.segments.CompactPlan`:
        affine row segments or the rows, whichever is smaller, and both tile views as runs),
        derived on first use and cached; the kernels still read the rows and the schedule.
        Its ``nbytes`` is the compact size, ``parts()`` the bytes by part."""
        from .segments import compact_plan

        return self.cached("compact", lambda: compact_plan(self))

    def stats(self) -> dict:
        """Numbers about the plan, over all its masks.

        Returns:
            A dict: ``density`` (visible pairs / (M * Nq * Nk)), ``visible_pairs``,
            ``intervals_per_row_max`` / ``_mean``, ``tiles_full`` / ``tiles_partial``
            (``tiles_partial_bits`` of them as bitmasks) / ``tiles_empty`` at the default
            tiling, ``tile_efficiency`` (visible pairs / pairs inside touched tiles, clipped to
            the lengths), ``bytes`` (:attr:`nbytes`), ``bytes_by_part``
            (:meth:`nbytes_by_part`), ``compact_bytes`` and ``compact_parts`` (the size of
            :meth:`compact`, which this derives and caches, in all and by part),
            ``encoding``, ``source`` (the mask text, or how a ``from_mask_mod`` plan was
            built: ``from_mask_mod:lifted`` / ``:broadcast`` / ``:vmap``) and the sizes.

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
        compact = self.compact()
        return {
            "q_len": self.q_len,
            "kv_len": self.kv_len,
            "masks": self.num_masks,
            "density": visible / total if total else 0.0,
            "visible_pairs": visible,
            "intervals_per_row_max": int(runs.max()),
            "intervals_per_row_mean": float(runs.float().mean()),
            "encoding": self.encoding,
            "source": self.source,
            "block_m": s.block_m,
            "block_n": s.block_n,
            "tiles_full": counts["full"],
            "tiles_partial": counts["partial"],
            "tiles_partial_bits": counts["partial_bits"],
            "tiles_empty": counts["empty"],
            "tile_efficiency": visible / touched_pairs if touched_pairs else 1.0,
            "bytes": self.nbytes,
            "bytes_by_part": self.nbytes_by_part(),
            "compact_bytes": compact.nbytes,
            "compact_parts": compact.parts(),
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
        """The same plan with every tensor on ``device`` (a CompileMaskError for a device
        this torch does not have)."""
        from .pipeline import resolve_device

        device = resolve_device(device)
        if device == self.device:
            return self
        return self._to(device)

    @outside_inference_mode
    def _to(self, device: torch.device) -> MaskPlan:
        self.check_unchanged()
        with built_plans():
            return self._moved(device)

    def _moved(self, device: torch.device) -> MaskPlan:
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
        """This plan without its permutation: q, k, v are expected in tiled order.

        Raises:
            PlanError: the plan was modified since it was built.
        """
        if self.permutation is None:
            return self
        if not torch.compiler.is_compiling():
            self.check_unchanged()
        return dataclasses.replace(self, permutation=None, _cache=self._cache)

    @property
    def inverse_permutation(self) -> torch.Tensor | None:
        """int64 ``[Nq]``: original position -> tiled position (None without a permutation)."""
        perm = self.permutation
        if perm is None:
            return None
        # kept with the permutation it inverts (the cache may outlive a permutation swapped by
        # ``dataclasses.replace``: its basis is the plan's other tensors)
        hit = self._cache.get("inverse")
        if hit is not None and hit[0] is perm:
            # (a traced call reads no version counter: the eager calls before it checked it)
            if torch.compiler.is_compiling() or hit[1] == perm._version:
                return hit[2]
        inverse = _inverse(perm)
        if not (torch.compiler.is_compiling() or torch.is_inference_mode_enabled()):
            self._cache["inverse"] = (perm, perm._version, inverse)  # never inference / traced
        return inverse

    def verify(self) -> None:
        """Check every invariant the kernels rely on, now (reads the device's answer back):
        field types, int32 dtypes, one device, contiguity and shapes; sorted, disjoint,
        non-touching intervals inside ``[0, kv_len)`` with empty unused slots; tile kinds, pair
        counts, slot ranges, bitmasks and work lists consistent with the intervals; a true
        permutation; the compact form's segments when ``compact()`` derived them. Cost
        O(N*K + Tq*Tk) (O(Nq*Nk) for ``encoding="bits"`` plans).

        Raises:
            PlanError: the first violated invariant, naming the field; or the plan's tensors
                were modified since it was built.
        """
        if self._verified is not None and self._changed():
            self._raise_changed()
        plan_check.check_structure(self)
        plan_check.raise_failed(plan_check.value_checks(self))
        plan_check.segment_checks(self)
        object.__setattr__(self, "_pending", None)
        if self._verified is None:
            self._record()

    def to_block_mask(self):
        """A FlexAttention ``BlockMask`` with this plan's mask: FULL tiles as full blocks,
        PARTIAL tiles as partial blocks, and a ``mask_mod`` that reads the row intervals (or
        the bitmask tiles of ``encoding="bits"`` plans); ``BLOCK_SIZE`` is the plan's tiling,
        ``[B or 1, H or 1, Tq, Tk]`` as the plan depends on them. ``flex_attention(q, k, v,
        block_mask=plan.to_block_mask())`` gives the output of ``compilemask.attention``.

        Raises:
            CompileMaskError: the plan reorders tokens (``tile_grid``); use
                ``plan.in_permuted_order().to_block_mask()`` with tokens in tiled order.
            PlanError: the plan was modified since it was built.
        """
        from .migrate.blockmask import to_block_mask

        self.check_unchanged()
        return to_block_mask(self)

    # ------------------------------------------------------------------ files
    def __reduce__(self):
        """Pickled (``torch.save(plan, f)``) as the dict :meth:`save` writes, read back by
        ``plan_file.restore_plan``, which ``torch.load(f, weights_only=True)`` may call, and
        which checks the plan. The shape class (values an eager call derived from the plan) is
        not pickled: the next eager call derives it again."""
        from .plan_file import restore_plan, saved_dict

        return restore_plan, (saved_dict(self, checksum=True),)

    def __copy__(self) -> MaskPlan:
        """A copy (checked as on every load) sharing the tensors; it keeps the shape class."""
        from .plan_file import saved_dict

        return self._restored(saved_dict(self))

    def __deepcopy__(self, memo) -> MaskPlan:
        """A copy (checked as on every load) with its own tensors; it keeps the shape class."""
        import copy

        from .plan_file import saved_dict

        return self._restored(copy.deepcopy(saved_dict(self), memo))

    def _restored(self, obj: dict) -> MaskPlan:
        from .plan_file import plan_from_dict

        new = plan_from_dict(MaskPlan, obj, "a copied MaskPlan", copied=True)
        object.__setattr__(new, "shape_class", self.shape_class)
        return new

    def save(self, path) -> None:
        """Write the plan to ``path`` (``torch.save`` of its tensors and fields; read back with
        :meth:`load`, which checks it). Derived tilings are not saved."""
        from .plan_file import save_plan

        save_plan(self, path)

    @classmethod
    def load(cls, path, map_location=None) -> MaskPlan:
        """Read a plan written by :meth:`save` (onto ``map_location``, default: the CPU) and
        check it like every plan.

        Raises:
            PlanError: the file is not a saved plan, or the plan in it is invalid.
        """
        from .plan_file import load_plan

        return load_plan(cls, path, map_location)


_MISSING = object()


def _allow_weights_only_loads() -> None:
    """Let ``torch.load(..., weights_only=True)`` rebuild pickled plans (through the checked
    ``restore_plan``, nothing else)."""
    from .plan_file import restore_plan

    torch.serialization.add_safe_globals([restore_plan])


_allow_weights_only_loads()


@outside_inference_mode
def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(len(inv), device=inv.device)
    return inv
