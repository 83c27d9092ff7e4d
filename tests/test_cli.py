"""The ``compilemask`` command line: show / stats / check on seed workloads and text files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

click_testing = pytest.importorskip("click.testing", reason="click is not installed")

try:
    from compilemask.compiler.pipeline import compile as _compile  # noqa: F401

    COMPILER_ERROR = None
except ImportError as err:  # the compiler is written in parallel; say why when it is missing
    COMPILER_ERROR = str(err)

from compilemask.tools.cli import cli, main  # noqa: E402

needs_compiler = pytest.mark.skipif(
    COMPILER_ERROR is not None, reason=f"compiler not importable: {COMPILER_ERROR}"
)


# docs/benchmarking.md, "Results files"
RESULT_KEYS = "date gpu torch triton commit workload N0 N B Hq Hkv D dtype mode system ms tflops"
RESULT_KEYS = [*RESULT_KEYS.split(), "rel_err"]


@pytest.fixture
def run(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CM_NO_PROGRESS", "1")
    runner = click_testing.CliRunner()

    def invoke(*args):
        return runner.invoke(cli, list(args), catch_exceptions=False)

    return invoke


@pytest.fixture
def mask_file(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("# two documents and a prefix\ndocument([100, 156]) | prefix_lm(8)\n")
    return path


@needs_compiler
def test_stats_workload(run):
    result = run("stats", "hstu", "--size", "1024", "--block-m", "64", "--block-n", "64")
    assert result.exit_code == 0, result.output
    assert "density" in result.output and "tiles_full" in result.output
    assert "compile_ms" in result.output


@needs_compiler
@pytest.mark.parametrize("name", ["causal", "hstu", "shared_prompt", "clear"])
def test_check_workloads(run, name):
    result = run("check", name, "--size", "1024")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("OK")


@needs_compiler
def test_check_text_file(run, mask_file):
    result = run("check", str(mask_file), "--block-m", "32", "--block-n", "64")
    assert result.exit_code == 0, result.output
    assert "OK" in result.output and "256x256" in result.output


@needs_compiler
def test_check_inline_text_needs_length(run):
    result = run("check", "sliding_window(16)")
    assert result.exit_code == 2
    assert "--q-len" in result.output
    result = run("check", "sliding_window(16)", "--q-len", "300", "--block-m", "64")
    assert result.exit_code == 0, result.output


@needs_compiler
def test_show_writes_png(run, mask_file, tmp_path):
    out = tmp_path / "pics" / "doc.png"
    result = run("show", str(mask_file), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_compiler
def test_show_downsampled(run, tmp_path):
    """Above 2048 tokens the picture comes from the intervals, not a dense mask."""
    out = tmp_path / "clear.png"
    result = run("show", "clear", "--size", "4096", "-o", str(out), "--max-pixels", "256")
    assert result.exit_code == 0, result.output
    assert out.exists()


@needs_compiler
def test_coverage_image_matches_dense():
    import torch

    from compilemask.compiler.pipeline import compile as cm_compile
    from compilemask.tools.visualize import coverage_image
    from compilemask.workloads import workload

    w = workload("hstu", 1024)
    plan = cm_compile(w.mask, w.N, block_m=64, block_n=64)
    img = coverage_image(plan.row_lo[0], plan.row_hi[0], w.N, max_pixels=128)
    want = plan.to_dense().float().view(128, 8, 128, 8).mean((1, 3))
    torch.testing.assert_close(img, want)


def test_user_errors_exit_2(run):
    for args in (["stats", "no_such_workload"], ["stats", "causal", "--size", "1000"]):
        result = run(*args)
        assert result.exit_code == 2
        assert "error:" in result.output and "Traceback" not in result.output


@needs_compiler
def test_show_names_text_masks_and_refuses_other_formats(run, tmp_path):
    """Inline mask text gets its own default file name (not one shared ``out/mask.png``);
    ``-o`` must name a PNG (a clean usage error, not matplotlib's traceback); a missing file
    is reported as missing."""
    result = run("show", "document([30, 34]) | prefix_lm(16)")
    assert result.exit_code == 0, result.output
    assert "out/document_30_34_prefix_lm_16.png" in result.output
    assert (tmp_path / "out" / "document_30_34_prefix_lm_16.png").exists()
    result = run("show", "causal()", "--q-len", "64", "-o", str(tmp_path / "x.txt"))
    assert result.exit_code == 2 and "must be a .png" in result.output
    assert "Traceback" not in result.output
    result = run("stats", "examples/nonexistent.txt")
    assert result.exit_code == 2 and "not found" in result.output


def test_syntax_error_is_clean(run, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("document([3, 5]) |\n")
    result = run("stats", str(bad), "--q-len", "8")
    assert result.exit_code == 2
    assert "error:" in result.output and "Traceback" not in result.output


def test_bench_without_gpu(run):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: bench would run for real")
    result = run("bench")
    assert result.exit_code == 2
    assert "GPU" in result.output


def test_main_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "demo" in capsys.readouterr().out


@needs_compiler
@pytest.mark.slow
def test_demo_small(run, tmp_path):
    result = run("demo", "--size", "1024", "--out-dir", str(tmp_path / "pics"))
    assert result.exit_code == 0, result.output
    for name in ("causal", "hstu", "shared_prompt", "clear"):
        assert name in result.output
        assert (tmp_path / "pics" / f"{name}-1024.png").exists()


def test_bench_compile_script_small(tmp_path):
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_compile.py"
    spec = importlib.util.spec_from_file_location("bench_compile", script)
    assert spec is not None
    if COMPILER_ERROR is not None:
        pytest.skip(f"compiler not importable: {COMPILER_ERROR}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "r.jsonl"
    module.main(["--sizes", "1024", "--repeats", "2", "--output", str(out)])

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["workload"] for r in rows] == ["causal", "hstu", "shared_prompt", "clear"]
    for r in rows:
        assert r["mode"] == "plan" and r["system"] == "compilemask-cpu"
        assert r["plan_bytes"] > 0 and r["flex_blockmask_bytes"] > 0
        assert set(RESULT_KEYS) <= set(r)
