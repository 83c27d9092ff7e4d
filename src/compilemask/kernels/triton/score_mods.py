"""Score modifiers and sinks inside the Triton kernels (``compilemask.score_mods``).

A modifier is a chain of up to :data:`MAX_STAGES` stages applied to the scaled score
``s = scale * q.k`` before the mask; each stage has a kind (a constexpr of the kernels,
``MOD0`` .. ``MOD3``; 0 = none, so a call without a modifier compiles the kernels exactly as
before) and reads its data from three flat buffers built by :func:`pack`:

- ``ModF`` float32: softcap's cap and its inverse, ALiBi's slopes [Hq], the relative bias of
  every head and relative position ``table[h, bucket(k - q)]`` [Hq, Nq + Nk - 1] (index
  ``k - q + Nq - 1``; one load per score), the additive bias [Bb, Hb, Nq, Nk], a custom
  modifier's aux tensor;
- ``ModI`` int32: the relative-bias bucket of every relative position (for the table's
  gradient). Buckets are computed on the host by the same torch function as the reference,
  so that kernel and oracle agree on every bucket;
- ``ModMeta`` int64 [MAX_STAGES, 8]: per stage ``[f_off, i_off, g_off, nb, stride_b,
  stride_h, learnable, 0]``.

Backward: the kernels recompute the chain with its derivatives ``d_i = d s_{i+1} / d s_i``;
``dS`` w.r.t. the scaled score is ``dS_mod * prod d_i``, and the gradient of an additive
stage's learnable value is ``dS_mod * prod_{j > i} d_j``. The dK/dV kernel, which visits every
visible pair exactly once, writes these into ``ModG`` (float32, no atomics):

- bias: ``[B, Hq, Nq, Nk]`` at ``g_off`` (one element per pair; summed over broadcast
  dimensions in torch);
- relative bias: per (batch row, query head, kv-tile) partial sums over buckets
  ``[B, Hq, Tk, NB]`` at ``g_off`` (summed over B and Tk in torch).

Sinks live in the forward's epilogue (``HAS_SINKS``): ``m = max(m, sink)``,
``l = l * 2^(m_old - m) + 2^(sink - m)`` in base 2; the backward needs nothing else (lse
includes the sink), and ``d sink_h = -sum_rows P_sink * delta`` is taken in torch from the
preprocess kernel's ``delta``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_STAGES = 4
SOFTCAP, ALIBI, RELATIVE_BIAS, BIAS, CUSTOM = 1, 2, 3, 4, 5
#: softcap through the GPU's ``tanh.approx.f32`` (one MUFU op; relative error <= 2^-10.7, the
#: precision of FlashAttention-4's softcap); :data:`SOFTCAP` is the exact formula, which the
#: interpreter runs (it has no inline PTX)
SOFTCAP_FAST = 6
_META = 8
_LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    """tanh without overflow: sign(x) * (1 - e^(-2|x|)) / (1 + e^(-2|x|)), and its series
    ``x - x^3/3 + 2x^5/15 - 17x^7/315`` below |x| = 0.1, where ``1 - e`` cancels (float32
    relative error below 6e-7 everywhere; a large cap makes every ``s / cap`` small)."""
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    t = (1.0 - e) / (1.0 + e)
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return tl.where(ax < 0.1, series, tl.where(x < 0, -t, t))


@triton.jit
def _tanh_approx(x):
    """tanh by the GPU's special-function unit (``tanh.approx.f32``)."""
    return tl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def softcap_alone(qk, scale, ModF, ModMeta):
    """A lone softcap (``MOD0 == SOFTCAP_FAST``, no other stage), folded: ``t = tanh(qk *
    (scale / cap))`` by ``tanh.approx.f32``, and the launch's ``qk_scale`` is ``cap * log2 e``
    (:func:`exp2_scale`), so that the exponent ``t * qk_scale - m`` is one FFMA: one multiply
    per score instead of three (scale, ``1 / cap``, ``cap``). Returns ``t`` (a softcap's
    derivative is ``1 - t^2``)."""
    inv_cap = tl.load(ModF + tl.load(ModMeta) + 1)
    return _tanh_approx(qk * (scale * inv_cap))


