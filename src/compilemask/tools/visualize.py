"""Pictures of a compiled mask and its tiles, and the numbers the CLI prints about a plan.

:func:`plot_mask` draws, side by side, the mask (which keys each query row sees) and the tile
classes of the plan's tiling (FULL / PARTIAL / EMPTY). Large masks are never materialised: the
picture is downsampled from the plan's row intervals chunk by chunk, each pixel showing the
fraction of visible (q, k) pairs it covers.

Legend: ``M`` = masks in the plan (batch rows x heads that differ, 1 when shared),
``Nq`` / ``Nk`` = query / key tokens, ``K`` = interval slots per row, ``Tq`` / ``Tk`` = q- / kv-
tiles. Only mask index 0 is drawn and summarised.

Example::

    >>> import compilemask as cm
    >>> from compilemask.tools.visualize import plot_mask
    >>> plan = cm.compile(cm.masks.causal(), 256, block_m=64, block_n=64)
    >>> plot_mask(plan, "out/causal.png")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

# Tile classes of TileSchedule.kind (int32 [M, Tq, Tk]).
EMPTY, FULL, PARTIAL, PARTIAL_BITS = 0, 1, 2, 3
TILE_COLOURS = {
    EMPTY: ("#ffffff", "EMPTY"),
    FULL: ("#1f4e9c", "FULL"),
    PARTIAL: ("#f39c12", "PARTIAL"),
    PARTIAL_BITS: ("#c0392b", "PARTIAL (bits)"),
}
#: What to install for pictures: matplotlib is an optional dependency (extra ``pictures``).
PICTURES_HINT = "pictures need matplotlib: pip install 'compilemask[pictures]'"
DENSE_MAX_TOK = 2048  # at or below this many tokens per axis the picture uses plan.to_dense()
_CHUNK_ELEMENTS = 1 << 22  # bound on the [pixel rows, Nk] temporaries of the downsampling


def plan_lengths(plan) -> tuple[int, int]:
    """``(Nq, Nk)`` of a plan."""
    nq = _first_attr(plan, ("q_len", "Nq", "n_q"))
    nk = _first_attr(plan, ("kv_len", "Nk", "n_k"))
    if nq is None:
        nq = int(plan.row_lo.shape[-2])
    if nk is None:
        nk = int(plan.to_dense().shape[-1])
    return int(nq), int(nk)


def summarize(plan, block_m: int | None = None, block_n: int | None = None) -> dict:
    """Numbers about mask index 0 of ``plan``, computed from its intervals and tiles.

    Args:
        plan: a ``MaskPlan``.
        block_m, block_n: the tiling to classify (default: the plan's own).

    Returns:
        A dict with ``Nq, Nk, visible`` (visible pairs), ``density`` (visible / (Nq * Nk)),
        ``intervals_max`` / ``intervals_mean`` (non-empty intervals per row), ``block_m, block_n,
        tiles_full, tiles_partial, tiles_empty`` and ``tile_efficiency`` (visible pairs / pairs
        in the tiles the kernel touches, FULL + PARTIAL), ``plan_bytes``.
    """
    nq, nk = plan_lengths(plan)
    bm = block_m or plan.block_m
    bn = block_n or plan.block_n
    sched = plan.tiles(bm, bn)
    visible = int(sched.pairs[0].sum())  # both encodings (intervals or bitmasks)
    per_row = plan.row_runs[0] if plan.encoding == "bits" else plan.row_count[0]
    kind = sched.kind[0]
    full = int((kind == FULL).sum())
    partial = int((kind >= PARTIAL).sum())
    touched_pairs = _touched_pairs(kind, bm, bn, nq, nk)
    return {
        "Nq": nq,
        "Nk": nk,
        "visible": visible,
        "density": visible / (nq * nk),
        "intervals_max": int(per_row.max()) if per_row.numel() else 0,
        "intervals_mean": float(per_row.float().mean()) if per_row.numel() else 0.0,
        "block_m": bm,
        "block_n": bn,
        "tiles_full": full,
        "tiles_partial": partial,
        "tiles_empty": int(kind.numel()) - full - partial,
        "tile_efficiency": visible / touched_pairs if touched_pairs else 1.0,
        "plan_bytes": int(getattr(plan, "nbytes", 0)),
    }


def coverage_image(
    row_lo: torch.Tensor, row_hi: torch.Tensor, kv_len: int, max_pixels: int = 1024
) -> torch.Tensor:
    """Downsample one mask given as row intervals to at most ``max_pixels`` per axis.

    Args:
        row_lo, row_hi: int ``[Nq, K]``, half-open key intervals ``[lo, hi)`` per row (empty
            slots have ``hi <= lo``).
        kv_len: ``Nk``.
        max_pixels: the largest picture side.

    Returns:
        float32 ``[Pq, Pk]`` with ``Pq = min(Nq, max_pixels)``, ``Pk = min(Nk, max_pixels)``: the
        fraction of visible pairs in each pixel. Time O(Nq * K + Pq * Nk), memory bounded (pixel
        rows in chunks); no ``Nq x Nk`` tensor is built.
    """
    nq = row_lo.shape[0]
    pq, pk = min(nq, max_pixels), min(kv_len, max_pixels)
    edges = torch.linspace(0, kv_len, pk + 1, dtype=torch.float64).round().long()  # [Pk + 1]
    row_bin = torch.arange(nq) * pq // nq  # [Nq], non-decreasing
    img = torch.zeros(pq, pk, dtype=torch.float64)
    width = kv_len + 1
    step = max(1, _CHUNK_ELEMENTS // width)  # pixel rows per chunk
    for p0 in range(0, pq, step):
        p1 = min(pq, p0 + step)
        r0, r1 = (int(x) for x in torch.searchsorted(row_bin, torch.tensor([p0, p1])))
        lo = row_lo[r0:r1].long()  # [R, K]
        hi = row_hi[r0:r1].long()
        valid = hi > lo
        pix = (row_bin[r0:r1] - p0).view(-1, 1).expand_as(lo)[valid]
        # starts - ends per (pixel row, key): its prefix sum counts the intervals covering a key
        diff = torch.zeros((p1 - p0) * width, dtype=torch.int64)
        ones = torch.ones(int(valid.sum()), dtype=torch.int64)
        diff.index_add_(0, pix * width + lo[valid], ones)
        diff.index_add_(0, pix * width + hi[valid], -ones)
        per_key = diff.view(p1 - p0, width).cumsum(1)[:, :kv_len]  # [P, Nk]
        below = torch.nn.functional.pad(per_key.cumsum(1), (1, 0))  # [P, Nk + 1]: keys < x
        img[p0:p1] = (below[:, edges[1:]] - below[:, edges[:-1]]).double()
    rows_per_pixel = torch.bincount(row_bin, minlength=pq).double().view(-1, 1)
    cols_per_pixel = (edges[1:] - edges[:-1]).double().view(1, -1)
    return (img / (rows_per_pixel * cols_per_pixel)).float()


def mask_image(plan, max_pixels: int = 1024) -> torch.Tensor:
    """Picture of mask index 0: ``plan.to_dense()`` when both sides are at most 2048 tokens,
    else :func:`coverage_image` of the plan's intervals. float32 in [0, 1]."""
    nq, nk = plan_lengths(plan)
    if nq <= DENSE_MAX_TOK and nk <= DENSE_MAX_TOK:
        dense = plan.to_dense()
        while dense.dim() > 2:
            dense = dense[0]
        return dense.float()
    return coverage_image(plan.row_lo[0], plan.row_hi[0], nk, max_pixels)


def have_matplotlib() -> bool:
    """True when matplotlib (the extra ``pictures``) is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def plot_mask(plan, path, *, max_pixels: int = 1024, title: str | None = None) -> Path:
    """Write a PNG of mask index 0 of ``plan`` beside its tile classes.

    Args:
        plan: a ``MaskPlan``.
        path: where to write the PNG (parent folders are created).
        max_pixels: the largest side of the mask picture (large masks are downsampled).
        title: the mask text to show (truncated); default ``plan.source``.

    Returns:
        The path written.

    Raises:
        ModuleNotFoundError: matplotlib is not installed (message: :data:`PICTURES_HINT`).
    """
    if not have_matplotlib():
        raise ModuleNotFoundError(PICTURES_HINT, name="matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    info = summarize(plan)
    nq, nk = info["Nq"], info["Nk"]
    if title is None:
        title = getattr(plan, "source", None)
    title = " ".join((title or "mask").split())
    if len(title) > 90:
        title = title[:87] + "..."

    fig, (ax_mask, ax_tiles) = plt.subplots(1, 2, figsize=(13, 6.5))
    ax_mask.imshow(
        mask_image(plan, max_pixels).numpy(),
        cmap="Greys",
        vmin=0.0,
        vmax=1.0,
        interpolation="nearest",
        extent=(0, nk, nq, 0),
        aspect="auto",
    )
    which = ""
    if plan.num_masks > 1:  # per-head / per-batch plans: the picture shows the first mask
        which = f" - mask 0 of {plan.num_masks} (batch row 0, head 0)"
    ax_mask.set_title("visible pairs (dark = visible)" + which)
    ax_mask.set_xlabel("key k")
    ax_mask.set_ylabel("query q")

    kind = plan.tiles(info["block_m"], info["block_n"]).kind[0].cpu().numpy()
    cmap = ListedColormap([TILE_COLOURS[c][0] for c in sorted(TILE_COLOURS)])
    ax_tiles.imshow(
        kind,
        cmap=cmap,
        vmin=-0.5,
        vmax=len(TILE_COLOURS) - 0.5,
        interpolation="nearest",
        aspect="auto",
    )
    ax_tiles.set_title(f"tiles {info['block_m']}x{info['block_n']}")
    ax_tiles.set_xlabel("kv-tile")
    ax_tiles.set_ylabel("q-tile")
    from matplotlib.ticker import MaxNLocator

    ax_tiles.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax_tiles.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    present = sorted({int(c) for c in kind.flat} | {EMPTY, FULL, PARTIAL})
    ax_tiles.legend(
        handles=[
            Patch(facecolor=TILE_COLOURS[c][0], edgecolor="black", label=TILE_COLOURS[c][1])
            for c in present
        ],
        loc="upper right",
        fontsize=8,
    )
    fig.suptitle(
        f"{title}\nNq={nq} Nk={nk}  density={info['density']:.4f}"
        f"{f' (mask 0 of {plan.num_masks})' if plan.num_masks > 1 else ''}  "
        f"FULL={info['tiles_full']} PARTIAL={info['tiles_partial']} "
        f"EMPTY={info['tiles_empty']}  tile efficiency={info['tile_efficiency']:.3f}",
        fontsize=10,
    )
    fig.tight_layout()
    path = Path(path)
    if not path.suffix:  # matplotlib would add ".png" itself; say the name it really gets
        path = path.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _touched_pairs(kind: torch.Tensor, bm: int, bn: int, nq: int, nk: int) -> int:
    """(q, k) pairs inside the FULL and PARTIAL tiles, edge tiles clipped to the axes."""
    tq, tk = kind.shape
    rows = (torch.clamp(nq - torch.arange(tq) * bm, 0, bm)).view(-1, 1)
    cols = (torch.clamp(nk - torch.arange(tk) * bn, 0, bn)).view(1, -1)
    return int(((kind != EMPTY).long() * rows * cols).sum())


def _first_attr(obj, names):
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int):
            return value
    return None
