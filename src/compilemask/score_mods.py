"""Score modifiers for :func:`compilemask.attention` (``score_mod=``).

A modifier changes the scaled score ``s = scale * q_i . k_j`` of every visible pair before
the softmax (the mask is applied after it: hidden pairs stay hidden)::

    out_i = sum_j softmax_j( mod(s_ij, b, h, i, j) ) v_j        (over the visible keys j)

``b`` is the batch row, ``h`` the query head, ``i`` / ``j`` the query / key positions (0-based
token indices of q and k). Built-ins:

==========================================  ===================================================
``softcap(cap)``                            ``cap * tanh(s / cap)`` (Gemma 2, Grok)
``alibi(slopes)``                           ``s + slopes[h] * (j - i)``; slopes [Hq]
``relative_bias(table, nb, max_d, bidir)``  ``s + table[h, bucket(j - i)]``, T5 buckets
                                            (:func:`relative_buckets`); table [Hq, nb],
                                            learnable
``bias(tensor)``                            ``s + tensor[b, h, i, j]``; [B or 1, Hq or 1, Nq,
                                            Nk], learnable
``custom(torch_fn, triton_fn, ...)``        your own (docs/score-mods.md)
``compose(a, b, ...)`` or ``[a, b, ...]``   ``... b(a(s))``: applied left to right, up to 4
==========================================  ===================================================

Each modifier is also a torch function ``mod(score, b, h, q_idx, kv_idx)`` on broadcastable
tensors: the twin the reference backend (the oracle) runs. The Triton backend runs the same
formulas inside its kernels, forward and backward, with deterministic gradients for the
learnable tensors; ``docs/score-mods.md`` has the details and the restrictions.

Example::

    >>> mod = cm.score_mods.compose(cm.score_mods.alibi(cm.score_mods.alibi_slopes(16)),
    ...                             cm.score_mods.softcap(50.0))
    >>> out = cm.attention(q, k, v, plan, score_mod=mod)
"""

from __future__ import annotations

import importlib.util
import math
import numbers
from collections.abc import Callable, Sequence

import torch

from .errors import CompileMaskError, InputError
from .language.values import integer_value

#: float32's largest value: the kernels cap scores in float32
_F32_MAX = float(torch.finfo(torch.float32).max)

MAX_STAGES = 4
SOFTCAP, ALIBI, RELATIVE_BIAS, BIAS, CUSTOM = 1, 2, 3, 4, 5


