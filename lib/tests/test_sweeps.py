"""Hydra multirun sweeps whose jobs are DDP or FSDP jobs, and the Optuna search, run for real on
the test task (the guides' sweeps as the pages write them: tests/template/test_sweep_guides.py).

Typed as a user types them: the sweep folder is Hydra's default, ``outputs/train/multiruns/<time>``
(unless a test places it)."""

import contextlib
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import (
    DATA_NAME,
    N_TRAIN,
    PROJECT,
    assert_same_tensors,
    kill_process_trees,
    read_metrics,
    run_entry,
    signal_at_step,
    tiny_overrides,
)

pytestmark = pytest.mark.slow


def sweep_overrides(tiny_root: Path, model: bool = False) -> list[str]:
    # lr is what the sweeps vary, so it is left out of the shared tiny overrides.
    shared = tiny_overrides(tiny_root, model=model)
    shared = [o for o in shared if not o.startswith(("model.lr=", "trainer."))]
    return [*shared, "trainer.max_epochs=1"]


def sweep_folders(workdir: Path) -> list[Path]:
    """The sweeps launched from ``workdir``, in the default layout, oldest first."""
    return sorted((workdir / "outputs" / "train" / "multiruns").iterdir())


def runs_by_job(store: Path) -> dict[int, object]:
    client = MlflowClient(f"sqlite:///{store}")
    runs = client.search_runs([client.get_experiment_by_name(DATA_NAME).experiment_id])
    return {int(run.data.tags["sweep.job"]): run for run in runs if "sweep.job" in run.data.tags}


def test_failed_sweep_job_is_reported_and_the_next_runs(tiny_root: Path, tmp_path: Path) -> None:
    """A sweep of FSDP jobs (the guide's is of DDP jobs): job 0 fails before training, job 1
    trains sharded into its own run and logs its model."""
    sweep = tmp_path / "sweep"
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "checkpoints").write_text("a file where job 0's checkpoints should go")
    proc = run_entry(
        "train",
        "-m",
        *sweep_overrides(tiny_root, model=True),
        f"hydra.sweep.dir={sweep}",
        "model.lr=0.01,0.02",
        "strategy=fsdp",
        "devices=2",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    assert "sweep job 0 exited with code 1" in proc.stderr
    assert f"File exists: '{sweep / '0' / 'checkpoints'}'" in proc.stderr
    runs = runs_by_job(tmp_path / "mlflow.db")
    assert runs[0].info.status == "FAILED" and runs[1].info.status == "FINISHED"
    assert (sweep / "1" / "metrics.json").is_file()
    assert proc.stdout.count("MLflow model models:/") == 1, proc.stdout[-3000:]
    assert "not logged as an MLflow model" not in proc.stderr


def test_a_seed_sweep_nests_its_runs_under_a_parent_that_sums_them_up(
    tiny_root: Path, tmp_path: Path
) -> None:
    """The sweep's parent run: children nested, a table of every job, the best job, and for jobs
    that differ only in seed, the mean, standard deviation and 95% interval of each metric."""
    run_entry("train", "-m", *sweep_overrides(tiny_root), "seed=1,2,3", cwd=tmp_path)
    (sweep,) = sweep_folders(tmp_path)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(DATA_NAME).experiment_id])
    (parent,) = [run for run in runs if run.data.tags.get("sweep.parent") == sweep.name]
    children = runs_by_job(tmp_path / "mlflow.db")
    assert sorted(children) == [0, 1, 2] and len(runs) == 4
    assert {run.data.tags["mlflow.parentRunId"] for run in children.values()} == {
        parent.info.run_id
    }
    assert parent.info.status == "FINISHED" and "-m" in parent.data.tags["command"]
    assert parent.info.run_name == "sweep seed=1,2,3", "what it sweeps"
    metrics = [json.loads((sweep / str(job) / "metrics.json").read_text()) for job in range(3)]
    # the task's optimized metric (its monitor, val/loss), lowest best: the first of ties
    best = min(range(3), key=lambda job: metrics[job]["val/loss"])
    assert parent.data.tags["best.job"] == str(best)
    assert parent.data.tags["best.run_id"] == children[best].info.run_id
    for key in ("test/mae", "val/loss_best", "test/loss"):
        values = [m[key] for m in metrics]
        centre, sd = statistics.mean(values), statistics.stdev(values)
        half = 4.302652729911275 * sd / 3**0.5  # Student's t, 2 degrees of freedom, 97.5%
        got = parent.data.metrics
        assert got[f"{key}_mean"] == pytest.approx(centre) and got[f"{key}_std"] == pytest.approx(
            sd
        )
        assert got[f"{key}_ci95_low"] == pytest.approx(centre - half)
        assert got[f"{key}_ci95_high"] == pytest.approx(centre + half)
    table = client.download_artifacts(parent.info.run_id, "jobs.csv", str(tmp_path))
    with open(table) as file:
        rows = list(csv.DictReader(file))
    assert [(r["job"], r["overrides"], r["status"]) for r in rows] == [
        (str(job), f"seed={job + 1}", "finished") for job in range(3)
    ]
    assert [float(r["test/mae"]) for r in rows] == [m["test/mae"] for m in metrics]


