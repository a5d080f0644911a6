"""Jobs counted in steps or in epochs, recorded the same way: every point a logger receives
during fitting sits at the job's step and carries its epoch, the test metrics sit at the job's
last step, and a job whose limits would silently cut it short says so in one line at its start.

A step is what Lightning counts for its loggers (``trainer.log_every_n_steps``): a batch that
steps the optimizers. For a model Lightning optimizes, an optimizer step (``global_step``; under
``trainer.accumulate_grad_batches=N``, N batches); for a model that steps its own optimizers
(``automatic_optimization = False``), a batch, however many optimizers it steps. The MLflow
x-axis, ``trainer.log_every_n_steps``, ``callbacks.stop_check_every_n_steps``,
``callbacks.checkpoint.every_n_train_steps`` and every note count these steps. Two Lightning
keys count otherwise, and a job says so at its start where they differ: ``trainer.max_steps``
counts optimizer steps (2 a batch for a GAN), ``trainer.val_check_interval`` batches (N a step
under gradient accumulation)."""

import math
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_exact.private import accumulating, batches_done, sends_step_values

# Lightning's own keys: a logged "step" is every logger's x-axis for the values logged with it
# (LoggerConnector.log_metrics); "epoch" is what Lightning adds when no "step" is logged.
STEP = "step"
EPOCH = "epoch"
LOGGED_STEP = "logged_step"  # a checkpoint's key: the job's step (the x-axis) it was saved at


def steps_its_own(trainer: L.Trainer) -> bool:
    """Whether the model steps its own optimizers (``automatic_optimization = False``)."""
    module = trainer.lightning_module
    return module is not None and not module.automatic_optimization


def logged_step(trainer: L.Trainer) -> int:
    """The job's step now, this one included while its hooks run: the x-axis of what is logged
    now. Optimizer steps (``trainer.global_step``), or the batches of a model that steps its own
    optimizers. A task logging an image at a validation's step passes this."""
    return batches_done(trainer) if steps_its_own(trainer) else trainer.global_step


def stepped(trainer: L.Trainer) -> bool:
    """Whether this training batch ended a step (it did not only accumulate gradients)."""
    return not accumulating(trainer)


class GlobalStepAxis(Callback):
    """Logs ``step`` (:func:`logged_step`) and ``epoch`` wherever Lightning sends values to the
    loggers while fitting: the steps it logs training values at, each validation and each
    epoch's end; and ``step`` beside the test metrics of a Trainer that fitted. Lightning would
    log them at the index of the step just taken (a validation after 20 steps at step 19, an
    epoch's end after 10 at step 9), and test metrics at a resumed job's step before its last.

    Says at the start what a job's limits cut short (:func:`notes`); for a model that steps its
    own optimizers, once its first batch has shown how many it steps a batch."""

    def __init__(self) -> None:
        self.first_global_step: int | None = None  # a model stepping its own: before its first

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if steps_its_own(trainer):
            self.first_global_step = trainer.global_step
        elif trainer.is_global_zero:
            say(notes(trainer, pl_module))

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.first_global_step is not None:
            per_batch = trainer.global_step - self.first_global_step
            self.first_global_step = None
            if trainer.is_global_zero:
                say(notes(trainer, pl_module, per_batch))
        if sends_step_values(trainer):
            log_position(trainer, pl_module, on_step=True)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        log_position(trainer, pl_module, on_step=False)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            # Also without loggers: the best checkpoint's name reads the step (``{step}``).
            log_position(trainer, pl_module, on_step=False, always=True)

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step > 0 and trainer.loggers:  # src.train's test, after fitting
            pl_module.log(STEP, float(logged_step(trainer)), on_step=False, on_epoch=True)

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[LOGGED_STEP] = logged_step(trainer)


def saved_step(saved: dict[str, Any]) -> int:
    """The job's step (the x-axis) a checkpoint was saved at; an older one's global step."""
    return saved.get(LOGGED_STEP, saved["global_step"])


def say(lines: list[str | None]) -> None:
    for line in filter(None, lines):
        print(line)


