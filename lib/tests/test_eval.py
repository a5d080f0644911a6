"""``python -m src.eval`` on the checkpoint of the shared training job (the first test is in the
daily set: eval runs end to end there)."""

from pathlib import Path

import pytest
import torch

from tests.conftest import (
    DATA_NAME,
    TRAIN_RUN_NAME,
    VAL_SIZE,
    best_checkpoint,
    only_run,
    read_metrics,
    run_entry,
)


def run_eval(trained: dict, workdir: Path, *overrides: str) -> Path:
    """Evaluate the shared training job's best checkpoint (its data where the checkpoint says it
    is); return the eval's output folder."""
    run_dir = workdir / "eval"
    run_entry(
        "eval",
        f"ckpt_path={best_checkpoint(trained['run_dir'])}",
        *overrides,
        f"hydra.run.dir={run_dir}",
        cwd=workdir,
    )
    return run_dir


def test_eval_reproduces_the_training_jobs_test_metrics(trained: dict[str, Path], tmp_path: Path):
    """The training job tested the same best checkpoint on the same data."""
    metrics = read_metrics(run_eval(trained, tmp_path, "logger=none"))
    tested = {k: v for k, v in read_metrics(trained["run_dir"]).items() if k.startswith("test/")}
    assert metrics == pytest.approx(tested, abs=1e-6)


@pytest.mark.slow
def test_eval_is_an_mlflow_run_linked_to_its_training_run(
    trained: dict[str, Path], tiny_root: Path
) -> None:
    workdir = trained["workdir"]  # the training job's store
    run_eval(trained, workdir)
    _, source = only_run(workdir / "mlflow.db", task="train")
    client, run = only_run(workdir / "mlflow.db", task="eval")
    assert run.info.status == "FINISHED" and run.info.run_name == f"eval {TRAIN_RUN_NAME}"
    assert run.data.tags["source_run_id"] == source.info.run_id
    assert run.data.tags["mlflow.parentRunId"] == source.info.run_id  # nested in the UI
    assert run.data.tags["source_checkpoint"] == str(best_checkpoint(trained["run_dir"]))
    assert run.data.metrics["test/loss"] == pytest.approx(
        read_metrics(trained["run_dir"])["test/loss"], abs=1e-6
    )


@pytest.mark.slow
def test_eval_on_the_validation_split(
    trained: dict[str, Path], tiny_root: Path, tmp_path: Path
) -> None:
    run_dir = run_eval(trained, tmp_path, f"data.val_size={VAL_SIZE}", "split=val", "logger=none")
    metrics = read_metrics(run_dir)
    assert metrics["val/samples"] == VAL_SIZE
    # the best checkpoint's: the lowest val/loss of the job's validations
    assert metrics["val/loss"] == pytest.approx(
        read_metrics(trained["run_dir"])["val/loss_best"], abs=1e-6
    )


@pytest.mark.slow
def test_eval_refuses_a_checkpoint_of_another_dataset(
    trained: dict[str, Path], tiny_root: Path, tmp_path: Path
) -> None:
    proc = run_entry(
        "eval",
        f"ckpt_path={best_checkpoint(trained['run_dir'])}",
        "data=noisy",
        "logger=none",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    assert f"was trained on {DATA_NAME} but data=noisy; add data={DATA_NAME}" in proc.stderr


@pytest.mark.slow
def test_eval_without_checkpoint_says_what_to_pass(tmp_path: Path) -> None:
    proc = run_entry("eval", "logger=none", cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "ckpt_path is required" in proc.stderr


@pytest.mark.slow
def test_eval_loads_a_checkpoint_written_before_newer_config_keys(
    trained: dict[str, Path], tiny_root: Path, tmp_path: Path
) -> None:
    """(A key of a nested model section: tests/task/test_predict.py, on the image task's.)"""
    saved = torch.load(best_checkpoint(trained["run_dir"]), weights_only=True)
    del saved["hyper_parameters"]["lr"]  # as if written before the key existed; default 0.01
    torch.save(saved, tmp_path / "old.ckpt")
    proc = run_entry(
        "eval",
        f"ckpt_path={tmp_path / 'old.ckpt'}",
        "logger=none",
        f"hydra.run.dir={tmp_path / 'eval'}",
        cwd=tmp_path,
    )
    warning = "old.ckpt predates config keys lr=0.01"
    assert warning in " ".join(proc.stderr.split())
    metrics = read_metrics(tmp_path / "eval")
    assert metrics["test/loss"] == pytest.approx(
        read_metrics(trained["run_dir"])["test/loss"], abs=1e-6
    )