@triton.jit
def _stage(
    s, b, h, q_idx, kv_idx, Nq, Nk, ModF, ModI, ModMeta,
    KIND: tl.constexpr,
    STAGE: tl.constexpr,
    SCORE_FN: tl.constexpr,
    SCORE_DFN: tl.constexpr,
    WANT_D: tl.constexpr,
):  # fmt: skip
    """``(f(s), f'(s))`` of one stage (``f'`` only when WANT_D; 1.0 for additive stages).
    ``q_idx``, ``kv_idx``: int32 indices broadcastable to ``s``."""
    meta = ModMeta + STAGE * 8
    d = 1.0
    if KIND == 1 or KIND == 6:  # softcap: cap * tanh(s / cap); ModF holds (cap, 1 / cap)
        f = ModF + tl.load(meta)
        cap = tl.load(f)
        if KIND == 6:
            t = _tanh_approx(s * tl.load(f + 1))
        else:
            t = _tanh(s * tl.load(f + 1))
        s = cap * t
        if WANT_D:
            d = 1.0 - t * t
    elif KIND == 2:  # alibi: s + slope_h * (kv - q)
        slope = tl.load(ModF + tl.load(meta) + h)
        s = s + slope * (kv_idx - q_idx).to(tl.float32)
    elif KIND == 3:  # relative bias: s + table[h, bucket(kv - q)], gathered on the host
        n_rel = Nq + Nk - 1
        rel = kv_idx - q_idx + Nq - 1
        ok = (rel >= 0) & (rel < n_rel)
        s = s + tl.load(ModF + tl.load(meta) + h * n_rel + rel, mask=ok, other=0.0)
    elif KIND == 4:  # bias: s + bias[b, h, q, kv]
        ok = (q_idx < Nq) & (kv_idx < Nk)
        off = tl.load(meta) + b * tl.load(meta + 4) + h * tl.load(meta + 5)
        s = s + tl.load(ModF + off + q_idx.to(tl.int64) * Nk + kv_idx, mask=ok, other=0.0)
    elif KIND == 5:  # custom: SCORE_FN(s, b, h, q, kv, aux)
        aux = ModF + tl.load(meta)
        if WANT_D:
            d = SCORE_DFN(s, b, h, q_idx, kv_idx, aux)
        s = SCORE_FN(s, b, h, q_idx, kv_idx, aux)
    return s, d


@triton.jit
def apply_mods(
    s, b, h, q_idx, kv_idx, Nq, Nk, ModF, ModI, ModMeta,
    MOD0: tl.constexpr,
    MOD1: tl.constexpr,
    MOD2: tl.constexpr,
    MOD3: tl.constexpr,
    SCORE_FN: tl.constexpr,
):  # fmt: skip
    """The modified scores (forward)."""
    s, _d = _stage(
        s, b, h, q_idx, kv_idx, Nq, Nk, ModF, ModI, ModMeta, MOD0, 0, SCORE_FN, None, False
    )
    if MOD1 != 0:
        s, _d = _stage(
            s, b, h, q_idx, kv_idx, Nq, Nk, ModF, ModI, ModMeta, MOD1, 1, SCORE_FN, None, False
        )
    if MOD2 != 0:
        s, _d = _stage(
            s, b, h, q_idx, kv_idx, Nq, Nk, ModF, ModI, ModMeta, MOD2, 2, SCORE_FN, None, False
        )
    if MOD3 != 0:
        s, _d = _stage(
            s, b, h, q_idx, kv_idx, Nq, Nk, ModF, ModI, ModMeta, MOD3, 3, SCORE_FN, None, False
        )
    return s


