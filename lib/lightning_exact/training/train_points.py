"""Training points for any task: what a LightningModule logs at epoch level while training
(``self.log(name, metric, on_step=False, on_epoch=True)`` in ``training_step``, as
docs/make-it-yours.md shows) is charted every ``trainer.log_every_n_steps`` steps and at each
epoch's end, each point covering exactly the steps since the one before, on any number of ranks
and across a stop and resume (the window's metric states travel in mid-epoch checkpoints:
:class:`~lightning_exact.checkpoints.resume.MidEpochState`), however many optimizers a batch
steps and however many batches a step accumulates (steps as Lightning counts them for its loggers:
:mod:`lightning_exact.training.steps`)."""

from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_exact.checkpoints.resume import epoch_finished
from lightning_exact.private import (
    epoch_level_training_results,
    forget_step_values,
    logged_as_tensor,
    reset_window,
)
from lightning_exact.training.steps import logged_step, sends_step_values, stepped


class TrainingPoints(Callback):
    """Closes the window of the training metrics logged at epoch level at every
    ``trainer.log_every_n_steps``-th step, where Lightning sends a step's values to the loggers:
    computes them (one sync of each metric's states across ranks), logs the values at that step,
    and resets them. An epoch's last step is left to Lightning's own epoch-end point, which then
    covers the rest of the epoch.

    Put it before :class:`~lightning_exact.checkpoints.shutdown.StopOnSignal` and the checkpoints: a
    stop or a checkpoint at a logging step then holds the emptied window, the point already
    logged."""

    HOOK = "on_train_batch_end"  # where the points are logged

    def __init__(self) -> None:
        self.closed_at = -1  # the step whose window was closed last
        self.names: set[str] = set()  # the values logged at that step
        self.named_tensors = False  # the note on tensors logged at epoch level, said once

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A job resumed at a logging step closed that step's window before it stopped.
        self.closed_at = logged_step(trainer)

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not sends_step_values(trainer):
            return  # Lightning sends nothing to the loggers at this batch
        forget_step_values(trainer, self.HOOK, self.names)  # the last point's, not this step's
        if not stepped(trainer):
            return  # a batch accumulating towards the logging step: the window is not closed
        step = logged_step(trainer)
        if step % trainer.log_every_n_steps or step == self.closed_at or epoch_finished(trainer):
            return
        self.closed_at = step
        if not self.named_tensors:
            self.named_tensors = True
            if (line := tensors_note(trainer)) and trainer.is_global_zero:
                print(line)
        points = close_window(trainer)
        self.names = {name for name, _, _ in points}
        for name, value, prog_bar in points:
            # At this step only: Lightning sends it to the loggers with the step's other values.
            pl_module.log(name, value, on_step=True, on_epoch=False, prog_bar=prog_bar)


def close_window(trainer: L.Trainer) -> list[tuple[str, Tensor, bool]]:
    """(name, value, shown on the progress bar) of each training value logged at epoch level
    since the last point, which are then reset for the next window."""
    points = []
    for result in epoch_level_training_results(trainer):
        meta = result.meta
        points.append((meta.forked_name(on_step=False), result.compute(), meta.prog_bar))
        reset_window(result)
    return points


def tensors_note(trainer: L.Trainer) -> str | None:
    """One line naming the training values logged at epoch level as tensors: their running
    value is Lightning's, per rank unless ``sync_dist=True``, and not in a checkpoint (the first
    point after a resume would leave out the steps before the stop)."""
    names = [
        result.meta.forked_name(on_step=False)
        for result in epoch_level_training_results(trainer)
        if logged_as_tensor(result)
    ]
    if not names:
        return None
    return (
        f"Note: {', '.join(names)} logged as tensors at epoch level: not exact across ranks "
        "without sync_dist=True, nor across a stop and resume. Log torchmetrics metric objects "
        "instead (docs/make-it-yours.md)"
    )
