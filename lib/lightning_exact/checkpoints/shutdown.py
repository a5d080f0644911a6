"""How a job ends early (docs/troubleshooting.md): never hanging, never leaving orphan processes
or a RUNNING run, a dead rank named."""

import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only

from lightning_exact.checkpoints.checkpoint import (
    job_overrides,
    resume_command,
    resume_path,
    save_last,
)
from lightning_exact.checkpoints.resume import epoch_finished
from lightning_exact.private import send_step_values
from lightning_exact.training.steps import stepped

log = logging.getLogger(__name__)

LAUNCHER_PID_ENV = "TEMPLATE_LAUNCHER_PID"  # set for the rank processes Lightning starts
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class StopOnSignal(Callback):
    """A stop signal while training is recorded; every ``check_every_n_steps`` steps (an
    all-reduce, a device-to-host read) ranks agree on it and stop with that step's ``last.ckpt``,
    after sending that step's points to the loggers (at a logging step). Callbacks before it in
    the Trainer's list have seen the step; those after it have not."""

    def __init__(self, check_every_n_steps: int = 1) -> None:
        self.check_every_n_steps = check_every_n_steps
        self.requested: signal.Signals | None = None
        self._deferring = False  # while training: stop at the next agreed step

    def handle(self, signum: int, frame: Any) -> None:
        first = self.requested is None
        self.requested = signal.Signals(signum)
        if not (first and self._deferring):
            raise KeyboardInterrupt(self.requested.name)
        log.warning(
            "rank %d: %s received: stopping after the current training step, with a checkpoint "
            "(again to stop now)",
            rank_zero_only.rank,
            self.requested.name,
        )

    def install(self) -> dict[int, Any]:
        """Handle the stop signals (in the main thread, where Python can); the handlers replaced."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self.handle) for sig in STOP_SIGNALS}

    def _defer(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Replaces the SIGTERM handler Lightning installs for fit (it restores ours after fit).
        self.install()
        self._deferring = True

    on_sanity_check_start = on_train_start = _defer

    def _stop_at_once(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Outside training a stop is at once (the job tests again when resumed). Lightning's own
        # SIGTERM handler for these stages broadcasts from rank 0, which a rank inside another
        # collective (an FSDP unit's gather) never meets: both ranks hung (issue 63).
        if not self._deferring:
            self.install()

    on_validation_start = on_test_start = on_predict_start = _stop_at_once

    def _stop_if_agreed(self, trainer: L.Trainer, checkpoint: bool = False) -> None:
        """Stop if any rank was asked to (every rank calls this at the same point)."""
        asked = self.requested is not None
        if trainer.world_size > 1 and trainer.strategy.reduce_boolean_decision(asked, all=False):
            self.requested = self.requested or signal.SIGTERM  # another rank was asked
        if self.requested is not None:
            if checkpoint:
                # The step's points first, as the job going on would log them (Lightning sends
                # them after the last batch-end hook): a resumed job starts at the next step.
                send_step_values(trainer)
                save_last(trainer)
            self._deferring = False
            raise KeyboardInterrupt(self.requested.name)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, index: int
    ) -> None:
        # Only where a step ends (a batch that accumulates gradients has them in no checkpoint),
        # every N steps of the epoch; not at its last step: a checkpoint before validation would
        # skip it on resume.
        if not stepped(trainer) or epoch_finished(trainer):
            return
        step = math.ceil((index + 1) / trainer.accumulate_grad_batches)  # of the epoch
        if trainer.world_size == 1 or step % self.check_every_n_steps == 0:
            self._stop_if_agreed(trainer, checkpoint=True)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_if_agreed(trainer)  # asked during the last epoch's end, which checkpointed

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_if_agreed(trainer)
        self._deferring = False


class RankFailed(RuntimeError):
    """A rank process died; the message names it and how."""


def dead_ranks(procs: list[subprocess.Popen], first_rank: int, output_dir: str) -> list[str]:
    """The rank processes of ``procs`` (ranks ``first_rank``, ...) that died, described."""
    return [
        f"rank {first_rank + i} (pid {proc.pid}) "
        + (f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}")
        + f"; its log: {output_dir}/*_ddp_process_{i + 1}.log"  # Hydra's log of that rank
        for i, proc in enumerate(procs)
        if (code := proc.poll()) not in (None, 0)
    ]


def stop_line(overrides: list[str], last: str) -> str:
    """What a stopped job says last: the whole command that continues it, as typed."""
    command = resume_command(overrides, Path(last).absolute())
    return f"Stopped. To continue: {command} (docs/resuming.md)"


@contextmanager
def run_lifecycle(trainer: L.Trainer) -> Iterator[None]:
    """End the run FINISHED when the job's work inside is done (its test and outcome recorded:
    the run's duration is the job's); KILLED on a stop signal, exit 128 + its number
    (Lightning: "failed", exit 1); FAILED on any other error, never RUNNING; a dead rank becomes
    a :class:`RankFailed`."""
    stop = next(c for c in trainer.callbacks if isinstance(c, StopOnSignal))
    previous = stop.install()
    try:
        yield
        for logger in trainer.loggers:
            logger.finalize("finished")
    except BaseException as error:
        # The stop itself (Lightning turns it into SystemExit), not an error met while stopping:
        # srun and torchrun send SIGTERM to the other ranks when one dies.
        killed = isinstance(error, KeyboardInterrupt) or (
            isinstance(error, SystemExit) and stop.requested is not None
        )
        for logger in trainer.loggers:
            logger.finalize("KILLED" if killed else "failed")
        if killed:
            # Under hydra/launcher=slurm, submitit requeues the job (rank 0) now that last.ckpt
            # is written; the requeued sweep job resumes from it (ckpt_path=auto).
            before = previous.get(stop.requested)
            if callable(before) and before is not signal.default_int_handler:
                before(stop.requested, None)
            # Only rank 0 fails: under srun --kill-on-bad-exit another rank would get it killed.
            code = 128 + (stop.requested or signal.SIGINT) if trainer.global_rank == 0 else 0
            if code and (last := resume_path("auto", Path(trainer.default_root_dir))):
                print(stop_line(job_overrides(), last), file=sys.stderr, flush=True)
            raise SystemExit(code) from error
        raise_if_a_rank_died(trainer, error)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def raise_if_a_rank_died(trainer: L.Trainer, error: BaseException) -> None:
    """An error that is a rank's death (its launcher's processes: none in a rank process) ends
    the job as :class:`RankFailed`, naming the dead ranks; the others are ended too."""
    procs = getattr(trainer.strategy.launcher, "procs", None) or []
    deadline = time.monotonic() + 1  # a rank's sockets close just before it is reaped
    while procs and all(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    first = trainer.node_rank * trainer.num_devices + 1
    if dead := dead_ranks(procs, first, trainer.default_root_dir):
        for proc in procs:
            proc.kill()  # Popen's kill skips those that ended
        raise RankFailed(f"{'; '.join(dead)}. The job stopped.") from error


def watch_ranks(
    procs: list[subprocess.Popen],
    first_rank: int,
    trainer: L.Trainer,
    every_s: float,
    grace_s: float,
) -> None:
    """In the launching process: once a rank dies, give rank 0 ``grace_s`` to end the job itself
    (it may be stuck in a collective), then end it: run FAILED, ranks killed, exit 1."""

    def watch() -> None:
        while all(proc.poll() in (None, 0) for proc in procs):
            time.sleep(every_s)
            stopping = any(c.requested for c in trainer.callbacks if isinstance(c, StopOnSignal))
            if stopping or all(proc.poll() == 0 for proc in procs):
                return  # stopping on request, or finished: the main thread ends the job
        time.sleep(grace_s)
        dead = "; ".join(dead_ranks(procs, first_rank, trainer.default_root_dir))
        print_before_exit(
            f"Error: {dead}. Rank 0 did not stop within {grace_s:g} s; ending the job."
        )
        for logger in trainer.loggers:
            logger.finalize("failed")
        for proc in procs:
            proc.kill()
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="rank-watchdog").start()


def print_before_exit(line: str) -> None:
    """``line`` on the process's own stderr (file descriptor 2) at once, for a thread that exits
    the process next: ``sys.stderr`` may be a buffer then (torch's excepthook swaps one in while
    it formats a rank's traceback), and what went there would be lost with it."""
    os.write(2, f"{line}\n".encode())


def watch_launcher(every_s: float) -> None:
    """In a rank process started by the launcher: exit if the launcher disappears."""
    launcher = int(os.environ[LAUNCHER_PID_ENV])

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(every_s)
        print_before_exit(
            f"Error: the launching process (rank 0, pid {launcher}) is gone; rank exiting"
        )
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="launcher-watch").start()
