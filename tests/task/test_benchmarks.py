"""``python -m benchmarks.run``, which measures the shipped image task (its ConvNet against a raw
PyTorch loop, its data at scale), runs end to end in its tiny mode and reports every figure. A
forker who replaces the task adapts or deletes the benchmark with this test."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import PROJECT


def test_results_go_outside_the_tracked_tree_by_default() -> None:
    from benchmarks.run import parse_args

    out = parse_args([]).out
    assert out == PROJECT / "outputs" / "benchmarks" / "results.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(out)], cwd=PROJECT)
    assert ignored.returncode == 0, f"{out} is not git-ignored"
    published = PROJECT / "benchmarks" / "results.json"
    assert parse_args(["--out", str(published)]).out == published, "written only when asked"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the check would run")
def test_the_gpu_check_says_in_one_line_that_there_is_no_gpu() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check"],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False): nothing to run"
    ]


def test_the_gpu_check_runs_tests_that_exist() -> None:
    """Each test it names (they skip here) is a test function of the file it names."""
    from benchmarks.gpu_check import GPU_TESTS

    for name, tests in GPU_TESTS.items():
        for test in tests:
            path, function = test.split("::")
            source = (PROJECT / path).read_text()
            assert f"def {function.split('[')[0]}(" in source, f"{name}: {test}"


def test_the_gpu_checks_benchmark_data_builds(tmp_path: Path) -> None:
    """The data of its benchmark rows, built here (the rows need a GPU: a mistake there was
    found only on a lent GPU, after its tests had run)."""
    from benchmarks.gpu_check import benchmark_data
    from src.task.data.mnist import MNISTDataModule

    data, overrides = benchmark_data(MNISTDataModule, tmp_path / "data", batch=8, steps=2)
    assert len(data.train_set) == 8 * 12
    assert overrides[0] == "data=mnist"


@pytest.mark.slow
def test_benchmark_tiny_mode_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    published = (PROJECT / "benchmarks" / "results.json").read_bytes()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--tiny", "--out", str(out)],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    rows = results["rows"]
    measured = [name for name, row in rows.items() if "skipped" not in row]
    for prefix in ("1.", "2.", "3.", "4.", "5.", "8.", "9.", "10.", "11.", "12."):  # 8: CPU
        assert any(name.startswith(f"{prefix} ") for name in measured), f"row {prefix} missing"
    assert any(name.startswith("6.") for name in rows)
    for name in measured:
        row = rows[name]
        assert row["min"] <= row["median"] <= row["max"], name
        assert all(math.isfinite(v) for v in row.values()), name
        if "cost" not in name:  # a cost in % may be negative when the exact loop is faster
            assert row["min"] > 0, name
    assert results["machine"]["cores"] >= 1 and results["machine"]["torch"]
    assert results["slowest_imports_of_src.train_s"], "the import profile is recorded"
    assert "Template vs. raw PyTorch" in proc.stdout
    # Row 9 (benchmarks.step_overhead): each kind on both networks, the targets beside them.
    for kind in ("raw loop", "bare L.Trainer", "python -m src.train"):
        assert f"9. tiny: {kind} (ms per step)" in measured
        assert kind == "bare L.Trainer" or f"9. convnet: {kind} (ms per step)" in measured
    targets = [name for name in measured if name.startswith("9.") and "target" in name]
    assert len(targets) == 3, targets  # tiny: wall and CPU time; ConvNet: throughput
    # Row 11 (benchmarks.sharding): FSDP holds half of DDP's weights, gradients and AdamW state
    # on each of 2 ranks (a mesh given whole to fully_shard replicated them instead: 1.0).
    share = rows["11. cpu, FSDP / DDP state per rank on 2 ranks (1/N: sharded)"]
    assert share["median"] == pytest.approx(0.5, abs=0.01), share
    assert (PROJECT / "benchmarks" / "results.json").read_bytes() == published, "left as it was"
