"""Scalars and arrays as the mask builders and ``compile`` take them: integers as Python ints,
numpy integers or 0-d integer tensors / arrays (one rule for every integer argument)."""

from __future__ import annotations

import numbers
import sys


def array_kind(value: object) -> tuple[int, str] | None:
    """``(dimensions, dtype kind)`` of a torch tensor or numpy array (kind ``"i"`` integer,
    ``"b"`` bool, ``"f"`` float, ..., ``"meta"`` for a tensor on the meta device, which holds no
    values), None for anything else. Neither module is imported here: a tensor or an array
    comes from an imported module."""
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    if torch is not None and isinstance(value, torch.Tensor):
        dt = value.dtype
        kind = "b" if dt == torch.bool else "f" if dt.is_floating_point or dt.is_complex else "i"
        if value.is_meta:  # no values to read: refused like a wrong dtype
            kind = "meta"
        return value.dim(), kind
    if np is not None and isinstance(value, np.ndarray):
        return value.ndim, "i" if value.dtype.kind in "iu" else value.dtype.kind
    return None


def integer_value(value: object) -> int | None:
    """``value`` as a Python int when it is an integer (an int, a numpy integer, a 0-d integer
    tensor or array; not a bool), else None."""
    if type(value) is int:
        return value
    shape = array_kind(value)
    if shape is not None:
        return int(value.item()) if shape == (0, "i") else None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)
