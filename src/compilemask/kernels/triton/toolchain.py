"""The ptxas that compiles our kernels: Triton's own, even after TorchInductor has run.

When TorchInductor compiles a Triton kernel (``torch.compile``, FlexAttention) it sets
``TRITON_PTXAS_PATH`` to the ptxas bundled with torch (``torch/_inductor/bin/ptxas``, the CUDA
toolkit torch was built with) for the rest of the process, unless the variable was already
set. Our kernels were tuned with the ptxas bundled with Triton (``triton/backends/nvidia/bin``);
a kernel compiled later in such a process would silently be built by another ptxas. Launchers
decorated with :func:`bundled_ptxas` remove that one value of the variable while they run (a
compile happens inside a launch), so the kernels are compiled by Triton's ptxas whatever ran
before them. Any other value (set by the user) is respected. Measurements:
``docs/perf-notes.md`` (session 7).

Not thread-safe against another thread that reads or sets ``TRITON_PTXAS_PATH`` while one of
our launches runs (the variable is process-wide).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

_KEY = "TRITON_PTXAS_PATH"
F = TypeVar("F", bound=Callable)


@functools.cache
def inductor_ptxas() -> str:
    """The path TorchInductor writes into ``TRITON_PTXAS_PATH`` (its
    ``compile_tasks._set_triton_ptxas_path``: ``<torch>/_inductor/bin/ptxas``)."""
    return str(Path(torch.__file__).absolute().parent / "_inductor" / "bin" / "ptxas")


def bundled_ptxas(fn: F) -> F:
    """Run ``fn`` with ``TRITON_PTXAS_PATH`` unset when it holds TorchInductor's value, so that
    the Triton kernels ``fn`` compiles use Triton's bundled ptxas; restored on return."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        value = os.environ.get(_KEY)
        if value is None or value != inductor_ptxas():
            return fn(*args, **kwargs)
        del os.environ[_KEY]
        try:
            return fn(*args, **kwargs)
        finally:
            os.environ[_KEY] = value

    return wrapper  # type: ignore[return-value]
