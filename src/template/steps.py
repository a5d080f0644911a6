"""Jobs counted in steps or in epochs, recorded the same way: every point a logger receives
during fitting sits at the global step (optimizer steps done) and carries its epoch, the test
metrics sit at the job's last step, and a job whose limits would silently cut it short says so
in one line at its start."""

import math
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

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
            notes = (epochs_end_first(trainer), unvalidated_steps(trainer, pl_module))
            for line in filter(None, notes):
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


def unvalidated_steps(trainer: L.Trainer, pl_module: L.LightningModule) -> str | None:
    """Where a job ends after its last validation, or before its first: its last steps are
    trained but never validated, and the best checkpoint, which the job tests, is chosen among
    the validations before (with none, the test runs on last.ckpt). Lightning validates at
    multiples of ``val_check_batch`` only (of the epoch's batches, or of the job's with
    ``check_val_every_n_epoch=null``), not at the step ``max_steps`` ends on."""
    batches = trainer.num_training_batches
    every = trainer.val_check_batch
    validates = trainer.limit_val_batches != 0 and is_overridden("validation_step", pl_module)
    if not validates or trainer.accumulate_grad_batches != 1 or math.isinf(batches * every):
        return None
    by_epochs = trainer.max_epochs * batches if trainer.max_epochs not in (-1, None) else None
    limits = [limit for limit in (trainer.max_steps, by_epochs) if limit not in (-1, None)]
    if not limits:
        return None
    end = min(limits)
    last, later = validations_around(end, batches, every, trainer.check_val_every_n_epoch)
    if last == end:
        return None
    cut_by_epochs = by_epochs is not None and later > by_epochs
    fix = f"trainer.max_steps={later}" + (" trainer.max_epochs=-1" if cut_by_epochs else "")
    if last == 0:
        return (
            f"Note: this job ends at step {end}, before its first validation (after step "
            f"{later}): it chooses no best checkpoint and tests last.ckpt. To validate, use e.g. "
            f"{fix}, or validate every N steps: trainer.val_check_interval=N "
            "trainer.check_val_every_n_epoch=null"
        )
    steps = f"step {end} is" if last + 1 == end else f"steps {last + 1}-{end} are"
    return (
        f"Note: {steps} trained but never validated (the last validation is after step {last}; "
        f"the best checkpoint is chosen among the validations up to it). For a validation at the "
        f"end, use e.g. {fix}"
    )


def validations_around(
    end: int, batches: int, every: int, every_n_epochs: int | None
) -> tuple[int, int]:
    """The step of the last validation at or before step ``end`` (0: none) and of the first
    after it, for epochs of ``batches`` steps validated after every ``every`` steps of the job
    (``every_n_epochs`` None) or of every ``every_n_epochs``-th epoch."""
    if every_n_epochs is None:
        last = end // every * every
        return last, last + every
    epoch, done = divmod(end - 1, batches)  # step ``end`` is the (done + 1)-th of ``epoch``
    done += 1
    validating = (epoch + 1) % every_n_epochs == 0
    before = epoch // every_n_epochs * every_n_epochs - 1  # the last validating epoch before
    if validating and done >= every:
        last = epoch * batches + done // every * every
    else:
        last = before * batches + batches // every * every if before >= 0 else 0
    if validating and (done // every + 1) * every <= batches:
        return last, epoch * batches + (done // every + 1) * every
    following = ((epoch + 1) // every_n_epochs + 1) * every_n_epochs - 1
    return last, following * batches + every


def without_position(metrics: dict[str, float]) -> dict[str, float]:
    """A job's metrics without the x-axis keys logged beside them."""
    return {name: value for name, value in metrics.items() if name not in (STEP, EPOCH)}
