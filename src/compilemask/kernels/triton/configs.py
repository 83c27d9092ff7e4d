"""Launch configurations of the Triton attention kernels, one row per head_dim.

The forward kernel asks the plan for the tiling it runs at (``plan.tiles(BLOCK_M, BLOCK_N)``),
so tile sizes here are free per head_dim. The table is tuned for Hopper (sm_90, H200: 228 KiB of
shared memory per SM) and stays valid elsewhere: on GPUs with less shared memory the number of
pipeline stages is lowered (:func:`forward_config`), and fp32 inputs use smaller tiles.

Shared memory of one program is about ``(BLOCK_M + 2 * num_stages * BLOCK_N) * D_pad * bytes``
(Q once, K and V per stage): D=256 bf16 at 128x64, 2 stages: 192 KiB.

Example::

    >>> cfg = forward_config(128, torch.float16)
    >>> cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.prefetch
    (64, 64, 4, 3, 1)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from ...errors import CompileMaskError

#: Launch orders of the programs (the ``GRID_ORDER`` constexpr of every kernel):
#: 0 heads fastest, tiles heaviest first (the plan's ``q_order`` / ``kv_order``);
#: 1 tiles fastest in natural order (neighbouring programs share K/V or Q/dO in L2);
#: 2 tiles fastest in reverse order (the last tiles first: heaviest first under causal masks
#: in the forward and dQ kernels); 3 tiles fastest, heaviest first.
GRID_ORDERS: tuple[int, ...] = (0, 1, 2, 3)

#: head_dim values the kernels (and ``compilemask.attention``) accept, for q / k and for v
#: (192 runs 256's configuration, padded to 256).
SUPPORTED_HEAD_DIMS: tuple[int, ...] = (32, 64, 96, 128, 192, 256)


@dataclass(frozen=True)
class FwdConfig:
    """Tile sizes and launch options of the forward kernel.

    Attributes:
        block_m: query rows per program (BLOCK_M), a power of two >= 16.
        block_n: keys per inner iteration (BLOCK_N), a power of two >= 16.
        num_warps: warps per program.
        num_stages: software-pipelining depth of the K/V loads.
        grid_order: order in which programs are launched, one of :data:`GRID_ORDERS`.
        tma: 1 loads K and V through Hopper TMA tensor descriptors (16-bit, head_dim <= 128,
            16-byte aligned strides; else pointers as with 0). On by default for D=128 where
            the H200 sweep measured it faster (sm_90 and newer only).
        prefetch: 1 (launch orders 0 and 3) reads the program's q-tile, tile counts and the
            first tile of each loop from one 32-byte entry of the schedule's work list
            (``schedule.work_list``) instead of a chain of dependent loads (order, counts,
            list, then K/V): one or two memory latencies fewer per program, which short rows
            feel (hstu, shared_prompt).
        one_slot: 1 masks PARTIAL tiles of plans with 2-4 preloaded slots per row, none of
            whose rows has two intervals in one kv-tile (``common.one_interval_per_tile``,
            read back once per plan and BLOCK_N), from the one slot per row that meets the
            tile (``common.one_slot_mask``: two comparisons per score instead of two per
            slot).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    grid_order: int = 1
    tma: int = 0
    prefetch: int = 0
    one_slot: int = 0

    def as_list(self) -> list[int]:
        """The ints in field order (the ``config`` argument of the forward custom op)."""
        return [
            self.block_m, self.block_n, self.num_warps, self.num_stages, self.grid_order,
            self.tma, self.prefetch, self.one_slot,
        ]  # fmt: skip


# fp16 / bf16, tuned on an H200 (the measurements are in docs/perf-notes.md): 128x64 at
# D <= 64, 64x64 at D=96 (padded to 128), 128x64 with 8 warps at D=256.
_FWD_16BIT: dict[int, FwdConfig] = {
    32: FwdConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    64: FwdConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    96: FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),  # D padded to 128
    128: FwdConfig(64, 64, 4, 3, grid_order=3, tma=1, prefetch=1, one_slot=1),
    256: FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=2),
}
# D=128, 16-bit: masked plans (bitmask plans included) run 64x64 with K/V through TMA, the
# work entry read in one load and one slot per PARTIAL tile; plans whose 128x128 tiles are
# nearly all visible (tile efficiency >= DENSE_TILE_EFFICIENCY, e.g. causal) run 128x128 with
# 8 warps. Both launch heaviest first (order 3); docs/perf-notes.md has the sweeps.
_FWD_DENSE_128 = FwdConfig(
    block_m=128, block_n=128, num_warps=8, num_stages=3, grid_order=3, prefetch=1
)
DENSE_TILE_EFFICIENCY = 0.94