def log_position(
    trainer: L.Trainer, pl_module: L.LightningModule, on_step: bool, always: bool = False
) -> None:
    """The point's step and epoch, for the loggers (none: nothing to place, unless ``always``).
    The same on every rank: no sync (Lightning's advice to sync them is quieted in
    reporting.py)."""
    if trainer.loggers or always:
        for key, value in ((STEP, logged_step(trainer)), (EPOCH, trainer.current_epoch)):
            pl_module.log(key, float(value), on_step=on_step, on_epoch=not on_step)


class Counting:
    """How a job's steps (the x-axis) relate to Lightning's batches and optimizer steps, for the
    notes: ``per_batch`` optimizer steps a batch for a model that steps its own optimizers (it is
    then a step: a batch), else ``trainer.accumulate_grad_batches`` batches a step."""

    def __init__(self, trainer: L.Trainer, per_batch: int | None = None) -> None:
        self.batches = trainer.num_training_batches  # an epoch's
        self.own = per_batch is not None
        self.per_batch = max(per_batch or 1, 1)
        self.accumulate = 1 if self.own else trainer.accumulate_grad_batches
        self.epoch_steps = math.ceil(self.batches / self.accumulate)  # the last batch steps

    def step_of_batch(self, batch: int) -> int:
        """The step the job's ``batch``-th batch (from 1) is in."""
        epoch, done = divmod(batch - 1, self.batches)
        return epoch * self.epoch_steps + math.ceil((done + 1) / self.accumulate)

    def steps_done_at(self, batch: int) -> int:
        """The steps done once the job's ``batch``-th batch (from 1) is trained: not the step a
        batch inside a step is in (a validation there has the weights of the step before)."""
        epoch, done = divmod(batch - 1, self.batches)
        in_epoch = self.epoch_steps if done + 1 == self.batches else (done + 1) // self.accumulate
        return epoch * self.epoch_steps + in_epoch

    def batch_of_step(self, step: int) -> int:
        """The job's last batch of its ``step``-th step."""
        epoch, done = divmod(step - 1, self.epoch_steps)
        return epoch * self.batches + min((done + 1) * self.accumulate, self.batches)

    def steps_of_max_steps(self, max_steps: int) -> int:
        """The steps ``trainer.max_steps`` (optimizer steps) allows."""
        return math.ceil(max_steps / self.per_batch) if self.own else max_steps

    def max_steps_for(self, steps: int) -> int:
        """The ``trainer.max_steps`` (optimizer steps) that ends a job after ``steps`` steps."""
        return steps * self.per_batch if self.own else steps


def notes(trainer: L.Trainer, pl_module: L.LightningModule, per_batch: int | None = None) -> list:
    """The lines a job says at its start about its limits, in its steps: a model stepping
    ``per_batch`` optimizers a batch first says what a step is."""
    if math.isinf(trainer.num_training_batches):
        return []
    counting = Counting(trainer, per_batch)
    return [
        own_steps(trainer, counting),
        accumulation(trainer, counting),
        epochs_end_first(trainer, counting),
        unvalidated_steps(trainer, pl_module, counting),
    ]


def own_steps(trainer: L.Trainer, counting: Counting) -> str | None:
    """For a model stepping several optimizers a batch: ``trainer.max_steps`` counts their steps,
    every other count of steps counts batches."""
    if not counting.own or counting.per_batch == 1:
        return None
    max_steps = trainer.max_steps
    limit = (
        f"trainer.max_steps={max_steps} is {counting.steps_of_max_steps(max_steps)} batches; "
        if max_steps not in (-1, None)
        else "trainer.max_steps would count them; "
    )
    return (
        f"Note: {counting.per_batch} optimizer steps a batch (the model steps its optimizers "
        f"itself): {limit}every other count of steps (trainer.log_every_n_steps, "
        "trainer.val_check_interval, the stop checks, the MLflow x-axis) is of batches"
    )


def accumulation(trainer: L.Trainer, counting: Counting) -> str | None:
    """Under gradient accumulation a step is several batches, but Lightning validates every
    ``val_check_batch`` batches: a validation may fall inside a step."""
    every = trainer.val_check_batch
    if counting.accumulate == 1 or math.isinf(every) or not validates(trainer):
        return None
    inside = every % counting.accumulate and every < counting.batches
    if not inside:
        return None
    return (
        f"Note: trainer.accumulate_grad_batches={counting.accumulate} makes a step of "
        f"{counting.accumulate} batches, but validation comes every {every} batches "
        "(trainer.val_check_interval counts batches): inside a step, with the weights of the "
        f"step before and no last.ckpt. Use a multiple of {counting.accumulate}"
    )


