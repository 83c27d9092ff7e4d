"""The default tile-schedule builder of plans on a CUDA device: Triton kernels.

On a GPU the tensor-operation builder of ``compiler/tiles.py`` is launch-bound (89 operations
for a 128x128 tile schedule and 40 for the kernels' schedules, against 1 launch and none with
``kernels/triton/tile_builder.py``; ``cpu-build-op-counts-2026-11-30.jsonl``). The
compiler may not import the kernels, so this layer registers a builder that imports them on
first use: ``import compilemask`` still loads no Triton. CPU plans keep the tensor builder.
``COMPILEMASK_TILE_BUILDER=tensor`` in the environment keeps the tensor builder everywhere.
"""

from __future__ import annotations

import os
import warnings

import torch

from ...compiler.decode import register_device_step_builder
from ...compiler.tiles import register_device_tile_builder
from .backend import triton_usable

ENV = "COMPILEMASK_TILE_BUILDER"


def serves_device(device: torch.device) -> bool:
    """CUDA devices, where Triton is installed (else the tensor builder, as ``backend="auto"``
    falls back to the reference)."""
    return device.type == "cuda" and triton_usable(device)[0]


def _on_cuda(t: torch.Tensor) -> bool:
    return serves_device(t.device)


def triton_tile_builder(lo, hi, count, q_len, kv_len, block_m, block_n):
    """The registered hook (arguments as for ``compiler.tiles.register_device_tile_builder``):
    the Triton builder for CUDA tensors, None (decline) elsewhere or without Triton."""
    if not _on_cuda(lo):
        return None
    from .tile_builder import _device_builder

    return _device_builder(lo, hi, count, q_len, kv_len, block_m, block_n)


def triton_table_builder(make_table, q_len, kv_len, device, block_m, block_n):
    """The registered hook for masks with a piece table (``compiler.lower.piece_table``): the
    rows and the schedule in the one launch (``tile_builder.build_from_table``) on CUDA
    devices; None (decline: the pipeline lowers the rows itself) elsewhere."""
    if device.type != "cuda" or not triton_usable(device)[0]:
        return None
    build = _FROM_TABLE or _import_from_table()
    return build(make_table, q_len, kv_len, device, block_m, block_n)


_FROM_TABLE = None  # tile_builder._device_builder_from_table, imported on first use


def _import_from_table():
    global _FROM_TABLE
    from .tile_builder import _device_builder_from_table

    _FROM_TABLE = _device_builder_from_table
    return _FROM_TABLE


def triton_tile_bits(lo, hi, tiles, jlo, jhi, block_m, block_n, q_len):
    """The registered bitmask-tile hook (``compiler.tiles.tile_bits``): one Triton launch."""
    from .tile_bits import tile_bits_triton

    return tile_bits_triton(lo, hi, tiles, jlo, jhi, block_m, block_n, q_len)


triton_tile_builder.serves = _on_cuda  # type: ignore[attr-defined]
triton_tile_builder.tile_bits = triton_tile_bits  # type: ignore[attr-defined]
triton_tile_builder.from_table = triton_table_builder  # type: ignore[attr-defined]


def install_default() -> None:
    """Register :func:`triton_tile_builder` unless ``COMPILEMASK_TILE_BUILDER=tensor``.

    Runs at ``import compilemask``, so a bad value does not raise (that would break CPU-only
    use too): an empty variable means the default, any value other than ``triton`` or
    ``tensor`` warns (naming the variable and the values it takes) and keeps the default.
    """
    choice = os.environ.get(ENV, "").strip().lower() or "triton"
    if choice not in ("triton", "tensor"):
        warnings.warn(
            f"{ENV}={choice!r} is not one of 'triton', 'tensor'; using 'triton'",
            RuntimeWarning,
            stacklevel=2,
        )
        choice = "triton"
    register_device_tile_builder(triton_tile_builder if choice == "triton" else None)
    register_device_step_builder(triton_step_builder if choice == "triton" else None)


def triton_step_builder(name, param, lens, offset, q_len, kv_len):
    """The registered decoding-plan hook (``compiler.decode.register_device_step_builder``):
    one Triton launch for CUDA tensors, None (decline) elsewhere or without Triton."""
    if not _on_cuda(lens):
        return None
    from .decode import PIECEWISE, step_pieces, step_rows, step_tree

    if name == "tree":
        return step_tree(param, lens, offset, q_len, kv_len)
    if name in PIECEWISE:
        return step_pieces(param, lens, offset, q_len, kv_len)
    return step_rows(name, param, lens, offset, q_len, kv_len)
