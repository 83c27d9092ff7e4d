"""Token permutation for grid masks: reorder the tokens of each 2-D grid into small 2-D tiles.

A local 2-D window (a disc, a NATTEN window) over row-major grid tokens leaves almost every
attention tile partially visible; with the grid's tokens reordered into tiles of ``th x tw``
cells (tiles row-major over the grid, tokens row-major inside a tile) the window covers whole
tiles and most attention tiles become FULL or EMPTY (docs/design.md, optimisation passes).

``grid_permutation(mask, axis_len, tile)`` is an int64 tensor ``perm`` of ``axis_len`` positions:
position ``i`` of the tiled order holds the token at position ``perm[i]`` of the original order.
"""

from __future__ import annotations

import torch

from ..errors import LayoutError
from .ast import Builtin, Mask, RuleMask, TiledGrid
from .resolve import resolve


def grid_regions(mask: Mask, axis_len: int) -> set[tuple[int, int, int]]:
    """The 2-D grids of ``mask`` as ``(start token, h, w)``: ``clear`` (after its text),
    ``natten2d`` and the ``grid(h, w)`` segments of rule layouts, through combinations."""
    if isinstance(mask, Builtin):
        if mask.name == "clear":
            (h, w), _, text_len = mask.args
            return {(text_len, h, w)}
        if mask.name == "natten2d":
            (h, w), _ = mask.args
            return {(0, h, w)}
        return set()
    if isinstance(mask, RuleMask):
        segs = resolve(mask.layout, axis_len)
        return {(s.start, *s.grid) for s in segs.values() if s.grid is not None}
    if isinstance(mask, TiledGrid):
        raise LayoutError("tile_grid cannot be nested inside tile_grid")
    out: set[tuple[int, int, int]] = set()
    for child in mask.children():
        out |= grid_regions(child, axis_len)
    return out


def tiled_order(h: int, w: int, tile: tuple[int, int]) -> torch.Tensor:
    """For an ``h x w`` grid: ``order[i]`` = row-major cell index of the i-th cell in tiled
    order (edge tiles are smaller when ``th`` / ``tw`` do not divide ``h`` / ``w``)."""
    th, tw = tile
    y = torch.arange(h).view(h, 1).expand(h, w)
    x = torch.arange(w).view(1, w).expand(h, w)
    ty, tx = y // th, x // tw
    tile_h = torch.clamp(h - ty * th, max=th)  # height of the tile row of (y, x)
    tile_w = torch.clamp(w - tx * tw, max=tw)
    new = ty * th * w + tile_h * tx * tw + (y % th) * tile_w + (x % tw)
    order = torch.empty(h * w, dtype=torch.int64)
    order[new.reshape(-1)] = torch.arange(h * w)
    return order


def grid_permutation(mask: Mask, axis_len: int, tile: tuple[int, int]) -> torch.Tensor:
    """``perm`` [axis_len] int64 (tiled position -> original position); see the module doc."""
    regions = sorted(grid_regions(mask, axis_len))
    if not regions:
        raise LayoutError(
            "tile_grid needs a mask with a 2-D grid (clear, natten2d or a grid(h, w) segment)"
        )
    perm = torch.arange(axis_len)
    end = -1
    for start, h, w in regions:
        if start < end:
            raise LayoutError(f"the grids of the mask overlap: {regions}")
        if start + h * w > axis_len:
            raise LayoutError(f"a {h}x{w} grid at token {start} does not fit {axis_len} tokens")
        perm[start : start + h * w] = start + tiled_order(h, w, tile)
        end = start + h * w
    return perm
