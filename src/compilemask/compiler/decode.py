"""Decoding plans: the intervals of the new query rows of a decode or speculative-decoding step.

A decode step adds ``Nq`` query rows (one token, or a draft of up to a few dozen) to each batch
row, whose KV cache holds ``cache_seqlens[b]`` keys (the new tokens' keys included). Row ``i``
of batch row ``b`` sits at key position ``q_offset[b] + i``; by default ``q_offset = cache_seqlens
- Nq`` (bottom-right: the new tokens are the last keys of the cache). :func:`step_plan` lowers
the mask at exactly those positions, vectorised over ``B * Nq`` rows, and clips every row to its
own cache length: O(B * Nq * K) work whatever the cache length, with torch operations on the
device of ``cache_seqlens`` and no host synchronisation (nothing is read back; host tables of
the mask's constants are copied through pinned memory without blocking, and cached).

No tile schedule is built: the paged / split-KV kernels read the intervals only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..errors import CompileMaskError, PlanError
from ..language.ast import Builtin, Combine, Mask, PerBatch, PerHead, RuleMask, TiledGrid
from . import intervals as iv
from .lower import _Ctx

I32 = torch.int32
_I32_MAX = 2**31 - 1
MAX_LEN = 2**31 - 1  # key positions and lengths are int32 in plans

#: catalogue masks with a decoding closed form (the rest of the catalogue is refused)
DECODE_BUILTINS = (
    "causal",
    "sliding_window",
    "prefix_lm",
    "chunked",
    "block_causal",
    "dilated",
    "document",
    "shared_prompt",
    "hstu",
    "tree",
)


#: the one-launch builder of catalogue masks on a device, or None (registered by
#: ``kernels/triton/device_builder.py``: the compiler does not import the kernels)
_STEP_BUILDER = None
_ONE_INTERVAL = {"causal", "sliding_window", "prefix_lm", "chunked", "block_causal"}
_PIECEWISE = {"document", "shared_prompt", "hstu"}


def register_device_step_builder(builder) -> None:
    """Use ``builder(name, param, lens, offset, q_len, kv_len)`` for the one-interval catalogue
    masks and ``tree`` (it returns ``(lo, hi, count, offset, lens)`` as :func:`step_plan` would
    build them, or None to decline); None: the tensor operations only.

    ``name``: the mask's catalogue name; ``param``: the window, prefix length, chunk or block
    (int; 1 for ``causal``); for ``tree`` the int32 ``[2, q_len, K]`` table of each node's
    ancestor runs on ``lens``' device (:func:`_tree_runs`); for ``document``, ``shared_prompt``
    and ``hstu`` the int32 ``[n, 1 + 4 K]`` table of their pieces (:func:`_pieces_table`);
    ``lens``: int ``[B]``
    ``cache_seqlens`` as given; ``offset``: None (bottom-right) or the int ``[B]`` ``q_offset``
    tensor (checked)."""
    global _STEP_BUILDER
    _STEP_BUILDER = builder


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """The visible key intervals of the new query rows of one decoding step.

    Attributes:
        q_len: ``Nq``, new query rows per batch row (tokens).
        kv_len: ``Nk``, the key axis the plan was built for (the cache capacity per batch row,
            in tokens; the padding value of empty interval slots).
        batch: ``B``.
        row_lo, row_hi: int32 ``[B, Nq, K]``: row ``i`` of batch row ``b`` sees the keys
            ``[row_lo[b, i, j], row_hi[b, i, j])``, the first ``row_count[b, i]`` slots sorted,
            disjoint, not touching and inside ``[0, cache_seqlens[b])``; the rest ``Nk``.
        row_count: int32 ``[B, Nq]``.
        cache_seqlens: int32 ``[B]``: keys in each batch row's cache.
        q_offset: int32 ``[B]``: the key position of each batch row's first query row.
        source: the mask's text.
        kv_len_given: whether ``kv_len`` was passed to :func:`step_plan` (else it is the
            longest cache, and :meth:`next` infers it again from the new lengths).
        bottom_right: built by :func:`step_plan` with ``q_offset=None`` (the new rows are the
            last ``Nq`` keys of each cache), which lets a cache call run a kernel's own causal
            or sliding-window mask for such plans of ``causal()`` / ``sliding_window(w)``
            (:meth:`native_window`).
    """

    q_len: int
    kv_len: int
    batch: int
    row_lo: torch.Tensor
    row_hi: torch.Tensor
    row_count: torch.Tensor
    cache_seqlens: torch.Tensor
    q_offset: torch.Tensor
    source: str = ""
    mask: Mask | None = None
    kv_len_given: bool = True  # False: kv_len was inferred from cache_seqlens (next() infers)
    bottom_right: bool = False

    # the fields MaskPlan users read
    heads = None
    permutation = None

    def __post_init__(self):
        # what native_window trusts: set by step_plan only (_sealed), so a plan made by
        # dataclasses.replace or by hand never runs a kernel's own mask instead of its rows
        object.__setattr__(self, "_versions", None)

    def _tensor_versions(self) -> tuple[int, ...]:
        return tuple(
            t._version for t in (self.row_lo, self.row_hi, self.row_count, self.cache_seqlens)
        )

    def native_window(self) -> int | None:
        """0 when every row is exactly causal over its cache, ``w`` for ``sliding_window(w)``,
        bottom-right aligned (rows ``[max(0, p - w + 1), p + 1)`` at key position ``p``, cut to
        the cache); None otherwise, once the row tensors or lengths were modified in place, and
        for plans not built by :func:`step_plan` (e.g. by ``dataclasses.replace``). Reads no
        tensor data."""
        mask = self.mask
        if not self.bottom_right or not isinstance(mask, Builtin):
            return None
        if self._versions is None or self._tensor_versions() != self._versions:
            return None
        if mask.name == "causal":
            return 0
        if mask.name == "sliding_window":
            return int(mask.args[0])
        return None

    @property
    def device(self) -> torch.device:
        return self.row_lo.device

    @property
    def num_masks(self) -> int:
        return self.batch

    def verify(self) -> None:
        """Check the invariants of the attributes above (shapes, dtypes, each row's first
        ``row_count`` slots sorted, disjoint, not touching and inside ``[0, min(kv_len,
        cache_seqlens[b]))``, the other slots ``kv_len``): O(B * Nq * K) work and one host
        read. ``compilemask.attention(..., check_plan=True)`` calls it.

        Raises:
            PlanError: naming the first entry that breaks one.
        """
        B, nq, kv = self.batch, self.q_len, self.kv_len
        for name, t, shape in (("row_lo", self.row_lo, None), ("row_hi", self.row_hi, None),
                               ("row_count", self.row_count, (B, nq)),
                               ("cache_seqlens", self.cache_seqlens, (B,)),
                               ("q_offset", self.q_offset, (B,))):  # fmt: skip
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32:
                raise PlanError(f"DecodePlan.{name} must be an int32 tensor")
            if shape is not None and tuple(t.shape) != shape:
                raise PlanError(f"DecodePlan.{name} must be {list(shape)}, got {list(t.shape)}")
        lo, hi = self.row_lo.long(), self.row_hi.long()
        if lo.dim() != 3 or tuple(lo.shape[:2]) != (B, nq) or hi.shape != lo.shape:
            raise PlanError(f"DecodePlan.row_lo / row_hi must be [{B}, {nq}, K], got "
                            f"{list(self.row_lo.shape)} / {list(self.row_hi.shape)}")  # fmt: skip
        k = lo.shape[-1]
        count = self.row_count.long()
        live = torch.arange(k, device=lo.device) < count[..., None]
        end = self.cache_seqlens.long().clamp(0, kv)[:, None, None]
        ok_live = (lo >= 0) & (lo < hi) & (hi <= end)
        ok_next = torch.ones_like(live)
        ok_next[..., :-1] = ~live[..., 1:] | (hi[..., :-1] < lo[..., 1:])
        good = torch.where(live, ok_live & ok_next, (lo == kv) & (hi == kv))
        good = good & ((count >= 0) & (count <= k))[..., None]
        bad = (~good).nonzero()
        if bad.numel():
            b, i, j = (int(x) for x in bad[0].tolist())
            raise PlanError(
                f"DecodePlan row {i} of batch row {b}, slot {j}: [{int(lo[b, i, j])}, "
                f"{int(hi[b, i, j])}) with row_count {int(count[b, i])} breaks the plan's "
                f"invariants (cache length {int(self.cache_seqlens[b])}, kv_len {kv})"
            )

    def to_dense(self) -> torch.Tensor:
        """bool ``[B, 1, Nq, Nk]`` (for tests and pictures: O(B * Nq * Nk))."""
        return iv.dense_rows(self.row_lo, self.row_hi, self.kv_len)[:, None]

    def next(self, cache_seqlens: torch.Tensor, q_len: int | None = None, **kwargs) -> DecodePlan:
        """The plan of the next step of the same mask (``q_len`` default: this plan's; the key
        axis: this plan's when it was given, else inferred again; ``q_offset``: bottom-right
        unless passed again)."""
        if self.mask is None:
            raise CompileMaskError("this DecodePlan records no mask; call step_plan")
        if self.kv_len_given:  # an inferred key axis grows with the caches: infer it again
            kwargs.setdefault("kv_len", self.kv_len)
        return step_plan(self.mask, cache_seqlens, self.q_len if q_len is None else q_len, **kwargs)

    def __repr__(self) -> str:
        return (
            f"DecodePlan({self.source!r}, B={self.batch}, q_len={self.q_len}, "
            f"kv_len={self.kv_len}, K={self.row_lo.shape[-1]}, device={self.device})"
        )


def step_plan(
    mask: Mask,
    cache_seqlens: torch.Tensor,
    q_len: int = 1,
    *,
    kv_len: int | None = None,
    q_offset=None,
) -> DecodePlan:
    """The plan of one decoding step: ``q_len`` new query rows per batch row over KV caches.

    Args:
        mask: ``causal``, ``sliding_window``, ``prefix_lm``, ``chunked``, ``block_causal``,
            ``dilated``, ``document``, ``shared_prompt``, ``hstu`` or ``tree`` from
            :mod:`compilemask.masks`, a mask of the language's rules, ``|`` / ``&`` / ``-`` of
            these, or ``per_batch([...])`` of ``B`` of them. Masks that fix their length
            (``document``, ``shared_prompt``, ``hstu``) describe the tokens so far: their last
            document / response runs on to the end of every cache. ``tree(parents,
            prefix_len)`` is a draft of ``len(parents) == q_len`` nodes: node ``i`` sits at key
            ``q_offset[b] + i`` and sees the keys before the draft and its ancestors
            (``prefix_len`` is not used: each batch row's prefix is its ``q_offset``).
        cache_seqlens: int ``[B]`` tensor (int32 or int64) on the device the plan is built
            on: the keys in each batch row's cache, the ``q_len`` new tokens' keys included.
            Every row sees only keys inside ``[0, cache_seqlens[b])`` (a batch row with
            ``cache_seqlens[b] = 0`` is an empty row), and rows at a negative position see
            nothing. Values must lie in ``[0, 2**31 - 1]``: checked here for CPU lengths
            (before any int32 conversion); GPU lengths are not read back here (no host
            synchronisation): ``compilemask.attention`` checks them on every call with the
            plan.
        q_len: new query rows per batch row (int >= 1).
        kv_len: the key axis, an int in ``[1, 2**31 - 1]`` (cache capacity per batch row,
            tokens: e.g. pages per sequence * page size); every ``cache_seqlens[b]`` must be
            at most this (checked here for CPU
            lengths, and by ``compilemask.attention`` on every call with the plan). None:
            ``cache_seqlens.max()``, read on the host (a synchronisation on a GPU: pass it
            there).
        q_offset: None (bottom-right: ``cache_seqlens - q_len``), an int, or an int ``[B]``
            tensor on the same device: the key position of each batch row's first new row.

    Returns:
        a :class:`DecodePlan` on ``cache_seqlens``' device.

    Raises:
        CompileMaskError: a mask without a decoding form (``per_head``, ``tile_grid``,
            ``clear``, ``natten2d``, ``global_local``), bad shapes or dtypes, CPU
            ``cache_seqlens`` outside ``[0, 2**31 - 1]``, a ``tree`` whose node count is not
            ``q_len``, a ``per_batch`` mask of another size than ``B``.

    Cost: O(B * q_len * K) work in a fixed number of device operations (K intervals per row;
    independent of the cache length); no host synchronisation when ``kv_len`` is given. On
    CUDA with Triton, one kernel launch for the catalogue masks but ``dilated`` (a ``q_offset``
    of None or a tensor; the registered builder, same tensors).

    Example::

        >>> lens = torch.tensor([9, 17], device="cuda", dtype=torch.int32)
        >>> plan = step_plan(cm.masks.sliding_window(8), lens, 1, kv_len=32)
    """
    if not isinstance(mask, Mask):
        raise CompileMaskError(f"mask must be a compilemask Mask, got {type(mask).__name__}")
    lens = _lengths(cache_seqlens)
    B, device = lens.shape[0], lens.device
    if isinstance(q_len, bool) or not isinstance(q_len, int) or q_len < 1:
        raise CompileMaskError(f"q_len must be a positive int, got {q_len!r}")
    kv_len_given = kv_len is not None
    if kv_len is None:
        kv_len = max(1, int(lens.max())) if B else 1
    if isinstance(kv_len, bool) or not isinstance(kv_len, int) or not 1 <= kv_len <= MAX_LEN:
        raise CompileMaskError(f"kv_len must be an int in [1, 2**31 - 1], got {kv_len!r}")
    if kv_len_given and lens.device.type == "cpu" and B and int(lens.max()) > kv_len:
        # (on a GPU the attention call checks it: no host read here)
        raise CompileMaskError(
            f"kv_len={kv_len} is shorter than the longest cache ({int(lens.max())} keys)"
        )
    if (
        _STEP_BUILDER is not None
        and isinstance(mask, Builtin)
        and mask.name in _ONE_INTERVAL | _PIECEWISE | {"tree"}
        and (q_offset is None or isinstance(q_offset, torch.Tensor))
    ):
        if q_offset is not None:
            _offsets(q_offset, lens, q_len)  # checks only
        if mask.name == "tree":
            param = _tree_runs(mask.args[0], q_len, device)
        elif mask.name in _PIECEWISE:
            values, n, k = _pieces_table(mask, kv_len)
            param = _device_table(("pieces", mask, kv_len), values, device).view(n, 1 + 4 * k)
        else:
            param = mask.args[0] if mask.args else 1
        built = _STEP_BUILDER(mask.name, param, cache_seqlens, q_offset, q_len, kv_len)
        if built is not None:
            lo, hi, count, offset, lens = built
            return _sealed(DecodePlan(
                q_len, kv_len, B, lo, hi, count, lens, offset, str(mask), mask, kv_len_given,
                q_offset is None,
            ))  # fmt: skip
    offset = _offsets(q_offset, lens, q_len)
    pos = offset[:, None] + torch.arange(q_len, device=device, dtype=I32)  # [B, Nq]
    if isinstance(mask, PerBatch):
        if len(mask.masks) != B:
            raise CompileMaskError(
                f"the mask is per_batch with {len(mask.masks)} entries but cache_seqlens has "
                f"{B} rows"
            )
        parts = [
            _lower(m, pos[b : b + 1], offset[b : b + 1], kv_len) for b, m in enumerate(mask.masks)
        ]
        k = max(p[0].shape[-1] for p in parts)
        parts = [iv.pad_k(lo, hi, k, kv_len) for lo, hi in parts]
        lo, hi = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    else:
        lo, hi = _lower(mask, pos, offset, kv_len)
    # each row inside its own cache; rows before the axis see nothing
    end = torch.where(pos >= 0, lens.clamp(max=kv_len)[:, None], 0)[..., None]
    hi = torch.minimum(hi, end)
    valid = lo < hi
    pad = torch.full((), kv_len, dtype=I32, device=device)
    lo, hi = torch.where(valid, lo, pad), torch.where(valid, hi, pad)
    count = valid.sum(-1, dtype=I32)
    # the plan keeps lengths of its own: the caller's int32 tensors, updated in place for the
    # next step, would otherwise change the lengths a cache call checks against the intervals
    if lens is cache_seqlens:
        lens = lens.clone()
    if offset is q_offset:
        offset = offset.clone()
    return _sealed(DecodePlan(
        q_len, kv_len, B, lo.contiguous(), hi.contiguous(), count, lens, offset, str(mask), mask,
        kv_len_given, q_offset is None,
    ))  # fmt: skip


def _sealed(plan: DecodePlan) -> DecodePlan:
    """``plan`` as step_plan built it: :meth:`DecodePlan.native_window` may name its mask
    while its tensors keep these versions."""
    object.__setattr__(plan, "_versions", plan._tensor_versions())
    return plan


def _lengths(cache_seqlens) -> torch.Tensor:
    if not isinstance(cache_seqlens, torch.Tensor):
        raise CompileMaskError(
            f"cache_seqlens must be an int [B] tensor, got {type(cache_seqlens).__name__}"
        )
    if (
        cache_seqlens.dim() != 1
        or cache_seqlens.dtype not in (torch.int32, torch.int64)
        or cache_seqlens.shape[0] < 1
    ):
        raise CompileMaskError(
            f"cache_seqlens must be an int32/int64 [B] tensor with B >= 1, got shape "
            f"{tuple(cache_seqlens.shape)} and dtype {cache_seqlens.dtype}"
        )
    if cache_seqlens.device.type == "meta":
        raise CompileMaskError("cache_seqlens must hold values: a meta tensor has none")
    # values: checked before the int32 conversion where it costs no host synchronisation (a GPU
    # tensor is not read back: compilemask.attention checks the lengths on every call)
    if cache_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
        bad = (cache_seqlens < 0) | (cache_seqlens > MAX_LEN)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise CompileMaskError(
                f"cache_seqlens[{b}] = {int(cache_seqlens[b])} is outside [0, 2**31 - 1] (a "
                f"cache length in keys; plans hold int32 positions)"
            )
    return cache_seqlens.to(I32)


def _offsets(q_offset, lens: torch.Tensor, q_len: int) -> torch.Tensor:
    if q_offset is None:
        return lens - q_len
    if isinstance(q_offset, torch.Tensor):
        if (
            q_offset.shape != lens.shape
            or q_offset.dtype not in (torch.int32, torch.int64)
            or q_offset.device != lens.device
        ):
            raise CompileMaskError(
                f"q_offset must be an int [B] tensor like cache_seqlens {tuple(lens.shape)} on "
                f"{lens.device}, got shape {tuple(q_offset.shape)}, {q_offset.dtype} on "
                f"{q_offset.device}"
            )
        if q_offset.device.type == "cpu" and q_offset.numel():  # (no host read on a GPU)
            lo, hi = int(q_offset.min()), int(q_offset.max())
            if lo < -_I32_MAX or hi > _I32_MAX - q_len:
                bad = lo if lo < -_I32_MAX else hi
                raise CompileMaskError(
                    f"q_offset holds {bad}: q_offset must be at least -(2**31 - 1) and "
                    f"q_offset + q_len (q_len={q_len}) at most 2**31 - 1 (int32 key positions)"
                )
        return q_offset.to(I32)
    if isinstance(q_offset, bool) or not isinstance(q_offset, int) or q_offset < 0:
        raise CompileMaskError(
            f"q_offset must be None, an int >= 0 or a [B] tensor, got {q_offset!r}"
        )
    if q_offset > _I32_MAX - q_len:
        raise CompileMaskError(
            f"q_offset + q_len must be at most 2**31 - 1 (int32 key positions), got q_offset="
            f"{q_offset} and q_len={q_len}"
        )
    return torch.full_like(lens, q_offset)


def _lower(mask: Mask, pos: torch.Tensor, offset: torch.Tensor, kv_len: int):
    """Canonical ``(lo, hi)`` ``[B, Nq, K]`` of ``mask`` at the positions ``pos`` (not yet cut
    to each row's cache)."""
    B, nq = pos.shape
    if isinstance(mask, Builtin) and mask.name == "tree":
        return _tree(mask.args[0], pos, offset, kv_len)
    _check_decodable(mask)
    ctx = _PositionsCtx(pos.clamp(min=0).reshape(-1), kv_len)
    lo, hi, _ = ctx.lower(mask)
    return lo.reshape(B, nq, -1), hi.reshape(B, nq, -1)


def _check_decodable(mask: Mask) -> None:
    if (
        isinstance(mask, Builtin)
        and mask.name not in DECODE_BUILTINS
        or isinstance(mask, (PerHead, TiledGrid, PerBatch))
    ):
        what = mask.name if isinstance(mask, Builtin) else type(mask).__name__
        raise CompileMaskError(
            f"{what} has no decoding form here (step_plan takes {', '.join(DECODE_BUILTINS)}, "
            "rule masks, their combinations, and per_batch of them at the outermost level)"
        )
    if isinstance(mask, Builtin) and mask.name == "tree":
        raise CompileMaskError("tree must be the whole mask of a decoding step")
    if isinstance(mask, Combine):
        _check_decodable(mask.left)
        _check_decodable(mask.right)
    elif not isinstance(mask, (Builtin, RuleMask)):
        raise CompileMaskError(f"{type(mask).__name__} has no decoding form here")


class _PositionsCtx(_Ctx):
    """The lowering at arbitrary query positions (``q``: int32 ``[R]``), on a key axis of
    ``kv_len``. The closed forms of the catalogue that depend on the row index are restated on
    positions; piecewise masks run on past their last piece; rule masks resolve their layout
    on the key axis. Never trims K (no host reads)."""

    def __init__(self, q: torch.Tensor, kv_len: int):
        super().__init__(kv_len, kv_len, q.device, trim=False)
        self.__dict__["q"] = q  # the cached_property's slot
        self.rows = q.shape[0]

    def _piece_of_row(self, ends):
        return torch.searchsorted(ends, self.q, right=True).clamp_(max=ends.shape[0] - 1)

    def _b_causal(self):
        return torch.zeros_like(self.q)[:, None], self.q[:, None] + 1

    def _b_sliding_window(self, window):
        w = min(window, self._axis())
        return (self.q - w + 1)[:, None], self.q[:, None] + 1

    def _b_prefix_lm(self, prefix_len):
        hi = (self.q + 1).clamp(min=min(prefix_len, self._axis()))
        return torch.zeros_like(self.q)[:, None], hi[:, None]

    def _b_chunked(self, chunk):
        c = min(chunk, self._axis())
        return (self.q // c * c)[:, None], self.q[:, None] + 1

    def _b_block_causal(self, block):
        b = min(block, self._axis())
        hi = ((self.q.long() // b + 1) * b).clamp_(max=self.kv_len).to(I32)  # no int32 wrap
        return torch.zeros_like(self.q)[:, None], hi[:, None]

    def _t_document(self, lengths, causal):
        if not causal:  # the last document's rows see it to the end of the cache
            lengths = (*lengths[:-1], self.kv_len)
        return super()._t_document(lengths, causal)

    def _rules(self, mask: RuleMask):
        if not mask.rules:
            z = torch.full((self.rows, 1), self.kv_len, dtype=I32, device=self.device)
            return z, z.clone(), torch.zeros(self.rows, dtype=I32, device=self.device)
        return super()._rules(mask)


class _PiecesOf(_PositionsCtx):
    """Keeps the pieces of a piecewise catalogue mask (its records, ``lower._Ctx.records``)
    instead of lowering them."""

    def table_of(self, records: list, k: int):
        return records, k


@functools.lru_cache(maxsize=256)
def _pieces_table(mask: Builtin, kv_len: int) -> tuple[list[int], int, int]:
    """The pieces of ``document``, ``shared_prompt`` or ``hstu`` on a key axis of ``kv_len``
    (as :meth:`_PositionsCtx.pieces` evaluates them; pieces without rows left out), as a flat
    table ``[n, 1 + 4 K]``: per piece its end, then ``lo_a``, ``hi_a``, ``lo_b``, ``hi_b``
    ``[K]`` (unused slots ``[Nk, Nk)``). Returns ``(values, n, K)``."""
    ctx = _PiecesOf(torch.zeros(0, dtype=I32), kv_len)
    records, k = getattr(ctx, "_t_" + mask.name)(*mask.args)
    width, values = 2 + 4 * k, []
    for i in range(0, len(records), width):  # each record without its count
        values += records[i : i + 1]
        values += records[i + 2 : i + width]
    return values, len(records) // width, k


@functools.lru_cache(maxsize=256)
def _tree_table(parents: tuple[int, ...]) -> tuple[list[int], int]:
    """Per node, the merged runs ``[a, b)`` of node indices on its root path (ascending), as
    a flat table ``[2, n, K]`` (unused slots ``(0, 0)``)."""
    n = len(parents)
    runs = []
    for i in range(n):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        merged: list[list[int]] = []
        for node in sorted(path):
            if merged and merged[-1][1] == node:
                merged[-1][1] = node + 1
            else:
                merged.append([node, node + 1])
        runs.append(merged)
    k = max(len(r) for r in runs)
    table = [[r[j][0] if j < len(r) else 0 for j in range(k)] for r in runs]
    table += [[r[j][1] if j < len(r) else 0 for j in range(k)] for r in runs]
    return [x for row in table for x in row], k


_TABLES: dict = {}


def _device_table(key, values: list[int], device: torch.device) -> torch.Tensor:
    """A host table on ``device``, copied once (through pinned memory on CUDA) and cached."""
    hit = _TABLES.get((key, str(device)))
    if hit is None:
        host = torch.tensor(values, dtype=I32)
        hit = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        hit = hit.to(device)
        if len(_TABLES) > 256:
            _TABLES.clear()
        _TABLES[(key, str(device))] = hit
    return hit


def _tree_runs(parents, nq: int, device: torch.device) -> torch.Tensor:
    """int32 ``[2, nq, K]`` on ``device``: :func:`_tree_table` of ``parents`` (cached)."""
    if len(parents) != nq:
        raise CompileMaskError(
            f"a tree of {len(parents)} nodes needs q_len={len(parents)}, got {nq}"
        )
    values, k = _tree_table(tuple(parents))
    return _device_table(("tree", tuple(parents)), values, device).view(2, nq, k)


def _tree(parents, pos: torch.Tensor, offset: torch.Tensor, kv_len: int):
    B, nq = pos.shape
    runs = _tree_runs(parents, nq, pos.device)[:, None]  # [2, 1, nq, K]
    base = offset[:, None, None]  # [B, 1, 1]; keys before 0 are cut by the clip
    lo = torch.cat([torch.zeros_like(base).expand(B, nq, 1), base + runs[0]], -1)
    hi = torch.cat([base.expand(B, nq, 1), base + runs[1]], -1)
    lo, hi = iv.clip(lo, hi, kv_len)
    lo, hi, _ = iv.compact_sorted(lo, hi, kv_len, trim=False)
    return lo, hi
