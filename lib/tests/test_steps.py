"""Jobs counted in steps or in epochs record alike (lib/lightning_exact/training/steps.py): real
Trainers on the
machinery's own task, their points read back from Lightning's CSV logger."""

import contextlib
import csv
import signal
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning_exact.checkpoints.checkpoint import LastCheckpoint
from lightning_exact.checkpoints.shutdown import StopOnSignal
from lightning_exact.training.steps import GlobalStepAxis, without_position
from lightning_exact.training.train_points import TrainingPoints

from tests.machinery_task import SIZES, Regressor, synthetic_data

STEPS_PER_EPOCH = (SIZES["n_train"] - SIZES["val_size"]) // SIZES["batch_size"]  # 5


def fit(
    tmp_path: Path, *callbacks: L.Callback, model: type = Regressor, **loop: object
) -> list[dict[str, str]]:
    """Fit the machinery's regression (or ``model``, a subclass) with ``loop``'s Trainer
    arguments; the CSV's rows."""
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        logger=CSVLogger(tmp_path, name="", version=""),
        callbacks=list(callbacks),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **loop,
    )
    trainer.fit(model(features=SIZES["features"], hidden=8), datamodule=synthetic_data())
    with (tmp_path / "metrics.csv").open() as file:
        return [{k: v for k, v in row.items() if v} for row in csv.DictReader(file)]


def steps_of(rows: list[dict[str, str]], key: str) -> list[int]:
    return [int(row["step"]) for row in rows if key in row]


@pytest.mark.parametrize("axis", [True, False], ids=["global step", "Lightning's own"])
def test_every_point_is_at_the_global_step_it_was_computed_after(axis: bool, tmp_path: Path):
    """Validated every 2 steps of 5-step epochs, for 2 epochs: validations after steps 2, 4, 7
    and 9, the training values at each epoch's end (5 and 10). Lightning alone logs each at the
    index of the step just taken, one less."""
    callbacks = [GlobalStepAxis()] if axis else []
    rows = fit(tmp_path, *callbacks, max_epochs=2, val_check_interval=2, log_every_n_steps=50)
    shift = 0 if axis else 1
    assert steps_of(rows, "val/loss") == [step - shift for step in (2, 4, 7, 9)]
    assert steps_of(rows, "train/loss") == [step - shift for step in (5, 10)]
    if axis:
        epochs = {int(row["step"]): float(row["epoch"]) for row in rows if "val/loss" in row}
        assert epochs == {2: 0, 4: 0, 7: 1, 9: 1}


@pytest.mark.parametrize("machinery", [True, False], ids=["training points", "Lightning's own"])
def test_a_task_logging_its_metrics_at_epoch_level_gets_a_point_per_window(
    machinery: bool, tmp_path: Path
) -> None:
    """The machinery's task logs its torchmetrics as docs/make-it-yours.md says (objects,
    on_epoch): every 2 steps of 5-step epochs a point covering the steps since the last (2, 2
    and 1 an epoch), the epoch's last step covered by Lightning's epoch-end point. Lightning
    alone charts one point an epoch."""
    callbacks = [TrainingPoints(), GlobalStepAxis()] if machinery else [GlobalStepAxis()]
    rows = fit(tmp_path, *callbacks, max_epochs=2, log_every_n_steps=2)
    batch = SIZES["batch_size"]
    samples = [
        (int(row["step"]), float(row["train/samples"])) for row in rows if "train/samples" in row
    ]
    if not machinery:
        assert samples == [(5, 5 * batch), (10, 5 * batch)]
        return
    assert samples == [(s, n * batch) for s, n in [(2, 2), (4, 2), (5, 1), (6, 1), (8, 2), (10, 2)]]
    assert steps_of(rows, "train/loss") == steps_of(rows, "train/mae") == [2, 4, 5, 6, 8, 10]
    assert steps_of(rows, "val/loss") == [5, 10]  # validation as before


class LogsATensor(Regressor):
    def training_step(self, batch, batch_idx: int):
        loss = super().training_step(batch, batch_idx)
        self.log("train/mse", loss, on_step=False, on_epoch=True)
        return loss


