"""Exact resume wherever a job stops: real jobs stopped by real signals (delivered at a chosen
step by ``tests/signal_at_step``), by ``max_steps`` or by SIGKILL after a step checkpoint, then
resumed; the result must equal an uninterrupted job's."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from tests.conftest import (
    N_TRAIN,
    PROJECT,
    VAL_SIZE,
    read_metrics,
    run_entry,
    run_job,
    tiny_overrides,
)
from tests.test_train import EPOCH_METRICS, assert_same_tensors

EPOCHS = 3
STEPS_PER_EPOCH = (N_TRAIN - VAL_SIZE) // 32  # 10: batch 32 of the tiny dataset
SIGNAL_AT_STEP = PROJECT / "tests" / "signal_at_step"
# In parallel runs (-n), one worker runs this module: its tests share the reference jobs.
pytestmark = pytest.mark.xdist_group("resume")


def overrides(tiny_root: Path, devices: int) -> list[str]:
    ddp = ["strategy=ddp", f"devices={devices}"] if devices > 1 else []
    return [*tiny_overrides(tiny_root), f"trainer.max_epochs={EPOCHS}", *ddp]


@pytest.fixture(scope="module")
def reference(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted job for a world size (run once per module and world size)."""
    done: dict[int, Path] = {}

    def get(devices: int) -> Path:
        if devices not in done:
            workdir = tmp_path_factory.mktemp(f"reference{devices}")
            run_entry("train", *overrides(tiny_root, devices), "hydra.run.dir=run", cwd=workdir)
            done[devices] = workdir
        return done[devices]

    return get


def history(store: Path) -> tuple[object, dict[str, list[tuple[int, float]]]]:
    client = MlflowClient(f"sqlite:///{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("mnist").experiment_id])
    points = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        for key in EPOCH_METRICS
    }
    return run, points


def stopped_job(workdir: Path, args: list[str], signal_at: str | None) -> int:
    """Run ``src.train`` until it stops; its exit code."""
    path = [str(SIGNAL_AT_STEP), str(PROJECT)] if signal_at else [str(PROJECT)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if signal_at:
        env["SIGNAL_AT_STEP"] = signal_at
    command = [sys.executable, "-m", "src.train", *args, "hydra.run.dir=run"]
    proc = run_job(command, cwd=workdir, env=env)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.returncode


CASES = {
    # name: devices, extra overrides, signal at step, exit code, step of last.ckpt, run status
    "sigterm-mid-epoch": (1, [], "14:SIGTERM", 143, 15, "KILLED"),
    # Ranks agree every 3rd batch: asked in step 14 (batch 4 of epoch 1), they stop after 16.
    "sigterm-mid-epoch-2-ranks": (
        2, ["callbacks.stop_check_every_n_steps=3"], "14:SIGTERM", 143, 16, "KILLED",
    ),
    "usr1-before-any-checkpoint": (1, [], "0:SIGUSR1", 138, 1, "KILLED"),
    "max-steps-mid-epoch": (1, ["trainer.max_steps=14"], None, 0, 14, "FINISHED"),
    "workers-epoch-end-2-ranks": (2, ["data.num_workers=2"], "19:SIGINT", 130, 20, "KILLED"),
    "workers-mid-epoch": (1, ["data.num_workers=2"], "14:SIGUSR1", 138, 15, "KILLED"),
    "step-checkpoint-then-sigkill": (
        1, ["callbacks.checkpoint.every_n_train_steps=4"], "17:SIGKILL", -9, 16, "RUNNING",
    ),
}  # fmt: skip
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
    again = case in SAME_COMMAND_AGAIN
    args = [*overrides(tiny_root, devices), *extra, *(["ckpt_path=auto"] if again else [])]
    assert stopped_job(tmp_path, args, signal_at) == code
    last = tmp_path / "run/checkpoints/last.ckpt"
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == stop_step, "stopped at another step than asked"
    assert (stop_step % STEPS_PER_EPOCH == 0) == ("epoch-end" in case), "mid-epoch as named"
    assert not list(last.parent.glob(".*.tmp")), "no temporary checkpoint left behind"
    run, _ = history(tmp_path / "mlflow.db")
    assert run.info.status == status

    resumed_args = [a for a in args if not a.startswith("trainer.max_steps")]
    resumed_dir = tmp_path / ("run" if again else "resumed")
    resume = [] if again else [f"ckpt_path={last}"]
    run_entry("train", *resumed_args, *resume, f"hydra.run.dir={resumed_dir}", cwd=tmp_path)

    expected_dir = reference(devices)
    expected = torch.load(expected_dir / "run/checkpoints/last.ckpt", weights_only=True)
    resumed = torch.load(resumed_dir / "checkpoints/last.ckpt", weights_only=True)
    for part in ("epoch", "global_step", "state_dict", "optimizer_states", "lr_schedulers"):
        assert_same_tensors(resumed[part], expected[part], part)
    expected_metrics = read_metrics(expected_dir / "run")
    resumed_metrics = read_metrics(resumed_dir)
    assert resumed_metrics.keys() == expected_metrics.keys()
    for name, value in resumed_metrics.items():
        assert value == pytest.approx(expected_metrics[name], rel=1e-5, abs=1e-6), name

    # One run, continued: every epoch once (the cut one logged by the job that completed it).
    _, expected_history = history(expected_dir / "mlflow.db")
    run, resumed_history = history(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"
    for key, points in expected_history.items():
        assert [step for step, _ in resumed_history[key]] == list(range(EPOCHS)), key
        values = [value for _, value in resumed_history[key]]
        assert values == pytest.approx([v for _, v in points], rel=1e-5, abs=1e-6), key


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
    run, points = history(tmp_path / "mlflow.db")  # one run, each epoch once
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"
    assert all([step for step, _ in steps] == list(range(EPOCHS)) for steps in points.values())

    # The same command once more, after it finished: nothing trained, tested or logged again.
    metrics = (tmp_path / "run" / "metrics.json").read_bytes()
    same = run_entry("train", *args, cwd=tmp_path)
    assert "this job finished in an earlier run" in same.stdout, same.stdout[-2000:]
    assert (tmp_path / "run" / "metrics.json").read_bytes() == metrics
    rerun, _ = history(tmp_path / "mlflow.db")
    assert rerun.data.tags == run.data.tags and rerun.info.end_time == run.info.end_time
    # Another override (one more epoch) is another job: it resumes from last.ckpt and trains on.
    more = [a.replace(f"max_epochs={EPOCHS}", f"max_epochs={EPOCHS + 1}") for a in args]
    longer = run_entry("train", *more, cwd=tmp_path)
    assert "finished in an earlier run" not in longer.stdout
    assert "exists and is not empty" not in longer.stderr, "Lightning's warning, moot here"
    trained = torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)
    assert trained["global_step"] == expected["global_step"] + STEPS_PER_EPOCH
