"""The systems ``compilemask bench`` runs side by side (ours and the peers), the benchmark case
and its shapes. Every system says whether it runs here (and why not), whether it applies to a
case, and how to prepare it; :mod:`compilemask.tools.bench` checks and times them.

Legend: B batch rows, H heads (Hq = Hkv), N tokens per row, D head_dim; BHSD = [B, H, N, D]
(ours, Flex, SDPA), BSHD = [B, N, H, D] (cuDNN-frontend, FA4).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import workloads as wl
from ..compiler.pipeline import compile as compile_mask
from ..compiler.plan import MaskPlan
from .bench_report import Shape

DTYPE = torch.bfloat16
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
HEADS = 16
HEAD_DIM = 128
CHECK_HEADS = 2  # the float64 check runs on the first heads (16 do not fit at 32K)
REFERENCE_MAX_N = 4096  # compilemask-reference is timed only up to this many tokens per row
#: ``CM_BENCH_DEVICE=cpu`` runs the whole loop on the CPU at a toy shape (2 heads, head_dim
#: 32, float32; CPU timer) so the machinery can be tested without a GPU; its numbers mean nothing.
SMOKE_ENV = "CM_BENCH_DEVICE"


def case_options() -> dict:
    """``make_case`` keywords: the benchmark's shape on CUDA, or the CPU smoke shape."""
    if os.environ.get(SMOKE_ENV) == "cpu":
        return {"device": "cpu", "heads": 2, "head_dim": 32, "dtype": torch.float32}
    return {}


# ------------------------------------------------------------------------------ one case


@dataclass
class Case:
    """One seed workload at one size on the GPU: plan, inputs (BHSD, no grad) and caches.

    Attributes:
        workload: the :class:`~compilemask.workloads.Workload`.
        plan: its :class:`MaskPlan` on CUDA (broadcast over B and heads).
        q, k, v, dout: bf16 [B, H, N, D], random normal, shared by every system.
        pairs: visible (q, k) pairs of one row-mask (the work of docs/workloads.md's TFLOP/s).
        cache: per-case objects systems share (Flex's BlockMask, the references).
    """

    workload: wl.Workload
    plan: MaskPlan
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    pairs: float
    cache: dict = field(default_factory=dict)

    @property
    def shape(self) -> Shape:
        w = self.workload
        B, H, _, D = self.q.shape
        return Shape(w.name, w.N0, w.N, B, H, self.k.shape[1], D, DTYPE_NAMES[self.q.dtype])

    @property
    def device(self) -> torch.device:
        return self.q.device


def visible_pairs(plan: MaskPlan) -> float:
    """Visible (q, k) pairs of one row-mask (averaged over the plan's masks)."""
    if plan.encoding == "intervals":
        total = (plan.row_hi - plan.row_lo).clamp(min=0).sum(dtype=torch.int64)
    else:
        total = plan.schedule.pairs.sum(dtype=torch.int64)
    return float(total) / plan.num_masks


