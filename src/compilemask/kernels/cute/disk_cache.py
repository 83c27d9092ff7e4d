"""Compiled cute kernels on disk, so that a new process loads the kernel instead of compiling it.

Mechanism (nvidia-cutlass-dsl's AOT export): after ``cute.compile`` the compiled function is
written with ``export_to_c`` (an object file holding the host launcher and the cubin; the
header it also writes is dropped), and a later process loads it with
``cutlass.cute.runtime.load_module(path)[name]``, which returns a callable taking the same
arguments as the compiled one. Loading skips both the Python tracing of the kernel and its
lowering to a cubin.

Directory: ``$COMPILEMASK_CACHE_DIR/cute`` when ``COMPILEMASK_CACHE_DIR`` is set (the values
``0``, ``off`` and the empty string turn the disk cache off), else
``$XDG_CACHE_HOME/compilemask/cute``, else ``~/.cache/compilemask/cute``.

One file per kernel, ``<name>.o`` with ``name`` from :func:`entry_name`: the head_dim, dtype,
tile, the device type of the example arguments (CUDA tensors compile to global-memory
pointers, CPU ones to generic pointers: different kernels) and a digest of what else decides
the compiled code: the source of the kernel modules (:data:`SOURCES`), the
``nvidia-cutlass-dsl`` version, the target arch (``CUTE_DSL_ARCH``), the Python version and
the host machine. A change of any of them gives a new name; stale files are never read again
(delete the directory to reclaim the space).

Writes go to a temporary folder of the cache directory and are renamed into place, so a
reader never sees a partial file and two processes compiling the same kernel both leave a
valid one. A file that does not load (truncated, another DSL build) counts as a miss: the
kernel is compiled and the file replaced. Failing to write the cache (read-only directory,
full disk) warns and goes on with the compiled kernel.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

ENV_DIR = "COMPILEMASK_CACHE_DIR"
_OFF = ("", "0", "off")
#: the modules whose source decides the compiled kernel
SOURCES = ("forward_sm90.py", "launch.py", "lower.py", "exp2.py", "disk_cache.py")
#: bump when the layout of the cache directory changes
FORMAT = 1


def cache_dir() -> Path | None:
    """The directory of the compiled kernels, or None when the disk cache is off."""
    raw = os.environ.get(ENV_DIR)
    if raw is not None:
        if raw.strip().lower() in _OFF:
            return None
        return Path(raw).expanduser() / "cute"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "compilemask" / "cute"


@functools.cache
def fingerprint() -> str:
    """Digest (hex) of the kernel sources, the DSL version, the target arch, the Python
    version and the host machine."""
    h = hashlib.sha256(f"format {FORMAT}".encode())
    here = Path(__file__).parent
    for name in SOURCES:
        h.update(name.encode())
        h.update((here / name).read_bytes())
    try:
        dsl = importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        dsl = "none"
    arch = os.environ.get("CUTE_DSL_ARCH", "")
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    h.update(f"dsl {dsl} arch {arch} python {py} {platform.machine()}".encode())
    return h.hexdigest()


def entry_name(
    head_dim: int,
    dtype_name: str,
    block_m: int,
    block_n: int,
    device_type: str,
    modifier: str = "",
) -> str:
    """The file stem and exported symbol prefix of one kernel (a C identifier), e.g.
    ``fwd_sm90_d128_bfloat16_128x128_cuda_<16 hex digits>`` (``..._softcap_cuda_...`` /
    ``..._alibi_cuda_...`` for the kernels of those score modifiers)."""
    mod = f"_{modifier}" if modifier else ""
    tag = f"fwd_sm90_d{head_dim}_{dtype_name}_{block_m}x{block_n}{mod}_{device_type}"
    return f"{tag}_{fingerprint()[:16]}"


def load(name: str):
    """The compiled function stored under ``name``, or None (no cache, no file, or a file
    that does not load: that one is reported by a warning and replaced after compiling)."""
    folder = cache_dir()
    if folder is None:
        return None
    path = folder / f"{name}.o"
    if not path.is_file():
        return None
    try:
        from cutlass.cute.runtime import load_module

        return load_module(str(path))[name]
    except Exception as exc:  # a bad entry is a miss
        warnings.warn(
            f"compilemask: cached cute kernel {path} does not load "
            f"({type(exc).__name__}: {exc}); compiling it again",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def store(compiled, name: str) -> Path | None:
    """Write ``compiled`` (from ``cute.compile``) under ``name``; the path written, or None
    when the cache is off or the write failed (with a warning)."""
    folder = cache_dir()
    if folder is None:
        return None
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=folder)
        compiled.export_to_c(tmp, name, name)
        target = folder / f"{name}.o"
        os.replace(Path(tmp) / f"{name}.o", target)
        return target
    except Exception as exc:
        warnings.warn(
            f"compilemask: could not write the cute kernel cache in {folder} "
            f"({type(exc).__name__}: {exc}); the kernel is compiled again in the next process",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
