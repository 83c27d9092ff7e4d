"""The ``compilemask`` command line (also ``python -m compilemask``).

Commands::

    compilemask demo   [--size N0] [--out-dir out]     compile the seed workloads, table + PNGs
    compilemask show   MASK -o out.png                 picture of the mask and its tiles
    compilemask stats  MASK                            numbers about the compiled plan
    compilemask check  MASK                            plan.to_dense() vs the dense evaluator
    compilemask bench  [--workloads ..] [--sizes ..]   GPU benchmark beside the peers (bench --help)
    compilemask bench --distributed [--time R]          context parallelism: balance, rank times

``MASK`` is a seed workload name (``causal``, ``hstu``, ``shared_prompt``, ``clear``; size from
``--size N0``, the nominal size), a path to a mask text file, or mask text itself
(``"sliding_window(128)"``); text masks take ``--q-len`` / ``--kv-len`` (default: the mask's
own length when it fixes one). User errors (bad input, a missing file, a bad option) print one
line, ``compilemask: error: ...`` (``compilemask CMD: error: ...`` for a bad option), on stderr
and exit with status 2.

Example::

    $ compilemask stats hstu --size 1024
    $ compilemask show examples/clear.txt -o out/clear.png
    $ compilemask check "document([300, 724]) | prefix_lm(16)"
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import click

from .. import __version__
from .. import workloads as wl
from ..errors import CompileMaskError, MaskSyntaxError
from ..language.ast import Mask
from . import progress

MAX_CHECK_PAIRS = 1 << 28  # `check` builds two dense masks; refuse beyond 2^28 pairs per mask
REPORT_KEYS = ("workload", "N0", "mode", "system")  # what `bench --report` needs of every row


@dataclass(frozen=True)
class MaskSpec:
    """A mask resolved from the command line, with the lengths to compile it at."""

    label: str
    mask: Mask
    q_len: int
    kv_len: int | None
    B: int | None = None  # batch rows of a seed workload (informational)


# ----------------------------------------------------------------------------------- helpers


def one_line(err: BaseException | str) -> str:
    """The message of ``err`` on one line (a syntax error keeps line, column and the text)."""
    if isinstance(err, MaskSyntaxError):  # message, the text's line, a caret under the column
        message, line = (str(err).split("\n") + ["", ""])[:2]
        return f"{message} in {line.strip()!r}" if line.strip() else message
    return " ".join(str(err).split()) or type(err).__name__


def fail(message: str, prefix: str = "compilemask") -> NoReturn:
    """Print ``<prefix>: error: <message>`` (one line) on stderr and exit with status 2."""
    click.echo(f"{prefix}: error: {message}", err=True)
    sys.exit(2)


def _os_message(err: OSError) -> str:
    if err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    return one_line(err)


def _clean_errors(fn):
    """Turn user errors (CompileMaskError, a file that cannot be read or written) into one line
    on stderr and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CompileMaskError as err:
            fail(one_line(err))
        except OSError as err:
            fail(_os_message(err))

    return wrapper


# click >= 8.2 reports a command called without arguments as a usage error holding its help
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


