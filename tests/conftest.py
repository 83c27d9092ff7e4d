"""Shared test setup: the interpreter setting, devices and dtypes, random inputs, the
correctness checks, the mask catalogues and the random-mask strategies.

* Without CUDA, ``TRITON_INTERPRET=1`` is set here, before any test module imports Triton, so
  the Triton kernels run in Triton's interpreter on CPU tensors.
* Markers: ``kernel`` (Triton kernel tests: minutes on two cores in the interpreter; the
  default run includes them, ``pytest -m "not kernel"`` is the fast tier), ``slow`` and ``gpu``
  (left out unless the ``-m`` expression names them: ``pytest -m slow``, ``pytest -m gpu``).
* Test modules import the helpers by name: ``from conftest import DEVICE, qkv, kernel_masks``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import strategies as st  # noqa: E402

import compilemask as cm  # noqa: E402
from compilemask import masks  # noqa: E402
from compilemask.errors import CompileMaskError  # noqa: E402
from compilemask.kernels.reference import (  # noqa: E402
    reference_attention,
    reference_attention_backward,
)
from compilemask.language.ast import Relation, Rule, RuleMask, Segment, Span  # noqa: E402
from compilemask.language.permutation import grid_permutation  # noqa: E402
from compilemask.testing import check_attention, check_close  # noqa: E402

# ------------------------------------------------------------------------- markers
#: Markers left out of a run whose ``-m`` expression does not name them.
OPT_IN_MARKERS = ("slow", "gpu")


def pytest_collection_modifyitems(config, items):
    expression = config.getoption("markexpr") or ""
    left_out = [m for m in OPT_IN_MARKERS if m not in expression]
    if not left_out:
        return
    keep, drop = [], []
    for item in items:
        (drop if any(item.get_closest_marker(m) for m in left_out) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# ------------------------------------------------------------------ devices and inputs
#: Where the kernel tests run: CUDA when present, else the CPU (Triton's interpreter).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: Tests of a kernel on CPU tensors (Triton's interpreter), which a CUDA machine skips.
on_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the kernel on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1)",
)
#: Kernel dtypes (the interpreter computes bf16 dots wrongly: bf16 only on CUDA).
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def qkv(B, Hq, Hkv, Nq, Nk, D, dtype, seed=0, *, grad_output=False, device=DEVICE):
    """Random ``q [B, Hq, Nq, D]``, ``k, v [B, Hkv, Nk, D]`` (and ``do`` shaped like q with
    ``grad_output``), drawn in float32 on the CPU from ``seed`` and cast to ``dtype`` on
    ``device``: the same numbers on every device."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, Hq, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)]
    if grad_output:
        shapes.append((B, Hq, Nq, D))
    return tuple(torch.randn(s, generator=g).to(dtype=dtype, device=device) for s in shapes)


# --------------------------------------------------------- checks (compilemask.testing)
def assert_attention_close(out, q, k, v, plan, scale=None):
    """``out`` passes the DESIGN.md section 3 measure against the float64 reference."""
    ok, err, bound = check_attention(out, q, k, v, plan, scale)
    assert ok, f"err {err:.3g} > bound {bound:.3g}"


def assert_lse_close(lse, q, k, v, plan, scale=None):
    """``lse`` (float32) is -inf exactly on the rows that see nothing and close to the float64
    reference elsewhere."""
    _, ref_lse = reference_attention(q, k, v, plan, scale, compute_dtype=torch.float64)
    assert lse.dtype == torch.float32
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty)
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], atol=2e-3, rtol=1e-4)


def assert_grads_close(grads, q, k, v, do, plan, *, scale=None, dlse=None):
    """``(dq, dk, dv)`` each pass the DESIGN.md section 3 measure against the float64
    reference backward (and hold no NaN: every element written)."""
    ref64 = reference_attention_backward(
        q, k, v, plan, do, scale, dlse=dlse, compute_dtype=torch.float64
    )
    ref_dt = reference_attention_backward(
        q, k, v, plan, do, scale, dlse=dlse, compute_dtype=torch.float32, matmul_dtype=q.dtype
    )
    for name, x, r64, rdt in zip(("dq", "dk", "dv"), grads, ref64, ref_dt):
        assert x.dtype == q.dtype and x.shape == r64.shape, name
        assert not torch.isnan(x).any(), f"{name} has NaN (unwritten or NaN-producing)"
        ok, err, bound = check_close(x, r64, rdt, q.dtype)
        assert ok, f"{name}: err {err:.3g} > bound {bound:.3g}"


