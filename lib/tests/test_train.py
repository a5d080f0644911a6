"""End-to-end: ``python -m src.train`` on the task's tiny job (``tests/task/tiny_job.py``), as a
subprocess. The checks of the session's one ``trained`` job are in the daily set (``python -m
pytest``): they check what the machinery promises, for any task (the shipped task's own numbers:
``tests/task/test_tiny_job.py``); the tests that start jobs of their own are slow."""

import contextlib
import csv
import itertools
import json
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from lightning_exact.job.config import flatten
from lightning_exact.tracking.store import mask_secrets
from mlflow import MlflowClient

from src.task import TASK
from tests.conftest import (
    BATCH_SIZE,
    DATA_NAME,
    FAKE_SECRET,
    LONG_VALUE,
    N_TEST,
    N_TRAIN,
    OPTIMIZER_STEPS_PER_BATCH,
    PROJECT,
    STEPS_PER_EPOCH,
    TRAIN_RUN_NAME,
    TRAINED_STEPS,
    VAL_SIZE,
    Job,
    assert_same_tensors,
    epoch_ends,
    only_run,
    read_metrics,
    run_entry,
    tiny_overrides,
    training_points,
)

# The trained job (tests/conftest.py): 2 epochs, validated twice an epoch, the training metrics
# logged every 4 steps.
VALIDATE_EVERY = max(1, int(STEPS_PER_EPOCH * 0.5))  # val_check_interval=0.5, as Lightning has it
LAST_STEP = 2 * STEPS_PER_EPOCH
# Every VALIDATE_EVERY batches of each epoch: of an odd number of steps, not at the epoch's end.
VALIDATIONS = [
    epoch * STEPS_PER_EPOCH + batches
    for epoch in range(2)
    for batches in range(VALIDATE_EVERY, STEPS_PER_EPOCH + 1, VALIDATE_EVERY)
]


def test_train_reports_the_tasks_metrics_and_seeds(trained: dict[str, Path]) -> None:
    metrics = read_metrics(trained["run_dir"])
    assert {TASK.monitor, TASK.config_values()["optimized_metric"]} <= metrics.keys()
    assert [name for name in metrics if name.startswith("test/")], "the best checkpoint tested"
    assert not {"step", "epoch"} & metrics.keys(), "the step axis is no metric"
    saved = torch.load(trained["run_dir"] / "checkpoints" / "last.ckpt", weights_only=True)
    assert saved["callbacks"]["SeedEachBatch"] == {"seed": 0}, "a falsy seed still seeds"


def test_train_leaves_checkpoints_config_and_log(trained: dict[str, Path]) -> None:
    run_dir = trained["run_dir"]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "last.ckpt").is_file()
    metric = TASK.monitor.rsplit("/", 1)[-1]
    assert len(list(ckpts.glob(f"epoch*-step*-{metric}*.ckpt"))) == 1, "the best, named by it"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["seed"] == 0
    assert (run_dir / "train.log").is_file()
    # Checkpoints hold plain values only: they load with torch.load's safe default.
    saved = torch.load(ckpts / "last.ckpt", weights_only=True)
    assert saved["datamodule_hyper_parameters"]["name"] == DATA_NAME
    assert saved["global_step"] == LAST_STEP * OPTIMIZER_STEPS_PER_BATCH


def test_train_logs_one_finished_mlflow_run(trained: dict[str, Path]) -> None:
    store = trained["workdir"] / "mlflow.db"
    assert store.is_file(), "the default store is mlflow.db in the launch folder"
    client, run = only_run(store)
    assert run.info.status == "FINISHED"
    # Named by its task's run_label alone: the experiment is the data's
    assert run.info.run_name == TRAIN_RUN_NAME and run.info.experiment_id != "0"
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(
        trained["workdir"] / "mlartifacts"
    )
    tested = {k: v for k, v in read_metrics(trained["run_dir"]).items() if k.startswith("test/")}
    assert {key: run.data.metrics[key] for key in tested} == pytest.approx(tested)


