"""The ``compilemask`` command line: show / stats / check / demo on seed workloads and text files,
and one-line errors (exit status 2) for bad input to every subcommand."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from click import testing as click_testing

from compilemask.tools.cli import cli, main

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


def test_stats_workload(run):
    result = run("stats", "hstu", "--size", "1024", "--block-m", "64", "--block-n", "64")
    assert result.exit_code == 0, result.output
    assert "density" in result.output and "tiles_full" in result.output
    assert "compile_ms" in result.output


@pytest.mark.parametrize("name", ["causal", "hstu", "shared_prompt", "clear"])
def test_check_workloads(run, name):
    result = run("check", name, "--size", "1024")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("OK")


def test_check_text_file(run, mask_file):
    result = run("check", str(mask_file), "--block-m", "32", "--block-n", "64")
    assert result.exit_code == 0, result.output
    assert "OK" in result.output and "256x256" in result.output


def test_check_inline_text_needs_length(run):
    result = run("check", "sliding_window(16)")
    assert result.exit_code == 2
    assert "--q-len" in result.output
    result = run("check", "sliding_window(16)", "--q-len", "300", "--block-m", "64")
    assert result.exit_code == 0, result.output


def test_show_writes_png(run, mask_file, tmp_path):
    out = tmp_path / "pics" / "doc.png"
    result = run("show", str(mask_file), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_downsampled(run, tmp_path):
    """Above 2048 tokens the picture comes from the intervals, not a dense mask."""
    out = tmp_path / "clear.png"
    result = run("show", "clear", "--size", "4096", "-o", str(out), "--max-pixels", "256")
    assert result.exit_code == 0, result.output
    assert out.exists()


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


def _assert_one_line_error(result, fragment: str) -> None:
    """Exit status 2 and exactly one line on stderr, ``compilemask[ CMD]: error: ...``."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("compilemask") and ": error: " in lines[0], lines[0]
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.output


#: (arguments, a fragment of the one-line error): every subcommand with bad input.
BAD_INPUT = [
    (["stats", "no_such_workload"], "neither a file nor a seed workload"),
    (["stats", "examples/nonexistent.txt"], "not found"),
    (["stats", "causal", "--size", "1000"], "nominal size 1000"),
    (["stats", "causal", "--q-len", "5"], "its length comes from --size"),
    (["stats", "causal()"], "give --q-len"),
    (["stats", "sliding_window(4", "--q-len", "8"], "(line 1, column 17) in 'sliding_window(4'"),
    (["stats", "foo(1)", "--q-len", "8"], "unknown mask 'foo'"),
    (["stats", "sliding_window(4)", "--q-len", "0"], "q_len"),
    (["stats", "sliding_window(4)", "--q-len", "8", "--kv-len", "-1"], "kv_len"),
    (["stats", "causal", "--size", "1024", "--block-m", "0"], "block_m"),
    (["stats", "causal", "--size", "abc"], "'abc' is not a valid integer"),
    (["stats", "causal", "--bogus"], "No such option '--bogus'"),
    (["stats"], "Missing argument 'MASK'"),
    (["no_such_command"], "No such command 'no_such_command'"),
    (["check", "causal", "--size", "32768"], "too large"),
    (["check", "document([3, 5])", "--q-len", "9"], "fixes the length"),
    (["show", "causal", "--size", "1024", "--max-pixels", "0"], "--max-pixels"),
    (["show", "causal()", "--q-len", "64", "-o", "x.txt"], "must be a .png"),
    (["demo", "--size", "1000", "--no-pictures", "--no-attention"], "nominal size 1000"),
    (["demo", "--block-m", "0", "--no-pictures", "--no-attention"], "block_m"),
    (["bench", "--report", "missing.jsonl"], "missing.jsonl: No such file or directory"),
    (["bench", "--workloads", "no_such_workload"], "invalid choice"),
    (["bench", "--sizes", "abc"], "invalid int value"),
    (["check", ""], "MASK is empty"),
    (["check", "layout"], "the mask's layout has no tokens"),
]


@pytest.mark.parametrize("args, fragment", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line(run, args, fragment):
    _assert_one_line_error(run(*args), fragment)


#: (file name, its bytes, arguments with {path}, a fragment of the error): bad files.
BAD_FILES = [
    ("folder", None, ["stats", "{path}"], "is a folder"),
    ("latin1.txt", b"causal() # \xe9\n", ["stats", "{path}"], "not UTF-8 text"),
    ("p.plan", b"PK\x03\x04\xff\xfe", ["check", "{path}"], "looks like a saved plan"),
    ("bad.txt", b"document([3, 5]) |\n", ["stats", "{path}", "--q-len", "8"], "(line 2, column 1)"),
    ("a_file", b"", ["show", "causal()", "--q-len", "8", "-o", "{path}/x.png"], "cannot write"),
    ("a_file", b"", ["demo", "--out-dir", "{path}", "--no-attention"], "is a file"),
    ("r.jsonl", b"not json\n", ["bench", "--report", "{path}"], "line 1: not JSON"),
    ("r.jsonl", b"[1, 2]\n", ["bench", "--report", "{path}"], "not a result row"),
    ("r.jsonl", b'{"ms": 1}\n', ["bench", "--report", "{path}"], "lacks workload, N0"),
    ("folder", None, ["bench", "--report", "{path}"], "Is a directory"),
]


@pytest.mark.parametrize(
    "name, data, args, fragment", BAD_FILES, ids=[f"{a[0]}-{n}-{f}" for n, _, a, f in BAD_FILES]
)
def test_bad_files_are_one_line(run, tmp_path, name, data, args, fragment):
    path = tmp_path / name
    if data is None:
        path.mkdir()
    else:
        path.write_bytes(data)
    _assert_one_line_error(run(*(a.format(path=path) for a in args)), fragment)


def test_main_alone_prints_its_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("Usage: compilemask") and "demo" in out


def test_main_exits_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["stats", "no_such_workload"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("compilemask: error: MASK 'no_such_workload'")


def test_without_matplotlib_show_fails_and_demo_skips_pictures(run, tmp_path, monkeypatch):
    from compilemask.tools import visualize

    monkeypatch.setattr(visualize, "have_matplotlib", lambda: False)
    _assert_one_line_error(run("show", "causal()", "--q-len", "64"), "compilemask[pictures]")
    result = run("demo", "--size", "1024", "--out-dir", str(tmp_path / "pics"), "--no-attention")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.output.splitlines() if "pictures" in line]
    assert notes == [f"pictures skipped: {visualize.PICTURES_HINT}"]
    assert not (tmp_path / "pics").exists()


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


def test_mask_text_longer_than_a_file_name(run):
    """Mask text of any length is parsed (not refused as a file name that is too long)."""
    text = "document([" + ", ".join(["10"] * 60) + "], causal=false) | sliding_window(4)"
    result = run("check", text)
    assert result.exit_code == 0, result.output
