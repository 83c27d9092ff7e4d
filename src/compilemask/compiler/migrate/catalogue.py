"""The recognised path of ``from_mask_mod``: a mask_mod written as a catalogue mask
(``recognise_bh.recognise_parts``: ``recognise.py`` and its form modules) is built by
``compile``'s own path (``pipeline.build_plan``: the catalogue's analytic lowering, no
per-row interval arithmetic and no probe), and kept by the mask's text (``plan_cache.py``)."""

from __future__ import annotations

import logging

from ..pipeline import build_plan, dependence, mask_text
from ..plan import MaskPlan
from . import plan_cache, recognise_pieces
from .recognise_bh import recognise_parts

log = logging.getLogger("compilemask.migrate")


def recognised_plan(
    gm, q_len, kv_len, batch, heads, block_m, block_n, device, cache: bool
) -> MaskPlan | None:
    """The plan of the traced mask_mod ``gm`` when it is recognised (``source ==
    "from_mask_mod:lifted"``; a ``tile_grid`` mask's plan in its tiled order, the order of the
    mask_mod's indices), else None. ``cache``: reuse / keep the plan by the mask's text. A
    mask_mod of a piecewise-affine form (``recognise_pieces.py``) is built from its piece
    table instead."""
    plan = recognise_pieces.recognised_plan(
        gm, q_len, kv_len, batch, heads, block_m, block_n, device, cache
    )
    if plan is not None:
        return plan
    mask = recognise_parts(gm, q_len, kv_len, batch, heads)
    if mask is None:
        return None
    log.debug("mask_mod recognised as %s", mask)
    key = (mask_text(mask), q_len, kv_len, batch, heads, block_m, block_n, str(device))
    hit = plan_cache.get_recognised(key) if cache else None
    if hit is not None:
        return hit
    nb, nh = dependence(mask, batch, heads)
    plan = build_plan(
        mask, q_len, kv_len, nb, nh, block_m, block_n, device,
        host_sync=device.type == "cpu", source="from_mask_mod:lifted",
    )  # fmt: skip
    plan = plan.in_permuted_order()  # a tile_grid mask: the mask_mod's indices are tiled ones
    return plan_cache.put_recognised(key, plan) if cache else plan
