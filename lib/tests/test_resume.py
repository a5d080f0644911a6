"""Exact resume wherever a job stops: real jobs stopped by real signals (delivered at a chosen
step by ``tests/signal_at_step``) or by SIGKILL after a step checkpoint, then
resumed; the result must equal an uninterrupted job's."""

import json
import os
import shlex
import sys
from pathlib import Path

import pytest
import torch
from lightning_exact.sweeps.jobs import JOB_FILE, resume_folder
from mlflow import MlflowClient

from tests.conftest import (
    BATCH_SIZE,
    DATA_NAME,
    PROJECT,
    STEPS_PER_EPOCH,
    assert_same_tensors,
    epoch_ends,
    load_checkpoint,
    read_metrics,
    run_entry,
    run_job,
    signal_at_step,
    tiny_overrides,
)
from tests.test_train import EPOCH_METRICS

EPOCHS = 3
EPOCH_ENDS = epoch_ends(EPOCHS)  # where the tiny job logs its validation metrics
LOG_EVERY = 4  # and its training metrics: every 4 steps and at each epoch's end
# In parallel runs (-n), one worker runs this module: its tests share the reference jobs.
pytestmark = pytest.mark.xdist_group("resume")


def overrides(
    tiny_root: Path, devices: int, strategy: str = "ddp", job: tuple[str, ...] = ()
) -> list[str]:
    ranks = [f"strategy={strategy}", f"devices={devices}"] if devices > 1 else []
    steps = [f"trainer.max_epochs={EPOCHS}", f"trainer.log_every_n_steps={LOG_EVERY}"]
    return [*tiny_overrides(tiny_root), *steps, *ranks, *job]


def points_at(key: str, epochs: int) -> list[int]:
    """The steps where a job of ``overrides`` with ``epochs`` epochs logs ``key``."""
    ends = epoch_ends(epochs)
    if key.startswith("val/"):
        return ends
    return sorted(set(range(LOG_EVERY, ends[-1] + 1, LOG_EVERY)) | set(ends))


