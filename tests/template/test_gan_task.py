"""A task that steps its own optimizers (issue #66): in a copy of the project, the image
classifier is replaced by Lightning's "Basic GAN" tutorial, ported as docs/make-it-yours.md says
(``tests/template/gan_task/``: a generator with ``BatchNorm1d``, a discriminator, manual
optimization of two Adam optimizers with ``toggle_optimizer``/``manual_backward``,
torchmetrics logged at epoch level, noise drawn for the global batch), keeping the image
task's data modules, on images shaped as Fashion-MNIST's written by the test. Two optimizer steps a
batch: the unchanged machinery counts the job in batches, charts every training point over the
batches since the one before, returns the best checkpoint's score to sweepers, runs DDP by default,
trains the same weights and both optimizers' states on 2 ranks as on 1 and after a stop and resume,
and its daily tests pass on it.

Three jobs, shared by every test (float64, 24 batches): the reference on 1 process, the same job
on 2 ranks, and one stopped by SIGTERM at a logging step on 1 process and resumed on 2."""

import json
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from lightning_exact.testing.instruments import RECORD_BATCHES, SIGNAL_AT_STEP
from lightning_exact.testing.processes import run_job
from lightning_exact.testing.records import load_checkpoint, read_metrics
from mlflow import MlflowClient

from tests.conftest import HARNESS, PROJECT
from tests.idx_data import make_dataset
from tests.template.test_task_contract import (
    CONFORMANCE,
    failures,
    leave_out,
    replace_the_task,
    run_pytest_in_a_fork,
)

run_entry = HARNESS.run_entry

GAN = PROJECT / "tests" / "template" / "gan_task"  # laid out as a project: src/task/, conf/
BATCHES = 10  # an epoch's: 336 training images (403 less 67 for validation), 32 a batch
# 24 batches (48 optimizer steps: trainer.max_steps counts both optimizers'), ending inside
# epoch 2; validated every 8 batches, the training losses charted every 5.
STEPS = [
    "trainer.precision=64-true",  # float64: N ranks and a resume equal one job to 1e-8
    "trainer.max_epochs=-1",
    "trainer.max_steps=48",
    "trainer.check_val_every_n_epoch=null",
    "trainer.val_check_interval=8",
    "trainer.log_every_n_steps=5",
    "callbacks.progress_bar=none",
    "model.lr=0.002",  # 10 times the tutorial's: the short job's generator moves
]
VALIDATIONS = [8, 16, 24]
POINTS = [5, 10, 15, 20, 24]  # every 5 batches, each epoch's end, the job's end
STOP_IN = 15  # a logging step: SIGTERM in its training step (global step 28: 2 a batch)
EQUAL = 1e-8  # float64: the largest difference allowed, as a share of a tensor's largest value
pytestmark = pytest.mark.xdist_group("gan-task")  # one worker: the tests share the jobs


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the project made a GAN by the steps of docs/make-it-yours.md: the image task
    deleted but its data modules and their configs, the GAN in its place; and the
    Fashion-MNIST-shaped images, in ./data."""
    copy = tmp_path_factory.mktemp("gan") / "project"
    shutil.copytree(PROJECT, copy, ignore=leave_out)
    replace_the_task(copy, GAN, data="fashion_mnist", model="gan", keep_image_data=True)
    make_dataset(copy / "data", "FashionMNIST", n_train=403, n_test=131, seed=7, learnable=True)
    return copy


def test_the_gan_is_written_as_the_page_says() -> None:
    """The code blocks of docs/make-it-yours.md's GAN section are the tested GAN's code."""
    page = (PROJECT / "docs" / "make-it-yours.md").read_text()
    blocks = re.findall(
        r"```python\n# [^\n]*tests/template/gan_task/[^\n]*\n(.*?)```", page, re.DOTALL
    )
    code = (GAN / "src" / "task" / "model.py").read_text()
    assert len(blocks) == 2 and all(block in code for block in blocks)


def data_keys(project: Path) -> list[str]:
    return [
        f"data.root={project / 'data'}",
        "data.download=false",
        "data.val_size=67",
        "data.batch_size=32",
    ]


def train(project: Path, run_dir: Path, *more: str, signal_at: str | None = None):
    """The job, in ``run_dir``'s parent (its MLflow store there), each batch's metric sums
    recorded in ``run_dir``.jsonl (tests/record_batches); or, ``signal_at``, with rank 0 sent a
    signal in a training step instead (tests/signal_at_step: one sitecustomize is imported)."""
    instrument = {"RECORD_METRICS": f"{run_dir}.jsonl"}
    if signal_at:
        instrument = {"SIGNAL_AT_STEP": signal_at}
    folder = SIGNAL_AT_STEP if signal_at else RECORD_BATCHES
    env = {**os.environ, **instrument, "PYTHONPATH": os.pathsep.join([str(folder), str(project)])}
    command = [sys.executable, "-m", "src.train", *data_keys(project), *STEPS, *more]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    return run_job([*command, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env=env)


def succeeded(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def reference(project: Path) -> tuple[Path, str]:
    """The uninterrupted job on 1 process, and what it printed."""
    run_dir = project / "runs" / "reference" / "run"
    proc = succeeded(train(project, run_dir))
    return run_dir, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def two_ranks(project: Path) -> tuple[Path, str]:
    """The same job on 2 DDP ranks, as conf/strategy/ddp.yaml has it."""
    run_dir = project / "runs" / "two-ranks" / "run"
    proc = succeeded(train(project, run_dir, "strategy=ddp", "devices=2"))
    return run_dir, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def resumed(project: Path) -> Path:
    """The job stopped by SIGTERM in batch 15 (a logging step) on 1 process, then continued by
    the command it printed, on 2 ranks."""
    run_dir = project / "runs" / "resumed" / "run"
    stopped = train(project, run_dir, signal_at=f"{2 * (STOP_IN - 1)}:SIGTERM")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert load_checkpoint(last)["global_step"] == 2 * STOP_IN, "the stop after batch 15"
    succeeded(train(project, run_dir, "strategy=ddp", "devices=2", f"ckpt_path={last}"))
    return run_dir


def history(store: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric's points in the store's one training run."""
    client = MlflowClient(f"sqlite:///{store}")
    (found,) = client.search_runs([client.get_experiment_by_name("fashion_mnist").experiment_id])
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, key))
        for key in found.data.metrics
        if not key.startswith("system/")
    }


