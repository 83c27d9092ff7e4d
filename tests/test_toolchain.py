"""``kernels.triton.toolchain.bundled_ptxas``: our launches compile with Triton's ptxas even
after TorchInductor has pointed ``TRITON_PTXAS_PATH`` at torch's."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")

from compilemask.kernels.triton import toolchain  # noqa: E402
from compilemask.kernels.triton.toolchain import bundled_ptxas, inductor_ptxas  # noqa: E402

KEY = "TRITON_PTXAS_PATH"


@bundled_ptxas
def _seen(fail: bool = False):
    if fail:
        raise ValueError("launch failed")
    return os.environ.get(KEY)


def test_inductor_value_is_removed_while_the_launcher_runs(monkeypatch):
    monkeypatch.setenv(KEY, inductor_ptxas())
    assert _seen() is None
    assert os.environ[KEY] == inductor_ptxas()  # restored
    with pytest.raises(ValueError):
        _seen(fail=True)
    assert os.environ[KEY] == inductor_ptxas()  # restored after an error too


@pytest.mark.parametrize("value", [None, "/opt/cuda/bin/ptxas"])
def test_other_values_are_respected(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(KEY, raising=False)
    else:
        monkeypatch.setenv(KEY, value)
    assert _seen() == value
    assert os.environ.get(KEY) == value


def test_inductor_path_matches_inductors_rule():
    """The path Inductor computes: ``Path(compile_tasks.__file__).parents[1] / 'bin' / 'ptxas'``."""
    from pathlib import Path

    from torch._inductor.runtime import compile_tasks

    want = Path(compile_tasks.__file__).absolute().parents[1] / "bin" / "ptxas"
    assert toolchain.inductor_ptxas() == str(want)


def test_attention_launchers_are_wrapped():
    from compilemask.kernels.triton import backward, forward, permute, tile_builder

    for fn in (
        forward.attention_forward,
        backward.attention_backward,
        permute.gather_tokens,
        tile_builder.build_tiles_triton,
    ):
        assert fn.__wrapped__ is not None, fn
