"""The library's promises, checked on a project's own task: its ``tests/test_conformance.py``
imports these checks (``from lightning_exact.testing.conformance import *``), and they train the
task's tiny job (``tests/task/tiny_job.py``) for real, in float64 (``trainer.precision=64-true``),
counted in steps, with validations and training points between epoch ends:

* 2 DDP ranks train the weights of 1 process (optimizer states included) and report its metrics;
* a job stopped by SIGTERM at a logging step, then resumed, equals the uninterrupted one: its
  weights, ``metrics.json`` and every MLflow point;
* training points come every ``trainer.log_every_n_steps`` steps and at each epoch's end;
* evaluating a checkpoint on 2 ranks gives the metrics of 1;
* the first training batch runs no random op that the library cannot make exact (it would be
  named in one ``strategy.exact:`` line).

One check is in the daily set: the tiny job trains, tests its best checkpoint, and that
checkpoint evaluates and predicts (``test_the_tiny_job_trains_evaluates_and_predicts``).

"Equal" is to 1e-8 of each tensor's largest value: float summation order, where a resume or a
world size that trained otherwise is 1e-2 or more away. The checks are slow (real processes):
``python -m pytest --full`` runs them, a few minutes on 2 cores for a seconds-long tiny job."""

import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightning_exact.testing.harness import Harness
from lightning_exact.testing.records import history, load_checkpoint, read_metrics

__all__ = [
    "conformance_jobs",
    "test_the_tiny_job_trains_evaluates_and_predicts",
    "test_a_stopped_job_resumes_to_the_uninterrupted_one",
    "test_evaluation_on_two_ranks_equals_one_process",
    "test_the_first_training_batch_runs_only_exact_random_ops",
    "test_training_points_come_every_log_every_n_steps_and_at_epoch_ends",
    "test_two_ranks_train_the_weights_of_one_process",
]

EQUAL = 1e-8  # of a tensor's largest value, in float64