def batch_sums(run_dir: Path) -> dict[int, dict[str, list[float]]]:
    """Each batch of the job (from 1) -> each training metric -> [sum, samples], added over the
    ranks that trained it (tests/record_batches: RECORD_METRICS)."""
    sums: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for line in Path(f"{run_dir}.jsonl").read_text().splitlines():
        record = json.loads(line)
        batch = record["epoch"] * BATCHES + record["batch"] + 1
        for module, added in record["added"].items():
            if module.startswith("train_metrics."):
                name = f"train/{module.removeprefix('train_metrics.')}"
                sums[batch][name][0] += added["total"]
                sums[batch][name][1] += added["samples"]
    return sums


def assert_windows(run_dir: Path, points: dict[str, list[tuple[int, float]]]) -> None:
    """Every train/* point is the mean over every sample of the batches since the point before."""
    sums = batch_sums(run_dir)
    assert sorted(sums) == list(range(1, POINTS[-1] + 1)), "each batch trained once"
    for name in ("train/g_loss", "train/d_loss"):
        assert [step for step, _ in points[name]] == POINTS, name
        start = 1
        for step, value in points[name]:
            window = [sums[batch][name] for batch in range(start, step + 1)]
            mean = sum(total for total, _ in window) / sum(count for _, count in window)
            assert value == pytest.approx(mean, rel=1e-9), f"{name} at {step}"
            start = step + 1


@pytest.mark.slow
def test_a_model_stepping_two_optimizers_is_counted_and_charted_in_batches(
    reference: tuple[Path, str],
) -> None:
    """Said once at the start; validations, points, the test and the best checkpoint's name at
    the batches that trained them; each point covers every batch since the one before."""
    run_dir, output = reference
    assert (
        "Note: 2 optimizer steps a batch (the model steps its optimizers itself): "
        "trainer.max_steps=48 is 24 batches; every other count of steps" in output
    )
    assert "strategy.exact:" not in output, "its noise is the global batch's: nothing named"
    points = history(run_dir.parent / "mlflow.db")
    for name in ("val/g_loss", "val/d_loss", "val/g_loss_best"):
        assert [step for step, _ in points[name]] == VALIDATIONS, name
    assert [step for step, _ in points["test/g_loss"]] == [24]
    assert_windows(run_dir, points)
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["global_step"] == 48


@pytest.mark.slow
def test_a_sweep_gets_the_best_checkpoints_score(reference: tuple[Path, str]) -> None:
    """The value returned to sweepers (job.json, metrics.json) is val/g_loss_best, what the best
    checkpoint (tested, logged, registered) scored; not the last validation's."""
    run_dir, _ = reference
    points = dict(history(run_dir.parent / "mlflow.db")["val/g_loss"])
    best_step = min(points, key=points.get)
    assert best_step != VALIDATIONS[-1], "a job whose last validation is not its best"
    (best,) = (run_dir / "checkpoints").glob("epoch*-step*-g_loss*.ckpt")
    assert f"-step{best_step:06d}-" in best.name
    saved = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    (state,) = [v for k, v in saved["callbacks"].items() if k.startswith("BestCheckpoint")]
    metrics = read_metrics(run_dir)
    result = json.loads((run_dir / "job.json").read_text())["result"]
    assert result == metrics["val/g_loss_best"] == pytest.approx(points[best_step])
    assert result == pytest.approx(float(state["best_model_score"]))
    assert metrics["val/g_loss"] == points[VALIDATIONS[-1]] != result