def test_mlflow_params_are_the_resolved_config_and_the_hardware(trained: dict[str, Path]) -> None:
    _, run = only_run(trained["workdir"] / "mlflow.db")
    params = run.data.params
    config = flatten(yaml.safe_load((trained["run_dir"] / "config.yaml").read_text()))
    config = mask_secrets(config)  # typed credentials are *** (below)
    del config["accelerator"]  # a param of the hardware used, below
    assert {key: params[key] for key in config} == {k: str(v) for k, v in config.items()}
    assert params["seed"] == "0"
    assert params["service.note"] == LONG_VALUE, "values are never cut short silently"
    assert (params["world_size"], params["num_devices"], params["num_nodes"]) == ("1", "1", "1")
    assert params["strategy"] == "SingleDeviceStrategy" and params["precision"] == "32-true"


def test_mlflow_tags_say_where_the_run_came_from(trained: dict[str, Path]) -> None:
    _, run = only_run(trained["workdir"] / "mlflow.db")
    tags = run.data.tags
    assert tags["command"].startswith("python -m src.train ")
    assert "seed=0" in tags["hydra.overrides"].split()
    assert tags["hydra.output_dir"] == str(trained["run_dir"])
    assert tags["host"] and tags["task"] == "train"
    assert "sweep.id" not in tags, "a single run is not part of a sweep"
    if has_commit(PROJECT):
        assert len(tags["mlflow.source.git.commit"]) == 40, "MLflow's own source tags"


def has_commit(folder: Path) -> bool:
    """Whether ``folder`` is a git checkout with a commit (MLflow tags runs with it)."""
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True)
    return git.returncode == 0


def test_secrets_never_become_params_or_tags(trained: dict[str, Path]) -> None:
    _, run = only_run(trained["workdir"] / "mlflow.db")
    everything = [*run.data.params.values(), *run.data.tags.values()]
    assert not [value for value in everything if FAKE_SECRET in value]
    assert run.data.params["service.api_token"] == "***"
    assert run.data.params["service.url"] == "https://user:***@example.com/data"
    assert "+service.api_token=***" in run.data.tags["hydra.overrides"]


def test_mlflow_metrics_are_at_the_global_step(trained: dict[str, Path]) -> None:
    """2 epochs, validated twice an epoch (of any number of steps), the training metrics logged
    every 4 steps and at each epoch's end (the steps since the last point): each at the global
    step, with the epoch it fell in; the best checkpoint chosen among every validation,
    mid-epoch ones too."""
    client, run = only_run(trained["workdir"] / "mlflow.db")
    history = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in run.data.metrics
    }
    validations = VALIDATIONS
    trained_at = sorted({*range(4, LAST_STEP + 1, 4), STEPS_PER_EPOCH, LAST_STEP})
    assert [step for step, _ in history[TASK.monitor]] == validations
    for key, points in history.items():
        steps = [step for step, _ in points]
        if key.startswith("val/"):
            assert steps == validations, key
        elif key.startswith("train/"):  # as the task logs them: each epoch's end at least
            assert {STEPS_PER_EPOCH, LAST_STEP} <= set(steps) <= set(trained_at), key
        elif key.startswith("test/"):
            assert steps == [LAST_STEP], key
    epochs = {step: (step - 1) // STEPS_PER_EPOCH for step in {*validations, *trained_at}}
    assert history["epoch"] == sorted(epochs.items())
    pick = max if TASK.mode == "max" else min
    best_step = pick(history[TASK.monitor], key=lambda point: point[1])[0]  # the first of equals
    (best,) = (trained["run_dir"] / "checkpoints").glob("epoch*-step*.ckpt")
    assert f"-step{best_step:06d}-" in best.name, "the best of every validation"


def test_the_best_so_far_is_the_best_checkpoints_score_and_the_jobs_result(
    trained: dict[str, Path],
) -> None:
    """``<monitor>_best``, the machinery's for any task, at each validation the best value so
    far: what the best checkpoint (tested, logged, registered) scored, and what the job returns
    to sweepers (job.json, metrics.json), not the last validation's."""
    client, run = only_run(trained["workdir"] / "mlflow.db")
    scores = client.get_metric_history(run.info.run_id, TASK.monitor)
    best_so_far = client.get_metric_history(run.info.run_id, f"{TASK.monitor}_best")
    pick = max if TASK.mode == "max" else min
    running = list(itertools.accumulate((m.value for m in scores), pick))
    assert [(m.step, m.value) for m in best_so_far] == [
        (m.step, pytest.approx(value)) for m, value in zip(scores, running, strict=True)
    ]
    metrics = read_metrics(trained["run_dir"])
    job = json.loads((trained["run_dir"] / "job.json").read_text())
    assert metrics[f"{TASK.monitor}_best"] == pytest.approx(running[-1])
    if TASK.optimized_metric is None:  # the task returns its best checkpoint's score
        assert job["result"] == metrics[f"{TASK.monitor}_best"]
    (best,) = (trained["run_dir"] / "checkpoints").glob("epoch*-step*.ckpt")
    assert best.stem.endswith(f"{running[-1]:.4f}"), "the score in its name"


def test_mlflow_artifacts_and_dataset_inputs(trained: dict[str, Path], tmp_path: Path) -> None:
    client, run = only_run(trained["workdir"] / "mlflow.db")
    run_id = run.info.run_id
    config = Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path)))
    assert config.read_text() == (trained["run_dir"] / "config.yaml").read_text()
    assert json.loads(
        Path(client.download_artifacts(run_id, "metrics.json", str(tmp_path))).read_text()
    )
    (ckpt,) = client.list_artifacts(run_id, "checkpoints")
    assert ckpt.path.startswith("checkpoints/epoch") and ckpt.file_size > 1000
    inputs = {d.dataset.name: {t.key: t.value for t in d.tags} for d in run.inputs.dataset_inputs}
    assert inputs == {
        f"{DATA_NAME}/train": {"mlflow.data.context": "train", "samples": str(N_TRAIN - VAL_SIZE)},
        f"{DATA_NAME}/validation": {"mlflow.data.context": "validation", "samples": str(VAL_SIZE)},
        f"{DATA_NAME}/test": {"mlflow.data.context": "test", "samples": str(N_TEST)},
    }
    assert all(len(d.dataset.digest) == 32 for d in run.inputs.dataset_inputs)


