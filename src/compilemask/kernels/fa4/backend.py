"""``backend="fa4"``: CompileMask plans run on FlashAttention-4's block-sparse kernels.

The kernels are ``flash_attn.cute`` (package ``flash-attn-4``, CuTe DSL; imported lazily,
inside the methods). What they read and return (from the 4.0.0b36 sources):

- Mask: ``block_sparse_tensors`` (``BlockSparseTensorsTorch``: per q-block the PARTIAL
  ("mask") and FULL kv-blocks, counts ``[B, H, Tq]`` and indices ``[B, H, Tq, Tk]``) for the
  forward, the transposed lists for the backward, at ``128 x 128`` token blocks (sm90, head_dim
  64 and 128: the forward tile; the backward runs 64-row tiles at head_dim 128, two per block,
  and 128-row tiles at 64). FULL blocks run
  without a mask; every element of a PARTIAL block goes through a CuTe ``mask_mod`` reading
  ``aux_tensors`` (:mod:`.mask_mod`: a lookup in the tile bitmasks of :mod:`.lower`). Blocks
  not listed are skipped. Broadcast batch / head dims are passed with stride 0.
- Layout: BSHD ``q [B, Nq, Hq, D]``, ``k, v [B, Nk, Hkv, D]`` (a transpose view of our
  ``[B, H, N, D]`` is passed as it is; FlashAttention copies only tensors whose last dim is
  strided). GQA: ``Hq % Hkv == 0``, called with ``pack_gqa=False`` (the masks are indexed by
  query head). ``Nq != Nk``: supported.
- ``flash_attn_func(..., return_lse=True)`` returns ``out [B, Nq, Hq, D]`` and ``lse`` fp32
  ``[B, Hq, Nq]``, natural log; a row whose sum is zero gets ``lse = -inf`` and ``out = 0``
  from the kernel's softmax finalisation.
- Backward: ``flash_attn_func`` is an autograd Function whose backward calls
  ``flash_attn.cute.interface._flash_attn_bwd(q, k, v, out, dout, lse, ...)``.
  :meth:`Fa4Backend.backward` calls that function directly with the saved ``out`` and ``lse``
  (the same kernels, no graph kept between the calls); :meth:`available` checks it exists.
- Score modifiers and sinks: a lone :func:`~compilemask.score_mods.softcap` runs as
  FlashAttention's ``softcap`` (``cap * tanh(s / cap)`` of the scaled score, forward and
  backward), ``sinks`` [Hq] as its ``learnable_sink`` (natural-log logits added to each row's
  denominator; lse includes them; a row that sees no key gets out 0 and lse = sink; the
  gradient ``dsinks`` comes from the backward). Other modifiers and ``Dv != Dqk`` are refused.
- Plans that are exactly causal or a causal sliding window (``q_len == kv_len``, no batch or
  head dependence, no permutation) run FlashAttention-4's own ``causal`` / ``window_size``
  kernels instead, with no tile lists or ``mask_mod`` (:mod:`.native`: the compiler's name
  for the plan selects it, its intervals are checked once with one host read).
- KV caches (decode): plans of ``causal()`` / ``sliding_window(w)`` built by ``step_plan``
  with the new rows at the end of each cache run FlashAttention-4's paged kernel
  (:mod:`.paged`).
- Costs paid once: the lowering per plan (cached on the plan; two host reads, see
  :mod:`.lower`); FlashAttention JIT-compiles each kernel configuration on first use (seconds;
  cached by FlashAttention in the process).
"""

from __future__ import annotations

import functools
import importlib.metadata

import torch

from ...compiler.plan import MaskPlan
from ...errors import CompileMaskError
from ..interface import (
    plain_attention_reason,
    plan_fit_reason,
    same_device,
    softcap_of,
    under_compile_reason,
)
from .lower import BLOCK, Fa4Blocks, lower
from .native import Fa4Native, native_form

INSTALL_HINT = "install compilemask[fa4] (flash-attn-4>=4.0.0b36)"
_DTYPES = (torch.float16, torch.bfloat16)
#: head dims whose sm90 kernel tiles equal the 128-token sparse block, forward and backward
HEAD_DIMS = (64, 128)
UNDER_COMPILE = under_compile_reason("fa4")


