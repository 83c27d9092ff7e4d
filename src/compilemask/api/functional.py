"""``compilemask.attention``: masked attention driven by a compiled :class:`MaskPlan`.

The api validates the inputs, applies the plan's permutation, resolves the backend through
``kernels/registry.py`` and dispatches to it (``kernels/interface.py``); it holds no
backend-specific code. Backends wire their own autograd (``attend``) or give a
``forward`` / ``backward`` pair that :class:`.autograd.BackendAttention` wires.

Legend: B batch, Hq / Hkv query / key-value heads, Nq / Nk query / key length, D head_dim.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch.autograd import forward_ad

from .. import score_mods
from ..compiler.decode import DecodePlan
from ..compiler.plan import MaskPlan
from ..errors import InputError
from ..kernels import registry
from ..kernels.interface import call_of
from . import paged, validate
from .autograd import BackendAttention


def _gather(x: torch.Tensor, index: torch.Tensor, gather) -> torch.Tensor:
    return x.index_select(2, index) if gather is None else gather(x, index)


class _TokenOrder(torch.autograd.Function):
    """``x.index_select(2, index)`` whose gradient is a gather too (``grad.index_select(2,
    inverse)``, ``inverse`` the inverse permutation of ``index``), not the atomic
    ``index_add`` of autograd's ``index_select`` backward (slow in 16 bits). ``gather`` is
    the backend's ``gather_tokens`` (a row-copy kernel) or None (``index_select``)."""

    @staticmethod
    def forward(x, index, inverse, gather):
        return _gather(x, index, gather)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1], inputs[2])
        ctx.index = inputs[1]  # for jvp
        ctx.gather = inputs[3]

    @staticmethod
    def backward(ctx, grad):
        index, inverse = ctx.saved_tensors
        # itself a _TokenOrder, so that gradients of gradients (create_graph=True) flow
        return _TokenOrder.apply(grad, inverse, index, ctx.gather), None, None, None

    @staticmethod
    def jvp(ctx, x_t, index_t, inverse_t, gather_t):
        return _gather(x_t, ctx.index, ctx.gather)


