"""``compile``: mask -> lengths checked -> row intervals -> tile schedule -> ``MaskPlan``."""

from __future__ import annotations

import functools
import math
import os
import threading
import weakref
from collections import OrderedDict

import torch

from ..errors import CompileMaskError, LengthError, too_deep
from ..language.ast import Builtin, Mask, TiledGrid
from ..language.permutation import grid_permutation
from ..language.semantics import accepted_lengths, natural_lengths, offsets_of
from ..language.values import integer_value
from . import intervals as iv
from .lower import TABLED, lower, piece_table
from .permute import permute_rows, tiled_natten_fits, tiled_natten_rows
from .plan import MaskPlan, built_plans, outside_inference_mode
from .tiles import build_tiles, device_tile_builder

_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 64
# lookups, inserts and evictions of _CACHE (plans are built outside it: threads compiling
# different masks build concurrently; two threads building the same key keep the first plan)
_CACHE_LOCK = threading.Lock()
# bytes per tile of one mask in a default tile schedule and its build: 7 int32 [M, Tq, Tk]
# tensors kept, and the int64 cumulative sums and sort keys of the build
_BYTES_PER_TILE = 64
# a GPU plan that needs at most this much to build skips the free-memory query (a driver call
# on every build); an allocation this small that does not fit fails in torch's own
# out-of-memory error
_SMALL_GPU_PLAN = 64 << 20


# mask object id -> (weak reference, its text, {call arguments: validated call}): masks are
# frozen, so each is printed once and each call's arguments are checked once (at most
# _CALLS_KEPT argument sets per mask)
_MASKS: dict[int, tuple] = {}
_CALLS_KEPT = 16
# the argument types whose values alone decide a call's checks (ints, None, device names):
# only such calls are kept (a bool or a float equals an int, a tensor can change)
_PLAIN = frozenset({int, type(None), str, torch.device})


def _entry(mask: Mask) -> tuple | None:
    """``(weak reference, text, calls)`` of a mask object, made on first use; None where none
    is kept (while tracing, or a mask that is not weakly referenceable)."""
    if torch.compiler.is_compiling():  # traced: no weak references
        return None
    key = id(mask)
    hit = _MASKS.get(key)
    if hit is not None and hit[0]() is mask:
        return hit
    text = str(mask)
    try:
        ref = weakref.ref(mask, lambda _, key=key: _MASKS.pop(key, None))
    except TypeError:  # not weakly referenceable: printed every time
        return None
    hit = _MASKS[key] = (ref, text, {})
    return hit


def mask_text(mask: Mask) -> str:
    """``str(mask)``, kept per mask object while it lives (a build prints its mask for the
    plan cache's key and the plan's ``source``; a long ``hstu`` mask takes microseconds)."""
    entry = _entry(mask)
    return str(mask) if entry is None else entry[1]


def forget_masks() -> None:
    """Forget what is kept per mask object (texts and checked call arguments): what a new mask
    object costs (``benchmarks/bench_build.py --fresh``, with ``lower.clear_tables``)."""
    _MASKS.clear()


def positive_int(value: object, name: str) -> int:
    """``value`` as a Python int if it is an integer >= 1 (an int, a numpy integer or a 0-d
    integer tensor; not a bool: :func:`~compilemask.language.values.integer_value`), else a
    :class:`CompileMaskError` naming ``name``."""
    number = integer_value(value)
    if number is None or number < 1:
        raise CompileMaskError(f"{name} must be a positive int, got {value!r}")
    return number


def strict_bool(value: object, name: str) -> bool:
    """``value`` if it is True or False (not a truthy string or number), else a
    :class:`CompileMaskError` naming ``name``."""
    if value is not True and value is not False:
        raise CompileMaskError(f"{name} must be True or False, got {value!r}")
    return value


