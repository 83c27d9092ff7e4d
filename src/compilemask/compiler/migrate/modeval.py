"""Calling a FlexAttention ``mask_mod`` on blocks of (query, key) pairs.

FlexAttention (``create_mask`` / ``create_block_mask``) calls a mask_mod under ``torch.vmap``
with 0-d index tensors and tensor indexing turned into ``aten.index``
(``TransformGetItemToIndex``): the *scalar* semantics. Most mask_mods give the same answer when
called once on broadcast index tensors (``q_idx`` ``[rows, 1]``, ``kv_idx`` ``[1, Nk]``),
which is cheaper; some do not (``interval = intervals[image_idx]; interval[0]`` takes a row of
the gathered block instead of the first bound). :func:`choose_mode` decides per mask_mod on a
small probe: broadcast when it runs there and gives exactly the vmap answer, else vmap.
A mask_mod that reduces a tensor of more than one element (``(q_idx == 157).any()``,
``table[q_idx].sum()``) is evaluated under vmap: on broadcast indices the reduction would run
over a whole block of rows, and a probe that misses the rows that matter cannot tell.
"""

from __future__ import annotations

import logging

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ...errors import CompileMaskError

log = logging.getLogger("compilemask.migrate")

_PROBE_Q = 37  # distinct probe sizes, so that a mask_mod that mixes up the axes is caught
_PROBE_KV = 43


def _check_out(out, rows: int, cols: int) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise CompileMaskError(f"mask_mod must return a bool tensor, got {got}")
    try:
        return torch.broadcast_to(out, (rows, cols))
    except RuntimeError:
        raise CompileMaskError(
            f"mask_mod returned shape {tuple(out.shape)}, not broadcastable to {(rows, cols)}"
        ) from None


def to_device(values: list[int], device, dtype=torch.int64) -> torch.Tensor:
    """``values`` as a 1-D ``dtype`` tensor on ``device``. On CUDA the copy goes through pinned
    memory without blocking: a blocking copy from pageable memory waits for the stream (all
    the operations queued before it), like a read."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def index_scalars(b: int, h: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``b`` and ``h`` as int64 0-d tensors on ``device``: views of one ``arange`` (one kernel,
    no copy from the host)."""
    both = torch.arange(max(b, h) + 1, device=device)
    return both[b], both[h]


def call_broadcast(
    mask_mod, b: int, h: int, q: torch.Tensor, kv: torch.Tensor, gather: bool = False
) -> torch.Tensor:
    """``mask_mod`` on broadcast indices: bool ``[len(q), len(kv)]`` (possibly a broadcast
    view). ``q``, ``kv``: int64 1-D. ``gather``: indexing by tensors alone as ``aten.index``,
    as FlexAttention's vmap does (``doc[b, h, q_idx]`` then reads no 0-d ``b`` / ``h`` back to
    the host)."""
    bt, ht = index_scalars(b, h, q.device)
    if not gather:
        return _check_out(mask_mod(bt, ht, q[:, None], kv[None, :]), q.numel(), kv.numel())
    with _IndexByTensors():
        out = mask_mod(bt, ht, q[:, None], kv[None, :])
    return _check_out(out, q.numel(), kv.numel())


class _IndexByTensors(TorchFunctionMode):
    """``t[i, j, ...]`` whose indices are all tensors as ``aten.index`` (a 0-d index is then
    not read back to the host, as under FlexAttention's ``TransformGetItemToIndex``); indices
    with an int, a slice or None as Python indexes them (no int made a device tensor)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and isinstance(args[0], torch.Tensor):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if index and all(isinstance(i, torch.Tensor) for i in index):
                return torch.ops.aten.index(args[0], list(index))
        return func(*args, **(kwargs or {}))


#: aten operations that combine the elements of a tensor (a reduction, a scan, a sort, a
#: selection): on broadcast indices they would mix the rows (or keys) of a block
_MIXING = frozenset(
    getattr(torch.ops.aten, name)
    for name in (
        "any", "all", "sum", "prod", "mean", "amax", "amin", "max", "min", "argmax", "argmin",
        "aminmax", "var", "std", "var_mean", "std_mean", "logsumexp", "norm", "linalg_vector_norm",
        "count_nonzero", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "sort",
        "argsort", "topk", "kthvalue", "median", "nanmedian", "mode", "unique_dim",
        "_unique2", "unique_consecutive", "nonzero", "masked_select", "nansum", "bincount",
        "histc", "searchsorted", "equal", "is_nonzero", "_local_scalar_dense",
    )
    if hasattr(torch.ops.aten, name)
)  # fmt: skip


class _MixingOps(TorchDispatchMode):
    """Records whether an operation of :data:`_MIXING` ran on a tensor of more than one
    element."""

    def __init__(self):
        super().__init__()
        self.seen = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.seen is None and func.overloadpacket in _MIXING:
            first = args[0] if args else None
            if isinstance(first, torch.Tensor) and first.numel() > 1:
                self.seen = func.overloadpacket.__name__
        return func(*args, **(kwargs or {}))


def call_vmap(mask_mod, b: int, h: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """``mask_mod`` with FlexAttention's scalar semantics (vmapped over b, h, q, kv in its
    order, tensor indexing as ``aten.index``): bool ``[len(q), len(kv)]``."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    fn = mask_mod
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None)):
        fn = torch.vmap(fn, in_dims=dims, out_dims=0)
    fn = torch.vmap(fn, in_dims=(0, None, None, None), out_dims=0)
    bt = torch.arange(b, b + 1, device=q.device)
    ht = torch.arange(h, h + 1, device=q.device)
    with TransformGetItemToIndex():
        out = fn(bt, ht, q, kv)
    if isinstance(out, torch.Tensor) and out.dim() == 4:
        out = out[0, 0]
    return _check_out(out, q.numel(), kv.numel())