def validates(trainer: L.Trainer) -> bool:
    return trainer.limit_val_batches != 0 and is_overridden(
        "validation_step", trainer.lightning_module
    )


def epochs_end_first(trainer: L.Trainer, counting: Counting) -> str | None:
    """Where ``trainer.max_steps`` asks for more steps than ``trainer.max_epochs`` allows:
    Lightning stops at whichever comes first, without a word."""
    max_steps = trainer.max_steps
    max_epochs = trainer.max_epochs
    if max_steps in (-1, None) or max_epochs in (-1, None):
        return None
    if (steps := counting.epoch_steps * max_epochs) >= counting.steps_of_max_steps(max_steps):
        return None
    return (
        f"Note: trainer.max_steps={max_steps} is more than trainer.max_epochs={max_epochs} "
        f"allows ({counting.epoch_steps} steps an epoch): the job ends at step {steps}. To "
        "train by steps, add trainer.max_epochs=-1"
    )


def unvalidated_steps(
    trainer: L.Trainer, pl_module: L.LightningModule, counting: Counting
) -> str | None:
    """Where a job ends after its last validation, or before its first: its last steps are
    trained but never validated, and the best checkpoint, which the job tests, is chosen among
    the validations before (with none, the test runs on last.ckpt). Lightning validates at
    multiples of ``val_check_batch`` only (of the epoch's batches, or of the job's with
    ``check_val_every_n_epoch=null``), not at the step ``max_steps`` ends on."""
    batches = trainer.num_training_batches
    every = trainer.val_check_batch
    by_epochs = trainer.max_epochs * batches if trainer.max_epochs not in (-1, None) else None
    end = last_batch(trainer, counting, by_epochs)  # in batches, as Lightning validates
    if end is None or not validates(trainer) or math.isinf(every):
        return None
    last, later = validations_around(end, batches, every, trainer.check_val_every_n_epoch)
    if last == end:
        return None
    end_step = counting.step_of_batch(end)
    later_step = counting.step_of_batch(later)
    cut_by_epochs = by_epochs is not None and later > by_epochs
    fix = f"trainer.max_steps={counting.max_steps_for(later_step)}" + (
        " trainer.max_epochs=-1" if cut_by_epochs else ""
    )
    if last == 0:
        return (
            f"Note: this job ends at step {end_step}, before its first validation (after step "
            f"{later_step}): it chooses no best checkpoint and tests last.ckpt. To validate, use "
            f"e.g. {fix}, or validate every N steps: trainer.val_check_interval=N "
            "trainer.check_val_every_n_epoch=null"
        )
    last_step = counting.steps_done_at(last)
    first = last_step + 1
    steps = f"step {end_step} is" if first == end_step else f"steps {first}-{end_step} are"
    return (
        f"Note: {steps} trained but never validated (the last validation is after step "
        f"{last_step}; the best checkpoint is chosen among the validations up to it). For a "
        f"validation at the end, use e.g. {fix}"
    )


def last_batch(trainer: L.Trainer, counting: Counting, by_epochs: int | None) -> int | None:
    """The job's last batch by ``trainer.max_steps`` and ``max_epochs`` (None: no end)."""
    by_steps = None
    if trainer.max_steps not in (-1, None):
        by_steps = counting.batch_of_step(counting.steps_of_max_steps(trainer.max_steps))
    limits = [limit for limit in (by_steps, by_epochs) if limit is not None]
    return min(limits) if limits else None


def validations_around(
    end: int, batches: int, every: int, every_n_epochs: int | None
) -> tuple[int, int]:
    """The batch after which the last validation at or before batch ``end`` comes (0: none) and
    the first after it, for epochs of ``batches`` batches validated after every ``every``
    batches of the job (``every_n_epochs`` None) or of every ``every_n_epochs``-th epoch."""
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