# ------------------------------------------------------------------ mask catalogues
def kernel_masks(n: int) -> dict[str, Callable[[], cm.Mask]]:
    """The masks the kernel tests run, for ``n >= 100`` tokens (masks that fix their length
    fix it to ``n``): one interval per row, unions, documents, many intervals per tile
    (bitmask tiles) and shared prompts."""
    prompt = 22
    resp = [(n - prompt) // 3] * 2
    resp.append(n - prompt - sum(resp))
    return {
        "causal": lambda: masks.causal(),
        "window_prefix": lambda: masks.sliding_window(20) | masks.prefix_lm(5),
        "document": lambda: masks.document([30, 17, 43, n - 90]),
        "dilated_bits": lambda: masks.dilated(40, 3),  # many intervals per tile: bitmask tiles
        "shared_prompt": lambda: masks.shared_prompt(prompt, resp),
    }


#: One mask of every constructor, with ``(q_len, kv_len)`` (kv_len None: the mask's own or
#: q_len): the catalogue the compiler and the text round trip are checked on.
CATALOGUE = {
    "causal": (masks.causal(), 200, 150),
    "sliding_window": (masks.sliding_window(40), 200, 260),
    "document": (masks.document([30, 70, 100]), 200, None),
    "document_bidirectional": (masks.document([30, 70, 100], causal=False), 200, None),
    "prefix_lm": (masks.prefix_lm(300), 200, None),
    "chunked": (masks.chunked(48), 200, None),
    "block_causal": (masks.block_causal(48), 200, None),
    "shared_prompt": (masks.shared_prompt(40, [60, 60, 40]), 200, None),
    "shared_prompt_groups": (masks.shared_prompt([20, 30], [[50, 10], [40, 50]]), 200, None),
    "hstu": (masks.hstu([120, 80], [20, 1], 6), 200, None),
    "clear": (masks.clear((12, 14), 5, 32), 200, None),
    "global_local": (masks.global_local(3, [0, 99]), 200, None),
    "tree": (masks.tree([-1, 0, 0, 1, 1, 2, -1, 6], 60), 8, None),
    "natten2d": (masks.natten2d((10, 20), (3, 5)), 200, None),
    "dilated": (masks.dilated(64, 3), 200, 190),
}


# ----------------------------------------------------------------------------- strategies
@st.composite
def partition(draw, total: int, min_part: int = 1, max_parts: int = 4):
    """A list of ints >= min_part summing to total."""
    parts = []
    left = total
    while left > 0 and len(parts) < max_parts - 1:
        n = draw(st.integers(min_part, max(min_part, left)))
        if n > left:
            break
        parts.append(n)
        left -= n
    if left:
        parts.append(left)
    return parts


@st.composite
def free_masks(draw, n: int):
    """Masks that accept any length (so q_len != kv_len is allowed)."""
    return draw(
        st.one_of(
            st.just(masks.causal()),
            st.builds(masks.sliding_window, st.integers(1, n + 2)),
            st.builds(masks.prefix_lm, st.integers(0, n + 3)),
            st.builds(masks.chunked, st.integers(1, n + 1)),
            st.builds(masks.block_causal, st.integers(1, n + 1)),
            st.builds(masks.dilated, st.integers(0, n), st.integers(1, 5)),
            st.builds(
                masks.global_local,
                st.integers(0, 6),
                st.lists(st.integers(0, n - 1), max_size=3, unique=True),
            ),
            rule_masks(n, open_ended=True),
        )
    )


@st.composite
def fixed_masks(draw, n: int):
    """Masks whose layout fixes the length to n."""
    kind = draw(st.sampled_from(["document", "shared", "hstu", "clear", "natten", "rules"]))
    if kind == "document":
        return masks.document(draw(partition(n)), draw(st.booleans()))
    if kind == "shared":
        groups = draw(partition(n, 2, 3))
        prompts, resps = [], []
        for g in groups:
            p = draw(st.integers(0, g - 1))
            prompts.append(p)
            resps.append(draw(partition(g - p, 1, 4)))
        return masks.shared_prompt(prompts, resps)
    if kind == "hstu":
        users = draw(partition(n, 1, 4))
        targets = [draw(st.integers(0, u - 1)) for u in users]
        return masks.hstu(users, targets, draw(st.integers(0, 8)))
    if kind == "clear":
        h = draw(st.integers(1, max(1, n // 2)))
        w = draw(st.integers(1, max(1, n // h)))
        return masks.clear((h, w), draw(st.integers(1, 6)), n - h * w)
    if kind == "natten":
        h = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
        w = n // h
        kh = draw(st.sampled_from([k for k in range(1, h + 1, 2)]))
        kw = draw(st.sampled_from([k for k in range(1, w + 1, 2)]))
        return masks.natten2d((h, w), (kh, kw))
    return draw(rule_masks(n, open_ended=False))


RELATIONS = st.one_of(
    st.sampled_from([Relation("full"), Relation("causal"), Relation("diag")]),
    st.tuples(st.integers(-8, 4), st.integers(0, 8)).map(
        lambda t: Relation("band", (min(t), max(t)))
    ),
    st.integers(1, 9).map(lambda c: Relation("chunk", (c,))),
    st.integers(1, 5).map(lambda r: Relation("disc", (r,))),
    st.tuples(st.sampled_from([1, 3, 5]), st.sampled_from([1, 3])).map(
        lambda t: Relation("box", t)
    ),
    st.tuples(st.sampled_from([1, 3]), st.sampled_from([1, 3])).map(
        lambda t: Relation("natten", t)
    ),
)


@st.composite
def rule_masks(draw, n: int, open_ended: bool):
    names = ["a", "b", "c"][: draw(st.integers(1, 3))]
    budget = n
    layout = []
    for i, name in enumerate(names):
        last = i == len(names) - 1
        if last and open_ended:
            layout.append(Segment(name, None))
            break
        style = draw(st.sampled_from(["plain", "family", "grid"]))
        if last:
            size = budget
        else:
            size = draw(st.integers(0, budget))
        budget -= size
        if style == "family" and size >= 2:
            layout.append(Segment(name, tuple(draw(partition(size, 1, 3)))))
        elif style == "grid" and size >= 1:
            h = draw(st.sampled_from([d for d in range(1, size + 1) if size % d == 0]))
            layout.append(Segment(name, (size,), (h, size // h)))
        else:
            layout.append(Segment(name, (size,)))
    rules = []
    for _ in range(draw(st.integers(0, 3))):
        qn = draw(st.sampled_from(names + ["*"]))
        kn = draw(st.sampled_from(names + ["*"]))
        qi = draw(st.sampled_from([None, "i", 0])) if qn != "*" else None
        ki = None
        if kn != "*":
            ki = draw(st.sampled_from([None, qi if isinstance(qi, str) else None, 0]))
        q = Span((qn,), qi)
        k = Span((kn,), ki)
        if draw(st.booleans()) and len(names) > 1 and qi is None and qn != "*":
            q = Span(tuple(sorted({qn, draw(st.sampled_from(names))})), None)
        rules.append(Rule(q, k, draw(RELATIONS)))
    return RuleMask(tuple(layout), tuple(rules))


@st.composite
def cases(draw):
    """(mask, q_len, kv_len, block_m, block_n)."""
    n = draw(st.integers(1, 70))
    free = draw(st.booleans())
    gen = free_masks if free else fixed_masks
    mask = draw(gen(n))
    for _ in range(draw(st.integers(0, 2))):
        op = draw(st.sampled_from(["|", "&", "-", "head", "batch"]))
        other = draw(gen(n))
        if op == "|":
            mask = mask | other
        elif op == "&":
            mask = mask & other
        elif op == "-":
            mask = mask - other
        elif op == "head" and mask.head_count is None:
            mask = masks.per_head([mask, other])
        elif op == "batch" and mask.batch_count is None:
            mask = masks.per_batch([other, mask, other])
    kv = draw(st.integers(1, 80)) if free and draw(st.booleans()) else None
    if kv is None and draw(st.integers(0, 3)) == 0:
        try:
            grid_permutation(mask, n, (2, 3))  # the mask holds a grid: try the tiling pass
            mask = masks.tile_grid(mask, (draw(st.integers(1, 4)), draw(st.integers(1, 5))))
        except CompileMaskError:
            pass
    bm = draw(st.sampled_from([8, 16, 32]))
    bn = draw(st.sampled_from([8, 16, 32, 64]))
    return mask, n, kv, bm, bn
