"""Plans of ``from_mask_mod`` kept for the next call of the same mask, where that is provably
the same plan.

Two keys, each an LRU of :data:`MAX_ENTRIES` plans:

* **pure**: a mask_mod that captures no tensor and whose ``torch.fx`` trace is cached by its
  structure (``trace.py``: its code, the values of the scalars and functions it reads, and a
  trace that read nothing else) is a function of that key alone, so its plan at given lengths,
  ``batch``, ``heads``, tile sizes and device is too, whichever path built it (lifted,
  recognised or evaluated). Nothing is read on a hit: no operation, no host read.
* **recognised**: a mask_mod recognised as a catalogue mask (``recognise.py``) is built by
  ``compile``'s path from that mask, whose text holds every value read from the captured
  tables (document lengths, global tokens, ...): plans are kept by the mask's text as
  ``compile(..., cache=True)`` keeps them. A hit still reads the tables (the recognition
  does), but builds nothing.

A kept plan written in place since it was built (``MaskPlan._changed``) is dropped and built
again, as in ``compile``'s cache. A mask_mod that captures a tensor is never kept under the
pure key: its tensors can change between calls.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ..pipeline import lru_put
from . import trace

#: the most plans kept per key kind (least recently used dropped first)
MAX_ENTRIES = 32

_PURE: OrderedDict = OrderedDict()
_RECOGNISED: OrderedDict = OrderedDict()
_LOCK = threading.Lock()


def _get(table: OrderedDict, key):
    with _LOCK:
        hit = table.get(key)
        if hit is not None and hit._verified is not None and hit._changed():
            del table[key]  # written in place since it was built
            return None
        if hit is not None:
            table.move_to_end(key)
        return hit


def _put(table: OrderedDict, key, plan):
    return lru_put(table, _LOCK, MAX_ENTRIES, key, plan)


def get_pure(key):
    """The plan kept under pure ``key``: ``(trace.structure(fn)[0], q_len, kv_len, batch,
    heads, block_m, block_n, device)`` of a mask_mod with no tensor leaf (None: not kept, or
    ``key`` is None)."""
    if key is None:
        return None
    return _get(_PURE, key)


def put_pure(key, plan):
    """Keep ``plan`` under pure ``key`` when the mask_mod's trace is cached (it read nothing
    but its structure); returns the plan kept (the first one when two threads build it)."""
    if key is None or not trace.is_cached(key[0]) or torch.compiler.is_compiling():
        return plan
    return _put(_PURE, key, plan)


def get_recognised(key):
    """The plan kept under recognised ``key``: ``(mask text, q_len, kv_len, block_m, block_n,
    device)`` (None: not kept)."""
    return _get(_RECOGNISED, key)


def put_recognised(key, plan):
    """Keep ``plan`` under recognised ``key``; returns the plan kept."""
    if torch.compiler.is_compiling():
        return plan
    return _put(_RECOGNISED, key, plan)


def clear() -> None:
    """Forget every kept plan."""
    with _LOCK:
        _PURE.clear()
        _RECOGNISED.clear()
