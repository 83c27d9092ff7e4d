"""``MaskPlan.save`` / ``MaskPlan.load``: a plan's tensors and fields through ``torch.save``
(``weights_only`` loading: no code runs), checked on load like every plan."""

from __future__ import annotations

import dataclasses
import os
import zlib

import torch

from ..errors import InputError, PlanError
from .tiles import TileSchedule

_SAVE_FORMAT = "compilemask.MaskPlan"
_SAVE_VERSION = 2  # 2: with a checksum; 1 (without) still loads
_KNOWN_VERSIONS = (1, 2)


def _check_path(path, writing: bool) -> None:
    """``path``: a str, an ``os.PathLike`` or a file object (with ``write`` / ``read``)."""
    if isinstance(path, (str, os.PathLike)) or hasattr(path, "write" if writing else "read"):
        return
    raise InputError(
        f"path must be a str, an os.PathLike or a {'writable' if writing else 'readable'} file "
        f"object, got {type(path).__name__}"
    )


def saved_dict(plan, checksum: bool = False) -> dict:
    """What a plan file holds: ``{"format", "version", "meta", "tensors"}`` (ints, strings
    and tensors only, so ``torch.load(..., weights_only=True)`` reads it), with ``checksum``
    a ``"checksum"`` of them (:func:`_checksum`; files and pickles carry one, copies do not).
    Raises :class:`~compilemask.errors.PlanError` for a plan modified since it was built."""
    plan.check_unchanged()
    s = plan.schedule
    meta = {
        "q_len": plan.q_len,
        "kv_len": plan.kv_len,
        "batch": plan.batch,
        "heads": plan.heads,
        "source": plan.source,
        "encoding": plan.encoding,
        "block_m": s.block_m,
        "block_n": s.block_n,
    }
    tensors = {"row_lo": plan.row_lo, "row_hi": plan.row_hi, "row_count": plan.row_count}
    for name in ("row_runs", "permutation"):
        if getattr(plan, name) is not None:
            tensors[name] = getattr(plan, name)
    tensors.update({f"schedule.{k}": v for k, v in s.tensors().items()})
    obj = {"format": _SAVE_FORMAT, "version": _SAVE_VERSION, "meta": meta, "tensors": tensors}
    if checksum:
        obj["checksum"] = _checksum(meta, tensors)
    return obj


def _checksum(meta: dict, tensors: dict) -> int:
    """CRC-32 of a saved plan's fields and of its tensors' names, dtypes, shapes and values
    (little-endian bytes), so that a file changed after it was written (a flipped bit in
    ``kv_len`` still makes a valid plan) is refused on load. Reads GPU tensors back."""
    crc = zlib.crc32(repr(sorted(meta.items())).encode())
    for name in sorted(tensors):
        t = tensors[name]
        crc = zlib.crc32(f"{name}:{t.dtype}:{tuple(t.shape)}".encode(), crc)
        if t.dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
            a = t.detach().cpu().contiguous().numpy()
            data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        else:  # no plan tensor has another dtype: the plan's checks refuse it first
            data = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        crc = zlib.crc32(data, crc)
    return crc


def save_plan(plan, path) -> None:
    _check_path(path, writing=True)
    obj = saved_dict(plan, checksum=True)
    try:
        torch.save(obj, path)
    except (OSError, RuntimeError) as err:  # a missing folder, no permission, a full disk
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InputError(f"cannot write the plan to {path!r}: {why}") from None


