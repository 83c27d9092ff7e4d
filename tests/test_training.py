"""The training example (examples/train_shared_prompt.py): a tiny Llama trained with the
shared_prompt mask through ``attn_implementation="compilemask"`` follows the dense-mask
reference step for step (float32, relative 1e-4), and its loss decreases."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (extra: hf)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_shared_prompt  # noqa: E402

STEPS = 5


def test_rows_use_the_shared_prompt_mask():
    rows = train_shared_prompt.build_rows(train_shared_prompt.TEXT.read_text().splitlines())
    assert len(rows) >= 5
    row = rows[0]
    assert row.plan.source.startswith("shared_prompt(")
    assert row.input_ids.shape == row.position_ids.shape == row.labels.shape
    assert row.plan.q_len == row.input_ids.shape[1]


def test_training_matches_dense_mask_and_decreases():
    got = train_shared_prompt.train(STEPS, "compilemask")
    want = train_shared_prompt.train(STEPS, "dense")
    assert got == pytest.approx(want, rel=1e-4)
    assert got[-1] < got[0]
    assert all(b < a for a, b in zip(got, got[1:])), got
