"""Test instrument: rank 0 sends itself a real signal during a chosen training step.

Put this folder on ``PYTHONPATH`` and set ``SIGNAL_AT_STEP=<global step>:<signal name>``: when
the task model's ``training_step`` (``TASK.model_class``) runs with ``global_step == <global
step>`` on rank 0 (the launching process), that process gets the signal, as from ``kill
-<signal> <pid>``. Stops then land at a known step instead of wherever a timer would put them.
``SIGNAL_AT_STEP=test:<signal name>``: in the first step of the test (``test_step``) instead.

``PAUSE_IN_SETUP=<seconds>``: every rank sleeps that long in the model's ``setup`` (a first
SLURM attempt only, not a requeued one), so a test can signal a job that has opened its run
but not started training.

``SLEEP_PER_STEP=<seconds>``: every training step takes that much longer, so a test can act
while a job is still training (stop a server, look at its progress).
"""

import os
import signal
import time

TARGET = "src.task"  # its TASK names the model class


def patch(module) -> None:
    if os.environ.get("PAUSE_IN_SETUP") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        pause_in_setup(module, float(os.environ["PAUSE_IN_SETUP"]))
    if os.environ.get("SIGNAL_AT_STEP"):
        signal_at_step(module, *os.environ["SIGNAL_AT_STEP"].split(":"))
    if os.environ.get("SLEEP_PER_STEP"):
        sleep_per_step(module, float(os.environ["SLEEP_PER_STEP"]))


def sleep_per_step(module, seconds: float) -> None:
    original = module.TASK.model_class.training_step

    def training_step(self, batch, batch_idx):
        time.sleep(seconds)
        return original(self, batch, batch_idx)

    module.TASK.model_class.training_step = training_step


def pause_in_setup(module, seconds: float) -> None:
    original = module.TASK.model_class.setup

    def setup(self, stage):
        time.sleep(seconds)
        return original(self, stage)

    module.TASK.model_class.setup = setup


def signal_at_step(module, step: str, name: str) -> None:
    hook = "test_step" if step == "test" else "training_step"
    original = getattr(module.TASK.model_class, hook)

    def signalled_step(self, batch, batch_idx):
        at = batch_idx == 0 if step == "test" else self.global_step == int(step)
        if self.trainer.global_rank == 0 and at:
            os.kill(os.getpid(), signal.Signals[name])
        return original(self, batch, batch_idx)

    setattr(module.TASK.model_class, hook, signalled_step)


if any(os.environ.get(name) for name in ("SIGNAL_AT_STEP", "PAUSE_IN_SETUP", "SLEEP_PER_STEP")):
    from lightning_exact.testing.instruments.patch_after_import import patch_after_import

    patch_after_import(TARGET, patch)