def _permute_tokens(x, index, inverse, gather) -> torch.Tensor:
    """``x.index_select(2, index)``: through :class:`_TokenOrder` in eager mode; traced as
    ``index_select`` under ``torch.compile`` (Dynamo does not trace a custom ``jvp``)."""
    if torch.compiler.is_compiling():
        return x.index_select(2, index)
    return _TokenOrder.apply(x, index, inverse, gather)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: MaskPlan,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    check_plan: bool = False,
    score_mod=None,
    sinks: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
):
    """Masked attention ``softmax(scale * q @ k^T + mask) @ v`` with the mask of ``plan``.

    Each query row attends exactly to the key intervals the plan compiled for it; rows that see
    no key give output 0 (and LSE -inf), never NaN. Heads are grouped (GQA / MQA): query head h
    reads key/value head ``h // (Hq // Hkv)``.

    Args:
        q: [B, Hq, Nq, D] float16 or bfloat16 (float32 also works; float64 on the reference).
        k: [B, Hkv, Nk, D], v: [B, Hkv, Nk, Dv], same dtype and device as q, Hq % Hkv == 0.
            D and Dv (head_dims) are each one of 32, 64, 96, 128, 192, 256 and may differ
            (e.g. D 192, Dv 128; reference and Triton; cudnn needs D == Dv, not 192). Any
            strides.
        plan: a :class:`MaskPlan` compiled for (Nq, Nk), on q's device, and for this B / Hq
            when its mask depends on the batch row / head. A plan of a ``tile_grid`` mask
            carries a permutation: q, k, v are given (and out returned) in the original token
            order, and the kernels run in tiled order.
        scale: softmax scale, default 1 / sqrt(D).
        return_lse: also return the log-sum-exp of each row's scaled scores.
        backend: "auto" (the first backend of ``kernels.registry.AUTO_TABLE`` that runs the
            call: Triton on CUDA, or on the CPU when TRITON_INTERPRET=1; else the reference;
            :func:`explain` says which and why), "triton", "reference" or any registered
            name ("cudnn": cuDNN-frontend interval attention, ``compilemask[cudnn]``; "fa4":
            FlashAttention-4's block-sparse kernels, ``compilemask[fa4]``; "cute": our CuTe-DSL
            sm90 forward, ``compilemask[cute]``; "cudnn+triton": cuDNN-frontend's forward with
            the Triton backward). An explicit backend that is unavailable or
            does not support the call raises (never a silent fallback).
        check_plan: verify every invariant of the plan on this call (O(N*K + Tq*Tk) work and
            one host read; also with ``COMPILEMASK_CHECK_PLAN=1``); on a CUDA cache call, also
            check page ids and cache lengths with a host read (an InputError naming the entry;
            by default the decode kernel gives a batch row with a bad value NaN instead).
            Plans are checked where they enter (constructors, copies, unpickling,
            ``MaskPlan.load``) and refused when modified afterwards, so this is for debugging.
            Under ``torch.compile`` only the shape checks run (call ``plan.verify()`` before
            compiled code sees a plan).
        score_mod: a :mod:`compilemask.score_mods` modifier, or a list of them (applied left
            to right; an empty list is no modifier), changing the scaled scores before the
            mask: softcap, alibi, relative_bias, bias, custom (docs/score-mods.md). Gradients
            flow to its learnable tensors (relative_bias's table, bias's tensor). Reference
            and Triton (eager calls; under ``torch.compile`` the reference); not with
            ``tile_grid`` plans.
        sinks: [Hq] float tensor of per-head sink logits (gpt-oss; may require grad): each
            row's softmax denominator gets ``+ exp(sink_h)``, and the sink adds no value. A
            row that sees no key then gives out 0 and lse = sink_h; lse includes the sink.

        block_table: int32 [B, P]: ``k`` and ``v`` are paged KV caches ``[num_pages,
            page_size, Hkv, D]`` (the FlashAttention / vLLM layout; any page size, pages in any
            order) and batch row ``b``'s key ``t`` is ``k[block_table[b, t // page_size], t %
            page_size]``. Forward only (docs/decode.md).
        cache_seqlens: int [B]: keys in each batch row's cache (ragged caches; later keys are
            never read). With it and no ``block_table``, k and v are contiguous caches
            ``[B, Hkv, Nk, D]``. A :class:`~compilemask.DecodePlan` (``compilemask.step_plan``)
            brings its own. Cache calls take a MaskPlan (shared by the heads) or a DecodePlan,
            run the split-KV decode kernel (Triton) or the reference, and are forward only.

    Differentiable in q, k and v through out and lse (Triton: deterministic FlashAttention-2
    backward kernels, also under ``torch.compile``; cudnn: cuDNN-frontend's backward;
    reference: torch autograd with per-chunk recomputation). Forward-mode AD (dual tensors of
    ``torch.autograd.forward_ad``, ``torch.func.jvp``) and higher-order gradients on the
    reference backend only (Triton: gradients taken with ``create_graph=True`` raise when
    differentiated again).

    Returns:
        out [B, Hq, Nq, Dv] in q's dtype; with ``return_lse``, ``(out, lse)`` with lse float32
        [B, Hq, Nq] (natural log; -inf for rows that see no key).

    Raises:
        InputError: mismatching shapes, dtypes or devices, unsupported head_dim, a plan built
            for other lengths / batch / heads or on another device, an unavailable backend,
            the Triton backend under a torch.func transform (grad, vjp, jvp, vmap), a backend
            other than the reference on dual tensors of forward-mode AD
            (``torch.autograd.forward_ad``; ``"auto"`` then runs the reference), an unknown
            backend name, ``return_lse`` not a bool.
        PlanError: the plan is invalid, or was modified after it was built.

    Example::

        >>> plan = cm.compile(cm.masks.sliding_window(256), 4096, device="cuda")
        >>> out = cm.attention(q, k, v, plan)  # q, k, v: [2, 16, 4096, 128] bf16 on CUDA

    Source: FlashAttention-2 (Dao, 2023) over the plan's tile lists.
    """
    if return_lse is not True and return_lse is not False:
        raise InputError(f"return_lse must be True or False, got {return_lse!r}")
    if check_plan is not True and check_plan is not False:
        raise InputError(f"check_plan must be True or False, got {check_plan!r}")
    if isinstance(score_mod, (list, tuple)) and not score_mod:  # no modifier
        score_mod = None
    if block_table is not None or cache_seqlens is not None or isinstance(plan, DecodePlan):
        if score_mod is not None or sinks is not None:
            raise InputError(
                "score_mod and sinks are not supported with KV caches (block_table / "
                "cache_seqlens / a DecodePlan) yet"
            )
        if check_plan or os.environ.get("COMPILEMASK_CHECK_PLAN") == "1":
            if isinstance(plan, (MaskPlan, DecodePlan)):
                plan.verify()
        scale = validate.check_scale(scale, q.shape[-1]) if isinstance(q, torch.Tensor) else scale
        return paged.attend_cache(
            q,
            k,
            v,
            plan,
            block_table,
            cache_seqlens,
            scale,
            return_lse,
            backend,
            check_plan or os.environ.get("COMPILEMASK_CHECK_PLAN") == "1",
        )
    if forward_ad._current_level >= 0 and backend != "reference":  # inside a dual level
        backend = _backend_for_tangents(q, k, v, sinks, backend)
    key = (
        None if check_plan else _dispatch_key(q, k, v, plan, backend, return_lse, score_mod, sinks)
    )
    hit = None if key is None else _dispatch_hit(plan, key)
    if hit is not None:
        impl, prepared, call = hit
        scale = validate.check_scale(scale, q.shape[-1])
        if score_mod is not None:  # the modifier of this call (the entry keeps none)
            score_mod = score_mods.as_score_mod(score_mod)
            call = type(call)(**{**call.__dict__, "score_mod": score_mod})  # replace, faster
        if sinks is not None:
            validate.check_sink_values(sinks)
    else:
        validate.check_tensors(q, k, v)
        validate.check_plan(q, k, plan, full=check_plan)
        scale = validate.check_scale(scale, q.shape[-1])
        score_mod = validate.check_score_mod(score_mod, q, k, plan)
        validate.check_sinks(sinks, q)
        call = call_of(q, k, v, return_lse, score_mod=score_mod, sinks=sinks)
        impl = registry.resolve(backend, plan, call)
        prepared = impl.prepare(plan, call)
        if key is not None:
            _dispatch_store(plan, key, impl, prepared, call)
    extra = None if score_mod is None and sinks is None else {
        "score_mod": score_mod, "sinks": sinks
    }  # fmt: skip
    if plan.permutation is not None:  # a tile_grid plan: run in tiled order, answer in ours
        perm, inv = plan.permutation, plan.inverse_permutation
        gather = registry.token_gather(impl)
        q, k, v = (_permute_tokens(t, perm, inv, gather) for t in (q, k, v))
        out, lse = _run(impl, q, k, v, plan, prepared, scale, call, extra)
        out = _permute_tokens(out, inv, perm, gather)
        lse = None if lse is None else _permute_tokens(lse, inv, perm, gather)
    else:
        out, lse = _run(impl, q, k, v, plan, prepared, scale, call, extra)
    return (out, lse) if return_lse else out