class _OneLineErrors(click.Group):
    """A click group whose usage errors (bad option, missing argument, unknown command) are one
    line, ``compilemask CMD: error: ...``, instead of click's usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            status = super().main(args, prog_name, complete_var, False, **extra)
        except _NO_ARGS_IS_HELP as err:  # `compilemask` alone: its help, as older click prints
            click.echo(err.ctx.get_help())
            sys.exit(0)
        except click.UsageError as err:
            where = err.ctx.command_path if err.ctx is not None else "compilemask"
            fail(f"{one_line(err.format_message())} (see {where} --help)", prefix=where)
        except click.ClickException as err:
            click.echo(f"compilemask: error: {one_line(err.format_message())}", err=True)
            sys.exit(err.exit_code)
        except click.Abort:
            click.echo("compilemask: aborted", err=True)
            sys.exit(1)
        sys.exit(status if isinstance(status, int) else 0)


def _mask_options(fn):
    fn = click.option(
        "--block-n", type=int, default=128, show_default=True, help="kv-tile size BLOCK_N (tokens)."
    )(fn)
    fn = click.option(
        "--block-m", type=int, default=128, show_default=True, help="q-tile size BLOCK_M (tokens)."
    )(fn)
    fn = click.option(
        "--size",
        "size",
        type=int,
        default=4096,
        show_default=True,
        help="Nominal size N0 of a seed workload: 1024, 4096, 16384 or 32768.",
    )(fn)
    fn = click.option(
        "--kv-len",
        type=int,
        default=None,
        help="Key length of a text mask (default: its own, else --q-len).",
    )(fn)
    fn = click.option(
        "--q-len",
        type=int,
        default=None,
        help="Query length of a text mask (default: the length it fixes).",
    )(fn)
    return click.argument("mask")(fn)


def mask_text(mask: Mask) -> str:
    """The mask as text (falls back to ``repr`` while the printer cannot print it)."""
    try:
        return str(mask)
    except Exception:  # noqa: BLE001 - a picture title must not fail on a missing printer
        return repr(mask)


def resolve_mask(spec: str, q_len: int | None, kv_len: int | None, size: int) -> MaskSpec:
    """Turn the MASK argument into a mask and its lengths (see the module docstring)."""
    path = Path(spec)
    try:
        is_file, is_dir = path.is_file(), path.is_dir()
    except OSError:  # mask text longer than a file name may be (ENAMETOOLONG)
        is_file = is_dir = False
    if spec in wl.SEED_WORKLOADS and not is_file:
        if q_len is not None or kv_len is not None:
            raise CompileMaskError(
                f"{spec} is a seed workload: its length comes from --size N0 "
                f"({', '.join(map(str, wl.NOMINAL_SIZES))}), not --q-len / --kv-len"
            )
        w = wl.workload(spec, size)
        return MaskSpec(f"{spec}@{size}", w.mask, w.N, w.N, w.B)
    if is_file:
        try:
            text, label = path.read_text(), path.name
        except UnicodeDecodeError as err:
            hint = ""
            with open(path, "rb") as f:
                if f.read(4) == b"PK\x03\x04":  # a zip archive: what torch.save writes
                    hint = (
                        "; it looks like a saved plan (plan.save / torch.save): load it with "
                        "compilemask.load_plan(path) in Python, the CLI reads mask text"
                    )
            raise CompileMaskError(
                f"MASK file {spec!r} is not UTF-8 text ({err.reason}){hint}"
            ) from None
    elif not spec.strip():
        raise CompileMaskError("MASK is empty: give a mask file, mask text or a seed workload")
    elif is_dir:
        raise CompileMaskError(f"MASK {spec!r} is a folder, not a mask file")
    elif any(c in spec for c in "(\n{") or spec.startswith("layout"):
        # a label for file names: the text's words, e.g. "document_30_34_prefix_lm_16"
        text, label = spec, re.sub(r"[^A-Za-z0-9]+", "_", spec).strip("_")[:60] or "mask"
    elif "/" in spec or path.suffix:
        raise CompileMaskError(f"MASK file {spec!r} not found")
    else:
        raise CompileMaskError(
            f"MASK {spec!r} is neither a file nor a seed workload "
            f"({', '.join(wl.SEED_WORKLOADS)}) nor mask text"
        )
    from ..language.parser import parse

    mask = parse(text)
    if q_len is None:
        q_len = _natural_q_len(mask)
        if q_len is None:
            raise CompileMaskError(f"{label} accepts any length: give --q-len")
        if q_len == 0:
            raise CompileMaskError(
                f"{label}: the mask's layout has no tokens (its parts sum to 0): give parts "
                "with lengths, e.g. 'layout p:64 r:32', or --q-len"
            )
    return MaskSpec(label, mask, q_len, kv_len)


def _natural_q_len(mask: Mask) -> int | None:
    """The query length a mask fixes by itself, or None when it accepts any."""
    from ..language.semantics import natural_lengths

    return natural_lengths(mask)[0]


def compile_spec(spec: MaskSpec, block_m: int, block_n: int, *, timed: bool = False):
    """Compile ``spec``; returns ``(plan, milliseconds)``. With ``timed``, the milliseconds are
    those of a second, warm build with the plan cache off (the first call of a process pays
    for imports and allocator warm-up); otherwise None."""
    from ..compiler.pipeline import compile as cm_compile

    kwargs = dict(
        batch=spec.mask.batch_count, heads=spec.mask.head_count, block_m=block_m, block_n=block_n
    )
    plan = cm_compile(spec.mask, spec.q_len, spec.kv_len, **kwargs)
    if not timed:
        return plan, None
    t0 = time.perf_counter()
    cm_compile(spec.mask, spec.q_len, spec.kv_len, cache=False, **kwargs)
    return plan, (time.perf_counter() - t0) * 1e3


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):  # bytes by part: the parts present
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items() if v not in (0, None))
    return str(value)


def print_table(rows: list[dict]) -> None:
    """Print dicts as an aligned text table (columns in the first row's key order)."""
    if not rows:
        return
    cols = list(rows[0])
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    click.echo("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for row in cells:
        click.echo("  ".join(v.rjust(w) for v, w in zip(row, widths)))


# ----------------------------------------------------------------------------------- commands


@click.group(
    "compilemask", cls=_OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.version_option(version=__version__, prog_name="compilemask")
def cli():
    """CompileMask: compile attention masks written as regions into per-row key intervals
    and a tile schedule."""


@cli.command()
@_mask_options
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default=None,
    help="PNG to write (default: out/<mask>.png).",
)
@click.option(
    "--max-pixels",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Largest side of the mask picture in pixels (longer masks are downsampled).",
)
@_clean_errors
def show(mask, q_len, kv_len, size, block_m, block_n, output, max_pixels):
    """Write a PNG of MASK and its tile classes (needs matplotlib: compilemask[pictures])."""
    from .visualize import PICTURES_HINT, have_matplotlib, plot_mask

    if not have_matplotlib():
        fail(PICTURES_HINT)
    if output is not None and Path(output).suffix.lower() != ".png":
        raise click.BadParameter(f"{output!r} must be a .png file", param_hint="-o/--output")
    spec = resolve_mask(mask, q_len, kv_len, size)
    plan, _ = compile_spec(spec, block_m, block_n)
    output = output or f"out/{Path(spec.label).stem.replace('@', '-')}.png"
    try:
        path = plot_mask(plan, output, max_pixels=max_pixels, title=mask_text(spec.mask))
    except OSError as err:
        fail(f"cannot write {output}: {_os_message(err)}")
    click.echo(f"wrote {path}")


@cli.command()
@_mask_options
@_clean_errors
def stats(mask, q_len, kv_len, size, block_m, block_n):
    """Print numbers about the compiled plan of MASK."""
    from .visualize import summarize

    spec = resolve_mask(mask, q_len, kv_len, size)
    plan, ms = compile_spec(spec, block_m, block_n, timed=True)
    stats_fn = getattr(plan, "stats", None)
    numbers = stats_fn() if stats_fn is not None else summarize(plan)
    info = {"mask": _short(mask_text(spec.mask)), **numbers, "compile_ms": ms}
    if isinstance(info.get("source"), str):  # the mask text again, on one line
        info["source"] = _short(info["source"])
    if spec.B is not None:
        info["B"] = spec.B
    width = max(map(len, info))
    for key, value in info.items():
        click.echo(f"{key.ljust(width)}  {_fmt(value)}")


@cli.command()
@_mask_options
@_clean_errors
def check(mask, q_len, kv_len, size, block_m, block_n):
    """Compile MASK and compare plan.to_dense() with the dense evaluator (exit 1 on mismatch)."""
    from ..language.semantics import accepted_lengths, dense

    spec = resolve_mask(mask, q_len, kv_len, size)
    nq, nk = accepted_lengths(spec.mask, spec.q_len, spec.kv_len)
    if nq * nk > MAX_CHECK_PAIRS:
        raise CompileMaskError(
            f"check builds dense masks: {nq} x {nk} is too large (at most {MAX_CHECK_PAIRS} "
            "pairs); use a smaller --size / --q-len"
        )
    plan, _ = compile_spec(spec, block_m, block_n)
    verify = getattr(plan, "verify", None)
    if verify is not None:
        verify()
    want = dense(
        spec.mask,
        spec.q_len,
        spec.kv_len,
        batch=spec.mask.batch_count,
        heads=spec.mask.head_count,
    )
    got = plan.to_dense().to(want.device)
    if got.shape != want.shape:
        click.echo(
            f"mismatch: plan.to_dense() has shape {tuple(got.shape)}, "
            f"the evaluator {tuple(want.shape)}"
        )
        sys.exit(1)
    bad = int((got != want).sum())
    if bad:
        click.echo(f"mismatch: {bad} of {want.numel()} pairs differ ({spec.label}, {nq}x{nk})")
        sys.exit(1)
    click.echo(f"OK: {spec.label} {nq}x{nk}, {int(want.sum())} visible pairs match")


@cli.command()
@click.option(
    "--size",
    type=int,
    default=4096,
    show_default=True,
    help="Nominal size N0 of the seed workloads: 1024, 4096, 16384 or 32768.",
)
@click.option(
    "--out-dir",
    type=click.Path(file_okay=False),
    default="out",
    show_default=True,
    help="Folder for the pictures.",
)
@click.option("--block-m", type=int, default=128, show_default=True)
@click.option("--block-n", type=int, default=128, show_default=True)
@click.option("--no-pictures", is_flag=True, help="Skip writing PNGs.")
@click.option("--no-attention", is_flag=True, help="Skip the attention checks.")
@_clean_errors
def demo(size, out_dir, block_m, block_n, no_pictures, no_attention):
    """Compile the four seed workloads, print a table and write their pictures (the pictures
    need matplotlib: compilemask[pictures])."""
    from .visualize import PICTURES_HINT, have_matplotlib, plot_mask, summarize

    pictures_note = None
    if not no_pictures and not have_matplotlib():
        no_pictures, pictures_note = True, f"pictures skipped: {PICTURES_HINT}"
    rows, plans = [], []
    for name in progress.progress(wl.SEED_WORKLOADS, desc="compile"):
        w = wl.workload(name, size)
        spec = MaskSpec(name, w.mask, w.N, w.N, w.B)
        plan, ms = compile_spec(spec, block_m, block_n, timed=True)
        info = summarize(plan, block_m, block_n)
        plans.append((w, plan))
        rows.append(
            {
                "workload": name,
                "N": w.N,
                "B": w.B,
                "density": info["density"],
                "ivl/row max": info["intervals_max"],
                "FULL": info["tiles_full"],
                "PARTIAL": info["tiles_partial"],
                "tile eff": info["tile_efficiency"],
                "plan KiB": round(info["plan_bytes"] / 1024, 1),
                "compile ms": round(ms, 1),
            }
        )
        if not no_pictures:
            plot_mask(plan, Path(out_dir) / f"{name}-{size}.png", title=mask_text(w.mask))
    import torch

    where = "CUDA" if torch.cuda.is_available() else "CPU"
    click.echo(
        f"seed workloads at nominal size {size} (tiles {block_m}x{block_n}, plans on the CPU, "
        f"attention on {where}):"
    )
    print_table(rows)
    if not no_pictures:
        click.echo(f"pictures in {out_dir}/")
    elif pictures_note is not None:
        click.echo(pictures_note)
    if not no_attention:
        from .demo import attention_rows

        title, results = attention_rows(size, progress.progress)
        click.echo(title)
        print_table(results)
        if any(str(r.get("check", "")).startswith("FAIL") for r in results):
            sys.exit(1)


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args):
    """Time CompileMask beside its peers on the GPU (docs/benchmarking.md); `bench --help` lists
    options; `bench --distributed` reports context parallelism's balance and per-rank times."""
    if "--distributed" in args:
        from .bench_distributed import build_parser as distributed_parser
        from .bench_distributed import main as distributed_main

        parser = distributed_parser()
        parser.error = lambda message: fail(message, prefix=parser.prog)
        parser.parse_args(list(args))
        try:
            sys.exit(distributed_main(list(args)))
        except CompileMaskError as err:
            fail(one_line(err))
    from .bench_sweep import build_parser
    from .bench_sweep import main as bench_main

    parser = build_parser()
    parser.error = lambda message: fail(message, prefix=parser.prog)  # one line, no usage block
    parsed = parser.parse_args(list(args))
    if parsed.report is not None:
        _check_report(parsed.report)
    sys.exit(bench_main(list(args)))


def _check_report(path: str) -> None:
    """Exit with one line unless ``path`` is a JSON-lines file of result rows."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as err:
        fail(f"--report {_os_message(err) if isinstance(err, OSError) else one_line(err)}")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            fail(f"--report {path}, line {i}: not JSON ({err.msg})")
        if not isinstance(row, dict):
            fail(f"--report {path}, line {i}: not a result row (a JSON object)")
        missing = [k for k in REPORT_KEYS if k not in row]
        if missing:
            fail(f"--report {path}, line {i}: not a result row (lacks {', '.join(missing)})")


# ------------------------------------------------------------------------------- entry point


def _short(text: str, n: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``compilemask``, ``python -m compilemask``)."""
    cli.main(args=argv, prog_name="compilemask")


if __name__ == "__main__":
    main()