# fp32 (tf32x3 dots, about fp32 accuracy): a correctness path, not a fast one; smaller tiles.
_FWD_32BIT: dict[int, FwdConfig] = {
    32: FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
    64: FwdConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    96: FwdConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    128: FwdConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
    256: FwdConfig(block_m=32, block_n=32, num_warps=4, num_stages=1),
}

_HOPPER_SMEM_BYTES = 227 * 1024
_OVERRIDE: list[FwdConfig] = []


@contextlib.contextmanager
def override_forward_config(cfg: FwdConfig) -> Iterator[None]:
    """Use ``cfg`` for every forward launch inside the block (tests use small tiles so that
    small sizes exercise many tiles).

    Example::

        >>> with override_forward_config(FwdConfig(16, 32, 4, 1)):
        ...     out = cm.attention(q, k, v, plan)
    """
    _OVERRIDE.append(cfg)
    try:
        yield
    finally:
        _OVERRIDE.pop()


def check_head_dim(head_dim: int) -> None:
    """Raise :class:`CompileMaskError` naming head_dim unless the kernels support it."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise CompileMaskError(
            f"head_dim={head_dim} is not supported; supported head_dim values are "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )


def padded_head_dim(head_dim: int) -> int:
    """The power of two the kernels use as the head_dim of their tiles (96 -> 128)."""
    return 1 << (head_dim - 1).bit_length()


def _shared_memory_bytes(cfg: FwdConfig, head_dim: int, elem_bytes: int) -> int:
    d_pad = padded_head_dim(head_dim)
    return (cfg.block_m + 2 * max(cfg.num_stages, 1) * cfg.block_n) * d_pad * elem_bytes


_CUDA_DEVICE_INFO: dict[int, tuple[int, tuple[int, int], int]] = {}


def _cuda_device_info(index: int) -> tuple[int, tuple[int, int], int]:
    """(opt-in shared memory per block in bytes, compute capability, total memory in bytes)
    of CUDA device ``index``, read once per process (these calls sit on every launch's host
    path). A plain dict, not ``functools.cache``: Dynamo warns on cache wrappers it traces."""
    info = _CUDA_DEVICE_INFO.get(index)
    if info is None:
        props = torch.cuda.get_device_properties(index)
        limit = int(getattr(props, "shared_memory_per_block_optin", 0)) or 48 * 1024
        info = (limit, (props.major, props.minor), int(props.total_memory))
        _CUDA_DEVICE_INFO[index] = info
    return info


def _cuda_info(device: torch.device | None) -> tuple[int, tuple[int, int], int] | None:
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_device_info(index)


def _device_smem_limit(device: torch.device | None) -> int:
    info = _cuda_info(device)
    return _HOPPER_SMEM_BYTES if info is None else info[0]


def _has_tma(device: torch.device | None) -> bool:
    """Whether ``device`` has TMA (Hopper, sm_90, and newer); True off CUDA (the interpreter
    runs the descriptor path)."""
    info = _cuda_info(device)
    return True if info is None else info[1] >= (9, 0)


def has_bitmask_tiles(plan) -> bool:
    """Whether ``plan``'s masked tiles are stored as bitmasks: a ``from_dense`` plan, or more
    than ``compiler.tiles.BITS_MIN_SLOTS`` intervals in its largest row (known after
    :func:`tile_efficiency_128`; before, the static bound ``row_lo.shape[-1]``)."""
    from ...compiler.plan import MAX_ROW_SLOTS
    from ...compiler.tiles import BITS_MIN_SLOTS

    slots = plan._cache.get(MAX_ROW_SLOTS, plan.row_lo.shape[-1])
    return plan.encoding == "bits" or slots > BITS_MIN_SLOTS


def forward_config(
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
    tile_efficiency: float | None = None,
    bitmask_tiles: bool = False,
) -> FwdConfig:
    """The forward launch configuration for ``head_dim`` and ``dtype`` on ``device``.

    ``tile_efficiency``: the plan's visible pairs / pairs of its touched 128x128 tiles
    (:func:`tile_efficiency_128`), or None when unknown; dense plans get larger tiles.
    ``bitmask_tiles``: the plan's masked tiles are mostly bitmasks (:func:`has_bitmask_tiles`):
    such plans keep the masked tiling however dense. TMA descriptors are used on sm_90 and
    newer only.

    Raises:
        CompileMaskError: head_dim is not one of :data:`SUPPORTED_HEAD_DIMS`.
    """
    check_head_dim(head_dim)
    if _OVERRIDE:
        return _OVERRIDE[-1]
    table = _FWD_32BIT if dtype == torch.float32 else _FWD_16BIT
    cfg = table[256 if head_dim == 192 else head_dim]  # 192 is padded to 256
    if head_dim == 128 and dtype != torch.float32 and tile_efficiency is not None:
        if not bitmask_tiles and tile_efficiency >= DENSE_TILE_EFFICIENCY:
            cfg = _FWD_DENSE_128
    if cfg.tma and not _has_tma(device):
        cfg = replace(cfg, tma=0)
    elem_bytes = 4 if dtype == torch.float32 else 2
    limit = _device_smem_limit(device)
    while cfg.num_stages > 1 and _shared_memory_bytes(cfg, head_dim, elem_bytes) > limit:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    while cfg.block_n > 16 and _shared_memory_bytes(cfg, head_dim, elem_bytes) > limit:
        cfg = replace(cfg, block_n=cfg.block_n // 2)
    return cfg


# ---------------------------------------------------------------------------------- backward


@dataclass(frozen=True)
class BwdConfig:
    """Tile sizes and launch options of the two backward kernels.

    The dK/dV kernel keeps a BLOCK_N-key tile of K, V, dK, dV on chip and streams BLOCK_M-row
    query tiles (``dkdv_block_m`` small, ``dkdv_block_n`` large); the dQ kernel keeps a
    BLOCK_M-row tile of Q, dO, dQ and streams BLOCK_N-key tiles (``dq_block_m`` large,
    ``dq_block_n`` small). Each kernel asks the plan for its own tiling.

    Attributes:
        dkdv_block_m, dkdv_block_n: query rows per inner step, keys per program (dK/dV).
        dkdv_warps, dkdv_stages: warps and pipelining depth of the dK/dV kernel.
        dq_block_m, dq_block_n: query rows per program, keys per inner step (dQ).
        dq_warps, dq_stages: warps and pipelining depth of the dQ kernel.
        dkdv_order, dq_order: launch orders of the two kernels, see :data:`GRID_ORDERS`.
        tma: 1 loads the streamed tiles (Q, dO in dK/dV; K, V in dQ) through Hopper TMA
            tensor descriptors (16-bit, head_dim <= 128, 16-byte
            aligned strides; else pointers). On by default for D=128 (sm_90 and newer).
        ds_dq: > 0 (16-bit only, dQ tiling equal to the dK/dV tiling:
            :func:`ds_tilings_match`) stores dS, in the inputs' dtype, tile by tile
            from the dK/dV kernel into a buffer of ``ds_dq`` slots per (batch row, query
            head), one per touched tile of the dQ tiling, and computes ``dQ = scale * dS K``
            with a GEMM-only kernel over the dQ tiling (1 MMA per tile pair instead of 3:
            6 per pair in all instead of 7, no recomputation of P in the dQ pass;
            deterministic). The tables hold 1 ("on"); :func:`fit_ds_buffer` sets the buffer's size
            from the plan (the largest number of touched tiles of one mask) or 0 when the
            buffer would exceed :func:`ds_buffer_limit` bytes.
        ds_tma: 1 (with ``ds_dq`` and ``tma``) stores the dS tiles through a TMA descriptor:
            the tile goes to shared memory and a bulk asynchronous copy writes it while the
            loop goes on (the pipeliner waits for it before the buffer is reused), instead of
            per-thread stores.
    """

    dkdv_block_m: int
    dkdv_block_n: int
    dkdv_warps: int
    dkdv_stages: int
    dq_block_m: int
    dq_block_n: int
    dq_warps: int
    dq_stages: int
    dkdv_order: int = 1
    dq_order: int = 2
    tma: int = 0
    ds_dq: int = 0
    ds_tma: int = 0

    def as_list(self) -> list[int]:
        """The thirteen ints in field order (the ``bwd_config`` argument of the custom op)."""
        return [
            self.dkdv_block_m, self.dkdv_block_n, self.dkdv_warps, self.dkdv_stages,
            self.dq_block_m, self.dq_block_n, self.dq_warps, self.dq_stages,
            self.dkdv_order, self.dq_order, self.tma,
            self.ds_dq, self.ds_tma,
        ]  # fmt: skip


# fp16 / bf16 on sm_90. Register budget of dK/dV: two fp32 [BLOCK_N, D] accumulators over
# 32 * num_warps threads. D=128: dK/dV and dQ at 64x64 with 4 warps and 2 stages, heaviest
# first, streamed tiles through TMA and dQ from the stored dS tiles (stored through TMA); the
# sweeps behind it are in docs/perf-notes.md.
_BWD_16BIT: dict[int, BwdConfig] = {
    32: BwdConfig(32, 128, 4, 3, 128, 32, 4, 3),
    64: BwdConfig(32, 128, 4, 3, 128, 32, 4, 3),
    96: BwdConfig(32, 128, 8, 2, 128, 32, 8, 2),  # D padded to 128
    128: BwdConfig(64, 64, 4, 2, 64, 64, 4, 2, 3, 3, tma=1, ds_dq=1, ds_tma=1),
    256: BwdConfig(32, 64, 8, 2, 64, 32, 8, 2),
}

# fp32 (tf32x3 dots: about fp32 accuracy): a correctness path; smaller tiles.
_BWD_32BIT: dict[int, BwdConfig] = {
    32: BwdConfig(32, 64, 4, 2, 64, 32, 4, 2),
    64: BwdConfig(32, 64, 4, 2, 64, 32, 4, 2),
    96: BwdConfig(32, 64, 8, 1, 64, 32, 8, 1),
    128: BwdConfig(32, 64, 8, 1, 64, 32, 8, 1),
    256: BwdConfig(16, 32, 8, 1, 32, 32, 8, 1),
}

_BWD_OVERRIDE: list[BwdConfig] = []


@contextlib.contextmanager
def override_backward_config(cfg: BwdConfig) -> Iterator[None]:
    """Use ``cfg`` for every backward launch configured inside the block (tests: small tiles).

    The backward's tilings are chosen in the forward call (they travel with the autograd
    graph), so the forward must run inside the block.
    """
    _BWD_OVERRIDE.append(cfg)
    try:
        yield
    finally:
        _BWD_OVERRIDE.pop()


def _bwd_shared_memory_bytes(cfg: BwdConfig, head_dim: int, elem_bytes: int) -> int:
    """The larger of the two kernels: resident tile (2 x D) plus streamed tiles per stage."""
    d_pad = padded_head_dim(head_dim)
    dkdv = (2 * cfg.dkdv_block_n + 2 * max(cfg.dkdv_stages, 1) * cfg.dkdv_block_m) * d_pad
    dq = (2 * cfg.dq_block_m + 2 * max(cfg.dq_stages, 1) * cfg.dq_block_n) * d_pad
    return max(dkdv, dq) * elem_bytes


def backward_config(
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> BwdConfig:
    """The backward launch configuration for ``head_dim`` and ``dtype`` on ``device`` (one
    tiling per head_dim and dtype: no plan-dependent choice measured a gain).

    Raises:
        CompileMaskError: head_dim is not one of :data:`SUPPORTED_HEAD_DIMS`.
    """
    check_head_dim(head_dim)
    if _BWD_OVERRIDE:
        return _BWD_OVERRIDE[-1]
    table = _BWD_32BIT if dtype == torch.float32 else _BWD_16BIT
    cfg = table[256 if head_dim == 192 else head_dim]  # 192 is padded to 256
    if cfg.tma and not _has_tma(device):
        cfg = replace(cfg, tma=0)
    if cfg.ds_dq and (dtype == torch.float32 or not ds_tilings_match(cfg)):
        cfg = replace(cfg, ds_dq=0)
    elem_bytes = 4 if dtype == torch.float32 else 2
    limit = _device_smem_limit(device)
    while _bwd_shared_memory_bytes(cfg, head_dim, elem_bytes) > limit:
        if cfg.dkdv_stages > 1 or cfg.dq_stages > 1:
            cfg = replace(
                cfg, dkdv_stages=max(cfg.dkdv_stages - 1, 1), dq_stages=max(cfg.dq_stages - 1, 1)
            )
        elif cfg.dkdv_block_n > 32 or cfg.dq_block_m > 32:
            cfg = replace(
                cfg,
                dkdv_block_n=max(cfg.dkdv_block_n // 2, 32),
                dq_block_m=max(cfg.dq_block_m // 2, 32),
            )
        else:
            break
    return cfg


# ------------------------------------------------------------------------ plan-dependent choice
#: Upper bound of the dS buffer of ``BwdConfig.ds_dq`` in bytes (None: 1/16 of the device's
#: memory, at most 4 GiB). Larger buffers fall back to the dQ kernel that recomputes P.
DS_BUFFER_MAX_BYTES: int | None = None


def ds_buffer_limit(device: torch.device | None) -> int:
    """The dS buffer limit in bytes on ``device`` (see :data:`DS_BUFFER_MAX_BYTES`)."""
    if DS_BUFFER_MAX_BYTES is not None:
        return DS_BUFFER_MAX_BYTES
    cap = 4 << 30
    info = _cuda_info(device)
    return cap if info is None else min(cap, info[2] // 16)


def touched_tiles_max(plan, block_m: int, block_n: int) -> int:
    """The largest number of touched (non-EMPTY) tiles of one mask of ``plan`` at
    (block_m, block_n): the dS buffer's tiles per (batch row, head). Read back once per plan
    and tiling (one small copy), then cached. Eager only (under ``torch.compile`` the Triton
    backend reads the plan's shape class instead)."""
    key = ("touched_tiles_max", block_m, block_n)
    cache = plan._cache
    if key not in cache:
        cache[key] = _touched(plan, block_m, block_n)
    return cache[key]


def _touched(plan, block_m: int, block_n: int) -> int:
    kind = plan.tiles(block_m, block_n, bits=True).kind
    if kind.numel() == 0:
        return 0
    return int((kind != 0).flatten(1).sum(1).max())


def ds_tilings_match(cfg: BwdConfig) -> bool:
    """Whether dQ can come from the dS tiles of the dK/dV kernel (``ds_dq``): the dQ tiling is
    the dK/dV tiling."""
    return (cfg.dq_block_m, cfg.dq_block_n) == (cfg.dkdv_block_m, cfg.dkdv_block_n)


def fit_ds_buffer(
    cfg: BwdConfig, plan, batch: int, heads: int, elem_bytes: int, device
) -> BwdConfig:
    """``cfg`` with ``ds_dq`` set to the dS buffer's tiles per (batch row, head) for ``plan``,
    or 0 when the buffer (``batch * heads * tiles * block_m * block_n * elem_bytes``) would
    exceed :func:`ds_buffer_limit` or no tile is touched."""
    if not cfg.ds_dq:
        return cfg
    # one slot per touched tile of the dQ tiling (the dK/dV tiling)
    tiles = touched_tiles_max(plan, cfg.dq_block_m, cfg.dq_block_n)
    size = batch * heads * tiles * cfg.dq_block_m * cfg.dq_block_n * elem_bytes
    if tiles == 0 or size > ds_buffer_limit(device):
        return replace(cfg, ds_dq=0)
    return replace(cfg, ds_dq=tiles)


_EFFICIENCY_KEY = "tile_efficiency_128"


def tile_efficiency_128(plan) -> float:
    """Visible pairs / pairs of the touched tiles of ``plan`` at 128x128 (edge tiles clipped to
    the lengths; all masks together).

    Read back from the device once per plan (one small copy), then kept in the plan's cache.
    Eager only: under ``torch.compile`` the Triton backend reads the plan's shape class.
    """
    cache = plan._cache
    if _EFFICIENCY_KEY in cache:
        return cache[_EFFICIENCY_KEY]
    return _efficiency(plan)


def _efficiency(plan) -> float:
    from ...compiler.plan import MAX_ROW_SLOTS

    sched = plan.tiles(128, 128)
    touched = sched.kind != 0
    tq, tk = touched.shape[1], touched.shape[2]
    dev = touched.device
    rows = (plan.q_len - 128 * torch.arange(tq, device=dev)).clamp(max=128)
    cols = (plan.kv_len - 128 * torch.arange(tk, device=dev)).clamp(max=128)
    area = (touched * (rows[:, None] * cols[None, :])).sum()
    pairs = sched.pairs.sum()
    # in the same read: the largest row's number of intervals (has_bitmask_tiles)
    slots = plan.row_count.max() if plan.row_count.numel() else area.new_zeros(())
    area, pairs, slots = (
        int(x) for x in torch.stack([area, pairs.to(area.dtype), slots.to(area.dtype)]).tolist()
    )
    value = pairs / area if area else 1.0
    plan._cache[_EFFICIENCY_KEY] = value
    plan._cache[MAX_ROW_SLOTS] = slots
    return value