def load_plan(cls, path, map_location=None):
    _check_path(path, writing=False)
    if map_location is not None and str(map_location) == "meta":
        raise PlanError("map_location='meta' holds no data: load the plan on the CPU or a GPU")
    try:
        obj = torch.load(path, map_location=map_location or "cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is a PlanError
        why = str(err).strip() or type(err).__name__
        if isinstance(err, (KeyError, EOFError)):  # the legacy reader's view of other bytes
            why = "not a file torch.save wrote (MaskPlan.save writes one), or a damaged one"
        elif isinstance(err, OSError) and err.errno == 22:  # a zip archive cut short
            why = f"the file is damaged or truncated ({why})"
        elif "weights_only" in why:  # not torch's advice to retry unsafely: the file is suspect
            why = "it holds objects a weights-only load refuses (not a MaskPlan file, or damaged)"
        raise PlanError(f"cannot read a MaskPlan from {path!r}: {why.splitlines()[0]}") from None
    return plan_from_dict(cls, obj, repr(path))


def plan_from_dict(cls, obj, where: str, copied: bool = False):
    """The plan of a :func:`saved_dict` ``obj`` (read from ``where``, for messages), checked
    like every plan (``cls``: ``MaskPlan``); a version 2 file's checksum must match, but for
    ``copied`` dicts (``copy.copy`` / ``copy.deepcopy``, never written)."""
    if not (
        isinstance(obj, dict)
        and obj.get("format") == _SAVE_FORMAT
        and isinstance(obj.get("meta"), dict)
        and isinstance(obj.get("tensors"), dict)
    ):
        raise PlanError(f"{where} does not hold a MaskPlan written by MaskPlan.save")
    version = obj.get("version")
    if version not in _KNOWN_VERSIONS:
        raise PlanError(f"{where}: unknown MaskPlan file version {version!r}")
    meta, tensors = obj["meta"], obj["tensors"]
    summed = version >= 2 and not copied  # a copy in memory (``copy.copy``) has no checksum
    if summed and type(obj.get("checksum")) is not int:
        raise PlanError(f"{where}: the saved plan has no checksum (a version {version} file "
                        f"always has one: the file was changed after it was written)")  # fmt: skip
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors.values()):
        raise PlanError(f"{where}: meta tensors hold no data: load the plan on the CPU or a GPU")
    sched_names = [f.name for f in dataclasses.fields(TileSchedule)][4:]
    need = ["row_lo", "row_hi", "row_count"] + [f"schedule.{n}" for n in sched_names]
    known = set(need) | {"row_runs", "permutation"}
    odd = [repr(n) for n in tensors if n not in known]
    odd += [repr(n) for n in meta if not isinstance(n, str)]
    odd += [repr(n) for n, t in tensors.items() if n in known and not (
        isinstance(t, torch.Tensor) and t.layout == torch.strided)]  # fmt: skip
    if odd:
        raise PlanError(f"{where}: the saved plan holds entries a plan file does not: "
                        f"{', '.join(odd[:5])} (unknown names, or not dense tensors)")  # fmt: skip
    missing = [n for n in need if n not in tensors]
    missing += [n for n in ("q_len", "kv_len", "block_m", "block_n") if n not in meta]
    if missing:
        raise PlanError(f"{where}: the saved plan has no {', '.join(missing)}")
    schedule = TileSchedule(
        meta["block_m"],
        meta["block_n"],
        meta["q_len"],
        meta["kv_len"],
        **{n: tensors[f"schedule.{n}"] for n in sched_names},
    )
    plan = cls(
        meta["q_len"],
        meta["kv_len"],
        meta.get("batch"),
        meta.get("heads"),
        tensors["row_lo"],
        tensors["row_hi"],
        tensors["row_count"],
        schedule,
        source=meta.get("source", ""),
        encoding=meta.get("encoding", "intervals"),
        row_runs=tensors.get("row_runs"),
        permutation=tensors.get("permutation"),
    )
    # after the plan's own checks (they name what is wrong); version 1 files have none
    if summed and obj["checksum"] != _checksum(meta, tensors):
        raise PlanError(
            f"{where}: the plan's checksum does not match its contents (the file was changed "
            f"or damaged after it was written)"
        )
    return plan


def restore_plan(obj):
    """Unpickles a plan saved by ``torch.save(plan, ...)`` (``MaskPlan.__reduce__``): a
    function ``torch.load(..., weights_only=True)`` is allowed to call (registered with
    ``torch.serialization.add_safe_globals``); the plan is checked as on every load."""
    from .plan import MaskPlan

    return plan_from_dict(MaskPlan, obj, "a pickled MaskPlan")
