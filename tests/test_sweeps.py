"""Hydra multirun sweeps whose jobs are DDP jobs, and the Optuna search, run for real.

Typed as a user types them: the sweep folder is Hydra's default, ``outputs/train/multiruns/<time>``
(only the failure test places it, to plant the fault)."""

import contextlib
import csv
import itertools
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
from omegaconf import OmegaConf

from src.template.distributed import hparams_digest
from tests.conftest import (
    N_TRAIN,
    PROJECT,
    kill_process_trees,
    read_metrics,
    run_entry,
    signal_at_step,
    tiny_overrides,
)
from tests.test_readme import arguments, override, page_command, split_top_level
from tests.test_train import assert_same_tensors

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
    runs = client.search_runs([client.get_experiment_by_name("mnist").experiment_id])
    return {int(run.data.tags["sweep.job"]): run for run in runs if "sweep.job" in run.data.tags}


def rank_lines(job_dir: Path) -> list[str]:
    """What each rank of a job logged about the world and hyperparameters it trained with."""
    logs = [job_dir / "train.log", *sorted(job_dir.glob("train_ddp_process_*.log"))]
    return [line for log in logs for line in log.read_text().splitlines() if " fit: " in line]


def trained_lr(job_dir: Path) -> tuple[float, str]:
    """The lr in the job's checkpoint and the digest its ranks log of its hyperparameters."""
    saved = torch.load(job_dir / "checkpoints" / "last.ckpt", weights_only=True)
    hparams = saved["hyper_parameters"]
    return hparams["lr"], f"hyperparameters md5 {hparams_digest(hparams)}"


def test_the_guides_ddp_sweep_runs_every_job_once_with_its_own_world(
    tiny_root: Path, tmp_path: Path
) -> None:
    """The README's DDP sweep as written: devices x learning rates, each job its own world."""
    command = page_command("test_the_guides_ddp_sweep_runs_every_job_once_with_its_own_world")
    run_entry("train", *arguments(command), *sweep_overrides(tiny_root), cwd=tmp_path)
    worlds, lrs = (split_top_level(override(command, key)) for key in ("devices", "model.lr"))
    expected = dict(enumerate(itertools.product(worlds, lrs)))
    (sweep,) = sweep_folders(tmp_path)
    assert sorted(p.name for p in sweep.iterdir()) == sorted(
        [*map(str, expected), "jobs.csv", "mlflow_parent_run.json", "multirun.yaml"]
    )
    assert [p.name for p in (tmp_path / "outputs" / "train").iterdir()] == ["multiruns"], (
        "no rank ran a job or sweep of its own elsewhere"
    )
    runs = runs_by_job(tmp_path / "mlflow.db")
    assert {
        job: (r.data.params["world_size"], r.data.params["model.lr"]) for job, r in runs.items()
    } == expected
    assert len({run.data.tags["sweep.id"] for run in runs.values()}) == 1
    assert all(run.info.status == "FINISHED" for run in runs.values())
    # Each run is named for what its job varies (DDP jobs run as their own process tree too).
    assert {job: (r.info.run_name, r.data.tags["world_size"]) for job, r in runs.items()} == {
        job: (f"train mnist convnet devices={world} lr={lr}", world)
        for job, (world, lr) in expected.items()
    }
    for job, (world, lr) in expected.items():
        lines = rank_lines(sweep / str(job))
        assert len(lines) == int(world), "one line per rank, each in the job's own folder"
        trained, digest = trained_lr(sweep / str(job))
        assert trained == float(lr)
        for rank, line in enumerate(lines):
            assert f"rank {rank}/{world} " in line and digest in line


def test_failed_sweep_job_is_reported_and_the_next_runs(tiny_root: Path, tmp_path: Path) -> None:
    """A sweep of FSDP jobs (the guide's sweep above is of DDP jobs): job 0 fails before
    training, job 1 trains sharded into its own run and logs its model."""
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