@triton.jit
def apply_mods_bwd(
    s, b, h, q_idx, kv_idx, Nq, Nk, ModF, ModI, ModMeta,
    MOD0: tl.constexpr,
    MOD1: tl.constexpr,
    MOD2: tl.constexpr,
    MOD3: tl.constexpr,
    SCORE_FN: tl.constexpr,
    SCORE_DFN: tl.constexpr,
):  # fmt: skip
    """``(f(s), f'(s), g0, g1, g2, g3)``: the modified scores, the chain's derivative, and
    per stage i the product of the later stages' derivatives (``g_i``)."""
    s, d0 = _stage(
        s, b, h, q_idx, kv_idx, Nq, Nk, ModF, ModI, ModMeta, MOD0, 0, SCORE_FN, SCORE_DFN, True
    )
    d1 = 1.0
    d2 = 1.0
    d3 = 1.0
    if MOD1 != 0:
        s, d1 = _stage(
            s, b, h, q_idx, kv_idx, Nq, Nk, ModF, ModI, ModMeta, MOD1, 1, SCORE_FN, SCORE_DFN, True
        )
    if MOD2 != 0:
        s, d2 = _stage(
            s, b, h, q_idx, kv_idx, Nq, Nk, ModF, ModI, ModMeta, MOD2, 2, SCORE_FN, SCORE_DFN, True
        )
    if MOD3 != 0:
        s, d3 = _stage(
            s, b, h, q_idx, kv_idx, Nq, Nk, ModF, ModI, ModMeta, MOD3, 3, SCORE_FN, SCORE_DFN, True
        )
    g3 = 1.0
    g2 = d3
    g1 = d3 * d2
    g0 = g1 * d1
    return s, g0 * d0, g0, g1, g2, g3


@triton.jit
def _stage_grad(
    tbl, ds, b, h, q_idx, kv_idx, Hq, Nq, Nk, ModI, ModMeta, ModG,
    KIND: tl.constexpr,
    STAGE: tl.constexpr,
    NB_PAD: tl.constexpr,
):  # fmt: skip
    """Gradient of one stage's learnable values from ``ds`` (the gradient of the stage's
    output): bias stored per pair; relative-bias bucket sums added to ``tbl`` [NB_PAD]."""
    meta = ModMeta + STAGE * 8
    if KIND == 4:
        if tl.load(meta + 6) != 0:
            ok = (q_idx < Nq) & (kv_idx < Nk)
            row = (b * Hq + h).to(tl.int64) * Nq + q_idx
            tl.store(ModG + tl.load(meta + 2) + row * Nk + kv_idx, ds, mask=ok)
    elif KIND == 3:
        rel = kv_idx - q_idx + Nq - 1
        ok = (rel >= 0) & (rel < Nq + Nk - 1) & (q_idx < Nq) & (kv_idx < Nk)
        if tl.load(meta + 6) != 0:
            bucket = tl.load(ModI + tl.load(meta + 1) + rel, mask=ok, other=-1)
            j_lo = tl.min(tl.where(ok, bucket, 1 << 30))
            j_hi = tl.max(bucket)
            offs_j = tl.arange(0, NB_PAD)
            # only the buckets this tile meets: far from the diagonal, one or two
            for j in range(j_lo, j_hi + 1):
                part = tl.sum(tl.sum(tl.where(bucket == j, ds, 0.0), 1), 0)
                tbl = tbl + tl.where(offs_j == j, part, 0.0)
    return tbl


@triton.jit
def mod_grads(
    tbl, ds_mod, g0, g1, g2, g3, b, h, q_idx, kv_idx, Hq, Nq, Nk, ModI, ModMeta, ModG,
    MOD0: tl.constexpr,
    MOD1: tl.constexpr,
    MOD2: tl.constexpr,
    MOD3: tl.constexpr,
    NB_PAD: tl.constexpr,
):  # fmt: skip
    """Gradients of the learnable stages from ``ds_mod`` (the gradient of the modified
    scores, zero where a pair is hidden); see the module docstring."""
    tbl = _stage_grad(
        tbl, ds_mod * g0, b, h, q_idx, kv_idx, Hq, Nq, Nk, ModI, ModMeta, ModG, MOD0, 0, NB_PAD
    )
    if MOD1 != 0:
        tbl = _stage_grad(
            tbl, ds_mod * g1, b, h, q_idx, kv_idx, Hq, Nq, Nk, ModI, ModMeta, ModG, MOD1, 1, NB_PAD
        )
    if MOD2 != 0:
        tbl = _stage_grad(
            tbl, ds_mod * g2, b, h, q_idx, kv_idx, Hq, Nq, Nk, ModI, ModMeta, ModG, MOD2, 2, NB_PAD
        )
    if MOD3 != 0:
        tbl = _stage_grad(
            tbl, ds_mod * g3, b, h, q_idx, kv_idx, Hq, Nq, Nk, ModI, ModMeta, ModG, MOD3, 3, NB_PAD
        )
    return tbl