def make_case(
    name: str,
    N0: int,
    *,
    device: str = "cuda",
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    dtype: torch.dtype = DTYPE,
    seed: int = 0,
) -> Case:
    """Compile workload ``name`` at ``N0`` on ``device`` and draw its inputs (seeded; the
    benchmark uses the defaults: 16 heads, head_dim 128, bf16, CUDA)."""
    w = wl.workload(name, N0)
    plan = compile_mask(w.mask, w.N, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (w.B, heads, w.N, head_dim)
    q, k, v, dout = (torch.randn(shape, device=device, dtype=dtype, generator=g) for _ in range(4))
    return Case(w, plan, q, k, v, dout, visible_pairs(plan))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------ systems


@dataclass
class Runner:
    """A prepared system: ``fn()`` runs one forward and returns its output.

    ``leaves`` are the q, k, v tensors ``fn`` reads (requiring grad in ``fwd+bwd``), ``dout``
    the output gradient, both in the system's layout (``bshd``: [B, N, H, D], else BHSD) and
    token order (``order``: row ``i`` holds original token ``order[i]``, as in a model that
    keeps its tokens in a ``tile_grid`` order; None: the original order).
    """

    fn: Callable[[], torch.Tensor]
    leaves: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    dout: torch.Tensor
    bshd: bool = False
    order: torch.Tensor | None = None

    def to_bhsd(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (an output or gradient of ``fn``) as BHSD in the original token order."""
        t = t.transpose(1, 2) if self.bshd else t
        return t if self.order is None else t.index_select(2, torch.argsort(self.order))


@dataclass(frozen=True)
class System:
    """One contender.

    Attributes:
        name: the ``system`` of the results rows.
        available: ``() -> (ok, reason)``: imports and hardware.
        prepare: ``(case, grad) -> Runner``; building plans and compiling happen here (and in
            the first call), never inside the timed loop.
        applies: ``(workload name, N) -> (ok, reason)``: whether it runs this case.
        supports_bwd: whether ``fwd+bwd`` is measured.
        score_mod: None, or the name of a :data:`SCORE_MODS` entry the system applies (its
            output is checked against the reference with the same modifier).
    """

    name: str
    available: Callable[[], tuple[bool, str]]
    prepare: Callable[[Case, bool], Runner]
    applies: Callable[[str, int], tuple[bool, str]] = lambda name, n: (True, "")
    supports_bwd: bool = True
    score_mod: str | None = None


#: Logit cap of the softcap rows (Gemma 2's attention softcap).
SOFTCAP = 50.0
#: Score modifiers of the score-modifier rows: ours (``compilemask.score_mods``) and the same
#: formula as a FlexAttention ``score_mod``.
SCORE_MODS = ("softcap", "alibi")


def score_mod_of(name: str, heads: int, device, first: int | None = None):
    """Our modifier ``name`` for ``heads`` query heads (ALiBi's slopes of ``heads`` heads,
    restricted to the ``first`` ones for the checks on the first heads)."""
    from .. import score_mods as sm

    if name == "softcap":
        return sm.softcap(SOFTCAP)
    slopes = sm.alibi_slopes(heads, device)
    return sm.alibi(slopes if first is None else slopes[:first])


def flex_score_mod(name: str, heads: int, device):
    """The same modifier as a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)``."""
    if name == "softcap":
        cap = SOFTCAP
        return lambda score, b, h, q, k: cap * torch.tanh(score / cap)
    from ..score_mods import alibi_slopes

    slopes = alibi_slopes(heads, device)
    return lambda score, b, h, q, k: score + slopes[h] * (k - q).to(score.dtype)


def _cuda() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "needs a CUDA GPU"
    return True, ""


def _imports(module: str) -> tuple[bool, str]:
    import importlib

    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - a peer may fail to import in many ways
        return False, f"{module} does not import: {type(err).__name__}: {err}"
    return True, ""


def _all(*checks: Callable[[], tuple[bool, str]]) -> Callable[[], tuple[bool, str]]:
    def check() -> tuple[bool, str]:
        for c in checks:
            ok, why = c()
            if not ok:
                return ok, why
        return True, ""

    return check


def _hopper() -> tuple[bool, str]:
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return False, f"needs sm_90 or newer, this GPU is sm_{major}{minor}"
    return True, ""


def _causal_only(name: str, n: int) -> tuple[bool, str]:
    return (name == "causal", "runs dense causal only")


def _grid_only(name: str, n: int) -> tuple[bool, str]:
    return (name == "clear", "the token-permutation pass applies to grid masks")


def _small_only(name: str, n: int) -> tuple[bool, str]:
    return (n <= REFERENCE_MAX_N, f"too slow beyond N = {REFERENCE_MAX_N}")


def _bhsd_leaves(case: Case, grad: bool):
    return tuple(t.detach().requires_grad_(grad) for t in (case.q, case.k, case.v))


def _bshd_leaves(case: Case, grad: bool):
    return tuple(
        t.detach().transpose(1, 2).contiguous().requires_grad_(grad)
        for t in (case.q, case.k, case.v)
    )


def _triton_installed() -> tuple[bool, str]:
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    return True, ""


def _triton_ok() -> tuple[bool, str]:
    from ..kernels.triton.backend import triton_usable

    ok, why = triton_usable(torch.device("cuda"))
    return ok, why


def _compilemask(backend: str, score_mod: str | None = None) -> Callable[[Case, bool], Runner]:
    def prepare(case: Case, grad: bool) -> Runner:
        from ..api.functional import attention

        q, k, v = _bhsd_leaves(case, grad)
        plan = case.plan
        if score_mod is not None:
            mod = score_mod_of(score_mod, q.shape[1], case.device)
            return Runner(
                lambda: attention(q, k, v, plan, backend=backend, score_mod=mod),
                (q, k, v),
                case.dout,
            )
        return Runner(lambda: attention(q, k, v, plan, backend=backend), (q, k, v), case.dout)

    return prepare


#: Tiles of the token-permutation pass for grid masks (docs/design.md: 8 x 16 cells).
GRID_TILE = (8, 16)


def _compilemask_tiled(backend: str, keep_tiled: bool = False) -> Callable[[Case, bool], Runner]:
    """``backend`` on ``tile_grid(mask, GRID_TILE)``: the compiler pass reorders the grid's
    tokens; q, k, v and the output stay in the original order (attention permutes them).
    ``keep_tiled``: q, k, v, dout are given in the tiled order (permuted once, outside the
    timing, as a model that keeps its tokens tiled) and run on ``plan.in_permuted_order()``."""

    def prepare(case: Case, grad: bool) -> Runner:
        from ..api.functional import attention
        from ..masks import tile_grid

        if "tiled_plan" not in case.cache:
            w = case.workload
            case.cache["tiled_plan"] = compile_mask(
                tile_grid(w.mask, GRID_TILE), w.N, device=case.device
            )
        plan = case.cache["tiled_plan"]
        q, k, v = _bhsd_leaves(case, grad)
        if keep_tiled:
            perm, kept = plan.permutation, plan.in_permuted_order()
            q, k, v = (t.detach().index_select(2, perm).requires_grad_(grad) for t in (q, k, v))
            return Runner(
                lambda: attention(q, k, v, kept, backend=backend),
                (q, k, v),
                case.dout.index_select(2, perm),
                order=perm,
            )
        return Runner(lambda: attention(q, k, v, plan, backend=backend), (q, k, v), case.dout)

    return prepare


def _backend_ok(name: str) -> Callable[[], tuple[bool, str]]:
    """Whether the registered backend ``name`` runs here (its own reason when not)."""

    def check() -> tuple[bool, str]:
        from ..kernels import registry

        return registry.get(name).available()

    return check


_FLEX: dict = {}


def _flex_compiled():
    """``torch.compile(flex_attention, dynamic=False)``, once per process, with the recompile
    limits raised (otherwise Flex falls back to a slow eager path after 8 recompiles)."""
    if "fn" not in _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        cfg = torch._dynamo.config
        for name, value in (("recompile_limit", 1000), ("accumulated_recompile_limit", 10000)):
            if hasattr(cfg, name):
                setattr(cfg, name, value)
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def flex_block_mask(case: Case):
    """Flex's BlockMask of the case (the natural ``mask_mod``, B = H = None), built once."""
    if "block_mask" not in case.cache:
        from torch.nn.attention.flex_attention import create_block_mask

        from .peers import flex_mask_mod

        mm = flex_mask_mod(case.workload.mask, case.device)
        n = case.workload.N
        case.cache["block_mask"] = create_block_mask(mm, None, None, n, n, device=case.device)
    return case.cache["block_mask"]


def _flex(
    kernel_options: dict | None, score_mod: str | None = None
) -> Callable[[Case, bool], Runner]:
    def prepare(case: Case, grad: bool) -> Runner:
        flex = _flex_compiled()
        bm = flex_block_mask(case)
        q, k, v = _bhsd_leaves(case, grad)
        if score_mod is not None:
            mod = flex_score_mod(score_mod, q.shape[1], case.device)
            return Runner(lambda: flex(q, k, v, score_mod=mod, block_mask=bm), (q, k, v), case.dout)
        if kernel_options:
            opts = dict(kernel_options)
            return Runner(
                lambda: flex(q, k, v, block_mask=bm, kernel_options=opts), (q, k, v), case.dout
            )
        return Runner(lambda: flex(q, k, v, block_mask=bm), (q, k, v), case.dout)

    return prepare


def _cudnn_api():
    """``(create_mask_plan, flex_attn_func)`` of cuDNN-frontend interval attention."""
    try:
        from cudnn.flex_attention import create_mask_plan, flex_attn_func
    except ImportError:
        from cudnn import create_mask_plan, flex_attn_func  # older / newer re-export
    return create_mask_plan, flex_attn_func


def _cudnn_available() -> tuple[bool, str]:
    try:
        _cudnn_api()
    except Exception as err:  # noqa: BLE001
        return False, f"cudnn.flex_attention does not import: {type(err).__name__}: {err}"
    return True, ""


def _cudnn(case: Case, grad: bool) -> Runner:
    from .peers import cudnn_endpoints

    create_mask_plan, flex_attn_func = _cudnn_api()
    q, k, v = _bshd_leaves(case, grad)
    ends = cudnn_endpoints(case.plan, case.workload.B)  # [1, nfunc, B * N] int32
    try:
        cplan = create_mask_plan(ends, q, k, v, build_backward=grad)
    except TypeError:  # a release without build_backward: it follows requires_grad
        cplan = create_mask_plan(ends, q, k, v)
    dout = case.dout.transpose(1, 2).contiguous()
    return Runner(lambda: flex_attn_func(q, k, v, mask_plan=cplan), (q, k, v), dout, bshd=True)


def _fa4(case: Case, grad: bool) -> Runner:
    from flash_attn.cute import flash_attn_func

    q, k, v = _bshd_leaves(case, grad)

    def fn():
        out = flash_attn_func(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out  # (out, lse) in the 4.0 betas

    dout = case.dout.transpose(1, 2).contiguous()
    return Runner(fn, (q, k, v), dout, bshd=True)


def _sdpa_available(backend: str) -> Callable[[], tuple[bool, str]]:
    def check() -> tuple[bool, str]:
        from torch.nn.attention import SDPBackend

        if not hasattr(SDPBackend, backend):
            return False, f"this torch has no SDPBackend.{backend}"
        if backend == "CUDNN_ATTENTION" and not torch.backends.cudnn.is_available():
            return False, "cuDNN is not available to torch"
        flash = getattr(torch.backends.cuda, "is_flash_attention_available", None)
        if backend == "FLASH_ATTENTION" and flash is not None and not flash():
            return False, "torch was built without flash attention"
        return True, ""

    return check


def _sdpa(backend: str) -> Callable[[Case, bool], Runner]:
    def prepare(case: Case, grad: bool) -> Runner:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        which = getattr(SDPBackend, backend)
        q, k, v = _bhsd_leaves(case, grad)

        def fn():
            with sdpa_kernel(which):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return Runner(fn, (q, k, v), case.dout)

    return prepare


# Probes run imports first, so a CPU machine still says which peers are missing.
_FLEX_OK = _all(lambda: _imports("torch.nn.attention.flex_attention"), _cuda)
_FA4_OK = _all(lambda: _imports("flash_attn.cute"), _cuda, _hopper)

#: Every contender, in the order it runs within a case.
SYSTEMS: tuple[System, ...] = (
    System(
        "compilemask-triton", _all(_triton_installed, _cuda, _triton_ok), _compilemask("triton")
    ),
    System(
        "compilemask-triton-tiled",
        _all(_triton_installed, _cuda, _triton_ok),
        _compilemask_tiled("triton"),
        applies=_grid_only,
    ),
    System("compilemask-cudnn", _all(_cuda, _backend_ok("cudnn")), _compilemask("cudnn")),
    System(
        "compilemask-cudnn-tiled",
        _all(_cuda, _backend_ok("cudnn")),
        _compilemask_tiled("cudnn"),
        applies=_grid_only,
    ),
    System(
        "compilemask-cudnn-tiled-kept",
        _all(_cuda, _backend_ok("cudnn")),
        _compilemask_tiled("cudnn", keep_tiled=True),
        applies=_grid_only,
    ),
    System(
        "compilemask-cudnn+triton",
        _all(_cuda, _backend_ok("cudnn+triton")),
        _compilemask("cudnn+triton"),
    ),
    System(
        "compilemask-cute+triton",
        _all(_cuda, _backend_ok("cute+triton")),
        _compilemask("cute+triton"),
    ),
    System("compilemask-fa4", _all(_cuda, _backend_ok("fa4")), _compilemask("fa4")),
    System(
        "compilemask-fa4-tiled",
        _all(_cuda, _backend_ok("fa4")),
        _compilemask_tiled("fa4"),
        applies=_grid_only,
    ),
    System(
        "compilemask-cute",
        _all(_cuda, _backend_ok("cute")),
        _compilemask("cute"),
        supports_bwd=False,
    ),
    System(
        "compilemask-cute-tiled",
        _all(_cuda, _backend_ok("cute")),
        _compilemask_tiled("cute"),
        applies=_grid_only,
        supports_bwd=False,
    ),
    System(
        "compilemask-cute-tiled-kept",
        _all(_cuda, _backend_ok("cute")),
        _compilemask_tiled("cute", keep_tiled=True),
        applies=_grid_only,
        supports_bwd=False,
    ),
    System("compilemask-auto", _cuda, _compilemask("auto")),
    System("compilemask-auto-tiled", _cuda, _compilemask_tiled("auto"), applies=_grid_only),
    System(
        "compilemask-auto-tiled-kept",
        _cuda,
        _compilemask_tiled("auto", keep_tiled=True),
        applies=_grid_only,
    ),
    System("flex-triton", _FLEX_OK, _flex(None)),
    System("flex-fa4", _all(_FA4_OK, _FLEX_OK), _flex({"BACKEND": "FLASH"})),
    System("cudnn-fe", _all(_cudnn_available, _cuda, _hopper), _cudnn),
    System("fa4", _FA4_OK, _fa4, applies=_causal_only),
    System(
        "sdpa-cudnn",
        _all(_sdpa_available("CUDNN_ATTENTION"), _cuda),
        _sdpa("CUDNN_ATTENTION"),
        applies=_causal_only,
    ),
    System(
        "sdpa-flash",
        _all(_sdpa_available("FLASH_ATTENTION"), _cuda),
        _sdpa("FLASH_ATTENTION"),
        applies=_causal_only,
    ),
    *(
        System(name, ok, prepare, score_mod=mod)
        for mod in SCORE_MODS
        for name, ok, prepare in (
            (
                f"compilemask-triton-{mod}",
                _all(_triton_installed, _cuda, _triton_ok),
                _compilemask("triton", mod),
            ),
            (f"flex-triton-{mod}", _FLEX_OK, _flex(None, mod)),
        )
    ),
    System(
        "compilemask-fa4-softcap",
        _all(_cuda, _backend_ok("fa4")),
        _compilemask("fa4", "softcap"),
        score_mod="softcap",
    ),
    *(
        System(
            f"compilemask-cute-{mod}",
            _all(_cuda, _backend_ok("cute")),
            _compilemask("cute", mod),
            supports_bwd=False,
            score_mod=mod,
        )
        for mod in ("softcap", "alibi")
    ),
    *(
        System(
            f"compilemask-cute+triton-{mod}",
            _all(_cuda, _backend_ok("cute+triton")),
            _compilemask("cute+triton", mod),
            score_mod=mod,
        )
        for mod in ("softcap", "alibi")
    ),
    System(
        "compilemask-reference", lambda: (True, ""), _compilemask("reference"), applies=_small_only
    ),
)
SYSTEM_NAMES = tuple(s.name for s in SYSTEMS)


def availability(systems: tuple[System, ...] = SYSTEMS) -> dict[str, tuple[bool, str]]:
    """``{name: (ok, reason)}``: which systems import and run on this machine, and why not."""
    out = {}
    for s in systems:
        try:
            out[s.name] = s.available()
        except Exception as err:  # noqa: BLE001 - a probe must not stop the run
            out[s.name] = (False, f"{type(err).__name__}: {err}")
    return out