def test_a_sweep_killed_anywhere_run_again_ends_as_the_uninterrupted_sweep(
    tiny_root: Path, tmp_path: Path
) -> None:
    """A 2-job sweep (one job on 1 rank, one DDP job on 2) SIGKILLed with all its processes at a
    random moment, then the same -m command in the same folder: every job ends as in the
    uninterrupted sweep (finished ones read back, interrupted ones resumed); run once more, it
    trains nothing."""
    args = [
        *sweep_overrides(tiny_root),
        "strategy=ddp",
        "devices=1,2",
        "callbacks.checkpoint.every_n_train_steps=4",
    ]
    started = time.monotonic()
    run_entry("train", "-m", *args, "hydra.sweep.dir=reference", cwd=tmp_path)
    delay = random.uniform(0.1, 0.9) * (time.monotonic() - started)
    sweep = subprocess.Popen(
        [sys.executable, "-m", "src.train", "-m", *args, "hydra.sweep.dir=sweep"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(PROJECT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with contextlib.suppress(subprocess.TimeoutExpired):
        sweep.wait(timeout=delay)
    kill_process_trees(sweep)
    where = f"killed {delay:.1f} s after the sweep started"
    run_entry("train", "-m", *args, "hydra.sweep.dir=sweep", cwd=tmp_path)
    for job in ("0", "1"):
        expected = torch.load(
            tmp_path / "reference" / job / "checkpoints/last.ckpt", weights_only=True
        )
        resumed = torch.load(tmp_path / "sweep" / job / "checkpoints/last.ckpt", weights_only=True)
        assert_same_tensors(resumed["state_dict"], expected["state_dict"], f"job {job}, {where}")
        reference = read_metrics(tmp_path / "reference" / job)
        for key, value in read_metrics(tmp_path / "sweep" / job).items():
            assert value == pytest.approx(reference[key], rel=1e-5, abs=1e-6), (job, key, where)
    once_more = run_entry("train", "-m", *args, "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert once_more.stdout.count("finished in an earlier run") == 2, where
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs(
        [client.get_experiment_by_name(DATA_NAME).experiment_id], "tags.task = 'train'"
    )
    assert len(runs) == 2 + 2, f"the reference's runs and the sweep's, continued; {where}"
    assert all(run.info.status == "FINISHED" for run in runs), where
    parents = client.search_runs([runs[0].info.experiment_id], "tags.`sweep.parent` = 'sweep'")
    assert len(parents) == 1, f"run again, the sweep continues its parent run; {where}"
    assert {
        r.data.tags["mlflow.parentRunId"] for r in runs if r.data.tags["sweep.id"] == "sweep"
    } == {parents[0].info.run_id}, where


def test_a_killed_optuna_search_run_again_resumes_its_unfinished_trial(
    tiny_root: Path, tmp_path: Path
) -> None:
    """Killed mid-trial (SIGKILL: the study keeps the trial RUNNING), the same command in the
    same folder resumes that trial in its folder from its step checkpoint, and tells the study
    the value of an uninterrupted trial: its val/loss (the task's optimized metric), logged
    before the kill only."""
    # data.batch_size=48: 5 steps an epoch on the tiny data; it validates after step 5 only
    # (max_steps=9).
    args = [
        *sweep_overrides(tiny_root),
        "hparams_search=mlp_optuna",
        "seed=7",
        "data.batch_size=48",
        "trainer.max_epochs=2",
        "trainer.max_steps=9",
        "callbacks.checkpoint.every_n_train_steps=2",
        "hydra.sweeper.n_trials=1",
    ]
    (tmp_path / "ref").mkdir()  # its own optuna.db
    run_entry("train", "-m", *args, "hydra.sweep.dir=reference", cwd=tmp_path / "ref")
    env = signal_at_step("8:SIGKILL")  # in the last step, after the step-8 checkpoint
    killed = run_entry(
        "train", "-m", *args, "hydra.sweep.dir=sweep", cwd=tmp_path, check=False, env=env
    )
    assert killed.returncode == -9
    again = run_entry("train", "-m", *args, "hydra.sweep.dir=sweep", cwd=tmp_path)
    assert "trial 0 was interrupted: it resumes in its folder" in again.stdout + again.stderr
    assert "Restored all states" in again.stderr
    assert not (tmp_path / "sweep" / "1").exists()
    reference = read_metrics(tmp_path / "ref" / "reference" / "0")
    resumed = read_metrics(tmp_path / "sweep" / "0")
    assert resumed.keys() == reference.keys()
    for key, value in resumed.items():
        assert value == pytest.approx(reference[key], rel=1e-5, abs=1e-6), key
    study = optuna.load_study(
        study_name=f"mlp-{DATA_NAME}", storage=f"sqlite:///{tmp_path}/optuna.db"
    )
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.COMPLETE
    assert trial.value == pytest.approx(reference["val/loss"]) == reference["val/loss_best"]


def test_a_sweep_folder_of_another_sweep_is_refused_in_one_line(
    tiny_root: Path, tmp_path: Path
) -> None:
    run_entry(
        "train", "-m", *sweep_overrides(tiny_root), "seed=1", "hydra.sweep.dir=s", cwd=tmp_path
    )
    other = run_entry(
        "train",
        "-m",
        *sweep_overrides(tiny_root),
        "seed=5",
        "hydra.sweep.dir=s",
        cwd=tmp_path,
        check=False,
    )
    assert other.returncode != 0
    (line,) = other.stderr.strip().splitlines()
    assert "holds another sweep" in line and "seed=1" in line, line
    assert json.loads((tmp_path / "s" / "0" / "job.json").read_text())["result"] is not None


def test_a_k_fold_sweep_validates_on_each_fold_once_and_sums_them_up(
    tiny_root: Path, tmp_path: Path
) -> None:
    run_entry(
        "train",
        "-m",
        *sweep_overrides(tiny_root),
        "data.folds=3",
        "data.fold=0,1,2",
        "hydra.sweep.dir=folds",
        cwd=tmp_path,
    )
    metrics = [read_metrics(tmp_path / "folds" / str(job)) for job in range(3)]
    assert sum(m["val/samples"] for m in metrics) == N_TRAIN, "every training sample validates once"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(DATA_NAME).experiment_id])
    (parent,) = [run for run in runs if "sweep.parent" in run.data.tags]
    values = [m["val/loss"] for m in metrics]
    assert parent.data.metrics["val/loss_mean"] == pytest.approx(statistics.mean(values))
    assert parent.data.metrics["val/loss_std"] == pytest.approx(statistics.stdev(values))