@triton.jit
def store_table_grad(
    tbl, b, h, kt, Hq, Tk, ModMeta, ModG, TABLE_STAGE: tl.constexpr, NB_PAD: tl.constexpr
):
    """Write one (batch row, head, kv-tile)'s relative-bias bucket sums (every slot is
    written by exactly one program)."""
    meta = ModMeta + TABLE_STAGE * 8
    nb = tl.load(meta + 3)
    offs_j = tl.arange(0, NB_PAD)
    base = tl.load(meta + 2) + ((b * Hq + h).to(tl.int64) * Tk + kt) * nb
    tl.store(ModG + base + offs_j, tbl, mask=offs_j < nb)


@triton.jit
def add_sink(m_i, l_i, acc, Sinks, h):
    """Fold the head's sink logit into the running max / sum (base 2) and rescale ``acc``."""
    sink = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.math.exp2(sink - m_new)
    return m_new, l_i, acc * alpha[:, None]


# ---------------------------------------------------------------------------------- host side
class Packed:
    """What the kernels read for one modifier: ``kinds`` (the MOD0..MOD3 constexprs),
    ``score_fn`` / ``score_dfn`` (a custom stage's functions), the flat buffers ``f`` (float32),
    ``i`` (int32), ``meta`` (int64 [4, 8]), the relative-bias stage index ``table_stage`` (or
    -1), its bucket count ``nb``, and the learnable stages ``learn`` (stage index -> the
    user's tensor)."""

    def __init__(self, kinds, score_fn, score_dfn, f, i, meta, table_stage, nb, learn):
        self.kinds, self.score_fn, self.score_dfn = kinds, score_fn, score_dfn
        self.f, self.i, self.meta = f, i, meta
        self.table_stage, self.nb, self.learn = table_stage, nb, learn

    @property
    def table_learnable(self) -> bool:
        return self.table_stage in self.learn

    @property
    def nb_pad(self) -> int:
        return max(triton.next_power_of_2(max(self.nb, 1)), 16)

    def grad_buffer(self, B: int, Hq: int, Nq: int, Nk: int, Tk: int) -> torch.Tensor:
        """Zeroed ``ModG`` with every learnable stage's slots; sets the stages' ``g_off``."""
        off = 0
        meta = self.meta.clone()
        for stage, (kind, _t) in self.learn.items():
            meta[stage, 2] = off
            meta[stage, 6] = 1
            off += B * Hq * (Tk * self.nb if kind == RELATIVE_BIAS else Nq * Nk)
        self.bwd_meta = meta.to(self.f.device)
        self.grad_shapes = (B, Hq, Nq, Nk, Tk)
        return torch.zeros(max(off, 1), dtype=torch.float32, device=self.f.device)

    def table_grads(self, g: torch.Tensor) -> list[torch.Tensor]:
        """The gradients of the learnable tensors (in ``learn``'s order) from ``ModG``."""
        B, Hq, Nq, Nk, Tk = self.grad_shapes
        grads = []
        for stage, (kind, t) in self.learn.items():
            off = int(self.bwd_meta[stage, 2])
            if kind == RELATIVE_BIAS:
                part = g[off : off + B * Hq * Tk * self.nb].view(B, Hq, Tk, self.nb)
                grads.append(part.sum((0, 2)).to(t.dtype))
            else:  # bias [Bb, Hb, Nq, Nk]
                full = g[off : off + B * Hq * Nq * Nk].view(B, Hq, Nq, Nk)
                dims = tuple(d for d in (0, 1) if t.shape[d] == 1 and full.shape[d] != 1)
                grads.append((full.sum(dims, keepdim=True) if dims else full).to(t.dtype))
        return grads