def _backend_for_tangents(q, k, v, sinks, backend):
    """``backend``, or ``"reference"`` for ``"auto"`` when an input carries a forward-mode AD
    tangent (only the reference propagates tangents; the kernels would drop them silently).

    Raises:
        InputError: an explicit backend other than the reference with a tangent on an input.
    """
    named = [
        n
        for n, t in (("q", q), ("k", k), ("v", v), ("sinks", sinks))
        if isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None
    ]
    if not named:
        return backend
    if backend == "auto":
        return "reference"
    raise InputError(
        f"backend={backend!r} does not support forward-mode AD (jvp, dual tensors of "
        f"torch.autograd.forward_ad): {', '.join(named)} "
        f'{"carries" if len(named) == 1 else "carry"} a tangent; use backend="reference" '
        f'(or "auto", which picks it), or pass the primals (forward_ad.unpack_dual(x).primal)'
    )


# ------------------------------------------------------------------------------ dispatch cache
# A call's validation, backend resolution and ``prepare`` depend on the plan (checked per call
# by ``check_unchanged``), the types, shapes, dtypes and devices of q, k, v, whether a
# backward will run, ``return_lse``, the backend name, the registry's table and backends, (on
# the CPU) TRITON_INTERPRET, and, with ``score_mod`` / ``sinks``, the modifier's structure
# (``score_mods.dispatch_key``: stage kinds in order, plain parameters, custom stages' Triton
# functions by identity, each tensor's shape, dtype, device, requires_grad and strides) and
# the sinks' shape, dtype, device and requires_grad. Their outcome is kept in the plan's cache
# (dropped with it when the plan is rebuilt) under a key of exactly those inputs; a call whose
# key is new runs every check. Tensor values are in no key: what the kernels read of the
# modifier and the sinks is passed on every call, the sinks' values are checked on every CPU
# call, and ALiBi's slopes where the modifier is built. An entry holds no modifier (its call's
# ``score_mod`` is None; a hit puts this call's in), so it keeps no table alive. Calls with
# check_plan, calls under torch.compile or torch.func transforms, tensor subclasses (a
# Parameter is none), modifiers ``dispatch_key`` does not key (subclasses of the built-ins,
# ScoreMod subclasses of one's own) and backends that opt out (``dispatch_token`` returning
# None) always run the full path.
_DISPATCH = "api.dispatch"