def assert_same_weights(run_dir: Path, expected_dir: Path) -> dict[str, float]:
    """The same weights, buffers and both optimizers' states as the reference, each tensor to
    1e-8 of its largest value; the largest relative difference of each group."""
    expected = load_checkpoint(expected_dir / "checkpoints" / "last.ckpt")
    actual = load_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    assert actual["global_step"] == expected["global_step"] == 48
    groups: dict[str, float] = defaultdict(float)
    for name, value in expected["state_dict"].items():
        if "num_batches" not in name:  # BatchNorm's count: an integer, compared as such
            group = f"{name.split('.')[0]} {'buffers' if 'running' in name else 'weights'}"
            groups[group] = max(groups[group], relative(actual["state_dict"][name], value))
    names = ("generator", "discriminator")
    optimizers = zip(actual["optimizer_states"], expected["optimizer_states"], strict=True)
    for name, (mine, theirs) in zip(names, optimizers, strict=True):
        for index, state in theirs["state"].items():
            for key, value in state.items():
                group = f"{name}'s Adam {key}"
                groups[group] = max(groups[group], relative(mine["state"][index][key], value))
    assert max(groups.values()) <= EQUAL, dict(groups)
    return dict(groups)


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference as a share of the tensor's largest value (at least 1e-3)."""
    scale = expected.double().abs().max().clamp_min(1e-3)
    return ((actual.double() - expected.double()).abs().max() / scale).item()


@pytest.mark.slow
def test_two_ranks_train_the_same_gan_by_default(
    reference: tuple[Path, str], two_ranks: tuple[Path, str]
) -> None:
    """strategy=ddp as shipped (find_unused_parameters from the model: its optimizers toggle)
    trains the weights, BatchNorm1d statistics and both Adam states of one process; its
    points are the same, each covering the batches since the one before on both ranks."""
    run_dir, output = two_ranks
    assert "strategy.exact:" not in output
    print("2 ranks vs 1 process:", assert_same_weights(run_dir, reference[0]))
    expected = history(reference[0].parent / "mlflow.db")
    points = history(run_dir.parent / "mlflow.db")
    assert_same_points(points, expected)
    assert_windows(run_dir, points)


def assert_same_points(points: dict, expected: dict) -> None:
    assert points.keys() == expected.keys()
    for key, values in expected.items():
        assert [step for step, _ in points[key]] == [step for step, _ in values], key
        assert [v for _, v in points[key]] == pytest.approx([v for _, v in values], rel=1e-6), key


@pytest.mark.slow
def test_stopped_at_a_logging_step_and_resumed_on_two_ranks_it_equals_the_uninterrupted_job(
    reference: tuple[Path, str], resumed: Path
) -> None:
    print("resumed vs uninterrupted:", assert_same_weights(resumed, reference[0]))
    assert_same_points(
        history(resumed.parent / "mlflow.db"), history(reference[0].parent / "mlflow.db")
    )
    client = MlflowClient(f"sqlite:///{resumed.parent / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("fashion_mnist").experiment_id])
    note = run.data.tags["mlflow.note.content"]
    assert note == f"Resume 1: from step {STOP_IN} on 2 ranks (was 1)", "a batch, as the x-axis"
    assert read_metrics(resumed) == pytest.approx(read_metrics(reference[0]), rel=1e-6)


@pytest.mark.slow
def test_predict_generates_images_from_a_checkpoint(
    project: Path, reference: tuple[Path, str]
) -> None:
    (best,) = (reference[0] / "checkpoints").glob("epoch*-step*-g_loss*.ckpt")
    out = project / "runs" / "predict"
    run_entry(
        "predict",
        f"ckpt_path={best}",
        "inputs=3",
        f"hydra.run.dir={out}",
        cwd=project,
        env={"PYTHONPATH": str(project)},
    )
    rows = (out / "predictions_inputs.csv").read_text().splitlines()
    assert rows[0] == "index,file" and len(rows) == 4
    assert all(Path(row.split(",")[1]).stat().st_size > 100 for row in rows[1:])


# The conformance check of the daily set on the GAN's own tiny job (tests/task/tiny_job.py: two
# optimizer steps a batch): it trains, its best checkpoint evaluates and predicts. (2 ranks and a
# resume are this module's tests; the library's own tests run on its test task: lib/tests/.)
DAILY = ["tests/test_conformance.py"] if CONFORMANCE.is_file() else []


@pytest.mark.slow
def test_the_daily_checks_pass_on_the_gan(project: Path, tmp_path: Path) -> None:
    """In a git fork of the copy, the daily tests that read a task's steps and modules pass on a
    task of two optimizer steps a batch (tests/task/tiny_job.py says so)."""
    proc = run_pytest_in_a_fork(project, tmp_path, "-m", "not slow", *DAILY)
    assert proc.returncode == 0, failures(proc)
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.match(r"\d+ passed, \d+ deselected(, \d+ warnings?)? in", summary), summary
