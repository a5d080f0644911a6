"""Jobs counted in steps or in epochs record alike (src/template/steps.py): real Trainers on the
machinery's own task, their points read back from Lightning's CSV logger."""

import csv
import warnings
from pathlib import Path

import lightning.pytorch as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from src.template.steps import GlobalStepAxis, without_position
from tests.machinery_task import SIZES, Regressor, synthetic_data

STEPS_PER_EPOCH = (SIZES["n_train"] - SIZES["val_size"]) // SIZES["batch_size"]  # 5


def fit(tmp_path: Path, *callbacks: L.Callback, **loop: object) -> list[dict[str, str]]:
    """Fit the machinery's regression with ``loop``'s Trainer arguments; the CSV's rows."""
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
    trainer.fit(Regressor(features=SIZES["features"], hidden=8), datamodule=synthetic_data())
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


def test_a_max_steps_beyond_max_epochs_is_named_at_start(tmp_path: Path) -> None:
    with pytest.warns(UserWarning) as caught:
        fit(tmp_path, GlobalStepAxis(), max_epochs=2, max_steps=100)
    lines = [str(w.message) for w in caught if "max_steps" in str(w.message)]
    assert lines == [
        f"trainer.max_steps=100 is more than trainer.max_epochs=2 allows ({STEPS_PER_EPOCH} "
        f"steps an epoch): the job ends at step {2 * STEPS_PER_EPOCH}. To train by steps, add "
        "trainer.max_epochs=-1"
    ]


def test_a_job_counted_in_steps_alone_says_nothing(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, GlobalStepAxis(), max_epochs=-1, max_steps=7)
    assert not [w for w in caught if "max_steps" in str(w.message)]


def test_the_axis_keys_stay_out_of_a_jobs_metrics() -> None:
    assert without_position({"step": 9.0, "epoch": 1.0, "val/loss": 0.5}) == {"val/loss": 0.5}