def test_optuna_search_trains_each_trial_on_every_rank(tiny_root: Path, tmp_path: Path) -> None:
    """docs/sweeps.md's Optuna search of DDP jobs, as written (2 trials)."""
    command = page_command("test_optuna_search_trains_each_trial_on_every_rank")
    run_entry(
        "train",
        *arguments(command),
        *sweep_overrides(tiny_root),
        "hydra.sweeper.n_trials=2",
        cwd=tmp_path,
    )
    (sweep,) = sweep_folders(tmp_path)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"  # the default: optuna.db in the launch folder
    runs = runs_by_job(tmp_path / "mlflow.db")
    assert sorted(runs) == [0, 1]
    for job, run in runs.items():
        assert run.data.params["world_size"] == "2"
        lines = rank_lines(sweep / str(job))
        assert len(lines) == 2
        trained, digest = trained_lr(sweep / str(job))
        assert trained == float(run.data.params["model.lr"])
        assert all(digest in line for line in lines), "both ranks train the trial's lr"
    result = OmegaConf.load(sweep / "optimization_results.yaml")
    best = max(run.data.metrics["val/acc_best"] for run in runs.values())
    assert result.best_value == pytest.approx(best)
    study_name = override(command, "hydra.sweeper.study_name")
    study = optuna.load_study(study_name=study_name, storage=storage)
    assert len(study.trials) == 2 and study.best_value == pytest.approx(best)


def test_a_seed_sweep_nests_its_runs_under_a_parent_that_sums_them_up(
    tiny_root: Path, tmp_path: Path
) -> None:
    """The sweep's parent run: children nested, a table of every job, the best job, and for jobs
    that differ only in seed, the mean, standard deviation and 95% interval of each metric."""
    run_entry("train", "-m", *sweep_overrides(tiny_root), "seed=1,2,3", cwd=tmp_path)
    (sweep,) = sweep_folders(tmp_path)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("mnist").experiment_id])
    (parent,) = [run for run in runs if run.data.tags.get("sweep.parent") == sweep.name]
    children = runs_by_job(tmp_path / "mlflow.db")
    assert sorted(children) == [0, 1, 2] and len(runs) == 4
    assert {run.data.tags["mlflow.parentRunId"] for run in children.values()} == {
        parent.info.run_id
    }
    assert parent.info.status == "FINISHED" and "-m" in parent.data.tags["command"]
    assert parent.info.run_name == f"train mnist sweep {sweep.name}"
    metrics = [json.loads((sweep / str(job) / "metrics.json").read_text()) for job in range(3)]
    best = max(range(3), key=lambda job: metrics[job]["val/acc_best"])  # the first of ties
    assert parent.data.tags["best.job"] == str(best)
    assert parent.data.tags["best.run_id"] == children[best].info.run_id
    for key in ("test/acc", "val/acc_best", "test/loss"):
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
    assert [float(r["test/acc"]) for r in rows] == [m["test/acc"] for m in metrics]


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
        [client.get_experiment_by_name("mnist").experiment_id], "tags.task = 'train'"
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
    the value of an uninterrupted trial: its val/acc_best, logged before the kill only."""
    # seed=7: the first trial draws data.batch_size=64, 5 steps an epoch on the tiny data; it
    # validates after step 5 only (max_steps=9).
    args = [
        *sweep_overrides(tiny_root),
        "hparams_search=convnet_optuna",
        "seed=7",
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
    study = optuna.load_study(study_name="convnet-mnist", storage=f"sqlite:///{tmp_path}/optuna.db")
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.COMPLETE
    assert trial.value == pytest.approx(reference["val/acc_best"])


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
    runs = client.search_runs([client.get_experiment_by_name("mnist").experiment_id])
    (parent,) = [run for run in runs if "sweep.parent" in run.data.tags]
    values = [m["val/acc"] for m in metrics]
    assert parent.data.metrics["val/acc_mean"] == pytest.approx(statistics.mean(values))
    assert parent.data.metrics["val/acc_std"] == pytest.approx(statistics.stdev(values))
