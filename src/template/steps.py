"""Jobs counted in steps or in epochs, recorded the same way: every point a logger receives
during fitting sits at the global step (optimizer steps done) and carries its epoch, and a job
counted in steps whose epoch limit would end it first says so at its start."""

import math
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

# Lightning's own keys: a logged "step" is every logger's x-axis for the values logged with it
# (LoggerConnector.log_metrics); "epoch" is what Lightning adds when no "step" is logged.
STEP = "step"
EPOCH = "epoch"


class GlobalStepAxis(Callback):
    """Logs ``step`` (``trainer.global_step``) and ``epoch`` wherever Lightning sends values to
    the loggers while fitting: the steps it logs training values at, each validation and each
    epoch's end. Lightning would log them at the index of the step just taken (a validation
    after 20 steps at step 19, an epoch's end after 10 at step 9)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        note_epochs_end_first(trainer)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if logs_this_step(trainer):
            log_position(trainer, pl_module, on_step=True)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log_position(trainer, pl_module, on_step=False)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            log_position(trainer, pl_module, on_step=False)


def logs_this_step(trainer: L.Trainer) -> bool:
    """Whether Lightning sends this training step's values to the loggers (every
    ``trainer.log_every_n_steps`` optimizer steps, and the step a stop lands on)."""
    every = trainer.log_every_n_steps
    return every > 0 and (trainer.global_step % every == 0 or trainer.should_stop)


def log_position(trainer: L.Trainer, pl_module: L.LightningModule, on_step: bool) -> None:
    for key, value in ((STEP, trainer.global_step), (EPOCH, trainer.current_epoch)):
        pl_module.log(key, float(value), on_step=on_step, on_epoch=not on_step, logger=True)


def note_epochs_end_first(trainer: L.Trainer) -> None:
    """One line where ``trainer.max_steps`` asks for more steps than ``trainer.max_epochs``
    allows: Lightning stops at whichever comes first, without a word."""
    max_steps = trainer.max_steps
    max_epochs = trainer.max_epochs
    batches = trainer.num_training_batches
    if max_steps in (-1, None) or max_epochs in (-1, None) or math.isinf(batches):
        return
    epoch_steps = math.ceil(batches / trainer.accumulate_grad_batches)
    if (steps := epoch_steps * max_epochs) < max_steps:
        rank_zero_warn(
            f"trainer.max_steps={max_steps} is more than trainer.max_epochs={max_epochs} allows "
            f"({epoch_steps} steps an epoch): the job ends at step {steps}. To train by steps, "
            "add trainer.max_epochs=-1"
        )


def without_position(metrics: dict[str, float]) -> dict[str, float]:
    """A job's metrics without the x-axis keys logged beside them."""
    return {name: value for name, value in metrics.items() if name not in (STEP, EPOCH)}
