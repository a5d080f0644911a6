"""Jobs counted in steps or in epochs, recorded the same way: every point a logger receives
during fitting sits at the global step (optimizer steps done) and carries its epoch, the test
metrics sit at the job's last step, and a job whose limits would silently cut it short says so
in one line at its start."""

import math
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback

# Lightning's own keys: a logged "step" is every logger's x-axis for the values logged with it
# (LoggerConnector.log_metrics); "epoch" is what Lightning adds when no "step" is logged.
STEP = "step"
EPOCH = "epoch"


class GlobalStepAxis(Callback):
    """Logs ``step`` (``trainer.global_step``) and ``epoch`` wherever Lightning sends values to
    the loggers while fitting: the steps it logs training values at, each validation and each
    epoch's end; and ``step`` beside the test metrics of a Trainer that fitted. Lightning would
    log them at the index of the step just taken (a validation after 20 steps at step 19, an
    epoch's end after 10 at step 9), and test metrics at a resumed job's step before its last."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            for line in filter(None, (epochs_end_first(trainer), unvalidated_steps(trainer))):
                print(line)

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

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step > 0 and trainer.loggers:  # src.train's test, after fitting
            pl_module.log(STEP, float(trainer.global_step), on_step=False, on_epoch=True)


def logs_this_step(trainer: L.Trainer) -> bool:
    """Whether Lightning sends this training step's values to the loggers (every
    ``trainer.log_every_n_steps`` optimizer steps, and the step a stop lands on)."""
    every = trainer.log_every_n_steps
    return every > 0 and (trainer.global_step % every == 0 or trainer.should_stop)


def log_position(trainer: L.Trainer, pl_module: L.LightningModule, on_step: bool) -> None:
    """The point's step and epoch, for the loggers (none: nothing to place). The same on every
    rank: no sync (Lightning's advice to sync them is quieted in reporting.py)."""
    if trainer.loggers:
        for key, value in ((STEP, trainer.global_step), (EPOCH, trainer.current_epoch)):
            pl_module.log(key, float(value), on_step=on_step, on_epoch=not on_step)


def epochs_end_first(trainer: L.Trainer) -> str | None:
    """Where ``trainer.max_steps`` asks for more steps than ``trainer.max_epochs`` allows:
    Lightning stops at whichever comes first, without a word."""
    max_steps = trainer.max_steps
    max_epochs = trainer.max_epochs
    batches = trainer.num_training_batches
    if max_steps in (-1, None) or max_epochs in (-1, None) or math.isinf(batches):
        return None
    epoch_steps = math.ceil(batches / trainer.accumulate_grad_batches)
    if (steps := epoch_steps * max_epochs) >= max_steps:
        return None
    return (
        f"Note: trainer.max_steps={max_steps} is more than trainer.max_epochs={max_epochs} "
        f"allows ({epoch_steps} steps an epoch): the job ends at step {steps}. To train by "
        "steps, add trainer.max_epochs=-1"
    )


def unvalidated_steps(trainer: L.Trainer) -> str | None:
    """Where a job validated every N steps of the job (``check_val_every_n_epoch=null``) ends
    between two validations: its last steps are trained but never validated, and the best
    checkpoint, which the job tests, is chosen among the validations before."""
    every = trainer.val_check_interval
    max_steps = trainer.max_steps
    counted_in_steps = trainer.check_val_every_n_epoch is None and isinstance(every, int)
    if not counted_in_steps or max_steps in (-1, None) or trainer.accumulate_grad_batches != 1:
        return None
    last = max_steps // every * every
    if last == max_steps:
        return None
    steps = f"step {max_steps} is" if last + 1 == max_steps else f"steps {last + 1}-{max_steps} are"
    return (
        f"Note: trainer.max_steps={max_steps} is no multiple of trainer.val_check_interval="
        f"{every}: {steps} trained but never validated (the best checkpoint is chosen among the "
        f"validations up to step {last}). For a validation at the end, use e.g. "
        f"trainer.max_steps={last + every}"
    )


def without_position(metrics: dict[str, float]) -> dict[str, float]:
    """A job's metrics without the x-axis keys logged beside them."""
    return {name: value for name, value in metrics.items() if name not in (STEP, EPOCH)}
