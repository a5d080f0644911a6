"""``python -m src.eval`` on the checkpoint of the shared training job (the first test is in the
daily set: eval runs end to end there)."""

from pathlib import Path

import pytest
import torch

from tests.conftest import VAL_SIZE, only_run, read_metrics, run_entry


def best_checkpoint(run_dir: Path) -> Path:
    (path,) = (run_dir / "checkpoints").glob("epoch*-step*.ckpt")
    return path


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
    assert run.info.status == "FINISHED" and run.info.run_name == "eval mnist"
    assert run.data.tags["source_run_id"] == source.info.run_id
    assert run.data.tags["mlflow.parentRunId"] == source.info.run_id  # nested in the UI
    assert run.data.tags["source_checkpoint"] == str(best_checkpoint(trained["run_dir"]))
    assert run.data.metrics["test/acc"] == read_metrics(trained["run_dir"])["test/acc"]


@pytest.mark.slow
def test_eval_on_the_validation_split(
    trained: dict[str, Path], tiny_root: Path, tmp_path: Path
) -> None:
    run_dir = run_eval(trained, tmp_path, f"data.val_size={VAL_SIZE}", "split=val", "logger=none")
    metrics = read_metrics(run_dir)
    assert metrics["val/samples"] == VAL_SIZE
    assert metrics["val/acc"] == read_metrics(trained["run_dir"])["val/acc_best"]


@pytest.mark.slow
def test_eval_refuses_a_checkpoint_of_another_dataset(
    trained: dict[str, Path], tiny_root: Path, tmp_path: Path
) -> None:
    proc = run_entry(
        "eval",
        f"ckpt_path={best_checkpoint(trained['run_dir'])}",
        f"data.root={tiny_root}",
        "data=fashion_mnist",
        "logger=none",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    assert "was trained on mnist but data=fashion_mnist; add data=mnist" in proc.stderr


@pytest.mark.slow
def test_eval_without_checkpoint_says_what_to_pass(tmp_path: Path) -> None:
    proc = run_entry("eval", "logger=none", cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert "ckpt_path is required" in proc.stderr


@pytest.mark.slow
def test_eval_loads_a_checkpoint_written_before_newer_config_keys(
    trained: dict[str, Path], tiny_root: Path, tmp_path: Path
) -> None:
    saved = torch.load(best_checkpoint(trained["run_dir"]), weights_only=True)
    del saved["hyper_parameters"]["channels_last"]  # as if written before the key existed
    del saved["hyper_parameters"]["net"]["batch_norm"]  # default True: what it was trained with
    torch.save(saved, tmp_path / "old.ckpt")
    proc = run_entry(
        "eval",
        f"ckpt_path={tmp_path / 'old.ckpt'}",
        f"data.root={tiny_root}",
        "logger=none",
        f"hydra.run.dir={tmp_path / 'eval'}",
        cwd=tmp_path,
    )
    warning = "old.ckpt predates config keys channels_last=False, net.batch_norm=True"
    assert warning in " ".join(proc.stderr.split())
    metrics = read_metrics(tmp_path / "eval")
    assert metrics["test/acc"] == read_metrics(trained["run_dir"])["test/acc"]