class ScoreMod:
    """A score modifier (one stage, or a composition: :meth:`stages`)."""

    kind = 0

    def stages(self) -> list[ScoreMod]:
        """The single stages, in the order they apply."""
        return [self]

    def __call__(self, score, b, h, q_idx, kv_idx):  # the torch twin
        raise NotImplementedError

    def learnable_tensor(self) -> torch.Tensor | None:
        """The stage's tensor that may receive a gradient (table, bias), or None."""
        return None

    def tensors(self) -> list[torch.Tensor]:
        """The learnable tensors of every stage that require grad."""
        out = []
        for st in self.stages():
            t = st.learnable_tensor()
            if t is not None and t.requires_grad:
                out.append(t)
        return out

    def requires_grad(self) -> bool:
        return bool(self.tensors())

    def check(self, B: int, Hq: int, Nq: int, Nk: int, device: torch.device) -> None:
        """Raise InputError when the modifier's tensors do not fit the call."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _tensor(name: str, t: object, shape: tuple, device) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        got = f"a {t.dtype} tensor" if isinstance(t, torch.Tensor) else type(t).__name__
        raise InputError(f"{name} must be a floating-point torch.Tensor, got {got}")
    if tuple(t.shape) != tuple(shape):
        raise InputError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise InputError(f"{name} is on {t.device} but q is on {device}")


class Softcap(ScoreMod):
    """``cap * tanh(s / cap)``."""

    kind = SOFTCAP

    def __init__(self, cap: float):
        if isinstance(cap, bool) or not isinstance(cap, (int, float, numbers.Real)):
            raise InputError(f"softcap: cap must be a float, got {type(cap).__name__}")
        # a comparison, not math.isfinite: under torch.compile a float argument may be a
        # SymFloat, which math.isfinite refuses (the comparison guards on it instead). The
        # kernels cap in float32: a cap above its largest value would be inf there, and
        # inf * tanh(s / inf) is NaN
        if not 0 < cap <= _F32_MAX:
            raise InputError(
                f"softcap: cap must be a positive finite float of float32 (at most "
                f"{_F32_MAX:.4g}), got {cap}"
            )
        self.cap = float(cap)

    def __call__(self, score, b, h, q_idx, kv_idx):
        return self.cap * torch.tanh(score / self.cap)

    def __repr__(self) -> str:
        return f"softcap({self.cap})"


class Alibi(ScoreMod):
    """``s + slopes[h] * (kv_idx - q_idx)``; slopes [Hq] (constant: no gradient)."""

    kind = ALIBI

    def __init__(self, slopes: torch.Tensor):
        if not isinstance(slopes, torch.Tensor) or slopes.dim() != 1:
            raise InputError("alibi: slopes must be a 1-dim tensor [Hq]")
        if slopes.requires_grad:
            raise InputError(
                "alibi: slopes that require grad are not supported (ALiBi slopes are "
                "constants); pass slopes.detach()"
            )
        # values: checked where it costs no host synchronisation (a GPU tensor is not read back)
        if (
            slopes.device.type == "cpu"
            and slopes.is_floating_point()
            and not torch.compiler.is_compiling()
            and not bool(torch.isfinite(slopes).all())
        ):
            raise InputError(f"alibi: slopes must be finite, got {slopes.tolist()}")
        self.slopes = slopes

    def __call__(self, score, b, h, q_idx, kv_idx):
        slope = self.slopes.to(score.dtype)[h]
        return score + slope * (kv_idx - q_idx).to(score.dtype)

    def check(self, B, Hq, Nq, Nk, device):
        _tensor("alibi slopes", self.slopes, (Hq,), device)

    def __repr__(self) -> str:
        return f"alibi(slopes[{self.slopes.shape[0]}])"


def alibi_slopes(heads: int, device=None) -> torch.Tensor:
    """The ALiBi paper's slopes ``2^(-8 (h + 1) / heads)``, float32 [heads].

    Raises:
        InputError: ``heads`` not a positive integer.
    """
    count = integer_value(heads)
    if count is None or count < 1:
        raise InputError(f"alibi_slopes: heads must be a positive int, got {heads!r}")
    heads = count
    h = torch.arange(1, heads + 1, dtype=torch.float64, device=device)
    return torch.exp2(-8.0 * h / heads).to(torch.float32)


def relative_buckets(
    rel: torch.Tensor, num_buckets: int, max_distance: int, bidirectional: bool
) -> torch.Tensor:
    """T5's bucket of the relative position ``rel = kv_idx - q_idx`` (int64 tensor, same
    shape): half the buckets (all when not bidirectional: ``rel > 0`` then shares bucket 0)
    hold exact distances ``< num_buckets // 2`` (``// 4`` bidirectional), the rest
    log-spaced distances up to ``max_distance`` (farther ones share the last bucket).
    Source: Raffel et al., "T5" (2020); the HuggingFace ``_relative_position_bucket``."""
    rel = rel.long()
    buckets = torch.zeros_like(rel)
    n = num_buckets
    if bidirectional:
        n //= 2
        buckets = buckets + (rel > 0).long() * n
        dist = rel.abs()
    else:
        dist = (-rel).clamp(min=0)
    max_exact = n // 2
    is_small = dist < max_exact
    large = (
        max_exact
        + (
            torch.log(dist.float().clamp(min=1) / max_exact)
            / math.log(max_distance / max_exact)
            * (n - max_exact)
        ).long()
    )
    large = large.clamp(max=n - 1)
    return buckets + torch.where(is_small, dist, large)


class RelativeBias(ScoreMod):
    """``s + table[h, relative_buckets(kv_idx - q_idx)]``; table [Hq, num_buckets],
    learnable."""

    kind = RELATIVE_BIAS

    def __init__(self, table, num_buckets: int, max_distance: int, bidirectional: bool):
        ints = []
        for name, val in (("num_buckets", num_buckets), ("max_distance", max_distance)):
            number = integer_value(val)
            if number is None or number < 1:
                raise InputError(f"relative_bias: {name} must be a positive int, got {val!r}")
            ints.append(number)
        num_buckets, max_distance = ints
        if bidirectional is not True and bidirectional is not False:
            raise InputError(
                f"relative_bias: bidirectional must be True or False, got {bidirectional!r}"
            )
        min_buckets = 4 if bidirectional else 2
        if num_buckets < min_buckets or num_buckets > 1024:
            raise InputError(
                f"relative_bias: num_buckets must be in [{min_buckets}, 1024], got {num_buckets}"
            )
        exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
        if max_distance <= exact:
            raise InputError(
                f"relative_bias: max_distance must exceed the exact range {exact}, "
                f"got {max_distance}"
            )
        if not isinstance(table, torch.Tensor) or table.dim() != 2:
            raise InputError("relative_bias: table must be a 2-dim tensor [Hq, num_buckets]")
        if table.shape[1] != num_buckets:
            raise InputError(
                f"relative_bias: table must have num_buckets={num_buckets} columns, got "
                f"{list(table.shape)}"
            )
        self.table, self.num_buckets = table, num_buckets
        self.max_distance, self.bidirectional = max_distance, bool(bidirectional)

    def __call__(self, score, b, h, q_idx, kv_idx):
        bucket = relative_buckets(
            kv_idx - q_idx, self.num_buckets, self.max_distance, self.bidirectional
        )
        return score + self.table.to(score.dtype)[h, bucket]

    def learnable_tensor(self):
        return self.table

    def check(self, B, Hq, Nq, Nk, device):
        _tensor("relative_bias table", self.table, (Hq, self.num_buckets), device)

    def __repr__(self) -> str:
        return (
            f"relative_bias(table{list(self.table.shape)}, {self.num_buckets}, "
            f"{self.max_distance}, {self.bidirectional})"
        )


class Bias(ScoreMod):
    """``s + tensor[b, h, q_idx, kv_idx]``; tensor [B or 1, Hq or 1, Nq, Nk], learnable."""

    kind = BIAS

    def __init__(self, tensor: torch.Tensor):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            raise InputError("bias: tensor must be a 4-dim tensor [B or 1, Hq or 1, Nq, Nk]")
        self.tensor = tensor

    def __call__(self, score, b, h, q_idx, kv_idx):
        t = self.tensor.to(score.dtype)
        bi = b if t.shape[0] > 1 else torch.zeros_like(b)
        hi = h if t.shape[1] > 1 else torch.zeros_like(h)
        return score + t[bi, hi, q_idx, kv_idx]

    def learnable_tensor(self):
        return self.tensor

    def check(self, B, Hq, Nq, Nk, device):
        t = self.tensor
        if (
            t.shape[0] not in (1, B)
            or t.shape[1] not in (1, Hq)
            or tuple(t.shape[2:])
            != (
                Nq,
                Nk,
            )
        ):
            raise InputError(
                f"bias: tensor must have shape [B or 1, Hq or 1, Nq, Nk] = [{B} or 1, {Hq} or "
                f"1, {Nq}, {Nk}], got {list(t.shape)}"
            )
        _tensor("bias tensor", t, tuple(t.shape), device)

    def __repr__(self) -> str:
        return f"bias({list(self.tensor.shape)})"


def _check_jit(name: str, fn: object) -> None:
    """``fn`` must be a ``@triton.jit`` function (a ``triton.runtime.JITFunction``, or an
    ``InterpretedFunction`` under ``TRITON_INTERPRET=1``); checked by class, without importing
    Triton (only ``kernels/triton`` does), and only when Triton is installed."""
    if importlib.util.find_spec("triton") is None:
        return
    if not any(
        c.__module__.split(".")[0] == "triton" and c.__name__ in _JIT_CLASSES
        for c in type(fn).__mro__
    ):
        raise InputError(
            f"custom: {name} must be a @triton.jit function (triton.runtime.JITFunction), "
            f"got {type(fn).__name__}"
        )


_JIT_CLASSES = ("JITFunction", "InterpretedFunction")


class Custom(ScoreMod):
    """A modifier of your own: ``torch_fn(score, b, h, q_idx, kv_idx, aux)`` (the reference's
    twin, on broadcastable tensors) and ``triton_fn`` (a ``@triton.jit`` function of the same
    arguments on the kernels' tiles; ``aux`` is a float32 pointer to ``aux``'s elements,
    flattened), with ``triton_grad_fn`` (``d triton_fn / d score``, same arguments) for the
    backward. ``aux`` is a constant (no gradient flows to it). Without ``triton_grad_fn`` the
    Triton backend runs forwards only (a backward raises)."""

    kind = CUSTOM

    def __init__(self, torch_fn, triton_fn, triton_grad_fn=None, aux=None, name="custom"):
        if not callable(torch_fn) or not callable(triton_fn):
            raise InputError("custom: torch_fn and triton_fn must be callables")
        _check_jit("triton_fn", triton_fn)
        if triton_grad_fn is not None:
            _check_jit("triton_grad_fn", triton_grad_fn)
        if aux is not None and (not isinstance(aux, torch.Tensor) or aux.requires_grad):
            raise InputError("custom: aux must be a tensor that does not require grad")
        if aux is not None and aux.numel() == 0:
            raise InputError(
                f"custom: aux must hold at least one element, got shape {list(aux.shape)} "
                f"(pass aux=None when the modifier reads none)"
            )
        self.torch_fn, self.triton_fn, self.triton_grad_fn = torch_fn, triton_fn, triton_grad_fn
        self.aux, self.name = aux, name

    def __call__(self, score, b, h, q_idx, kv_idx):
        try:
            out = self.torch_fn(score, b, h, q_idx, kv_idx, self.aux)
        except CompileMaskError:
            raise
        except Exception as exc:  # the user's function: name it in the error
            raise InputError(
                f"custom score_mod {self.name!r}: torch_fn raised {type(exc).__name__}: {exc}"
            ) from exc
        # exactly score's shape: a smaller result would broadcast silently to a wrong score
        if not isinstance(out, torch.Tensor):
            got = type(out).__name__
        elif tuple(out.shape) != tuple(score.shape) or not out.is_floating_point():
            got = f"shape {tuple(out.shape)} of dtype {out.dtype}"
        else:
            return out
        raise InputError(
            f"custom score_mod {self.name!r}: torch_fn must return a floating-point tensor of "
            f"score's shape {tuple(score.shape)}, got {got}"
        )

    def check(self, B, Hq, Nq, Nk, device):
        if self.aux is not None and self.aux.device != device:
            raise InputError(f"custom: aux is on {self.aux.device} but q is on {device}")

    def __repr__(self) -> str:
        return f"custom({self.name})"


class Compose(ScoreMod):
    """Stages applied left to right."""

    def __init__(self, mods: Sequence[ScoreMod]):
        flat: list[ScoreMod] = []
        for m in mods:
            if not isinstance(m, ScoreMod):
                raise InputError(
                    f"compose: every part must be a compilemask.score_mods modifier, got "
                    f"{type(m).__name__}"
                )
            flat.extend(m.stages())
        if not flat:
            raise InputError("compose: give at least one modifier")
        if len(flat) > MAX_STAGES:
            raise InputError(f"compose: at most {MAX_STAGES} stages, got {len(flat)}")
        for kind, name in ((RELATIVE_BIAS, "relative_bias"), (CUSTOM, "custom")):
            if sum(st.kind == kind for st in flat) > 1:
                raise InputError(f"compose: at most one {name} stage")
        self._stages = flat

    def stages(self) -> list[ScoreMod]:
        return list(self._stages)

    def __call__(self, score, b, h, q_idx, kv_idx):
        for st in self._stages:
            score = st(score, b, h, q_idx, kv_idx)
        return score

    def check(self, B, Hq, Nq, Nk, device):
        for st in self._stages:
            st.check(B, Hq, Nq, Nk, device)

    def __repr__(self) -> str:
        return "compose(" + ", ".join(map(repr, self._stages)) + ")"


# ------------------------------------------------------------------------ the dispatch key
#: tensor types whose facts a dispatch key records (a Parameter is a plain tensor; other
#: subclasses may dispatch differently, so their calls are not kept); the api keys sinks by it
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _facts(t: object) -> tuple | None:
    """Shape, dtype, device, requires_grad and strides of a modifier's tensor, or None (not a
    plain tensor). No values: a learnable table changes every step."""
    if type(t) not in PLAIN_TENSORS:
        return None
    return (t.shape, t.dtype, t.device, t.requires_grad, t.stride())


def _softcap_key(st: Softcap) -> tuple | None:
    return (SOFTCAP, st.cap) if type(st.cap) is float else None


def _alibi_key(st: Alibi) -> tuple | None:
    facts = _facts(st.slopes)
    return None if facts is None else (ALIBI, facts)


def _relative_bias_key(st: RelativeBias) -> tuple | None:
    facts = _facts(st.table)
    ints = (st.num_buckets, st.max_distance)
    if facts is None or any(type(n) is not int for n in ints) or type(st.bidirectional) is not bool:
        return None
    return (RELATIVE_BIAS, *ints, st.bidirectional, facts)


def _bias_key(st: Bias) -> tuple | None:
    facts = _facts(st.tensor)
    return None if facts is None else (BIAS, facts)


def _custom_key(st: Custom) -> tuple | None:
    # the Triton functions by identity (ids: the key keeps no reference, and a reused id
    # keys the same outcome, which reads no more of them than triton_grad_fn being None);
    # torch_fn and aux's values are read by the kernels on every call, from the modifier the
    # call passes, and by no check, so a closure changed between calls needs no new key
    aux = None if st.aux is None else _facts(st.aux)
    if st.aux is not None and aux is None:
        return None
    grad_fn = None if st.triton_grad_fn is None else id(st.triton_grad_fn)
    return (CUSTOM, id(st.triton_fn), grad_fn, aux)


_STAGE_KEYS = {
    Softcap: _softcap_key,
    Alibi: _alibi_key,
    RelativeBias: _relative_bias_key,
    Bias: _bias_key,
    Custom: _custom_key,
}


def dispatch_key(obj: object) -> tuple | None:
    """A hashable key of what ``compilemask.attention``'s checks and backend resolution read
    of ``obj`` (a ``score_mod`` argument: a modifier or a list / tuple of them): per stage, in
    order, its kind, its plain Python parameters (softcap's cap, relative_bias's num_buckets,
    max_distance, bidirectional, a custom stage's Triton functions by identity) and its
    tensors' shape, dtype, device, requires_grad and strides; never tensor values. A list and
    the composition of its modifiers have one key. None: not keyed (a subclass of a built-in
    or of :class:`ScoreMod`, a tensor subclass, a part that is not a modifier), and such calls
    run every check. Every check of a modifier depends on its key alone (and on q, k, plan),
    so a key that passed them once passes them again."""
    parts = obj if type(obj) in (list, tuple) else (obj,)
    key = []
    for part in parts:
        stages = part._stages if type(part) is Compose else (part,)
        for st in stages:
            of = _STAGE_KEYS.get(type(st))
            stage = None if of is None else of(st)
            if stage is None:
                return None
            key.append(stage)
    return tuple(key)


def softcap(cap: float) -> ScoreMod:
    """``cap * tanh(s / cap)`` (logit soft-capping; Gemma 2 uses 50.0)."""
    return Softcap(cap)


def alibi(slopes: torch.Tensor) -> ScoreMod:
    """``s + slopes[h] * (kv_idx - q_idx)``; ``slopes`` [Hq] (:func:`alibi_slopes`), a float
    tensor that does not require grad, of finite values (checked on the CPU; a GPU tensor is
    not read back). Raises InputError otherwise."""
    return Alibi(slopes)


def relative_bias(
    table: torch.Tensor, num_buckets: int = 32, max_distance: int = 128, bidirectional=True
) -> ScoreMod:
    """``s + table[h, relative_buckets(kv_idx - q_idx, num_buckets, max_distance,
    bidirectional)]``; ``table`` [Hq, num_buckets] may require grad."""
    return RelativeBias(table, num_buckets, max_distance, bidirectional)


def bias(tensor: torch.Tensor) -> ScoreMod:
    """``s + tensor[b, h, q_idx, kv_idx]``; ``tensor`` [B or 1, Hq or 1, Nq, Nk] may require
    grad (its gradient is summed over the broadcast dimensions)."""
    return Bias(tensor)


def custom(
    torch_fn: Callable,
    triton_fn: Callable,
    triton_grad_fn: Callable | None = None,
    aux: torch.Tensor | None = None,
    name: str = "custom",
) -> ScoreMod:
    """A modifier of your own (see :class:`Custom` and docs/score-mods.md). Raises InputError
    when ``triton_fn`` (or ``triton_grad_fn``) is not a ``@triton.jit`` function (with triton
    installed), when ``aux`` requires grad or is empty, and, in the reference, when
    ``torch_fn`` raises or returns anything but a floating-point tensor of score's shape."""
    return Custom(torch_fn, triton_fn, triton_grad_fn, aux, name)


def compose(*mods: ScoreMod) -> ScoreMod:
    """The modifiers applied left to right (``compose(alibi(s), softcap(30))`` caps the
    biased score); at most 4 stages, one relative_bias and one custom among them."""
    return Compose(mods)


def as_score_mod(obj: object) -> ScoreMod:
    """A modifier from a modifier or a list / tuple of them (their composition)."""
    if isinstance(obj, ScoreMod):
        if len(obj.stages()) > 1 or isinstance(obj, Compose):
            return obj
        return Compose([obj])
    if isinstance(obj, (list, tuple)):
        return Compose(list(obj))
    raise InputError(
        f"score_mod must be a compilemask.score_mods modifier or a list of them, got "
        f"{type(obj).__name__} (a plain function cannot run in the kernels: wrap it with "
        f"compilemask.score_mods.custom)"
    )


__all__ = [
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "as_score_mod",
    "bias",
    "compose",
    "custom",
    "relative_bias",
    "relative_buckets",
    "softcap",
]