def test_a_tensor_logged_at_epoch_level_is_named_once(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Its running mean is Lightning's, per rank and not in checkpoints: charted, and named."""
    rows = fit(
        tmp_path,
        TrainingPoints(),
        GlobalStepAxis(),
        model=LogsATensor,
        max_epochs=2,
        log_every_n_steps=2,
    )
    assert steps_of(rows, "train/mse") == [2, 4, 5, 6, 8, 10]
    (note,) = notes(capsys)
    assert note.startswith("Note: train/mse logged as tensors at epoch level: not exact")


class SaveAtTheLastStep(L.Callback):
    """last.ckpt where the template writes it at ``max_steps``: the last step's batch end."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == trainer.max_steps:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("axis", [True, False], ids=["global step", "Lightning's own"])
def test_a_job_resumed_with_nothing_left_to_train_tests_at_its_last_step(
    axis: bool, tmp_path: Path
) -> None:
    """A job stopped in its test after fitting 7 steps, resumed: Lightning alone would log the
    test at step 6 (its count of stepped batches is restored one short)."""
    last = tmp_path / "last.ckpt"
    callbacks = [GlobalStepAxis()] if axis else []
    fit(tmp_path / "stopped", *callbacks, SaveAtTheLastStep(last), max_epochs=-1, max_steps=7)
    trainer = L.Trainer(
        accelerator="cpu",
        logger=CSVLogger(tmp_path / "resumed", name="", version=""),
        callbacks=callbacks,
        max_epochs=-1,
        max_steps=7,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regressor(features=SIZES["features"], hidden=8)
    data = synthetic_data()
    trainer.fit(model, datamodule=data, ckpt_path=last)  # nothing left to train
    tested = trainer.test(model, datamodule=data, verbose=False)[0]
    with (tmp_path / "resumed" / "metrics.csv").open() as file:
        rows = [{k: v for k, v in row.items() if v} for row in csv.DictReader(file)]
    assert steps_of(rows, "test/loss") == [7 if axis else 6]
    assert "step" not in without_position(tested)


def notes(capsys: pytest.CaptureFixture) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("Note: ")]


def test_a_max_steps_beyond_max_epochs_is_named_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    fit(tmp_path, GlobalStepAxis(), max_epochs=2, max_steps=100)
    assert notes(capsys) == [
        f"Note: trainer.max_steps=100 is more than trainer.max_epochs=2 allows ({STEPS_PER_EPOCH} "
        f"steps an epoch): the job ends at step {2 * STEPS_PER_EPOCH}. To train by steps, add "
        "trainer.max_epochs=-1"
    ]


UNVALIDATED = {
    # name: the Trainer's loop arguments (5 steps an epoch), the note at start, the steps
    # Lightning validated after
    "every 3 steps of the job, 8 steps": (
        {
            "max_epochs": -1,
            "max_steps": 8,
            "check_val_every_n_epoch": None,
            "val_check_interval": 3,
        },
        "Note: steps 7-8 are trained but never validated (the last validation is after step 6; "
        "the best checkpoint is chosen among the validations up to it). For a validation at the "
        "end, use e.g. trainer.max_steps=9",
        [3, 6],
    ),
    "at each epoch's end, 3 steps": (
        {"max_epochs": 2, "max_steps": 3},
        "Note: this job ends at step 3, before its first validation (after step 5): it chooses "
        "no best checkpoint and tests last.ckpt. To validate, use e.g. trainer.max_steps=5, or "
        "validate every N steps: trainer.val_check_interval=N trainer.check_val_every_n_epoch=null",
        [],
    ),
    "every 0.4 of an epoch, 1 epoch": (
        {"max_epochs": 1, "val_check_interval": 0.4},
        "Note: step 5 is trained but never validated (the last validation is after step 4; the "
        "best checkpoint is chosen among the validations up to it). For a validation at the end, "
        "use e.g. trainer.max_steps=7 trainer.max_epochs=-1",
        [2, 4],
    ),
    "every 2nd epoch, 3 epochs": (
        {"max_epochs": 3, "check_val_every_n_epoch": 2},
        "Note: steps 11-15 are trained but never validated (the last validation is after step "
        "10; the best checkpoint is chosen among the validations up to it). For a validation at "
        "the end, use e.g. trainer.max_steps=20 trainer.max_epochs=-1",
        [10],
    ),
}


@pytest.mark.parametrize("case", UNVALIDATED)
def test_steps_after_the_last_validation_are_named_at_start(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    loop, note, validated = UNVALIDATED[case]
    rows = fit(tmp_path, GlobalStepAxis(), **loop)
    assert notes(capsys) == [note]
    assert steps_of(rows, "val/loss") == validated


def test_a_job_counted_in_steps_and_validated_at_its_end_says_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    every = {"check_val_every_n_epoch": None, "val_check_interval": 3}
    fit(tmp_path, GlobalStepAxis(), max_epochs=-1, max_steps=9, **every)
    assert notes(capsys) == []


def test_the_axis_keys_stay_out_of_a_jobs_metrics() -> None:
    assert without_position({"step": 9.0, "epoch": 1.0, "val/loss": 0.5}) == {"val/loss": 0.5}


# --- a model stepping two optimizers itself, and gradient accumulation


class TwoOptimizers(Regressor):
    """The regression stepping its two layers' optimizers itself, as a GAN steps its generator's
    and discriminator's: two optimizer steps (``global_step``) a batch."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx: int) -> None:
        first, second = self.optimizers()
        loss = self._step(batch, "train")
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.step()

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        layers = [layer for layer in self.net if isinstance(layer, torch.nn.Linear)]
        return [torch.optim.Adam(layer.parameters(), lr=0.01) for layer in layers]


def windows(rows: list[dict[str, str]]) -> list[tuple[int, int]]:
    """(step, batches covered) of each training point: the tiny task logs its samples."""
    batch = SIZES["batch_size"]
    return [
        (int(row["step"]), round(float(row["train/samples"]) / batch))
        for row in rows
        if "train/samples" in row
    ]


def test_a_model_stepping_two_optimizers_counts_its_steps_in_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Two optimizer steps a batch: every point covers the batches since the one before (before,
    the machinery closed windows at every 2nd batch's global step, which Lightning never sent:
    half of each window was computed, reset and never logged); validations and the x-axis count
    batches as ``log_every_n_steps`` and ``val_check_interval`` do; ``max_steps`` counts
    optimizer steps, said at the start with the steps it leaves unvalidated."""
    callbacks = [TrainingPoints(), GlobalStepAxis()]
    loop = {"max_epochs": -1, "max_steps": 16, "check_val_every_n_epoch": None}
    every = {"log_every_n_steps": 2, "val_check_interval": 3}
    rows = fit(tmp_path, *callbacks, model=TwoOptimizers, **every, **loop)
    assert windows(rows) == [(2, 2), (4, 2), (5, 1), (6, 1), (8, 2)]
    assert steps_of(rows, "val/loss") == [3, 6]
    assert notes(capsys) == [
        "Note: 2 optimizer steps a batch (the model steps its optimizers itself): "
        "trainer.max_steps=16 is 8 batches; every other count of steps "
        "(trainer.log_every_n_steps, trainer.val_check_interval, the stop checks, the MLflow "
        "x-axis) is of batches",
        "Note: steps 7-8 are trained but never validated (the last validation is after step 6; "
        "the best checkpoint is chosen among the validations up to it). For a validation at "
        "the end, use e.g. trainer.max_steps=18",
    ]


def test_gradient_accumulation_counts_a_step_of_batches(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Two batches a step of 5-batch epochs (3 steps, the last one batch): a point every 2 steps
    covers the 4 batches since the one before, the epoch's end the rest; a validation every 3
    batches falls inside a step, said at the start."""
    callbacks = [TrainingPoints(), GlobalStepAxis()]
    rows = fit(
        tmp_path,
        *callbacks,
        max_epochs=2,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        val_check_interval=3,
    )
    assert windows(rows) == [(2, 4), (3, 1), (4, 2), (6, 3)]
    assert notes(capsys) == [
        "Note: trainer.accumulate_grad_batches=2 makes a step of 2 batches, but validation "
        "comes every 3 batches (trainer.val_check_interval counts batches): inside a step, with "
        "the weights of the step before and no last.ckpt. Use a multiple of 2",
        "Note: steps 5-6 are trained but never validated (the last validation is after step 4; "
        "the best checkpoint is chosen among the validations up to it). For a validation at the "
        "end, use e.g. trainer.max_steps=8 trainer.max_epochs=-1",
    ]


class AskToStop(L.Callback):
    """A stop signal during the batch ``at`` (from 0), as a SIGTERM would record it."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        stop = next(c for c in trainer.callbacks if isinstance(c, StopOnSignal))
        if trainer.fit_loop.epoch_loop.batch_progress.total.ready == self.at + 1:
            stop.requested = signal.SIGTERM


def fitted_weights(tmp_path: Path, *callbacks: L.Callback, ckpt_path: Path | None = None):
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        callbacks=[StopOnSignal(), LastCheckpoint(tmp_path), *callbacks],
        max_epochs=2,
        accumulate_grad_batches=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = Regressor(features=SIZES["features"], hidden=8)
    with contextlib.suppress(SystemExit, KeyboardInterrupt):
        trainer.fit(model, datamodule=synthetic_data(), ckpt_path=ckpt_path)
    return trainer, model.state_dict()


def test_a_stop_inside_an_accumulated_step_waits_for_its_end(tmp_path: Path) -> None:
    """Asked to stop in the 3rd batch (the first of step 2), the job stops after the 4th, with
    the step whole: resumed, it equals the job never stopped (stopped in the 3rd, the gradients
    of the 3rd batch were in no checkpoint)."""
    _, expected = fitted_weights(tmp_path / "whole")
    stopped, _ = fitted_weights(tmp_path / "stopped", AskToStop(at=2))
    last = tmp_path / "stopped" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert stopped.fit_loop.epoch_loop.batch_progress.total.processed == 4
    _, resumed = fitted_weights(tmp_path / "stopped", ckpt_path=last)
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=0, msg=name)