def _dispatch_key(q, k, v, plan, backend, return_lse, score_mod=None, sinks=None):
    """The key of a call in ``plan``'s dispatch cache, or None (no caching for this call)."""
    if (
        type(q) is not torch.Tensor
        or type(k) is not torch.Tensor
        or type(v) is not torch.Tensor
        or type(backend) is not str
        or not (return_lse is True or return_lse is False)
        or not isinstance(plan, MaskPlan)
        or torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
        or os.environ.get("COMPILEMASK_CHECK_PLAN") == "1"
    ):
        return None
    device = q.device
    interpret = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    key = (
        _DISPATCH, backend, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, device,
        k.device, v.device, grad, return_lse, interpret,
    )  # fmt: skip
    if score_mod is None and sinks is None:
        return key
    mod = None
    if score_mod is not None:
        mod = score_mods.dispatch_key(score_mod)
        if mod is None:
            return None
    held = None
    if sinks is not None:
        if type(sinks) not in score_mods.PLAIN_TENSORS:
            return None
        held = (sinks.shape, sinks.dtype, sinks.device, sinks.requires_grad)
    # grad mode too: a learnable table or the sinks may ask for a backward when q, k, v do not
    return (*key, torch.is_grad_enabled(), mod, held)


def _dispatch_hit(plan, key):
    """``(impl, prepared, call)`` of a call seen before with ``key``, or None. Runs the
    per-call plan check (``check_unchanged``: the plan was not modified)."""
    if plan._cache.get(key) is None:
        return None
    plan.check_unchanged()  # may rebuild the plan's cache (then this is a miss)
    entry = plan._cache.get(key)
    if entry is None:
        return None
    impl, prepared, call, state = entry
    if state != registry.dispatch_state(impl):
        return None
    return impl, prepared, call


def _dispatch_store(plan, key, impl, prepared, call) -> None:
    state = registry.dispatch_state(impl)
    if state is not None:
        if call.score_mod is not None:  # keep no modifier (nor its tensors) in the plan
            call = dataclasses.replace(call, score_mod=None)
        plan._cache[key] = (impl, prepared, call, state)


def _run(impl, q, k, v, plan, prepared, scale, call, extra=None):
    """``(out, lse)`` of inputs in the plan's (tiled) token order, with gradients; ``extra``
    holds ``score_mod`` / ``sinks`` when given (only backends with ``attend`` run them)."""
    attend = getattr(impl, "attend", None)
    if attend is not None:
        return attend(q, k, v, plan, prepared, scale, call, **(extra or {}))
    if extra:
        modified = getattr(impl, "attend_modified", None)
        if modified is None:
            raise InputError(f"backend={impl.name!r} does not run score_mod or sinks")
        return modified(q, k, v, plan, prepared, scale, call, **extra)
    if call.requires_grad:
        return BackendAttention.apply(q, k, v, impl, plan, prepared, scale)
    return impl.forward(
        q, k, v, plan, prepared, scale, **registry.forward_options(impl, call.return_lse)
    )


def explain(
    plan: MaskPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    score_mod=None,
    sinks: torch.Tensor | None = None,
) -> dict:
    """Which backend ``backend="auto"`` runs for these inputs (and ``score_mod`` / ``sinks``,
    as :func:`attention` takes them), and why.

    Returns:
        ``{"backend": name, "reason": str, "skipped": [(name, why), ...]}``: the row of
        ``kernels.registry.AUTO_TABLE`` that picked it and the backends passed over before
        it (unavailable, or not supporting the call), plus ``"shape_class"``, the plan's
        recorded shape class (what compiled graphs are specialised on besides shapes).

    Example::

        >>> cm.explain(plan, q, k, v)["backend"]
        'triton'
    """
    if isinstance(plan, torch.Tensor) and isinstance(v, MaskPlan):
        raise InputError(
            "explain takes (plan, q, k, v), the plan first (attention takes (q, k, v, plan)); "
            "got the plan last"
        )
    validate.check_tensors(q, k, v)
    validate.check_plan(q, k, plan)
    score_mod = validate.check_score_mod(score_mod, q, k, plan)
    validate.check_sinks(sinks, q)
    call = call_of(q, k, v, False, score_mod=score_mod, sinks=sinks)
    if forward_ad._current_level >= 0 and _backend_for_tangents(q, k, v, sinks, "auto") != "auto":
        info = {
            "backend": "reference",
            "reason": "an input carries a forward-mode AD tangent: only the reference "
            "propagates tangents",
            "skipped": [],
        }
    else:
        info = registry.explain_call(plan, call)
    info["shape_class"] = dict(plan.shape_class)
    return info