@functools.cache
def _availability() -> tuple[bool, str]:
    try:
        importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        no_gpu = "" if torch.cuda.is_available() else "it needs a CUDA sm90 GPU, none here; "
        return False, no_gpu + INSTALL_HINT
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch  # noqa: F401
        from flash_attn.cute.interface import _flash_attn_bwd  # noqa: F401
    except ImportError as exc:
        return False, f"flash_attn.cute does not import ({exc}): {INSTALL_HINT}"
    except Exception as exc:  # CUDA / CuTe DSL libraries missing or broken
        return False, f"flash_attn.cute does not load ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return False, "flash_attn.cute needs a CUDA GPU"
    major, _ = torch.cuda.get_device_capability()
    if major != 9:
        return False, f"the fa4 backend runs FlashAttention-4's sm90 kernels, not sm{major}x"
    return True, ""


def _sparse(lists, batch: int, heads: int, block: int):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    def full_shape(t):
        return t.expand(batch, heads, *t.shape[2:])

    return BlockSparseTensorsTorch(
        mask_block_cnt=full_shape(lists.mask_cnt),
        mask_block_idx=full_shape(lists.mask_idx),
        full_block_cnt=full_shape(lists.full_cnt),
        full_block_idx=full_shape(lists.full_idx),
        block_size=(block, block),
    )