@pytest.fixture(scope="module")
def reference(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted job for a world size, strategy and the overrides that make its job
    another (run once per module and each)."""
    done: dict[tuple[int, str, tuple[str, ...]], Path] = {}

    def get(devices: int, strategy: str = "ddp", job: tuple[str, ...] = ()) -> Path:
        if (devices, strategy, job) not in done:
            workdir = tmp_path_factory.mktemp(f"reference{devices}{strategy}")
            args = overrides(tiny_root, devices, strategy, job)
            run_entry("train", *args, "hydra.run.dir=run", cwd=workdir)
            done[devices, strategy, job] = workdir
        return done[devices, strategy, job]

    return get


def history(
    store: Path, runs: int = 1, keys: tuple[str, ...] | None = EPOCH_METRICS
) -> tuple[object, dict[str, list[tuple[int, float]]]]:
    """The newest of the store's ``runs`` runs, and the points of its ``keys`` (None: every
    key but the system metrics)."""
    client = MlflowClient(f"sqlite:///{store}")
    experiment = client.get_experiment_by_name(DATA_NAME).experiment_id
    found = client.search_runs([experiment], order_by=["attribute.start_time DESC"])
    assert len(found) == runs, [r.info.run_id for r in found]
    return history_of(client, found[0].info.run_id, keys)


def history_of(
    client: MlflowClient, run_id: str, keys: tuple[str, ...] | None = EPOCH_METRICS
) -> tuple[object, dict]:
    run = client.get_run(run_id)
    every_key = [key for key in run.data.metrics if not key.startswith("system/")]
    points = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        for key in (every_key if keys is None else keys)
    }
    return run, points


def approx_points(points: list[tuple[int, float]]) -> list[tuple[int, object]]:
    """``points`` with each value compared up to float summation order."""
    return [(step, pytest.approx(value, rel=1e-5, abs=1e-6)) for step, value in points]


def stopped_job(workdir: Path, args: list[str], signal_at: str | None) -> int:
    """Run ``src.train`` until it stops; its exit code."""
    signal = signal_at_step(signal_at) if signal_at else {}
    env = {**os.environ, "PYTHONPATH": str(PROJECT), **signal}
    command = [sys.executable, "-m", "src.train", *args, "hydra.run.dir=run"]
    proc = run_job(command, cwd=workdir, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.returncode


CASES = {
    # name: devices, extra overrides, signal at step, exit code, step of last.ckpt, run status.
    # (The tiny job: 16 steps an epoch.) Training points every 4 steps: a stop at step 15 falls
    # between them, at 20 on one.
    "sigterm-mid-epoch": (1, [], "14:SIGTERM", 143, 15, "KILLED"),
    # Ranks agree every 3rd batch: asked in step 26 (batch 10 of epoch 1), they stop after 28,
    # a logging step.
    "sigterm-mid-epoch-2-ranks": (
        2,
        ["callbacks.stop_check_every_n_steps=3"],
        "26:SIGTERM",
        143,
        28,
        "KILLED",
    ),
    # Sharded (strategy=fsdp): each rank writes its shard of last.ckpt/, and loads it back.
    # Counted in steps (JOB): asked in step 21, after the last validation (step 16), they stop
    # after 22 (where they agree, not a logging step); the resume trains to 25, not validating.
    "fsdp-sigterm-mid-epoch-2-ranks": (
        2,
        ["callbacks.stop_check_every_n_steps=3"],
        "21:SIGTERM",
        143,
        22,
        "KILLED",
    ),
    "usr1-before-any-checkpoint": (1, [], "0:SIGUSR1", 138, 1, "KILLED"),
    "workers-epoch-end-2-ranks": (2, ["data.num_workers=2"], "31:SIGINT", 130, 32, "KILLED"),
    "workers-mid-epoch": (1, ["data.num_workers=2"], "19:SIGUSR1", 138, 20, "KILLED"),
    "step-checkpoint-then-sigkill": (
        1,
        ["callbacks.checkpoint.every_n_train_steps=4"],
        "21:SIGKILL",
        -9,
        20,
        "RUNNING",
    ),
}
# Cases whose job is not the reference's 3 epochs: their overrides (a reference of their own).
JOB = {"fsdp-sigterm-mid-epoch-2-ranks": ("trainer.max_steps=25",)}
# Cases whose resume is stopped again (SIGTERM) in its final test, after its fit ended, and
# resumed once more: it trains nothing, tests, and reports what the fits before logged. (Under
# FSDP a SIGTERM in the test once hung both ranks: Lightning's handler broadcast from rank 0
# while rank 1 gathered a unit's parameters.)
STOPPED_AGAIN_IN_TEST = {"sigterm-mid-epoch", "fsdp-sigterm-mid-epoch-2-ranks"}
# Cases run as a user with a fixed output folder would: the same command with ckpt_path=auto,
# again, in the same folder (the others resume by path into a new folder).
SAME_COMMAND_AGAIN = {
    "usr1-before-any-checkpoint",
    "workers-mid-epoch",
    "step-checkpoint-then-sigkill",
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_stopped_and_resumed_equals_uninterrupted(
    case: str, reference, tiny_root: Path, tmp_path: Path
) -> None:
    devices, extra, signal_at, code, stop_step, status = CASES[case]
    strategy = "fsdp" if case.startswith("fsdp") else "ddp"
    job = JOB.get(case, ())
    again = case in SAME_COMMAND_AGAIN
    args = [
        *overrides(tiny_root, devices, strategy, job),
        *extra,
        *(["ckpt_path=auto"] if again else []),
    ]
    assert stopped_job(tmp_path, args, signal_at) == code
    last = tmp_path / "run/checkpoints/last.ckpt"
    saved = load_checkpoint(last)
    assert saved["global_step"] == stop_step, "stopped at another step than asked"
    assert (stop_step % STEPS_PER_EPOCH == 0) == ("epoch-end" in case), "mid-epoch as named"
    assert not list(last.parent.glob(".*.tmp")), "no temporary checkpoint left behind"
    stopped_run, _ = history(tmp_path / "mlflow.db")
    assert stopped_run.info.status == status

    resumed_dir = tmp_path / ("run" if again else "resumed")
    resume = [] if again else [f"ckpt_path={last}"]
    resumes = 1
    if case in STOPPED_AGAIN_IN_TEST:
        env = signal_at_step("test:SIGTERM")
        command = [*args, *resume, f"hydra.run.dir={resumed_dir}"]
        stopped = run_entry("train", *command, cwd=tmp_path, check=False, env=env)
        assert stopped.returncode == 143, stopped.stderr[-3000:]
        assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
        assert not (resumed_dir / "metrics.json").exists(), "stopped before its report"
        resume = [] if again else [f"ckpt_path={resumed_dir / 'checkpoints' / 'last.ckpt'}"]
        resumes = 2
    run_entry("train", *args, *resume, f"hydra.run.dir={resumed_dir}", cwd=tmp_path)

    expected_dir = reference(devices, strategy, job)
    expected = load_checkpoint(expected_dir / "run/checkpoints/last.ckpt")
    resumed = load_checkpoint(resumed_dir / "checkpoints/last.ckpt")
    for part in ("epoch", "global_step", "state_dict", "optimizer_states", "lr_schedulers"):
        assert_same_tensors(resumed[part], expected[part], part)
    expected_metrics = read_metrics(expected_dir / "run")
    resumed_metrics = read_metrics(resumed_dir)
    assert resumed_metrics.keys() == expected_metrics.keys()
    for name, value in resumed_metrics.items():
        assert value == pytest.approx(expected_metrics[name], rel=1e-5, abs=1e-6), name
    # The value returned to Hydra's sweepers (optimized_metric), as job.json records it.
    expected_result = json.loads((expected_dir / "run" / JOB_FILE).read_text())["result"]
    result = json.loads((resumed_dir / JOB_FILE).read_text())["result"]
    assert result == pytest.approx(expected_result, rel=1e-5) and result is not None

    # One run, continued: every point of every key once, with the uninterrupted run's values
    # (a training point covers the same steps whether or not a stop fell in them).
    _, expected_history = history(expected_dir / "mlflow.db", keys=None)
    run, resumed_history = history(tmp_path / "mlflow.db", keys=None)
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == str(resumes)
    assert resumed_history.keys() == expected_history.keys()
    for key, points in expected_history.items():
        assert resumed_history[key] == approx_points(points), key


@pytest.mark.slow
def test_auto_starts_fresh_in_the_run_it_opened_and_never_repeats_a_finished_job(
    reference, tiny_root: Path, tmp_path: Path
) -> None:
    """A job killed before its first checkpoint leaves only the id of the MLflow run it opened:
    the same command again trains from the start into that run. Once the job has finished, the
    same command reads its result back; another override trains on."""
    args = [*overrides(tiny_root, 1), "ckpt_path=auto", "hydra.run.dir=run"]
    run_entry("train", *args, cwd=tmp_path)
    for checkpoint in (tmp_path / "run" / "checkpoints").iterdir():
        checkpoint.unlink()  # as if it had been killed before writing one
    job = tmp_path / "run" / "job.json"  # and before it finished
    job.write_text(json.dumps({"overrides": json.loads(job.read_text())["overrides"]}))
    run_entry("train", *args, cwd=tmp_path)
    expected = torch.load(reference(1) / "run/checkpoints/last.ckpt", weights_only=True)
    again = torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)
    assert_same_tensors(again["state_dict"], expected["state_dict"], "state_dict")
    run, points = history(tmp_path / "mlflow.db")  # one run, each point once
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"
    assert {key: [step for step, _ in steps] for key, steps in points.items()} == {
        key: points_at(key, EPOCHS) for key in points
    }

    # The same command once more, after it finished: nothing trained, tested or logged again.
    metrics = (tmp_path / "run" / "metrics.json").read_bytes()
    same = run_entry("train", *args, cwd=tmp_path)
    assert "this job finished in an earlier run" in same.stdout, same.stdout[-2000:]
    assert (tmp_path / "run" / "metrics.json").read_bytes() == metrics
    rerun, _ = history(tmp_path / "mlflow.db")
    assert rerun.data.tags == run.data.tags and rerun.info.end_time == run.info.end_time
    # One more epoch lengthens the job: it resumes from last.ckpt and trains on, into a new run
    # (its finished run is never reopened).
    more = [a.replace(f"max_epochs={EPOCHS}", f"max_epochs={EPOCHS + 1}") for a in args]
    longer = run_entry("train", *more, cwd=tmp_path)
    assert "finished in an earlier run" not in longer.stdout
    assert "it trains on into a new MLflow run" in longer.stdout, longer.stdout[-2000:]
    new_run, points = history(tmp_path / "mlflow.db", runs=2)
    assert new_run.data.tags["continues_run"] == run.info.run_id
    assert {key: [step for step, _ in steps] for key, steps in points.items()} == {
        key: points_at(key, EPOCHS + 1) for key in points
    }
    old = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run.info.run_id)
    assert old.info == rerun.info and old.data.metrics == rerun.data.metrics
    assert "exists and is not empty" not in longer.stderr, "Lightning's warning, moot here"
    trained = torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)
    assert trained["global_step"] == expected["global_step"] + STEPS_PER_EPOCH
    # The added epoch trains on the restored schedule: model.lr_decay (0.99) once a step, every
    # step of the 4 epochs (a lengthened cosine: tests/task/test_model.py).
    total = STEPS_PER_EPOCH * (EPOCHS + 1)
    (schedule,) = trained["lr_schedulers"]
    assert schedule["_last_lr"] == [pytest.approx(0.01 * 0.99**total)]


def folder_contents(folder: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def assert_one_record(client: MlflowClient, run_id: str, folder: Path) -> None:
    """The run's test metrics, its one logged model's and the folder's metrics.json agree."""
    run = client.get_run(run_id)
    (model,) = client.search_logged_models([run.info.experiment_id], f"source_run_id = '{run_id}'")
    on_model = {metric.key: metric.value for metric in model.metrics}
    for key, value in read_metrics(folder).items():
        if key.startswith("test/"):
            assert run.data.metrics[key] == pytest.approx(value), key
            assert on_model[key] == pytest.approx(value), key


