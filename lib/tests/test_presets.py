"""The trainer presets (``trainer=cpu|gpu|ddp``) and debug presets (``debug=fast|limit|overfit|
profiler``), each run for real on the tiny dataset and checked for what its file says it does."""

import json
import os
from pathlib import Path

import pytest
import torch
from lightning_exact.job.entry import LIBRARY_CONF
from lightning_exact.testing.instruments import RECORD_BATCHES
from omegaconf import OmegaConf

from tests.conftest import (
    BATCH_SIZE,
    N_TEST,
    N_TRAIN,
    PROJECT,
    VAL_SIZE,
    read_metrics,
    run_entry,
    tiny_overrides,
)

pytestmark = pytest.mark.slow


def train(tiny_root: Path, workdir: Path, *overrides: str, env: dict[str, str] | None = None):
    """A tiny training job without a logger, for as many epochs as its presets say; returns
    (process, run folder)."""
    run_dir = workdir / "run"
    tiny = tiny_overrides(tiny_root, logger="none")
    tiny = [o for o in tiny if not o.startswith("trainer.max_epochs=")]
    proc = run_entry(
        "train",
        *tiny,
        *overrides,
        f"hydra.run.dir={run_dir}",
        cwd=workdir,
        env=env,
    )
    return proc, run_dir


def job_config(run_dir: Path):
    return OmegaConf.load(run_dir / ".hydra" / "config.yaml")


def default_trainer() -> dict:
    return dict(OmegaConf.load(LIBRARY_CONF / "trainer" / "default.yaml"))


# --- trainer presets


def test_trainer_cpu_runs_on_the_cpu_with_the_default_loop(tiny_root: Path, tmp_path: Path) -> None:
    _, run_dir = train(tiny_root, tmp_path, "trainer=cpu", "trainer.max_epochs=1")
    cfg = job_config(run_dir)
    assert (cfg.accelerator, cfg.devices, cfg.strategy.name) == ("cpu", 1, "auto")
    expected = {**default_trainer(), "max_epochs": 1}  # inherited from trainer=default
    assert OmegaConf.to_container(cfg.trainer) == expected
    assert "rank 0/1 (node 0, local 0) fit: backend none" in (run_dir / "train.log").read_text()
    assert read_metrics(run_dir)["test/samples"] == N_TEST


def test_trainer_ddp_runs_two_ranks(tiny_root: Path, tmp_path: Path) -> None:
    _, run_dir = train(tiny_root, tmp_path, "trainer=ddp", "trainer.max_epochs=1")
    cfg = job_config(run_dir)
    assert (cfg.devices, cfg.strategy.name) == (2, "ddp")
    assert OmegaConf.to_container(cfg.trainer) == {**default_trainer(), "max_epochs": 1}
    logs = [run_dir / "train.log", *sorted(run_dir.glob("train_ddp_process_*.log"))]
    fit_lines = [line for log in logs for line in log.read_text().splitlines() if " fit: " in line]
    assert len(fit_lines) == 2, fit_lines
    assert "rank 0/2 " in fit_lines[0] and "rank 1/2 " in fit_lines[1]
    assert read_metrics(run_dir)["test/samples"] == N_TEST, "each test sample counted once"


def test_trainer_gpu_composes_and_is_refused_without_a_gpu(tiny_root: Path, tmp_path: Path) -> None:
    shown = run_entry("train", "trainer=gpu", "--cfg", "job", cwd=tmp_path)
    cfg = OmegaConf.create(shown.stdout)
    assert (cfg.accelerator, cfg.devices) == ("gpu", 1)
    assert OmegaConf.to_container(cfg.trainer) == default_trainer()
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: trainer=gpu is not refused here")
    proc = run_entry("train", *tiny_overrides(tiny_root), "trainer=gpu", cwd=tmp_path, check=False)
    assert proc.returncode == 1
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert lines == [
        "Error: accelerator=gpu but no GPU is visible here (torch.cuda.device_count() is 0); "
        "use accelerator=cpu or accelerator=auto"
    ]
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "mlflow.db").exists()


# --- debug presets

TRAIN_SPLIT = N_TRAIN - VAL_SIZE


@pytest.mark.parametrize(
    ("preset", "batch", "samples"),
    [
        # 5 training, 2 validation and 2 test batches, one epoch.
        ("fast", 16, {"train": 5 * 16, "val": 2 * 16, "test": 2 * 16, "epochs": 1}),
        # 20 training, 5 validation and 5 test batches per epoch, the usual epochs.
        ("limit", 8, {"train": 20 * 8, "val": 5 * 8, "test": 5 * 8, "epochs": 3}),
    ],
)
def test_debug_presets_limit_the_batches(
    preset: str, batch: int, samples: dict, tiny_root: Path, tmp_path: Path
) -> None:
    assert samples["train"] < TRAIN_SPLIT and samples["val"] < VAL_SIZE < N_TEST
    _, run_dir = train(tiny_root, tmp_path, f"debug={preset}", f"data.batch_size={batch}")
    metrics = read_metrics(run_dir)
    for stage in ("train", "val", "test"):
        assert metrics[f"{stage}/samples"] == samples[stage], stage
    last = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)
    assert last["epoch"] == samples["epochs"] - 1, "the last epoch trained"


def test_debug_overfit_trains_the_same_batches_every_epoch(tiny_root: Path, tmp_path: Path) -> None:
    record = tmp_path / "batches.jsonl"
    env = {"PYTHONPATH": f"{RECORD_BATCHES}{os.pathsep}{PROJECT}", "RECORD_BATCHES": str(record)}
    _, run_dir = train(tiny_root, tmp_path, "debug=overfit", "trainer.max_epochs=3", env=env)
    steps = [json.loads(line) for line in record.read_text().splitlines()]
    by_epoch: dict[int, list] = {}
    for step in steps:
        by_epoch.setdefault(step["epoch"], []).append(step["indices"])
    assert sorted(by_epoch) == [0, 1, 2]
    first = by_epoch[0]
    assert len(first) == 2 and all(len(batch) == BATCH_SIZE for batch in first), "2 full batches"
    assert len({i for batch in first for i in batch}) == 2 * BATCH_SIZE, "two different batches"
    assert all(batches == first for batches in by_epoch.values()), "the same batches, same order"
    metrics = read_metrics(run_dir)
    assert metrics["train/samples"] == metrics["val/samples"] == 2 * BATCH_SIZE
    assert metrics["test/samples"] == 2 * BATCH_SIZE, "overfit_batches alone tests them all"


def test_debug_profiler_reports_a_handful_of_steps(tiny_root: Path, tmp_path: Path) -> None:
    proc, _ = train(tiny_root, tmp_path, "debug=profiler")
    out = proc.stdout + proc.stderr
    assert "FIT Profiler Report" in out and "TEST Profiler Report" in out
    fit_report = out.split("FIT Profiler Report", 1)[1].split("TEST Profiler Report", 1)[0]
    row = next(line for line in fit_report.splitlines() if "|  run_training_batch " in line)
    calls = int(row.split("|")[3])  # Action | Mean duration (s) | Num calls | ...
    assert calls == 10, row
