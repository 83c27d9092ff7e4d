"""attention-gym mask_mods whose rows are piecewise affine, recognised by their trace and built
from a host piece table (``pieces.py``: on a GPU the rows and the schedule in one launch).

A form is a template mask_mod whose integer constants are parameters. A traced mask_mod is
that form when its graph is the template's node for node (the same operations on the same
operands, in the same order; ``b`` and ``h`` unused but in ``fa4_document``; tensors read
only where the template reads its own, :data:`TENSOR_FORMS`) and its constants bind the
parameters consistently (one value per parameter; every other constant equal, of the same
type): it then computes the template's function of those parameters and tensors, and the
rows below are that function's. Forms (``S``, ``B``, ``P``, ``C``, ``F``, ``W`` Python ints):

* ``jetspec_training(P, B)`` (``P >= 0``, ``B >= 1``): ``(kv < P) | (kv >= P) & (q // B ==
  (kv - P) // B) & ((kv - P) % B <= q % B)``: row ``q`` sees ``[0, P)`` and
  ``[P + q // B * B, P + q + 1)``; one piece per block of ``B`` rows.
* ``block_diffusion(S, B)`` (``S, B >= 1``, ``q_len, kv_len <= 2S``: the keys' ``% S`` then
  folds once): a noised row ``q < S`` of block ``p = q // B`` sees its block of the noised
  half ``[pB, min(pB + B, S))`` and the clean blocks before it ``[S, S + pB)``; a clean row of
  block ``p = (q - S) // B`` sees ``[S, S + pB + B)``; one piece per block.
* ``sta_2d`` (sliding tile attention on a canvas of tiles of ``T`` tokens, ``CTW`` tiles a
  row, a vision part of ``V`` tokens then text up to ``E``): a vision row of query tile ``t``
  sees the vision keys of the tiles in rows ``[c_h - LH, c_h + RH]`` and columns ``[c_w -
  LW, c_w + RW]`` (``c_h = clamp(t // CTW, LH, HH)``, ``c_w = clamp(t % CTW, LW, HW)``,
  columns inside ``[0, CTW)``): one interval per tile row, and the text ``[V, E)``; a text
  row sees ``[0, E)``; one piece per query tile (``T, CTW >= 1``, radii ``>= 0``, ``LH <=
  HH``, ``LW <= HW``, ``V >= 0``, at most ``MAX_RAW - 1`` tile rows).
* Sparse VideoGen's spatial union ``(kv < C) | (q < P) | (|q - kv| < W)`` (``svg_spatial``,
  with or without the sink frame: ``C = P`` or ``P + frame``): rows ``q < P`` see every key,
  the others ``[0, C)`` and ``[q - W + 1, q + W)``.
* Sparse VideoGen's temporal mask ``(kv < P) | (q < P) | (|(q - P) % F - (kv - P) % F| <
  W)`` (``P >= 0``, ``F, W >= 1``): rows ``q < P`` see every key, the others ``[0, P)`` and
  in every key frame ``g`` the keys ``P + gF + [max(t - W + 1, 0), min(t + W, F))`` (``t``
  the row's position in its frame); three pieces per query frame (at the two clamps), at
  most ``MAX_RAW - 1`` key frames.
* ``flamingo(intervals, T)`` (``interval = intervals[bounds[kv]]``, ``(q >= interval[0]) &
  (q < interval[1])``; ``bounds`` 1-D integer covering the keys, ``intervals`` integer
  ``[I, >= 2]``): key ``kv`` is seen by the rows of its image's range; one read of both
  tables, one piece between consecutive range ends.
* FlashAttention-4's ``doc[b, h, q] == doc[b, h, kv]`` (a 3-D integer table, rows
  non-decreasing, ``q_len == kv_len``): every ``(b, h)`` part a document mask, the parts'
  rows one after another in one table; one read of ``doc[:B, :H, :N]``.

Tables of the pure forms are kept per (form, parameters, lengths) (:data:`MAX_TABLES`, least
recently made dropped first); those of :data:`TENSOR_FORMS` are read and made on every call,
their plans kept by the table's values. Anything else: None (recognise's forms and the
lifting apply).
"""