class Fa4Backend:
    """CompileMask plans on FlashAttention-4 (see the module docstring).

    Example::

        >>> be = Fa4Backend()
        >>> ok, why = be.available()  # (False, "install compilemask[fa4] ...") without it
    """

    name = "fa4"

    def available(self) -> tuple[bool, str]:
        """(True, "") when ``flash_attn.cute`` imports and an sm90 GPU is present."""
        if torch.compiler.is_compiling():
            return False, UNDER_COMPILE
        return _availability()

    #: the paged path checks page ids and cache lengths on the device (NaN rows, :mod:`.paged`)
    checks_cache_values = True

    def decode_supports(self, call) -> tuple[bool, str]:
        """Whether FlashAttention-4's paged kernel runs this cache call (``DecodeCall``):
        decode plans of ``causal()`` / ``sliding_window(w)``, bottom-right (:mod:`.paged`)."""
        from .paged import decode_reason

        why = decode_reason(call)
        return not why, why

    def decode(self, q, k_cache, v_cache, call, scale: float):
        """``(out, lse)`` over a paged cache: FlashAttention-4's paged causal / sliding-window
        kernel (:func:`.paged.decode`)."""
        from .paged import decode

        return decode(q, k_cache, v_cache, call, scale)

    def dispatch_token(self):
        """What ``supports`` and ``prepare`` read beyond the plan and the call
        (``registry.dispatch_state``): nothing (availability is probed once per process), so
        ``compilemask.attention`` keeps a call's checks and preparation per call signature."""
        return ()

    def supports(self, plan: MaskPlan, call) -> tuple[bool, str]:
        """Whether FlashAttention-4 runs this call; (False, reason) otherwise."""
        why = plain_attention_reason(call, "fa4", softcap_and_sinks=True)
        if why:
            return False, why
        if call.return_lse and call.requires_grad:
            return False, 'no gradient through lse on fa4: call without return_lse, or use "triton"'
        if call.device.type != "cuda":
            return False, f"fa4 runs on CUDA tensors, not {call.device.type}"
        if call.dtype not in _DTYPES:
            return False, f"fa4 runs float16 / bfloat16, not {call.dtype}"
        if call.head_dim not in HEAD_DIMS:
            return False, (
                f"fa4 runs head_dim {' and '.join(map(str, HEAD_DIMS))} here (its block-sparse "
                f"kernels need {BLOCK}-key tiles), not {call.head_dim}"
            )
        why = plan_fit_reason(plan, call)
        if why:
            return False, why
        return True, ""

    def prepare(self, plan: MaskPlan, call) -> Fa4Blocks | Fa4Native:
        """:class:`.native.Fa4Native` for plans FlashAttention runs as plain causal or sliding
        window attention (:func:`.native.native_form`), else the block lists and tile bitmasks
        of :func:`.lower.lower`; built once per plan and cached on it (shared by every call
        shape: batch and heads broadcast at the call)."""
        if not same_device(plan.device, call.device):
            raise CompileMaskError(f"the plan is on {plan.device}, the tensors on {call.device}")
        return plan.cached(("fa4", BLOCK), lambda: native_form(plan) or lower(plan, BLOCK))

    @staticmethod
    def _aux(blocks: Fa4Blocks, batch: int, heads: int) -> list[torch.Tensor]:
        index = blocks.tile_index.expand(batch, heads, *blocks.tile_index.shape[2:])
        return [index, blocks.bits]

    def forward(
        self, q, k, v, plan: MaskPlan, blocks: Fa4Blocks | Fa4Native, scale: float, need_lse=True,
        softcap: float | None = None, sinks: torch.Tensor | None = None,
    ):  # fmt: skip
        """``(out [B, Hq, Nq, D], lse fp32 [B, Hq, Nq])``; ``out`` is a transpose view;
        ``need_lse=False`` asks FlashAttention for no lse (None is returned). ``softcap``: the
        cap of a softcap modifier; ``sinks``: float32 [Hq] sink logits (lse includes them)."""
        from flash_attn.cute import flash_attn_func

        from .mask_mod import plan_bits_mask_mod

        B, Hq = q.shape[:2]
        if isinstance(blocks, Fa4Native):  # FlashAttention's own causal / window path
            mask = blocks.flash_args()
        else:
            mask = dict(
                pack_gqa=False, mask_mod=plan_bits_mask_mod(),
                aux_tensors=self._aux(blocks, B, Hq),
                block_sparse_tensors=_sparse(blocks.forward, B, Hq, blocks.block),
            )  # fmt: skip
        with torch.no_grad():
            out, lse = flash_attn_func(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                return_lse=need_lse, softcap=softcap or 0.0, learnable_sink=sinks, **mask,
            )  # fmt: skip
        return out.transpose(1, 2), (lse if need_lse else None)

    def backward(
        self, q, k, v, out, lse, dout, plan: MaskPlan, blocks: Fa4Blocks | Fa4Native, scale: float,
        softcap: float | None = None, sinks: torch.Tensor | None = None,
    ):  # fmt: skip
        """``(dq, dk, dv)`` in the shapes of q, k, v, from the forward's ``out`` and ``lse``;
        with ``sinks``, ``(dq, dk, dv, dsinks)``."""
        from flash_attn.cute.interface import _flash_attn_bwd

        from .mask_mod import plan_bits_mask_mod

        B, Hq = q.shape[:2]
        qb, kb, vb, ob, dob = (t.transpose(1, 2) for t in (q, k, v, out, dout))
        dob = dob if dob.stride(-1) == 1 else dob.contiguous()
        if isinstance(blocks, Fa4Native):
            mask = blocks.bwd_args()
        else:
            mask = dict(
                mask_mod=plan_bits_mask_mod(), aux_tensors=self._aux(blocks, B, Hq),
                block_sparse_tensors=_sparse(blocks.backward, B, Hq, blocks.block),
            )  # fmt: skip
        with torch.no_grad():
            grads = _flash_attn_bwd(
                qb, kb, vb, ob, dob, lse.contiguous(), softmax_scale=scale,
                softcap=softcap or 0.0, learnable_sink=sinks, **mask,
            )  # fmt: skip
        dq, dk, dv = (g.transpose(1, 2) for g in grads[:3])
        return (dq, dk, dv) if sinks is None else (dq, dk, dv, grads[3])

    def attend(
        self, q, k, v, plan: MaskPlan, blocks: Fa4Blocks | Fa4Native, scale: float, call, *,
        score_mod=None, sinks=None,
    ):  # fmt: skip
        """``(out, lse)`` with gradients to q, k, v and ``sinks``; ``score_mod`` is a lone
        softcap (``supports`` refuses the others). ``lse`` is None when the call neither
        returns it nor runs a backward."""
        cap = softcap_of(score_mod) if score_mod is not None else None
        sinks32 = None if sinks is None else sinks.to(torch.float32)
        if not call.requires_grad:
            return self.forward(
                q, k, v, plan, blocks, scale, need_lse=call.return_lse, softcap=cap,
                sinks=None if sinks32 is None else sinks32.detach(),
            )  # fmt: skip
        return _Fa4Attention.apply(q, k, v, sinks32, self, plan, blocks, scale, cap)


class _Fa4Attention(torch.autograd.Function):
    """``(out, lse)`` of :meth:`Fa4Backend.forward`; gradients to q, k, v and the sinks from
    :meth:`Fa4Backend.backward` (through ``out``: no gradient of ``lse``)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, backend, plan, blocks, scale, softcap):
        out, lse = backend.forward(q, k, v, plan, blocks, scale, softcap=softcap, sinks=sinks)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (backend, plan, blocks, scale, softcap)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dlse is not None:
            raise CompileMaskError(
                'backend="fa4" has no gradient through lse; use the output only or '
                'backend="reference"'
            )
        if dout is None:
            return (None,) * 9
        q, k, v, out, lse, sinks = ctx.saved_tensors
        backend, plan, blocks, scale, softcap = ctx.args
        grads = backend.backward(
            q, k, v, out, lse, dout, plan, blocks, scale, softcap=softcap, sinks=sinks
        )
        dsinks = grads[3] if sinks is not None and ctx.needs_input_grad[3] else None
        return (*grads[:3], dsinks, None, None, None, None, None)
