"""CompileMask: attention masks written as regions, compiled ahead of execution into exact
per-row key intervals and a tile schedule (a :class:`MaskPlan`), run by attention kernels.

Example::

    >>> import compilemask as cm
    >>> mask = cm.masks.shared_prompt(8, [4, 4])
    >>> plan = cm.compile(mask, 16, block_m=16, block_n=16)
    >>> bool((plan.to_dense() == cm.dense(mask, 16)).all())
    True
"""

from . import masks, score_mods
from .api.functional import attention, explain
from .compiler.decode import DecodePlan, step_plan
from .compiler.migrate import from_block_mask, from_dense, from_mask_mod
from .compiler.pipeline import clear_cache, compile
from .compiler.plan import MaskPlan
from .compiler.tiles import TileSchedule
from .errors import CompileMaskError, InputError, PlanError
from .language.parser import parse
from .language.semantics import dense, visible

__all__ = [
    "CompileMaskError",
    "InputError",
    "DecodePlan",
    "MaskPlan",
    "PlanError",
    "TileSchedule",
    "attention",
    "clear_cache",
    "compile",
    "dense",
    "explain",
    "from_block_mask",
    "from_dense",
    "from_mask_mod",
    "load_plan",
    "masks",
    "parse",
    "score_mods",
    "step_plan",
    "tile_grid",
    "visible",
]
__version__ = "0.1.0"

tile_grid = masks.tile_grid
load_plan = MaskPlan.load
