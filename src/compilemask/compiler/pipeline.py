"""``compile``: mask -> lengths checked -> row intervals -> tile schedule -> ``MaskPlan``."""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict

import torch

from ..errors import CompileMaskError
from ..language.ast import Mask, TiledGrid
from ..language.permutation import grid_permutation
from ..language.semantics import accepted_lengths, natural_lengths
from .lower import lower
from .permute import permute_rows
from .plan import MaskPlan, built_plans, outside_inference_mode
from .tiles import build_tiles

_CACHE: OrderedDict = OrderedDict()
_CACHE_SIZE = 64
# lookups, inserts and evictions of _CACHE (plans are built outside it: threads compiling
# different masks build concurrently; two threads building the same key keep the first plan)
_CACHE_LOCK = threading.Lock()
# bytes per tile of one mask in a default tile schedule and its build: 7 int32 [M, Tq, Tk]
# tensors kept, and the int64 cumulative sums and sort keys of the build
_BYTES_PER_TILE = 64


def positive_int(value: object, name: str) -> int:
    """``value`` if it is an int >= 1, else a :class:`CompileMaskError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CompileMaskError(f"{name} must be a positive int, got {value!r}")
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
        if given is not None and (
            isinstance(given, bool) or not isinstance(given, int) or given < 1
        ):
            raise CompileMaskError(f"{name} must be a positive int or None, got {given!r}")
        if own is not None and given is not None and given != own:
            raise CompileMaskError(
                f"the mask is per_{'batch' if name == 'batch' else 'head'} with {own} entries "
                f"but {name}={given} was given"
            )
        out.append(own)
    return out[0], out[1]


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

    Returns:
        A :class:`MaskPlan`.

    Raises:
        CompileMaskError: bad lengths, a length the mask does not accept, an inconsistent
            layout, a batch/heads that contradicts a per_batch/per_head mask.

    Example::

        >>> import compilemask as cm
        >>> plan = cm.compile(cm.masks.sliding_window(256), 1024, block_m=64, block_n=64)
        >>> plan.stats()["tiles_full"] > 0
        True
    """
    if not isinstance(mask, Mask):
        raise CompileMaskError(f"mask must be a compilemask Mask, got {type(mask).__name__}")
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
    key = (str(mask), q_len, kv_len, batch, heads, block_m, block_n, str(device))
    if cache:
        with _CACHE_LOCK:
            hit = _CACHE.get(key)
            if hit is not None:
                _CACHE.move_to_end(key)
                return hit
    check_plan_size((batch or 1) * (heads or 1), q_len, kv_len, block_m, block_n, device)
    plan = build_plan(
        mask, q_len, kv_len, batch, heads, block_m, block_n, device,
        host_sync=device.type == "cpu", source=key[0],
    )  # fmt: skip
    if cache:
        with _CACHE_LOCK:
            plan = _CACHE.setdefault(key, plan)
            _CACHE.move_to_end(key)
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    return plan


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
    in the lengths) would not fit in the memory free on ``device``."""
    tiles = masks * math.ceil(q_len / block_m) * math.ceil(kv_len / block_n)
    need = tiles * _BYTES_PER_TILE
    free = available_memory(device)
    if free is not None and need > free:
        raise CompileMaskError(
            f"a plan for q_len={q_len}, kv_len={kv_len} at {block_m}x{block_n} tiles "
            f"({masks} mask(s) x {math.ceil(q_len / block_m)} x {math.ceil(kv_len / block_n)} "
            f"tiles) needs about {_gib(need)} to build, but {device} has {_gib(free)} free; "
            f"use larger block_m / block_n or shorter lengths"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


@outside_inference_mode
def build_plan(
    mask: Mask, q_len, kv_len, batch, heads, block_m, block_n, device, *, host_sync, source
) -> MaskPlan:
    """Lower and tile (lengths already validated). ``host_sync=False`` is the device build:
    K stays at its static bound and no tile is stored as a bitmask, so nothing waits for the
    device (no ``.item()``, no ``nonzero``); CPU builds trim K and use bitmasks."""
    perm = None
    if isinstance(mask, TiledGrid):
        perm = grid_permutation(mask.mask, q_len, mask.tile).to(device)
        mask = mask.mask
    lo, hi, count = lower(mask, q_len, kv_len, device, trim=host_sync)
    m = lo.shape[0] * lo.shape[1]
    lo = lo.reshape(m, q_len, -1).contiguous()
    hi = hi.reshape(m, q_len, -1).contiguous()
    count = count.reshape(m, q_len).contiguous()
    if perm is not None:
        lo, hi, count = permute_rows(lo, hi, perm, kv_len)
    schedule = build_tiles(lo, hi, count, q_len, kv_len, block_m, block_n, use_bits=host_sync)
    with built_plans():  # correct by construction: the host-side checks only
        return MaskPlan(
            q_len, kv_len, batch, heads, lo, hi, count, schedule, source=source, permutation=perm
        )


def clear_cache() -> None:
    """Forget every cached plan."""
    with _CACHE_LOCK:
        _CACHE.clear()