def pack(mod, Nq: int, Nk: int, device, fast_tanh: bool | None = None) -> Packed:
    """Flatten the stages of ``mod`` (a ``compilemask.score_mods`` modifier) into buffers.
    ``fast_tanh``: softcap through ``tanh.approx.f32`` (:data:`SOFTCAP_FAST`); default: on
    CUDA devices (compiled kernels), not in the interpreter (the Triton backend passes it for
    16-bit inputs only: float32 keeps the exact formula)."""
    from ...score_mods import relative_buckets

    if fast_tanh is None:
        fast_tanh = torch.device(device).type == "cuda"

    floats, ints = [], []
    f_len = i_len = 0
    meta = torch.zeros((MAX_STAGES, _META), dtype=torch.int64)
    kinds = [0] * MAX_STAGES
    score_fn = score_dfn = None
    table_stage, nb, learn, cap = -1, 0, {}, 0.0
    for n, st in enumerate(mod.stages()):
        kinds[n] = SOFTCAP_FAST if st.kind == SOFTCAP and fast_tanh else st.kind
        meta[n, 0] = f_len
        if st.kind == SOFTCAP:
            data = torch.tensor([st.cap, 1.0 / st.cap], dtype=torch.float32)
            cap = float(data[0])  # the float32 cap, as the kernels see it
        elif st.kind == ALIBI:
            data = st.slopes.detach().reshape(-1)
        elif st.kind == RELATIVE_BIAS:
            lut = relative_buckets(
                torch.arange(-(Nq - 1), Nk, device=device), st.num_buckets, st.max_distance,
                st.bidirectional,
            ).to(torch.int32)  # fmt: skip
            data = st.table.detach().to(torch.float32)[:, lut.long()].reshape(-1)
            meta[n, 1] = i_len
            meta[n, 3] = st.num_buckets
            ints.append(lut)
            i_len += lut.numel()
            table_stage, nb = n, st.num_buckets
        elif st.kind == BIAS:
            t = st.tensor.detach()
            data = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
            meta[n, 4] = t.shape[1] * Nq * Nk if t.shape[0] > 1 else 0
            meta[n, 5] = Nq * Nk if t.shape[1] > 1 else 0
        else:  # CUSTOM
            score_fn, score_dfn = st.triton_fn, st.triton_grad_fn
            data = st.aux.detach().reshape(-1) if st.aux is not None else torch.zeros(1)
        t = st.learnable_tensor()
        if t is not None and t.requires_grad:
            learn[n] = (st.kind, t)
        floats.append(data.to(device=device, dtype=torch.float32))
        f_len += data.numel()
    f = torch.cat(floats) if floats else torch.zeros(1, device=device)
    i = torch.cat(ints) if ints else torch.zeros(1, dtype=torch.int32, device=device)
    packed = Packed(
        tuple(kinds), score_fn, score_dfn, f, i, meta.to(device), table_stage, nb, learn
    )
    packed.cap = cap  # a softcap stage's cap (the last one), for exp2_scale
    return packed


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``d sink_h = -sum over (b, rows) of exp(sink_h - lse) * delta`` (lse includes the
    sink; ``delta = rowsum(dO * O) - dlse``)."""
    p_sink = torch.exp(sinks.detach().float()[None, :, None] - lse)
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)


def exp2_scale(scale: float, mods: Packed | None) -> float:
    """``qk_scale`` of a launch, the factor of the kernels' exponent: without a modifier the
    kernels take ``exp2(qk * scale * log2 e)`` (the scale folded into the exponent); with one
    they compute ``s = scale * qk``, modify it and take ``exp2(s * log2 e)``; a lone fast
    softcap (:func:`softcap_alone`) gives ``t = tanh(s / cap)`` and ``exp2(t * cap * log2 e)``."""
    if mods is None:
        return scale * _LOG2E
    if mods.kinds == (SOFTCAP_FAST, 0, 0, 0):
        return mods.cap * _LOG2E
    return _LOG2E


def natural_scale_args(scale: float, mods: Packed | None) -> tuple[float, float]:
    """``(sm_scale, qk_scale)`` of a forward launch (:func:`exp2_scale`)."""
    return scale, exp2_scale(scale, mods)