def resolve_device(device, default="cpu") -> torch.device:
    """``device`` (a torch.device, a string such as ``"cuda:0"``, or None for ``default``) as a
    torch.device that exists here, else a :class:`CompileMaskError`."""
    try:
        dev = torch.device(default if device is None else device)
    except (RuntimeError, TypeError) as err:
        raise CompileMaskError(
            f"device must be a torch device such as 'cpu' or 'cuda', got {device!r}: {err}"
        ) from None
    if dev.type == "meta":
        raise CompileMaskError(
            f"device={device!r}: plans hold data (intervals and tile lists), not only shapes; "
            "use 'cpu' or 'cuda'"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CompileMaskError(f"device={device!r}, but this torch has no CUDA device available")
    return dev


def dependence(mask: Mask, batch: int | None, heads: int | None) -> tuple[int | None, int | None]:
    """The batch / head counts a plan of ``mask`` carries (None: broadcasts)."""
    out = []
    for given, own, name in ((batch, mask.batch_count, "batch"), (heads, mask.head_count, "heads")):
        if given is not None:
            n = integer_value(given)
            if n is None or n < 1:
                raise CompileMaskError(f"{name} must be a positive int or None, got {given!r}")
            given = n
        if own is not None and given is not None and given != own:
            raise CompileMaskError(
                f"the mask is per_{'batch' if name == 'batch' else 'head'} with {own} entries "
                f"but {name}={given} was given"
            )
        out.append(own)
    return out[0], out[1]


@too_deep
def compile(  # noqa: A001 - the public name is fixed by the design
    mask: Mask,
    q_len: int | None = None,
    kv_len: int | None = None,
    *,
    batch: int | None = None,
    heads: int | None = None,
    block_m: int = 128,
    block_n: int = 128,
    device=None,
    cache: bool = True,
    q_offset=0,
) -> MaskPlan:
    """Compile a mask into a :class:`MaskPlan` for the given lengths.

    Args:
        mask: a mask from :mod:`compilemask.masks`, :func:`compilemask.parse` or the builders.
        q_len: query rows ``Nq`` (tokens, int >= 1); None for a mask that fixes its own
            lengths (``document``, ``tree``, a layout without ``*``, ...).
        kv_len: keys ``Nk``; None: the mask's own key length when its layout fixes one (e.g.
            ``tree``: ``prefix_len + n``), else ``q_len``.
        batch, heads: batch size / query-head count; used (and checked) only when the mask is
            per_batch / per_head, ignored otherwise (the plan then broadcasts).
        block_m, block_n: the default tiling (BLOCK_M query rows x BLOCK_N keys); kernels that
            want another ask ``plan.tiles(bm, bn)``.
        device: where the plan is built and lives (None: CPU). The lowering runs there with
            vectorised torch operations; on a GPU K is kept at its static bound so that the
            build does not synchronise with the host.
        cache: reuse a plan compiled for the same (mask, lengths, sizes, tiles, device).
        q_offset: where the query rows sit on the key axis (see :func:`compilemask.dense`):
            row ``i`` is position ``q_offset + i``. An int >= 0 (default 0: top-left, the
            rows start at the first key; ``kv_len - q_len`` is bottom-right, the decoding
            alignment), or a ``[B]`` integer tensor / sequence, one offset per batch row: the
            plan then depends on the batch row (``batch = B``). The intervals are absolute key
            positions, so every kernel runs such a plan unchanged. A tensor offset is read on
            the host; per-step decoding plans are built without host reads by
            :func:`compilemask.step_plan`. ``kv_len`` None: ``q_offset + q_len``
            (or the mask's own key length).

    Returns:
        A :class:`MaskPlan`.

    Raises:
        CompileMaskError: bad lengths, a length the mask does not accept, an inconsistent
            layout, a batch/heads that contradicts a per_batch/per_head mask, a ``cache``
            that is not True or False.

    Example::

        >>> import compilemask as cm
        >>> plan = cm.compile(cm.masks.sliding_window(256), 1024, block_m=64, block_n=64)
        >>> plan.stats()["tiles_full"] > 0
        True
    """
    entry = _entry(mask) if isinstance(mask, Mask) else None
    if (
        entry is not None and q_offset.__class__ is int and q_offset == 0
        and cache.__class__ is bool and _PLAIN.issuperset((
            q_len.__class__, kv_len.__class__, batch.__class__, heads.__class__,
            block_m.__class__, block_n.__class__, device.__class__,
        ))
    ):  # fmt: skip
        args = (q_len, kv_len, batch, heads, block_m, block_n, device)
        calls = entry[2]
        call = calls.get(args)
        if call is None:
            call = _checked_call(mask, entry[1], *args, cache)
            if len(calls) >= _CALLS_KEPT:
                calls.clear()
            calls[args] = call
    else:
        call = _compile_call(mask, q_len, kv_len, batch, heads, block_m, block_n, device, cache,
                             q_offset)  # fmt: skip
        if not isinstance(call, tuple):  # a plan at a query offset
            return call
    q_len, kv_len, batch, heads, block_m, block_n, device, key, small = call
    if cache:
        with _CACHE_LOCK:
            hit = _CACHE.get(key)
            if hit is not None and hit._verified is not None and hit._changed():
                del _CACHE[key]  # modified in place since it was built: build a new one
                hit = None
            if hit is not None:
                _CACHE.move_to_end(key)
                return hit
    if not small:
        check_plan_size((batch or 1) * (heads or 1), q_len, kv_len, block_m, block_n, device)
    plan = build_plan(
        mask, q_len, kv_len, batch, heads, block_m, block_n, device,
        host_sync=device.type == "cpu", source=key[0],
    )  # fmt: skip
    if cache:
        plan = lru_put(_CACHE, _CACHE_LOCK, _CACHE_SIZE, key, plan)
    return plan


def lru_put(table: OrderedDict, lock, size: int, key, value):
    """Keep ``value`` under ``key`` in the LRU ``table`` of at most ``size`` entries (under
    ``lock``); returns the value kept, an earlier one for the same key if another thread
    put it first."""
    with lock:
        value = table.setdefault(key, value)
        table.move_to_end(key)
        while len(table) > size:
            table.popitem(last=False)
    return value


def _compile_call(mask, q_len, kv_len, batch, heads, block_m, block_n, device, cache, q_offset):
    """:func:`_checked_call` of a call that is not kept, or the plan of a call with a query
    offset."""
    if not isinstance(mask, Mask):
        hint = "; parse text with compilemask.parse(text)" if isinstance(mask, str) else ""
        raise CompileMaskError(f"mask must be a compilemask Mask, got {type(mask).__name__}{hint}")
    strict_bool(cache, "cache")
    if q_len is None:
        q_len = natural_lengths(mask)[0]
        if q_len is None:
            raise CompileMaskError(f"q_len is needed: {mask} accepts any length")
    offsets = offsets_of(q_offset)
    if offsets != 0:
        return _compile_offset(
            mask, q_len, kv_len, offsets, batch, heads, block_m, block_n, device, cache
        )
    return _checked_call(mask, mask_text(mask), q_len, kv_len, batch, heads, block_m, block_n,
                         device, cache)  # fmt: skip


def _checked_call(mask, text, q_len, kv_len, batch, heads, block_m, block_n, device, cache):
    """``(q_len, kv_len, batch, heads, block_m, block_n, device, cache key, small)``: the
    arguments of a :func:`compile` call at offset 0, checked (``small``: a GPU plan that skips
    :func:`check_plan_size`). Depends on the mask (frozen) and the arguments alone."""
    strict_bool(cache, "cache")
    if q_len is None:
        q_len = natural_lengths(mask)[0]
        if q_len is None:
            raise CompileMaskError(f"q_len is needed: {mask} accepts any length")
    q_len, kv_len = accepted_lengths(mask, q_len, kv_len)
    if max(q_len, kv_len) > 2**31 - 1:
        raise CompileMaskError(
            f"q_len and kv_len must be below 2**31 (plans hold int32 token positions), got "
            f"q_len={q_len}, kv_len={kv_len}"
        )
    batch, heads = dependence(mask, batch, heads)
    block_m, block_n = positive_int(block_m, "block_m"), positive_int(block_n, "block_n")
    device = resolve_device(device)
    key = (text, q_len, kv_len, batch, heads, block_m, block_n, str(device))
    masks = (batch or 1) * (heads or 1)
    small = device.type == "cuda" and _plan_bytes(masks, q_len, kv_len, block_m, block_n) <= (
        _SMALL_GPU_PLAN
    )
    return q_len, kv_len, batch, heads, block_m, block_n, device, key, small


def _compile_offset(mask, q_len, kv_len, offsets, batch, heads, block_m, block_n, device, cache):
    """A plan whose row ``i`` of batch row ``b`` is position ``offsets[b] + i`` (``offsets``:
    an int, or a list of one per batch row): the rows ``[o, o + q_len)`` of the plan compiled
    for ``o + q_len`` rows, one such slice per distinct offset."""
    if isinstance(mask, TiledGrid):
        raise CompileMaskError("q_offset must be 0 for a tile_grid mask (it permutes one axis)")
    per_row = isinstance(offsets, list)
    if per_row:
        if batch is not None and batch != len(offsets):
            raise CompileMaskError(f"batch={batch} but q_offset has {len(offsets)} rows")
        if mask.batch_count is not None and mask.batch_count != len(offsets):
            raise CompileMaskError(
                f"q_offset has {len(offsets)} rows but the mask is per_batch with "
                f"{mask.batch_count} entries"
            )
    if not isinstance(q_len, int) or isinstance(q_len, bool) or q_len < 1:
        raise CompileMaskError(f"q_len must be a positive int, got {q_len!r}")
    rows = offsets if per_row else [offsets]
    kv = kv_len if kv_len is not None else max(rows) + q_len
    try:
        full = {
            o: compile(mask, o + q_len, kv, batch=batch if not per_row else mask.batch_count,
                       heads=heads, block_m=block_m, block_n=block_n, device=device, cache=cache)
            for o in sorted(set(rows))
        }  # fmt: skip
    except LengthError as err:
        raise LengthError(
            f"with q_offset={offsets}, the plan's rows are positions q_offset + [0, {q_len}) of "
            f"a mask compiled for q_offset + q_len rows: {err}"
        ) from None
    some = next(iter(full.values()))
    k = max(p.row_lo.shape[-1] for p in full.values())
    hm = some.heads or 1
    parts = []
    for b, o in enumerate(rows):
        p = full[o]
        lo, hi, cnt = (
            t.view(p.batch or 1, hm, p.q_len, -1)
            for t in (p.row_lo, p.row_hi, p.row_count[..., None])
        )
        pick = b if (per_row and p.batch is not None) else 0
        lo, hi = iv.pad_k(lo[pick, :, o:], hi[pick, :, o:], k, p.kv_len)
        parts.append((lo, hi, cnt[pick, :, o:, 0]))
    lo, hi, cnt = (torch.stack([x[i] for x in parts]) for i in range(3))
    nb = len(rows) if per_row else (some.batch or 1)
    if not per_row and some.batch is not None:  # a per_batch mask at one offset: rows kept
        lo, hi, cnt = (full[offsets].row_lo, full[offsets].row_hi, full[offsets].row_count)
        lo = lo.view(nb, hm, -1, lo.shape[-1])[:, :, offsets:]
        hi = hi.view(nb, hm, -1, hi.shape[-1])[:, :, offsets:]
        cnt = cnt.view(nb, hm, -1)[:, :, offsets:]
    m = lo.shape[0] * lo.shape[1]
    lo, hi = lo.reshape(m, q_len, -1).contiguous(), hi.reshape(m, q_len, -1).contiguous()
    cnt = cnt.reshape(m, q_len).contiguous()
    host = some.device.type == "cpu"
    schedule = build_tiles(lo, hi, cnt, q_len, some.kv_len, block_m, block_n, use_bits=host)
    out_batch = len(rows) if per_row else some.batch
    source = f"{some.source} @ q_offset={offsets}"
    with built_plans():
        return MaskPlan(
            q_len, some.kv_len, out_batch, some.heads, lo, hi, cnt, schedule, source=source
        )


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a plan on ``device`` (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_plan_size(masks: int, q_len: int, kv_len: int, block_m: int, block_n: int, device):
    """Refuse, before building, a plan whose tile schedule (``[M, Tq, Tk]`` tensors, quadratic
    in the lengths) would not fit in the memory free on ``device`` (on a GPU, plans needing
    at most 64 MiB are not compared: the query costs as much as a launch)."""
    need = _plan_bytes(masks, q_len, kv_len, block_m, block_n)
    if device.type == "cuda" and need <= _SMALL_GPU_PLAN:
        return
    free = available_memory(device)
    if free is not None and need > free:
        raise CompileMaskError(
            f"a plan for q_len={q_len}, kv_len={kv_len} at {block_m}x{block_n} tiles "
            f"({masks} mask(s) x {math.ceil(q_len / block_m)} x {math.ceil(kv_len / block_n)} "
            f"tiles) needs about {_gib(need)} to build, but {device} has {_gib(free)} free; "
            f"use larger block_m / block_n or shorter lengths"
        )


def _plan_bytes(masks: int, q_len: int, kv_len: int, block_m: int, block_n: int) -> int:
    return masks * math.ceil(q_len / block_m) * math.ceil(kv_len / block_n) * _BYTES_PER_TILE


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


@outside_inference_mode
def build_plan(
    mask: Mask, q_len, kv_len, batch, heads, block_m, block_n, device, *, host_sync, source
) -> MaskPlan:
    """Lower and tile (lengths already validated). ``host_sync=False`` is the device build:
    K stays at its static bound and no tile is stored as a bitmask, so nothing waits for the
    device (no ``.item()``, no ``nonzero``); CPU builds trim K and use bitmasks."""
    if not host_sync and isinstance(mask, Builtin) and mask.name in TABLED:
        built = _rows_in_the_launch(mask, q_len, kv_len, block_m, block_n, device)
        if built is not None:
            return MaskPlan._built(q_len, kv_len, batch, heads, *built, source=source)
    perm = None
    if isinstance(mask, TiledGrid):
        perm = _permutation(mask, q_len, device)
        tiled, mask = mask, mask.mask
    if perm is not None and _tiled_natten(tiled, q_len, kv_len):
        lo, hi, count = tiled_natten_rows(*mask.args, tiled.tile, device, trim=host_sync)
    else:
        lo, hi, count = lower(mask, q_len, kv_len, device, trim=host_sync)
        m = lo.shape[0] * lo.shape[1]
        lo = lo.reshape(m, q_len, -1).contiguous()
        hi = hi.reshape(m, q_len, -1).contiguous()
        count = count.reshape(m, q_len).contiguous()
        if perm is not None:
            lo, hi, count = permute_rows(lo, hi, perm, kv_len)
    schedule = build_tiles(lo, hi, count, q_len, kv_len, block_m, block_n, use_bits=host_sync)
    return MaskPlan._built(  # correct by construction, its own fresh tensors
        q_len, kv_len, batch, heads, lo, hi, count, schedule, source=source, permutation=perm
    )


# (inner mask's text, axis length, tile, device) -> the tiled order's permutation on the device
# (never handed out: plans get copies)
_PERMUTATIONS: OrderedDict = OrderedDict()
_PERMUTATIONS_LOCK = threading.Lock()


def _permutation(tiled: TiledGrid, axis: int, device) -> torch.Tensor:
    """``grid_permutation`` of a ``tile_grid`` mask on ``device``, kept per (mask, axis, tile,
    device): at 32K it is about 25 host tensor operations (1.5 ms on one CPU thread) and a
    copy to the device that waits for the stream, on every build of a new plan; a kept one
    costs a device copy."""
    key = (mask_text(tiled.mask), axis, tiled.tile, str(device))
    perm = _PERMUTATIONS.get(key)
    if perm is None:
        with torch.inference_mode(False):  # kept: usable by later calls outside the mode
            perm = grid_permutation(tiled.mask, axis, tiled.tile).to(device)
        perm = lru_put(_PERMUTATIONS, _PERMUTATIONS_LOCK, 16, key, perm)
    return perm.clone()  # each plan its own (a write into one reaches no other plan)


def _tiled_natten(tiled: TiledGrid, q_len: int, kv_len: int) -> bool:
    """``tile_grid(natten2d(...))`` whose tiled rows have a closed form (``permute.py``)."""
    inner = tiled.mask
    return (
        isinstance(inner, Builtin)
        and inner.name == "natten2d"
        and tiled_natten_fits(*inner.args, tiled.tile, q_len, kv_len)
    )


def _rows_in_the_launch(mask: Builtin, q_len, kv_len, block_m, block_n, device):
    """``(row_lo, row_hi, row_count, schedule)`` of a device build of a mask with a piece
    table, from the registered device builder's ``from_table`` (its launch evaluates the
    table: no operation expands the rows), or None where there is none or it declines."""
    build = getattr(device_tile_builder(), "from_table", None)
    if build is None or torch.compiler.is_compiling():
        return None
    if not isinstance(device, torch.device):
        device = torch.device(device)
    table = functools.partial(piece_table, mask, q_len, kv_len, device, trim=False)
    return build(table, q_len, kv_len, device, block_m, block_n)


def clear_cache() -> None:
    """Forget every cached plan (and the kept tile_grid permutations)."""
    with _CACHE_LOCK:
        _CACHE.clear()
    with _PERMUTATIONS_LOCK:
        _PERMUTATIONS.clear()