def _probe_list(n: int, k: int) -> list[int]:
    """Up to ``k`` indices in ``[0, n)``, sorted: both ends, their neighbours and an even
    spread between them (host arithmetic: no device operation)."""
    if n <= k:
        return list(range(n))
    pts = {(2 * j * (n - 1) + k - 1) // (2 * (k - 1)) for j in range(k)}  # rounded j(n-1)/(k-1)
    return sorted(pts | {1, n - 2})


def probe_pair(q_len: int, kv_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The query and key probe indices (int64, 1-D), in one copy to ``device``."""
    q, kv = _probe_list(q_len, _PROBE_Q), _probe_list(kv_len, _PROBE_KV)
    both = to_device(q + kv, device)
    return both[: len(q)], both[len(q) :]


#: the most (batch row, head) parts a lifted plan's probe calls the mask_mod on
_PROBE_PARTS = 64


def lifted_agrees(mask_mod, lo, hi, q_len: int, kv_len: int, bh, device) -> bool:
    """Whether lifted intervals agree with the mask_mod on the probe (:func:`probe_read`)."""
    return probe_read(mask_mod, lo, hi, q_len, kv_len, bh, device) is not None


def probe_read(mask_mod, lo, hi, q_len: int, kv_len: int, bh, device, value=None) -> int | None:
    """``int(value)`` (a 0-d int32 tensor; None: 0) when lifted intervals (``lo``, ``hi``: int32
    ``[len(bh), Nq, K]``, empty slots ``lo >= hi``) agree with FlexAttention's scalar semantics
    on a small probe of every (batch row, head) part up to ``_PROBE_PARTS`` of them (else that
    many spread evenly, first and last included), else None: a lifted plan is admitted on
    this check alone. ``value`` is read in the host copy of the agreement (one read in all
    when the probe passes on broadcast indices).

    The mask_mod is called on broadcast indices first (plain tensor operations, a fraction of
    a vmapped call's host time) and under ``torch.vmap`` only for a part where that does not
    match: every operation the lifter takes on values of both q and kv is elementwise, and
    gathers are plain indexing of 1-D indices, where broadcast and scalar semantics give the
    same booleans; the operations where they can differ (on values of q alone or kv alone) are
    lifted under vmap, so a broadcast answer that differs from vmap there does not match the
    lifted one either and the vmapped call decides. The lifted booleans of every part come
    from one gather, and every broadcast answer is compared with them at once (one host
    read, with ``value``); only when that comparison fails is each part decided on its own,
    as before."""
    q, kv = probe_pair(q_len, kv_len, device)
    n = len(bh)
    picks = (
        list(range(n))
        if n <= _PROBE_PARTS
        else sorted({j * (n - 1) // (_PROBE_PARTS - 1) for j in range(_PROBE_PARTS)})
    )
    if len(picks) < n:
        rows = to_device(picks, lo.device)[:, None]
        lo_q, hi_q = lo[rows, q], hi[rows, q]
    else:
        lo_q, hi_q = lo[:, q], hi[:, q]
    k = kv[:, None]  # [P, probe q, K, 1] against [probe kv, 1]: any over the slots
    got = ((lo_q[..., None, :] <= k) & (k < hi_q[..., None, :])).any(-1)
    wants: list = []
    for i in picks:
        b, h = bh[i]
        try:
            wants.append(call_broadcast(mask_mod, b, h, q, kv, gather=True))
        except Exception:  # noqa: BLE001 - broadcast refuses it: vmap decides
            wants.append(None)
    if all(w is not None for w in wants):
        want = wants[0][None] if len(wants) == 1 else torch.stack(wants)
        same = (got == want.to(got.device)).all()
        if value is None:
            if same.item():
                return 0
        else:
            ok, read = torch.stack([same.to(torch.int32), value.to(same.device)]).tolist()
            if ok:
                return read
    for j, i in enumerate(picks):  # one part at a time, each with the vmapped call's say
        b, h = bh[i]
        if wants[j] is not None and torch.equal(got[j], wants[j]):
            continue
        try:
            want = call_vmap(mask_mod, b, h, q, kv)
        except Exception:  # noqa: BLE001 - vmap refuses it: compare with broadcast
            want = call_broadcast(mask_mod, b, h, q, kv)
        if not torch.equal(got[j], want):
            return None
    return 0 if value is None else int(value)


def _flex_refusal(exc: Exception) -> str | None:
    """The hint for a ``torch.vmap`` refusal that FlexAttention makes too, or None: a Python
    decision on tensor values (a branch, ``and`` / ``or`` / ``not``, ``.item()``), which on
    broadcast indices would be taken once per chunk of rows, not per element, so the mask would
    depend on the chunk size; or a random operation (a mask is a function of the indices)."""
    text = str(exc)
    if "data-dependent control flow" in text or "calling .item() on a Tensor" in text:
        return (
            "a Python `if`, `and`, `or`, `not` or `.item()` on values of q_idx / kv_idx: "
            "FlexAttention refuses it too; write it with torch.where and the tensor operators "
            "&, |, ~"
        )
    if "called random operation" in text:
        return (
            "a random operation: a mask_mod must be a function of (b, h, q_idx, kv_idx); "
            "FlexAttention refuses it too"
        )
    return None


def _user_error(exc: Exception) -> CompileMaskError:
    if isinstance(exc, CompileMaskError):
        return exc
    if "must only return Tensors" in str(exc):  # torch.vmap on a Python bool / number
        err = CompileMaskError(
            "mask_mod must return a bool tensor (built from q_idx / kv_idx), got a Python value; "
            "e.g. write `q_idx >= 0` instead of `True`"
        )
        err.__cause__ = exc
        return err
    refusal = _flex_refusal(exc)
    hint = f" ({refusal})" if refusal else ""
    err = CompileMaskError(f"mask_mod raised {type(exc).__name__}: {exc}{hint}")
    err.__cause__ = exc
    return err


def choose_mode(mask_mod, q_len: int, kv_len: int, bh: list[tuple[int, int]], device) -> str:
    """``"broadcast"`` or ``"vmap"`` for ``mask_mod`` (see the module docstring).

    Raises:
        CompileMaskError: the mask_mod fails both ways, or returns no bool tensor.
    """
    q, kv = probe_pair(q_len, kv_len, device)
    probe_bh = [bh[0]] if len(bh) == 1 else [bh[0], bh[-1]]
    try:
        want = [call_vmap(mask_mod, b, h, q, kv) for b, h in probe_bh]
    except Exception as exc:  # noqa: BLE001 - FlexAttention would refuse it too
        vmap_error = exc
        want = None
    mixing = _MixingOps()
    try:
        with mixing:
            got = [call_broadcast(mask_mod, b, h, q, kv) for b, h in probe_bh]
    except Exception as exc:  # noqa: BLE001 - the mask_mod needs the scalar semantics
        if want is None:
            raise _user_error(vmap_error) from vmap_error
        log.info("mask_mod evaluated under vmap: broadcast call raised %s", type(exc).__name__)
        return "vmap"
    if mixing.seen is not None:
        if want is None:
            raise _user_error(vmap_error) from vmap_error
        log.info("mask_mod evaluated under vmap: it reduces a tensor (%s)", mixing.seen)
        return "vmap"
    if want is None:
        if _flex_refusal(vmap_error):  # a branch on values, .item(), a random operation
            raise _user_error(vmap_error) from vmap_error
        log.info("mask_mod evaluated on broadcast indices (vmap raised %s)", vmap_error)
        return "broadcast"
    for g in (*got, *want):
        if g.device != q.device:
            raise CompileMaskError(
                f"the mask_mod returned a tensor on {g.device} for indices on {q.device}: the "
                f"tensors it captures must be on the device of the plan ({q.device})"
            )
    if all(torch.equal(g, w) for g, w in zip(got, want)):
        return "broadcast"
    log.info("mask_mod evaluated under vmap: broadcast call disagrees on the probe")
    return "vmap"


def evaluator(mask_mod, mode: str):
    """``f(b, h, q, kv) -> bool [len(q), len(kv)]`` for the chosen mode; a user's exception
    becomes a :class:`CompileMaskError` naming it."""
    call = call_broadcast if mode == "broadcast" else call_vmap

    def run(b, h, q, kv):
        try:
            return call(mask_mod, b, h, q, kv)
        except Exception as exc:  # noqa: BLE001 - report the user's error as ours
            raise _user_error(exc) from exc

    return run