@dataclass(frozen=True)
class Plan:
    """The tiny job counted in steps: ``steps`` in all (an epoch and a half, so it ends inside an
    epoch), a training point every ``every`` steps, a validation every ``2 * every``, a stop at
    ``stop`` (a logging step that is no validation step and no epoch's end)."""

    steps: int
    every: int
    stop: int
    epoch: int  # steps an epoch

    @classmethod
    def of(cls, harness: Harness) -> "Plan":
        epoch = harness.steps_per_epoch
        if epoch < 3:
            raise ValueError(f"the tiny job's epochs have {epoch} steps; the checks need 3 or more")
        every = max(1, epoch // 3)
        steps = epoch + epoch // 2
        logging = [step for step in range(every, steps, every) if step % (2 * every)]
        stop = next((s for s in logging if s % epoch), logging[0])
        return cls(steps=steps, every=every, stop=stop, epoch=epoch)

    def overrides(self) -> list[str]:
        return [
            "trainer.precision=64-true",
            "trainer.max_epochs=-1",
            f"trainer.max_steps={self.steps}",
            "trainer.check_val_every_n_epoch=null",
            f"trainer.val_check_interval={2 * self.every}",
            f"trainer.log_every_n_steps={self.every}",
            "callbacks.progress_bar=none",
            "logger.log_model=false",
        ]

    def training_points(self) -> list[int]:
        """The steps training values are logged at: every ``every`` and each epoch's end."""
        marks = set(range(self.every, self.steps + 1, self.every))
        marks |= set(range(self.epoch, self.steps + 1, self.epoch)) | {self.steps}
        return sorted(marks)


@dataclass(frozen=True)
class Jobs:
    """The jobs the checks read, each trained once: the reference (1 process), the same job on
    2 DDP ranks, and the same job stopped at ``plan.stop`` and resumed."""

    plan: Plan
    reference: Path
    two_ranks: Path
    resumed: Path
    stopped_at: int  # the step of the stopped job's last.ckpt
    first_batch_lines: list[str]  # what the reference printed of its first training batch


@pytest.fixture(scope="module")
def conformance_jobs(
    harness: Harness, tiny_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> Jobs:
    plan = Plan.of(harness)
    base = [*harness.tiny_overrides(tiny_root), *plan.overrides()]
    folders = {}
    for name, extra in (("reference", []), ("two_ranks", ["strategy=ddp", "devices=2"])):
        workdir = tmp_path_factory.mktemp(name)  # its own ./mlflow.db
        folders[name] = workdir / "run"
        proc = harness.run_entry(
            "train", *base, *extra, f"hydra.run.dir={folders[name]}", cwd=workdir
        )
        if name == "reference":
            lines = [line for line in proc.stderr.splitlines() if "strategy.exact:" in line]
    workdir = tmp_path_factory.mktemp("resumed")
    run_dir = workdir / "run"
    args = [*base, f"hydra.run.dir={run_dir}", "ckpt_path=auto"]
    # A signal in the step that global_step ``stop - 1`` takes: the job stops once it is done,
    # at ``stop``.
    signalled = harness.signal_at_step(f"{plan.stop - 1}:SIGTERM")
    stopped = harness.run_entry("train", *args, cwd=workdir, check=False, env=signalled)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    stopped_at = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"]
    harness.run_entry("train", *args, cwd=workdir)  # the same command, as a user runs it again
    return Jobs(plan, folders["reference"], folders["two_ranks"], run_dir, stopped_at, lines)


def assert_same_weights(run_dir: Path, expected_dir: Path) -> None:
    """Every weight and optimizer state of last.ckpt within :data:`EQUAL` of the expected."""
    import torch

    expected = load_checkpoint(expected_dir / "checkpoints" / "last.ckpt")
    actual = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert actual["global_step"] == expected["global_step"]
    pairs = [
        (f"state_dict.{k}", v, actual["state_dict"][k]) for k, v in expected["state_dict"].items()
    ]
    optimizers = zip(expected["optimizer_states"], actual["optimizer_states"], strict=True)
    for n, (want, got) in enumerate(optimizers):
        for param, state in want["state"].items():
            for key, value in state.items():
                if torch.is_tensor(value) and value.is_floating_point():
                    pairs.append((f"optimizer {n} {param}.{key}", value, got["state"][param][key]))
    assert pairs, "the checkpoint holds weights"
    for name, want, got in pairs:
        tolerance = EQUAL * want.double().abs().max().clamp_min(1e-3).item()
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance, msg=name)


def assert_metrics_equal(actual: dict[str, float], expected: dict[str, float]) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert actual[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name


def test_the_tiny_job_trains_evaluates_and_predicts(
    harness: Harness, tiny_root: Path, tmp_path: Path
) -> None:
    """One process, no tracking: the job's test metrics, then its best checkpoint's, evaluated
    alone (the same numbers), and its predictions of the test split if the task writes any."""
    run_dir = tmp_path / "run"
    overrides = [*harness.tiny_overrides(tiny_root, logger="none"), "trainer.max_epochs=1"]
    harness.run_entry("train", *overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    tested = {k: v for k, v in read_metrics(run_dir).items() if k.startswith("test/")}
    assert tested, "the job tests its best checkpoint"
    (best,) = [p for p in (run_dir / "checkpoints").glob("*.ckpt") if p.name != "last.ckpt"]
    out = tmp_path / "eval"
    harness.run_entry(
        "eval", f"ckpt_path={best}", "logger=none", f"hydra.run.dir={out}", cwd=tmp_path
    )
    assert_metrics_equal(read_metrics(out), tested)
    out = tmp_path / "predict"
    proc = harness.run_entry(
        "predict", f"ckpt_path={best}", f"hydra.run.dir={out}", cwd=tmp_path, check=False
    )
    writes = "writes no predictions of a data split" not in proc.stderr
    assert proc.returncode == 0 or not writes, proc.stderr[-3000:]
    assert not writes or (out / "predictions_test.csv").is_file()


@pytest.mark.slow
@pytest.mark.xdist_group("conformance")
def test_two_ranks_train_the_weights_of_one_process(conformance_jobs: Jobs) -> None:
    assert_same_weights(conformance_jobs.two_ranks, conformance_jobs.reference)
    assert_metrics_equal(
        read_metrics(conformance_jobs.two_ranks), read_metrics(conformance_jobs.reference)
    )


@pytest.mark.slow
@pytest.mark.xdist_group("conformance")
def test_a_stopped_job_resumes_to_the_uninterrupted_one(
    harness: Harness, conformance_jobs: Jobs
) -> None:
    jobs = conformance_jobs
    assert jobs.stopped_at == jobs.plan.stop, "stopped at the logging step it was signalled in"
    assert_same_weights(jobs.resumed, jobs.reference)
    assert_metrics_equal(read_metrics(jobs.resumed), read_metrics(jobs.reference))
    expected = history(jobs.reference.parent / "mlflow.db", harness.data_name)
    resumed = history(jobs.resumed.parent / "mlflow.db", harness.data_name)
    assert resumed.keys() == expected.keys()
    for key, points in expected.items():
        assert [step for step, _ in resumed[key]] == [step for step, _ in points], key
        values = [value for _, value in resumed[key]]
        assert values == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-9), key


@pytest.mark.slow
@pytest.mark.xdist_group("conformance")
def test_training_points_come_every_log_every_n_steps_and_at_epoch_ends(
    harness: Harness, conformance_jobs: Jobs
) -> None:
    points = history(conformance_jobs.reference.parent / "mlflow.db", harness.data_name)
    trained = [key for key in points if key.startswith("train/")]
    assert trained, f"the task logs training values (train/...): {sorted(points)}"
    expected = conformance_jobs.plan.training_points()
    for key in trained:
        assert [step for step, _ in points[key]] == expected, key


@pytest.mark.slow
@pytest.mark.xdist_group("conformance")
def test_evaluation_on_two_ranks_equals_one_process(
    harness: Harness, conformance_jobs: Jobs, tmp_path: Path
) -> None:
    checkpoint = conformance_jobs.reference / "checkpoints" / "last.ckpt"
    metrics = {}
    for devices in (1, 2):
        out = tmp_path / f"eval{devices}"
        harness.run_entry(
            "eval",
            f"ckpt_path={checkpoint}",
            "strategy=ddp" if devices > 1 else "strategy=auto",
            f"devices={devices}",
            "logger=none",
            f"hydra.run.dir={out}",
            cwd=tmp_path,
        )
        metrics[devices] = read_metrics(out)
    assert_metrics_equal(metrics[2], metrics[1])


@pytest.mark.slow
@pytest.mark.xdist_group("conformance")
def test_the_first_training_batch_runs_only_exact_random_ops(conformance_jobs: Jobs) -> None:
    """What the library cannot make exact is named in one line (``strategy.exact: ...``) on the
    first real batch; a task with such an op trains otherwise on N ranks than on 1."""
    assert conformance_jobs.first_batch_lines == []