@pytest.mark.slow
def test_train_resumes_at_the_next_epoch_with_its_best_metric(
    trained: dict[str, Path], tiny_root: Path, tmp_path: Path
) -> None:
    first = read_metrics(trained["run_dir"])
    last = trained["run_dir"] / "checkpoints" / "last.ckpt"
    run_dir = tmp_path / "resumed"
    overrides = tiny_overrides(tiny_root, logger="csv")
    overrides = [o for o in overrides if not o.startswith("trainer.max_epochs")]
    run_entry(
        "train",
        *overrides,
        *TRAINED_STEPS,
        "trainer.max_epochs=3",
        "seed=0",  # the trained job's (another seed would be another job: refused)
        f"ckpt_path={last}",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    with (run_dir / "csv" / "metrics.csv").open() as file:
        rows = [row for row in csv.DictReader(file) if row.get(TASK.monitor)]
    assert [float(row["epoch"]) for row in rows] == [2, 2], "only the third epoch is trained"
    resumed = read_metrics(run_dir)
    best = min if TASK.mode == "min" else max
    assert resumed["val/loss_best"] == pytest.approx(
        best(first["val/loss_best"], *(float(row[TASK.monitor]) for row in rows))
    )
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    batches_per_epoch = (N_TRAIN - VAL_SIZE) // BATCH_SIZE
    assert (saved["epoch"], saved["global_step"]) == (2, 3 * batches_per_epoch)


@pytest.mark.slow
def test_failing_run_is_marked_failed(tiny_root: Path, tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("a file where checkpoints should go")
    proc = run_entry(
        "train",
        *tiny_overrides(tiny_root),
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(DATA_NAME).experiment_id])
    assert [run.info.status for run in runs] == ["FAILED"]


# --- resuming after a crash: the same result as never stopping

EPOCH_METRICS = ("train/loss", "train/mae", "val/loss", "val/mae", "val/loss_best")


def history(store: Path) -> tuple[object, dict[str, list[tuple[int, float]]]]:
    client, run = only_run(store)
    return run, {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in EPOCH_METRICS
    }


def wait_for_metric(store: Path, key: str, timeout: float = 60) -> None:
    """Wait until a run in the SQLite store has a point of ``key`` (read-only queries)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.closing(
            sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5)
        ) as db:
            try:
                if db.execute("SELECT 1 FROM metrics WHERE key = ?", (key,)).fetchone():
                    return
            except sqlite3.OperationalError:  # the schema is still being created
                pass
        time.sleep(0.05)
    pytest.fail(f"no {key} in {store} after {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2])  # 1 rank: tests/test_resume.py
def test_resume_after_a_kill_equals_an_uninterrupted_run(
    devices: int, tiny_root: Path, tmp_path: Path
) -> None:
    overrides = [*tiny_overrides(tiny_root), "trainer.max_epochs=6", f"devices={devices}"]
    overrides += ["strategy=ddp"] if devices > 1 else []
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    reference.mkdir(), crashed.mkdir()
    run_entry("train", *overrides, f"hydra.run.dir={reference / 'run'}", cwd=reference)

    # The same job, its last rank process SIGKILLed as soon as a first last.ckpt exists and its
    # epoch's train/* metrics are in MLflow: Lightning logs them just after the epoch-end
    # checkpoint, and a kill in between loses those points (docs/troubleshooting.md).
    job = Job(PROJECT, crashed, *overrides)
    try:
        processes = job.wait_for_checkpoint(ranks=devices)
        wait_for_metric(crashed / "mlflow.db", "train/loss")
        processes[-1].kill()
        job.wait(timeout=60)
    finally:
        job.kill_all()
    stopped_at = torch.load(job.last, weights_only=True)["epoch"]
    assert stopped_at < 5, "the kill came too late to leave anything to resume"
    run_entry(
        "train",
        *overrides,
        f"ckpt_path={job.last}",
        f"hydra.run.dir={crashed / 'resumed'}",
        cwd=crashed,
    )

    expected = torch.load(reference / "run/checkpoints/last.ckpt", weights_only=True)
    resumed = torch.load(crashed / "resumed/checkpoints/last.ckpt", weights_only=True)
    for part in ("epoch", "global_step", "state_dict", "optimizer_states", "lr_schedulers"):
        assert_same_tensors(resumed[part], expected[part], part)  # incl. val_loss_best's state
    expected_metrics = read_metrics(reference / "run")
    for name, value in read_metrics(crashed / "resumed").items():
        assert value == pytest.approx(expected_metrics[name], rel=1e-5, abs=1e-6), name

    # One MLflow run, continued: every epoch once, with the uninterrupted run's values.
    _, expected_history = history(reference / "mlflow.db")
    run, resumed_history = history(crashed / "mlflow.db")
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"
    assert "ckpt_path: None -> " in run.data.tags["resume.1.changed_params"]
    for key, points in expected_history.items():
        logged = training_points(6) if key.startswith("train/") else epoch_ends(6)
        assert [step for step, _ in resumed_history[key]] == logged, key
        values = [value for _, value in resumed_history[key]]
        assert values == pytest.approx([v for _, v in points], rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_resume_starts_a_new_run_when_asked(tiny_root: Path, tmp_path: Path) -> None:
    overrides = [*tiny_overrides(tiny_root), "trainer.max_epochs=1"]
    run_entry("train", *overrides, f"hydra.run.dir={tmp_path / 'first'}", cwd=tmp_path)
    run_entry(
        "train",
        *tiny_overrides(tiny_root),
        f"ckpt_path={tmp_path / 'first/checkpoints/last.ckpt'}",
        "logger.continue_run=false",
        f"hydra.run.dir={tmp_path / 'second'}",
        cwd=tmp_path,
    )
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(DATA_NAME).experiment_id])
    assert [run.info.status for run in runs] == ["FINISHED", "FINISHED"]
    second = next(run for run in runs if run.data.tags["hydra.output_dir"].endswith("second"))
    steps = [m.step for m in client.get_metric_history(second.info.run_id, TASK.monitor)]
    assert steps == [2 * STEPS_PER_EPOCH], (
        "the new run holds the steps trained after the checkpoint"
    )
