"""``compilemask bench`` on the CPU: the registry's skip reasons, the cuDNN endpoints built from
a plan, the results rows, the TFLOP/s formula, the measuring loop on a small CPU case (check,
failure, error, skip) and the report; the GPU run itself is in docs/benchmarking.md."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import compilemask as cm
from compilemask import masks
from compilemask import workloads as wl
from compilemask.kernels.reference import reference_attention
from compilemask.tools import bench, bench_plan, bench_report, bench_sweep, bench_systems
from compilemask.tools.bench_report import RESULT_KEYS, Shape, effective_tflops, result_row
from compilemask.tools.peers import cudnn_endpoints, endpoints_dense

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: runs for real")
ENV = {"date": "2026-12-01T00:00:00+00:00", "gpu": "test", "torch": "x", "triton": "y",
       "commit": "abc"}  # fmt: skip


# ------------------------------------------------------------------------------ registry


def test_system_names_are_the_design_names():
    assert bench.SYSTEM_NAMES == (
        "compilemask-triton", "compilemask-triton-tiled", "compilemask-cudnn",
        "compilemask-cudnn-tiled", "compilemask-cudnn-tiled-kept", "compilemask-cudnn+triton",
        "compilemask-cute+triton",
        "compilemask-fa4",
        "compilemask-fa4-tiled", "compilemask-cute", "compilemask-cute-tiled",
        "compilemask-cute-tiled-kept", "compilemask-auto",
        "compilemask-auto-tiled", "compilemask-auto-tiled-kept", "flex-triton",
        "flex-fa4", "cudnn-fe", "fa4", "sdpa-cudnn", "sdpa-flash",
        "compilemask-triton-softcap", "flex-triton-softcap", "compilemask-triton-alibi",
        "flex-triton-alibi", "compilemask-fa4-softcap", "compilemask-cute-softcap",
        "compilemask-cute-alibi", "compilemask-cute+triton-softcap",
        "compilemask-cute+triton-alibi",
        "compilemask-reference",
    )  # fmt: skip
    tiled = next(s for s in bench.SYSTEMS if s.name == "compilemask-triton-tiled")
    assert tiled.applies("clear", 33280)[0] and not tiled.applies("hstu", 32768)[0]


@no_gpu
def test_registry_reports_peers_skipped_with_a_reason_on_cpu():
    status = bench.availability()
    assert set(status) == set(bench.SYSTEM_NAMES)
    assert status["compilemask-reference"] == (True, "")  # plain PyTorch runs anywhere
    for name, (ok, why) in status.items():
        if name != "compilemask-reference":
            assert not ok, name
            assert why, f"{name} is skipped without a reason"
    if importlib.util.find_spec("cudnn") is None:
        assert "cudnn" in status["cudnn-fe"][1] and "import" in status["cudnn-fe"][1]
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash_attn" in status["fa4"][1]
        assert "flash_attn" in status["flex-fa4"][1]


def test_applicability():
    by_name = {s.name: s for s in bench.SYSTEMS}
    for name in ("fa4", "sdpa-cudnn", "sdpa-flash"):
        assert by_name[name].applies("causal", 32768)[0]
        ok, why = by_name[name].applies("hstu", 1024)
        assert not ok and "causal" in why
    ok, why = by_name["compilemask-reference"].applies("clear", 4608)
    assert not ok and "4096" in why
    assert by_name["compilemask-reference"].applies("clear", 4096)[0]
    assert by_name["cudnn-fe"].applies("clear", 33280)[0]


# ------------------------------------------------------------------------------ endpoints


def _endpoint_plans():
    yield "causal", cm.compile(masks.causal(), 200)
    for name in wl.SEED_WORKLOADS:
        w = wl.workload(name, 1024)
        yield name, cm.compile(w.mask, w.N)
    yield "sliding-q300-kv120", cm.compile(masks.sliding_window(64), 300, 120)  # empty rows
    yield "document-bidir", cm.compile(masks.document([70, 30, 100], causal=False), 200)
    yield "prefix_lm", cm.compile(masks.prefix_lm(40), 150)
    rows = torch.arange(64)[:, None]
    keys = torch.arange(200)[None, :]
    yield "from_dense-empty-rows", cm.from_dense(keys < rows % 5 * 40)  # from 0, or empty
    heads = masks.per_head([masks.causal(), masks.sliding_window(16)])
    yield "per_head", cm.compile(heads, 96, heads=2)


@pytest.mark.parametrize("label,plan", list(_endpoint_plans()), ids=lambda x: str(x)[:24])
def test_cudnn_endpoints_cover_exactly_the_plan(label, plan):
    assert plan.encoding == "intervals"
    B = 3
    ends = cudnn_endpoints(plan, B)
    hmask = plan.heads or 1
    assert ends.dtype == torch.int32 and ends.is_contiguous()
    assert ends.shape[0] == hmask and ends.shape[2] == B * plan.q_len
    assert ends.shape[1] % 2 == 1
    assert bool((ends[:, 1:] >= ends[:, :-1]).all()), "endpoints must be non-decreasing"
    assert bool((ends >= 0).all()) and bool((ends <= plan.kv_len).all())
    dense = endpoints_dense(ends, plan.kv_len).view(hmask, B, plan.q_len, plan.kv_len)
    want = plan.to_dense()
    want = want.view(-1, hmask, plan.q_len, plan.kv_len)[0]  # [Hmask, Nq, Nk]
    for b in range(B):
        assert torch.equal(dense[:, b], want), f"{label}: batch row {b} differs"


def test_cudnn_endpoints_short_form_for_rows_from_zero():
    plan = cm.compile(masks.causal(), 64)
    assert cudnn_endpoints(plan, 1).shape[1] == 2 * plan.row_lo.shape[-1] - 1
    shifted = cm.compile(masks.sliding_window(8), 64)
    assert cudnn_endpoints(shifted, 1).shape[1] == 2 * shifted.row_lo.shape[-1] + 1


def test_cudnn_endpoints_refuse_bits_plans():
    dense = torch.rand(64, 64, generator=torch.Generator().manual_seed(0)) < 0.5
    plan = cm.from_dense(dense)
    assert plan.encoding == "bits"
    with pytest.raises(cm.CompileMaskError, match="interval"):
        cudnn_endpoints(plan, 1)


def test_cudnn_endpoints_refuse_a_wrong_batch():
    plan = cm.compile(masks.per_batch([masks.causal(), masks.sliding_window(4)]), 32, batch=2)
    assert cudnn_endpoints(plan, 2).shape == (1, cudnn_endpoints(plan, 2).shape[1], 64)
    with pytest.raises(cm.CompileMaskError, match="batch"):
        cudnn_endpoints(plan, 3)


# ------------------------------------------------------------------------------ rows


def test_result_row_has_exactly_the_design_keys():
    shape = Shape("hstu", 1024, 1024, 32, 16, 16, 128, "bf16")
    row = result_row(ENV, shape, "fwd", "cudnn-fe", ms=1.5, tflops=100.0, rel_err=1e-3)
    assert tuple(row) == RESULT_KEYS
    design = "date gpu torch triton commit workload N0 N B Hq Hkv D dtype mode system ms tflops"
    assert list(row) == [*design.split(), "rel_err"]
    extra = result_row(ENV, shape, "plan", "compilemask-cuda", status="ok", plan_bytes=4)
    assert tuple(extra)[: len(RESULT_KEYS)] == RESULT_KEYS
    assert list(extra)[len(RESULT_KEYS) :] == ["status", "plan_bytes"]
    json.dumps(extra)
    with pytest.raises(ValueError, match="mode"):
        result_row(ENV, shape, "bwd", "fa4")
    with pytest.raises(ValueError, match="overwrite"):
        result_row(ENV, shape, "fwd", "fa4", N=3)


def test_environment_names_the_commit(monkeypatch):
    monkeypatch.setenv("COMPILEMASK_COMMIT", "deadbeef")
    env = bench_report.environment()
    assert env["commit"] == "deadbeef"
    assert set(env) == set(RESULT_KEYS[:5])


def test_effective_tflops_formula():
    B, H, D, pairs, ms = 32, 16, 128, 1024 * 1025 // 2, 0.25
    fwd = effective_tflops(B, H, D, pairs, ms, "fwd")
    assert fwd == pytest.approx(4 * B * H * D * pairs / (ms * 1e-3) / 1e12)
    assert effective_tflops(B, H, D, pairs, ms, "fwd+bwd") == pytest.approx(3.5 * fwd)
    with pytest.raises(ValueError):
        effective_tflops(B, H, D, pairs, ms, "plan")


def test_visible_pairs_of_causal():
    assert bench.visible_pairs(cm.compile(masks.causal(), 100)) == 100 * 101 / 2


# ------------------------------------------------------------------------------ measuring


def _cpu_case(N: int = 192, B: int = 2, H: int = 2, D: int = 32) -> bench.Case:
    mask = masks.causal()
    w = wl.Workload("causal", 1024, N, B, mask)
    plan = cm.compile(mask, N)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, generator=g) for _ in range(4))
    return bench.Case(w, plan, q, k, v, do, bench.visible_pairs(plan))


def _always() -> tuple[bool, str]:
    return True, ""


def _bshd_reference(case: bench.Case, grad: bool) -> bench.Runner:
    q, k, v = bench._bshd_leaves(case, grad)

    def fn():
        t = (x.transpose(1, 2) for x in (q, k, v))
        return reference_attention(*t, case.plan)[0].transpose(1, 2)

    return bench.Runner(fn, (q, k, v), case.dout.transpose(1, 2).contiguous(), bshd=True)


def _zeros(case: bench.Case, grad: bool) -> bench.Runner:
    q, k, v = bench._bhsd_leaves(case, grad)
    return bench.Runner(lambda: q * 0 + k.sum() * 0, (q, k, v), case.dout)


def _raises(case: bench.Case, grad: bool) -> bench.Runner:
    raise RuntimeError("peer exploded")


@pytest.fixture
def fake_timer(monkeypatch):
    monkeypatch.setattr(bench, "time_ms", lambda runner, bwd: 2.0)


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_measure_checks_then_times(fake_timer, mode):
    case = _cpu_case()
    systems = [
        bench.System("ref-bhsd", _always, bench._compilemask("reference")),
        bench.System("ref-bshd", _always, _bshd_reference),
    ]
    for system in systems:
        row = bench.measure(system, case, mode, ENV)
        assert tuple(row)[: len(RESULT_KEYS)] == RESULT_KEYS
        assert row["status"] == "ok", row
        assert row["ms"] == 2.0
        assert row["tflops"] == pytest.approx(effective_tflops(2, 2, 32, case.pairs, 2.0, mode))
        assert row["rel_err"] <= row["bound"]
        want = {"out", "dq", "dk", "dv"} if mode == "fwd+bwd" else {"out"}
        assert set(row["errors"]) == want
        assert (row["N"], row["B"], row["Hq"], row["D"], row["dtype"]) == (192, 2, 2, 32, "fp32")


@pytest.mark.parametrize("keep_tiled", [False, True])
def test_tiled_systems_check_in_the_original_order(fake_timer, monkeypatch, keep_tiled):
    """The -tiled (attention permutes) and -tiled-kept (tokens given in the tiled order)
    runners are checked against the row-major reference, gradients included."""
    monkeypatch.setattr(bench_systems, "GRID_TILE", (2, 4))
    mask = masks.clear((6, 8), 2, 5)
    w = wl.Workload("clear", 1024, 53, 1, mask)
    plan = cm.compile(mask, 53)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 53, 32, generator=g) for _ in range(4))
    case = bench.Case(w, plan, q, k, v, do, bench.visible_pairs(plan))
    prepare = bench_systems._compilemask_tiled("reference", keep_tiled=keep_tiled)
    system = bench.System("tiled", _always, prepare, applies=bench_systems._grid_only)
    for mode in ("fwd", "fwd+bwd"):
        row = bench.measure(system, case, mode, ENV)
        assert row["status"] == "ok", row.get("reason")
    runner = prepare(case, False)
    assert (runner.order is not None) == keep_tiled
    if keep_tiled:  # the leaves really are in the tiled order
        assert not torch.equal(runner.leaves[0], q)
        assert torch.equal(runner.to_bhsd(runner.leaves[0]), q)


def test_measure_reports_failures_errors_and_skips(fake_timer):
    case = _cpu_case()
    wrong = bench.measure(bench.System("zeros", _always, _zeros), case, "fwd", ENV)
    assert wrong["status"] == "failed" and wrong["ms"] is None and wrong["tflops"] is None
    assert wrong["rel_err"] > wrong["bound"]
    broken = bench.measure(bench.System("boom", _always, _raises), case, "fwd+bwd", ENV)
    assert broken["status"] == "error" and "peer exploded" in broken["reason"]
    absent = bench.System("absent", lambda: (False, "no module named peer"), _raises)
    skipped = bench.measure(absent, case, "fwd", ENV)
    assert skipped["status"] == "skipped" and skipped["reason"] == "no module named peer"
    causal_only = bench.System("dense", _always, _zeros, applies=lambda n, N: (False, "causal"))
    assert bench.measure(causal_only, case, "fwd", ENV)["status"] == "skipped"
    fwd_only = bench.System("fwd-only", _always, _zeros, supports_bwd=False)
    assert bench.measure(fwd_only, case, "fwd+bwd", ENV)["reason"] == "has no backward"


def test_measure_without_check(fake_timer):
    row = bench.measure(
        bench.System("zeros", _always, _zeros), _cpu_case(), "fwd+bwd", ENV, check=False
    )
    assert row["status"] == "ok" and row["rel_err"] is None and row["ms"] == 2.0


def test_plan_rows_on_cpu(monkeypatch):
    monkeypatch.setattr(bench_plan, "PLAN_REPEATS", 2)
    monkeypatch.setattr(bench_plan, "PLAN_WARMUP", 1)
    rows = bench_plan.plan_rows(_cpu_case(N=256), ENV)
    assert [r["system"] for r in rows] == ["compilemask-cpu", "flex-create_block_mask"]
    for r in rows:
        assert tuple(r)[: len(RESULT_KEYS)] == RESULT_KEYS
        assert r["mode"] == "plan" and r["status"] == "ok" and r["ms"] > 0, r
    assert rows[0]["plan_bytes"] > 0 and rows[0]["sync_free"] is None  # checked on CUDA only
    assert 0 < rows[0]["compact_bytes"] < rows[0]["plan_bytes"]
    assert rows[1]["blockmask_bytes"] > 0


def test_fresh_rows_time_a_new_mask_every_step(monkeypatch):
    from compilemask.tools import bench_fresh

    monkeypatch.setattr(bench_fresh, "FRESH_WARMUP", 0)
    monkeypatch.setattr(bench_fresh, "FRESH_STEPS", 2)
    monkeypatch.setattr(bench_fresh, "FRESH_SYSTEMS", ("compilemask-reference", "flex-triton"))
    drawn = []
    real = bench_fresh.wl.workload

    def spy(name, N0, seed=0):
        drawn.append(seed)
        return real(name, N0, seed=seed)

    monkeypatch.setattr(bench_fresh.wl, "workload", spy)
    monkeypatch.setitem(
        bench_fresh.STEPS, "compilemask-reference", lambda: bench_fresh._ours("reference")
    )
    opts = {"device": "cpu", "heads": 1, "head_dim": 32, "dtype": torch.float32}
    rows = bench_fresh.fresh_rows("hstu", 1024, bench.SYSTEMS, ENV, opts)
    by = {r["system"]: r for r in rows}
    assert set(by) == {"compilemask-reference", "flex-triton"}
    ours = by["compilemask-reference"]
    assert ours["status"] == "ok" and ours["ms"] > 0 and ours["steps"] == 2, ours
    assert ours["syncs"] == 0 and ours["mode"] == "fresh"
    assert tuple(ours)[: len(RESULT_KEYS)] == RESULT_KEYS
    assert by["flex-triton"]["status"] == "skipped" and by["flex-triton"]["reason"]
    assert drawn[1:4] == [1, 2, 3]  # a new draw every step (after the case's own, seed 0)
    assert real("hstu", 1024, seed=1).mask != real("hstu", 1024, seed=2).mask
    skipped = bench_fresh.fresh_rows("causal", 1024, bench.SYSTEMS, ENV, opts)
    assert all(r["status"] == "skipped" for r in skipped)


# ------------------------------------------------------------------------------ command


@no_gpu
def test_cli_without_cuda_exits_2(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from compilemask.tools.cli import cli

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["bench", "--workloads", "causal", "--sizes", "1024"])
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output
    assert not (tmp_path / "benchmarks").exists()


def test_bench_help_and_bad_arguments(capsys):
    assert bench_sweep.main(["--help"]) == 0
    assert "--one-per-process" in capsys.readouterr().out
    assert bench_sweep.main(["--sizes", "1000"]) == 2


def test_list_names_every_system(capsys):
    assert bench_sweep.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in bench.SYSTEM_NAMES:
        assert name in out


def _rows() -> list[dict]:
    shape = Shape("causal", 1024, 1024, 32, 16, 16, 128, "bf16")
    rows = [
        result_row(ENV, shape, "fwd", "flex-triton", ms=2.0, tflops=100.0, rel_err=1e-3,
                   status="ok"),
        result_row(ENV, shape, "fwd", "compilemask-triton", ms=1.0, tflops=200.0,
                   rel_err=1e-3, status="ok"),
        result_row(ENV, shape, "fwd", "cudnn-fe", status="skipped", reason="no module"),
        result_row(ENV, shape, "fwd", "fa4", rel_err=0.5, status="failed", bound=1e-3),
        result_row(ENV, Shape("causal", 1024, 1024, 32), "plan", "compilemask-cuda", ms=0.5,
                   status="ok", plan_bytes=2048, sync_free=True),
        result_row(ENV, Shape("causal", 1024, 1024, 32), "plan", "flex-create_block_mask",
                   ms=2.0, status="ok", blockmask_bytes=4096),
    ]  # fmt: skip
    return rows


def test_table_ratios_and_skips():
    text = bench_report.format_table(_rows())
    lines = text.splitlines()
    ours = next(line for line in lines if "compilemask-triton" in line)
    assert "2.00" in ours and "200.0" in ours
    plan = next(line for line in lines if "compilemask-cuda" in line)
    assert "4.00" in plan and "sync-free" in plan
    assert "FAIL" in next(line for line in lines if " fa4 " in line)
    assert "cudnn-fe: no module (causal)" in text


def test_report_prints_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results = tmp_path / "r.jsonl"
    bench_report.append_rows(results, _rows())
    png = tmp_path / "r.png"
    assert bench_sweep.main(["--report", str(results), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "compilemask-triton" in out and "plot:" in out
    assert png.exists() and png.stat().st_size > 0


# ------------------------------------------------------------------------------ smoke sweeps


def _smoke(monkeypatch, tmp_path, *extra):
    monkeypatch.setenv(bench.SMOKE_ENV, "cpu")
    monkeypatch.setenv("CM_NO_PROGRESS", "1")
    out = tmp_path / "r.jsonl"
    args = ["--workloads", "causal", "--sizes", "1024", "--out", str(out), "--no-plot", *extra]
    assert bench_sweep.main(args) == 0
    return bench_report.read_rows(out)


def test_smoke_sweep_in_process(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_plan, "PLAN_REPEATS", 2)
    rows = _smoke(
        monkeypatch, tmp_path, "--modes", "plan", "fwd",
        "--systems", "compilemask-reference", "fa4",
    )  # fmt: skip
    by = {(r["mode"], r["system"]): r for r in rows}
    assert by[("fwd", "compilemask-reference")]["status"] == "ok"
    assert by[("fwd", "compilemask-reference")]["rel_err"] is not None
    assert by[("plan", "compilemask-cpu")]["ms"] > 0
    assert by[("plan", "flex-create_block_mask")]["ms"] > 0
    if importlib.util.find_spec("flash_attn") is None:
        assert by[("fwd", "fa4")]["status"] == "skipped"
    for r in rows:
        assert tuple(r)[: len(RESULT_KEYS)] == RESULT_KEYS
        assert r["workload"] == "causal" and r["N0"] == 1024 and r["B"] == 32


@pytest.mark.slow
def test_smoke_sweep_one_process_per_case(monkeypatch, tmp_path):
    rows = _smoke(
        monkeypatch, tmp_path, "--one-per-process", "--modes", "fwd+bwd",
        "--systems", "compilemask-reference",
    )  # fmt: skip
    assert [r["status"] for r in rows] == ["ok"]
    assert set(rows[0]["errors"]) == {"out", "dq", "dk", "dv"}


def test_results_file_names_carry_the_gpu_as_a_short_slug():
    from compilemask.tools.bench_report import gpu_slug

    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"
    assert gpu_slug("none") == "cpu"


def _status_rows():
    base = {"gpu": "NVIDIA H200", "torch": "2.11", "triton": "3.6", "N0": 1024, "N": 1024}
    return [
        {**base, "commit": "aaa111", "workload": "hstu", "mode": "fwd",
         "system": "compilemask-triton", "ms": 9.0},
        {**base, "commit": "bbb222", "workload": "hstu", "mode": "fwd",
         "system": "compilemask-triton", "ms": 2.0},
        {**base, "commit": "bbb222", "workload": "hstu", "mode": "fwd",
         "system": "flex-triton", "ms": 3.0},
        {**base, "commit": "bbb222", "workload": "hstu", "mode": "fwd",
         "system": "cudnn-fe", "ms": 1.0},
        {**base, "commit": "bbb222", "workload": "hstu", "mode": "fwd+bwd",
         "system": "compilemask-triton", "ms": 4.0},
        {**base, "commit": "bbb222", "workload": "hstu", "mode": "plan",
         "system": "compilemask-triton", "ms": 0.5},
    ]  # fmt: skip


def test_status_table_sets_ratios_of_one_commit_beside_each_peer():
    from compilemask.tools.status import select, status_table

    commit, rows = select(_status_rows())
    assert commit == "bbb222"  # the file's last commit by default
    lines = status_table(rows).splitlines()
    assert lines[0] == "| workload | N | mode | CompileMask ms | Flex (Triton) | cuDNN-frontend |"
    assert lines[2] == "| hstu | 1024 | fwd | 2.000 | 1.50x (3.000) | 0.50x (1.000) |"
    assert lines[3] == "| hstu | 1024 | fwd+bwd | 4.000 | - | - |"  # no peer in that case
    assert len(lines) == 4  # plan rows are not attention timings
    _, old = select(_status_rows(), "aaa")
    assert status_table(old).splitlines()[2] == "| hstu | 1024 | fwd | 9.000 |"


def test_status_names_the_bad_argument(tmp_path):
    from compilemask.errors import InputError
    from compilemask.tools.status import read_results, select

    with pytest.raises(InputError, match="commit 'ccc'"):
        select(_status_rows(), "ccc")
    with pytest.raises(InputError, match="does not exist"):
        read_results(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ms": 1}\nnot json\n')
    with pytest.raises(InputError, match="line 2"):
        read_results(bad)


def test_status_command_prints_the_table_and_draws_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from compilemask.tools.status import main

    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _status_rows()))
    assert main([str(path), "--plot", str(tmp_path / "s.png")]) == 0
    out = capsys.readouterr().out
    assert "commit bbb222" in out and "| hstu | 1024 | fwd | 2.000 | 1.50x (3.000)" in out
    assert (tmp_path / "s.png").stat().st_size > 0