from __future__ import annotations

import logging
import threading
import weakref

import numpy as np
import torch

from . import packed, pieces, plan_cache
from .packed import NoForm

log = logging.getLogger("compilemask.migrate")

MAX_TABLES = 32
_SENTINEL = 7_919_000_000_000  # parameter i of a template is traced as _SENTINEL + i


def _jetspec_training(P, B):
    def fn(b, h, q_idx, kv_idx):
        kv_rel = kv_idx - P
        same = (kv_idx >= P) & (q_idx // B == kv_rel // B)
        return (kv_idx < P) | (same & (kv_rel % B <= q_idx % B))

    return fn


def _block_diffusion(S, B):
    def fn(b, h, q_idx, kv_idx):
        q_noised, kv_noised = q_idx < S, kv_idx < S
        q_block = (q_idx % S) // B
        kv_block = (kv_idx % S) // B
        diag = (q_block == kv_block) & (q_noised == kv_noised)
        offset_causal = (q_block > kv_block) & q_noised & ~kv_noised
        block_causal = (q_block >= kv_block) & ~q_noised & ~kv_noised
        return diag | offset_causal | block_causal

    return fn


def _svg_spatial(C, P, W):
    def fn(b, h, q_idx, kv_idx):
        return (kv_idx < C) | (q_idx < P) | (torch.abs(q_idx - kv_idx) < W)

    return fn


def _sta_2d(T, CTW, LH, HH, LW, HW, RH, RW, V, E):
    def fn(b, h, q_idx, kv_idx):
        qt, kt = q_idx // T, kv_idx // T
        c_h = (qt // CTW).clamp(LH, HH)
        c_w = (qt % CTW).clamp(LW, HW)
        hm = (kt // CTW >= c_h - LH) & (kt // CTW <= c_h + RH)
        wm = (kt % CTW >= c_w - LW) & (kt % CTW <= c_w + RW)
        vis = (q_idx < V) & (kv_idx < V)
        v2t = (q_idx < V) & (kv_idx >= V) & (kv_idx < E)
        t2a = (q_idx >= V) & (kv_idx < E)
        return (vis & hm & wm) | v2t | t2a

    return fn


def _svg_temporal(P, F, W):
    def fn(b, h, q_idx, kv_idx):
        qt = (q_idx - P) % F
        kt = (kv_idx - P) % F
        return (kv_idx < P) | (q_idx < P) | (torch.abs(qt - kt) < W)

    return fn


def _flamingo(bounds, intervals):
    def fn(b, h, q_idx, kv_idx):
        interval = intervals[bounds[kv_idx]]
        return (q_idx >= interval[0]) & (q_idx < interval[1])

    return fn


def _fa4_document(doc):
    return lambda b, h, q_idx, kv_idx: doc[b, h, q_idx] == doc[b, h, kv_idx]


def _rows_jetspec(nq: int, nk: int, P: int, B: int):
    if P < 0 or B < 1:
        raise NoForm("jetspec_training with a negative prefix or a block below 1")
    s = np.arange(0, nq, B, dtype=np.int64)
    e = np.minimum(s + B, nq)
    z, one = np.zeros_like(s), np.ones_like(s)
    la, lb = np.stack([z, z], 1), np.stack([z, P + s], 1)
    ha, hb = np.stack([z, one], 1), np.stack([z + P, z + P + 1], 1)
    return s, e, la, lb, ha, hb


def _rows_block_diffusion(nq: int, nk: int, S: int, B: int):
    if S < 1 or B < 1 or max(nq, nk) > 2 * S:
        raise NoForm("block_diffusion with lengths past twice the noised half")
    p = np.arange(0, S, B, dtype=np.int64)  # block starts inside a half
    z = np.zeros_like(p)
    noised = (p, np.minimum(p + B, S), [z, z], [p, z + S], [z, z], [np.minimum(p + B, S), S + p])
    clean = (S + p, np.minimum(S + p + B, 2 * S), [z, z], [z + S, z], [z, z], [S + p + B, z])
    s, e, la, lb, ha, hb = (np.concatenate([np.asarray(x), np.asarray(y)], -1)
                            for x, y in zip(noised, clean))  # fmt: skip
    la, lb, ha, hb = (x.T for x in (la, lb, ha, hb))
    keep = s < nq  # the pieces of the rows there are
    s, e, la, lb, ha, hb = (x[keep] for x in (s, e, la, lb, ha, hb))
    return s, np.minimum(e, nq), la, lb, ha, hb


def _rows_svg_spatial(nq: int, nk: int, C: int, P: int, W: int):
    p = min(max(P, 0), nq)
    s = np.array([0, p], np.int64)
    e = np.array([p, nq], np.int64)
    la = np.array([[0, 0], [0, 1]], np.int64)
    lb = np.array([[0, 0], [0, 1 - W]], np.int64)
    ha = np.array([[0, 0], [0, 1]], np.int64)
    hb = np.array([[nk, 0], [C, W]], np.int64)
    return s, e, la, lb, ha, hb


def _rows_sta_2d(nq: int, nk: int, T, CTW, LH, HH, LW, HW, RH, RW, V, E):
    if T < 1 or CTW < 1 or min(LH, RH, LW, RW) < 0 or LH > HH or LW > HW or V < 0:
        raise NoForm("sta_2d with a tile, width, radius or clamp out of range")
    rows = LH + RH + 1
    if rows + 1 > pieces.MAX_RAW:
        raise NoForm("sta_2d with a window of more tile rows than a piece table holds")
    vis = min(V, nq)
    s = np.arange(0, vis, T, dtype=np.int64)  # the query tiles of the vision rows
    qt = s // T
    c_h = np.clip(qt // CTW, LH, HH)
    c_w = np.clip(qt % CTW, LW, HW)
    x0, x1 = np.maximum(c_w - LW, 0), np.minimum(c_w + RW, CTW - 1) + 1  # key tile columns
    ky = c_h[:, None] - LH + np.arange(rows)  # the window's key tile rows
    lo = np.minimum((ky * CTW + x0[:, None]) * T, V)  # keys of those tiles below V
    hi = np.where((x1 > x0)[:, None], np.minimum((ky * CTW + x1[:, None]) * T, V), lo)
    lb = np.concatenate([lo, np.full((len(s), 1), V)], 1)  # and the text [V, E)
    hb = np.concatenate([hi, np.full((len(s), 1), E)], 1)
    s = np.append(s, vis)
    e = np.append(np.minimum(s[1:], vis), nq)
    lb = np.concatenate([lb, [[0] * (rows + 1)]])  # text rows: [0, E)
    hb = np.concatenate([hb, [[E] + [0] * rows]])
    z = np.zeros_like(lb)
    return s, e, z, lb, z, hb


def _rows_svg_temporal(nq: int, nk: int, P: int, F: int, W: int):
    if P < 0 or F < 1 or W < 1:
        raise NoForm("svg_temporal with a negative prompt, or a frame or width below 1")
    g = np.arange(max(0, -(-(nk - P) // F)), dtype=np.int64)  # the key frames
    if len(g) + 1 > pieces.MAX_RAW:
        raise NoForm("svg_temporal with more key frames than a piece table holds")
    p = min(P, nq)
    h = np.arange(max(0, -(-(nq - p) // F)), dtype=np.int64)  # the query frames
    if not len(h):  # prompt rows only
        return [0], [nq], [[0]], [[0]], [[0]], [[nk]]
    # each query frame in three parts at the clamps of [qt - W + 1, qt + W) to [0, F)
    c = sorted((min(max(W - 1, 0), F), min(max(F - W + 1, 0), F)))
    c0 = np.array([0, *c], np.int64)
    s = (P + h[:, None] * F + c0).reshape(-1)
    e = np.append(s[1:], P + len(h) * F)
    s, e = np.minimum(s, nq), np.minimum(e, nq)
    hh = np.repeat(h, 3)[:, None]
    lo_free = np.tile(c0 >= W - 1, len(h))[:, None]  # lo = qt - W + 1 (else 0)
    hi_free = np.tile(c0 < F - W + 1, len(h))[:, None]  # hi = qt + W (else F)
    shift = (g[None, :] - hh) * F  # key frame g seen from query frame h
    one = np.ones_like(shift)
    la, lb = np.where(lo_free, one, 0), np.where(lo_free, shift - W + 1, P + g * F)
    ha, hb = np.where(hi_free, one, 0), np.where(hi_free, shift + W, P + g * F + F)
    first = np.zeros((len(s), 1), np.int64)  # [0, P)
    la, ha = np.concatenate([first, la], 1), np.concatenate([first, ha], 1)
    lb, hb = np.concatenate([first, lb], 1), np.concatenate([first + P, hb], 1)
    full = np.zeros((1, la.shape[1]), np.int64)  # prompt rows: [0, nk)
    hb0 = full.copy()
    hb0[0, 0] = nk
    la, lb, ha = (np.concatenate([full, x]) for x in (la, lb, ha))
    return np.append(0, s), np.append(p, e), la, lb, ha, np.concatenate([hb0, hb])


def _rows_flamingo(nq: int, nk: int, batch, heads, bounds, intervals):
    """Key ``kv`` is seen by the rows ``[intervals[bounds[kv], 0], intervals[bounds[kv], 1])``
    (FlexAttention's scalar indexing; negative ids from the end). One host read."""
    if not packed.readable(bounds, nk) or bounds.dtype not in (torch.int32, torch.int64):
        raise NoForm("flamingo's bounds not a 1-D int32 / int64 table covering the keys")
    n = intervals.shape[0] if intervals.dim() == 2 else 0
    if intervals.dtype not in packed._INT_DTYPES or n < 1 or intervals.shape[1] < 2:
        raise NoForm("flamingo's intervals not an integer [images, >= 2] table")
    if bounds.device != intervals.device or bounds.device.type == "meta":
        raise NoForm("flamingo's tables on two devices")
    host = torch.cat([bounds[:nk].to(torch.int64),
                      intervals[:, :2].reshape(-1).to(torch.int64)]).to("cpu").numpy()  # fmt: skip
    ids, iv = host[:nk], host[nk:].reshape(n, 2)
    if ids.min() < -n or ids.max() >= n:
        raise NoForm("flamingo's bounds index past its intervals")
    qlo, qhi = iv[ids % n, 0], iv[ids % n, 1]
    # keys in runs of one row range; rows in pieces where no range starts or ends
    new = np.flatnonzero(np.concatenate([[True], (qlo[1:] != qlo[:-1]) | (qhi[1:] != qhi[:-1])]))
    kv0, kv1 = new, np.append(new[1:], nk)
    rlo, rhi = qlo[new], qhi[new]
    cuts = np.unique(np.concatenate([[0], np.clip(np.concatenate([rlo, rhi]), 0, nq)]))
    s = cuts[cuts < nq]
    if len(s) * len(new) > 1 << 24:
        raise NoForm("flamingo with too many pieces and key runs")
    on = (rlo[None, :] <= s[:, None]) & (s[:, None] < rhi[None, :])  # [pieces, key runs]
    edge = np.diff(np.pad(on, ((0, 0), (1, 1))).astype(np.int8), axis=1)
    ps, rs = np.nonzero(edge == 1)  # a run of seen key runs starts (row-major: by piece)
    pe, re_ = np.nonzero(edge == -1)
    count = np.bincount(ps, minlength=len(s))
    j = max(1, int(count.max()) if len(ps) else 1)
    if j > pieces.MAX_RAW:
        raise NoForm("flamingo rows of more key intervals than a piece table holds")
    slot = np.arange(len(ps)) - np.repeat(np.cumsum(count) - count, count)
    lb, hb = np.zeros((len(s), j), np.int64), np.zeros((len(s), j), np.int64)
    lb[ps, slot], hb[pe, slot] = kv0[rs], kv1[re_ - 1]
    z = np.zeros_like(lb)
    return (s, np.append(s[1:], nq), z, lb, z, hb), 1, None, None


def _rows_fa4_document(nq: int, nk: int, batch, heads, doc, doc_kv):
    """FlashAttention-4's documents per batch row and head: part ``(b, h)`` (``b`` over
    ``range(batch or 1)``, ``h`` likewise) of a 3-D integer table whose rows hold
    non-decreasing ids (``q_len == kv_len``): row ``q`` sees its run of equal ids. The parts
    as consecutive blocks of ``q_len`` virtual rows. The steps between ids are signed on the
    table's device and read as one byte per row (one host read)."""
    nb, nh = batch or 1, heads or 1
    if doc is not doc_kv or nq != nk or doc.dim() != 3 or doc.device.type == "meta":
        raise NoForm("per-part documents of two tables, unequal lengths or no 3-D table")
    if doc.dtype not in packed._INT_DTYPES or doc.shape[0] < nb or doc.shape[1] < nh:
        raise NoForm("per-part documents of a non-integer table or one too small")
    if doc.shape[2] < nq or nb * nh * nq > pieces.I32_LIMIT:
        raise NoForm("per-part documents of a table too short or too many rows")
    ids = doc[:nb, :nh, :nq].reshape(nb * nh, nq).to(torch.int64)  # steps without wrapping
    # the sign of each step, a byte per row, read in one copy
    step = (ids[:, 1:] - ids[:, :-1]).clamp_(-1, 1).to(torch.int8).to("cpu").numpy()
    if (step < 0).any():
        raise NoForm("per-part document ids not non-decreasing")
    flag = np.ones(ids.shape, bool)
    flag[:, 1:] = step != 0
    s = np.flatnonzero(flag)  # virtual rows where a run starts (every part starts one)
    e = np.append(s[1:], ids.numel())
    lo = s % nq
    hi = lo + (e - s)
    z = np.zeros((len(s), 1), np.int64)
    return (s, e, z, lo[:, None], z, hi[:, None]), nb * nh, batch, heads


# name -> (template, parameter count, rows(nq, nk, *params))
FORMS = {
    "jetspec_training": (_jetspec_training, 2, _rows_jetspec),
    "block_diffusion": (_block_diffusion, 2, _rows_block_diffusion),
    "svg_spatial": (_svg_spatial, 3, _rows_svg_spatial),
    "sta_2d": (_sta_2d, 10, _rows_sta_2d),
    "svg_temporal": (_svg_temporal, 3, _rows_svg_temporal),
}
# forms reading captured tensors: name -> (template of stand-in tensors, tensors it takes,
# rows(nq, nk, batch, heads, *tensors) -> (raw pieces over M * nq virtual rows, M, the plan's
# batch, heads)); their tables are read on every call, their plans kept by the table's values
TENSOR_FORMS = {
    "flamingo": (_flamingo, 2, _rows_flamingo),
    "fa4_document": (_fa4_document, 1, _rows_fa4_document),
}

_LOCK = threading.Lock()
_TEMPLATES: dict[str, list] = {}
_MATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph -> (name, params)
_TABLES: dict[tuple, pieces.Table] = {}


def _template(name: str) -> list:
    nodes = _TEMPLATES.get(name)
    if nodes is None:
        import torch.fx

        if name in FORMS:
            make, n, _ = FORMS[name]
            fn = make(*(_SENTINEL + i for i in range(n)))
        else:
            make, n, _ = TENSOR_FORMS[name]
            fn = make(*(torch.zeros(2, 2, 2, dtype=torch.int64) for _ in range(n)))
        nodes = _TEMPLATES[name] = list(torch.fx.symbolic_trace(fn).graph.nodes)
    return nodes


def _same(t, u, where: dict, params: dict) -> bool:
    """Whether the template argument ``t`` is the traced argument ``u`` (nodes at the same
    positions, parameters bound consistently in ``params``, other constants equal)."""
    if isinstance(t, torch.fx.Node):
        return isinstance(u, torch.fx.Node) and where.get(t) == where.get(u, -1)
    if isinstance(t, (tuple, list)):
        return (
            type(t) is type(u)
            and len(t) == len(u)
            and all(_same(x, y, where, params) for x, y in zip(t, u))
        )
    if isinstance(t, dict):
        return (
            isinstance(u, dict)
            and t.keys() == u.keys()
            and all(_same(t[k], u[k], where, params) for k in t)
        )
    if type(t) is int and t >= _SENTINEL:
        if type(u) is not int:
            return False
        return params.setdefault(t - _SENTINEL, u) == u
    return type(t) is type(u) and t == u


def _match(graph) -> tuple | None:
    import torch.fx  # noqa: F401 - torch.fx.Node in _same

    user = list(graph.nodes)
    for name in (*FORMS, *TENSOR_FORMS):
        tpl = _template(name)
        if len(tpl) != len(user):
            continue
        where = {}
        for i, (t, u) in enumerate(zip(tpl, user)):
            where[t], where[u] = i, i
        params: dict = {}
        if all(
            t.op == u.op
            and (t.op in ("placeholder", "get_attr") or t.target == u.target)
            and _same(t.args, u.args, where, params)
            and _same(dict(t.kwargs), dict(u.kwargs), where, params)
            for t, u in zip(tpl, user)
        ):
            if name in TENSOR_FORMS:  # the captured tensors, in the order they are read
                return name, tuple(u.target for u in user if u.op == "get_attr")
            return name, tuple(params[i] for i in range(FORMS[name][1]))
    return None


def match(gm) -> tuple | None:
    """``(form name, parameters)`` of the traced mask_mod ``gm`` (kept per graph; for a form
    of :data:`TENSOR_FORMS` the ``get_attr`` targets of its tensors), or None."""
    graph = gm.graph
    with _LOCK:
        if graph in _MATCHES:
            return _MATCHES[graph]
    found = _match(graph)
    with _LOCK:
        _MATCHES[graph] = found
    return found


def table(name: str, params: tuple, q_len: int, kv_len: int) -> pieces.Table:
    """The canonical piece table of form ``name`` at these lengths (kept).

    Raises:
        NoForm: parameters or lengths outside the form's conditions.
    """
    key = (name, params, q_len, kv_len)
    with _LOCK:
        hit = _TABLES.get(key)
    if hit is not None:
        return hit
    rows = FORMS[name][2](q_len, kv_len, *params)
    made = pieces.canonical(*rows, q_len, kv_len)
    with _LOCK:
        if len(_TABLES) >= MAX_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = made
    return made


def recognised_plan(gm, q_len, kv_len, batch, heads, block_m, block_n, device, cache: bool):
    """The plan of ``gm`` when it is one of the forms (``source == "from_mask_mod:lifted"``;
    broadcast over batch and heads but for ``fa4_document``), else None. ``cache``: keep /
    reuse the plan of a form reading tensors by its raw pieces, i.e. the values read
    (``plan_cache``); the others are kept by ``from_mask_mod`` under the mask_mod's
    structure."""
    found = match(gm)
    if found is None:
        return None
    name, params = found
    m, nb, nh, key = 1, None, None, None
    try:
        if name in TENSOR_FORMS:
            tensors = (getattr(gm, target) for target in params)
            rows, m, nb, nh = TENSOR_FORMS[name][2](q_len, kv_len, batch, heads, *tensors)
            if cache:
                raw = b"".join(np.ascontiguousarray(x, np.int64).tobytes() for x in rows)
                key = ("pieces", name, raw, m, nb, nh, q_len, kv_len, block_m, block_n,
                       str(device))  # fmt: skip
                hit = plan_cache.get_recognised(key)
                if hit is not None:
                    return hit
            t = pieces.canonical(*rows, m * q_len, kv_len)
        else:
            t = table(name, params, q_len, kv_len)
    except NoForm as exc:
        log.debug("mask_mod %s not built from a piece table: %s", name, exc)
        return None
    except Exception as exc:  # noqa: BLE001 - the lifting decides then
        log.info("mask_mod %s not built from a piece table: %s: %s", name,
                 type(exc).__name__, exc)  # fmt: skip
        return None
    log.debug("mask_mod recognised as %s", name)
    plan = pieces.plan_of(
        t, q_len, kv_len, block_m, block_n, device, "from_mask_mod:lifted", (m, nb, nh)
    )
    return plan if key is None else plan_cache.put_recognised(key, plan)