@pytest.mark.slow
def test_stop_refused_resume_resume_as_printed_again_lengthen_and_new_job_from_weights(
    tiny_root: Path, tmp_path: Path
) -> None:
    """A user's sequence: each step leaves one true record per job (run, logged model and
    metrics.json agree); a finished run is never reopened."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    args = [*tiny_overrides(tiny_root, model=True), "trainer.max_epochs=2", "hydra.run.dir=run"]
    stopped = run_job(
        [sys.executable, "-m", "src.train", *args],
        cwd=tmp_path,
        env={**env, **signal_at_step("14:SIGTERM")},
    )
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    (line,) = [x for x in stopped.stderr.splitlines() if x.startswith("Stopped. To continue: ")]
    typed = line.removeprefix("Stopped. To continue: ").removesuffix(" (docs/resuming.md)")
    command = shlex.split(typed)
    folder, store = tmp_path / "run", tmp_path / "mlflow.db"
    assert command[:3] == ["python", "-m", "src.train"]
    assert command[-1] == f"ckpt_path={folder / 'checkpoints' / 'last.ckpt'}"
    client = MlflowClient(f"sqlite:///{store}")
    first, _ = history(store)
    assert first.info.status == "KILLED"

    # Another setting that decides the result: refused in one line, nothing changed.
    before = folder_contents(folder)
    other = [*command[3:], f"data.batch_size={BATCH_SIZE // 2}"]
    refused = run_entry("train", *other, cwd=tmp_path, check=False)
    errors = [x for x in refused.stderr.splitlines() if x.startswith("Error:")]
    assert refused.returncode == 1 and len(errors) == 1, refused.stderr[-3000:]
    changed = f"data.batch_size={BATCH_SIZE} (here {BATCH_SIZE // 2})"
    assert changed in errors[0] and typed in errors[0], errors[0]
    assert folder_contents(folder) == before
    assert client.get_run(first.info.run_id).info == first.info
    assert not (tmp_path / "outputs").exists()

    # The printed command as typed: the same folder, the same run.
    resumed = run_job([sys.executable, *command[1:]], cwd=tmp_path, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not (tmp_path / "outputs").exists(), "a resume continues in the job's folder"
    run, points = history(store)
    assert run.info.run_id == first.info.run_id and run.info.status == "FINISHED"
    assert all([step for step, _ in steps] == EPOCH_ENDS[:2] for steps in points.values())
    assert_one_record(client, run.info.run_id, folder)

    # The same again: nothing trained, tested or logged.
    before = folder_contents(folder)
    again = run_job([sys.executable, *command[1:]], cwd=tmp_path, env=env)
    assert "this job finished; its result is read back" in again.stdout, again.stdout[-2000:]
    assert folder_contents(folder) == before and not (tmp_path / "outputs").exists()
    assert client.get_run(run.info.run_id).info == run.info
    assert_one_record(client, run.info.run_id, folder)

    # One more epoch: a new run (and folder) that shows every epoch once; the old one as it was.
    longer = [a.replace("max_epochs=2", "max_epochs=3") for a in command[3:]]
    run_entry("train", *longer, cwd=tmp_path)
    new_run, points = history(store, runs=2)
    assert new_run.data.tags["continues_run"] == run.info.run_id
    assert all([step for step, _ in steps] == EPOCH_ENDS for steps in points.values())
    (new_folder,) = (tmp_path / "outputs" / "train" / "runs").iterdir()
    assert_one_record(client, new_run.info.run_id, new_folder)
    assert client.get_run(run.info.run_id).info == run.info
    assert_one_record(client, run.info.run_id, folder)

    # A new job from its weights: a new run from epoch 0, its first epoch already good.
    weights = [a for a in args if a != "hydra.run.dir=run"]
    last = folder / "checkpoints" / "last.ckpt"
    run_entry("train", *weights, f"weights_from={last}", "hydra.run.dir=fresh", cwd=tmp_path)
    fresh, points = history(store, runs=3)
    assert "continues_run" not in fresh.data.tags
    assert all([step for step, _ in steps] == EPOCH_ENDS[:2] for steps in points.values())
    _, original = history_of(client, run.info.run_id)
    assert points["train/loss"][0][1] < original["train/loss"][0][1], "weights not loaded"
    saved = torch.load(tmp_path / "fresh/checkpoints/last.ckpt", weights_only=True)
    assert saved["global_step"] == 2 * STEPS_PER_EPOCH


def test_a_resume_continues_in_the_stopped_jobs_folder_unless_told_or_finished(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "runs" / "a"
    (folder / ".hydra").mkdir(parents=True)
    (folder / "checkpoints").mkdir()
    last = folder / "checkpoints" / "last.ckpt"
    last.write_bytes(b"")
    resume = ["data=noisy", f"ckpt_path={last}"]
    assert resume_folder(resume) == folder
    assert resume_folder([*resume, "hydra.run.dir=elsewhere"]) is None  # the user's choice
    assert resume_folder(["-m", *resume]) is None  # a sweep's jobs have their own folders
    assert resume_folder(["ckpt_path=auto"]) is None
    (folder / JOB_FILE).write_text(json.dumps({"overrides": []}))
    assert resume_folder(resume) == folder  # started, not finished
    (folder / JOB_FILE).write_text(json.dumps({"overrides": [], "result": 0.9}))
    assert resume_folder(resume) is None  # finished: lengthening it is a new record
    loose = tmp_path / "last.ckpt"
    loose.write_bytes(b"")
    assert resume_folder([f"ckpt_path={loose}"]) is None  # not in a job's folder
