"""How a job ends early: never hanging, never leaving orphan processes or a RUNNING run.

* Ctrl-C, SIGTERM, SIGUSR1 or SIGUSR2 (a scheduler's warning before preemption: SIGUSR2 is
  submitit's, under ``hydra/launcher=slurm``; :class:`StopOnSignal`):
  during training the request is only recorded; every ``callbacks.stop_check_every_n_steps``
  training steps all ranks agree on it (one tiny all-reduce then, none in the steps between), write
  ``last.ckpt`` *at that step* and stop together, so no step is half-applied and no rank waits
  in a collective for one that left. Resuming from it
  continues the epoch exactly. A request in an epoch's last step or its validation lets the
  epoch end (validation, its checkpoint, its metrics) first. A second Ctrl-C stops at once.
  The run ends KILLED; exit code 128 + the signal's number (130, 143, 138, 140). A handler that
  was there before the job (submitit's checkpoint-and-requeue) then gets the signal.
* A rank process that dies (:class:`RankWatchdog`, in the launching process): within
  ``strategy.watch_s`` it names the rank and how it died, marks the run FAILED and kills the
  other ranks; the job exits 1 at most ``strategy.exit_grace_s`` later even if rank 0 is stuck
  in a collective. Rank processes watch the launcher in turn and exit if it is gone.
* Anything else that escapes the job (:func:`run_lifecycle`) marks the run FAILED.
"""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback

from src.template.checkpoint import save_last
from src.template.resume import epoch_finished

log = logging.getLogger(__name__)

LAUNCHER_PID_ENV = "TEMPLATE_LAUNCHER_PID"  # set for the rank processes Lightning starts
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class StopOnSignal(Callback):
    """Turns a stop signal into a stop that all ranks take at the same step boundary, with a
    checkpoint of that step.

    Ranks agree every ``check_every_n_steps`` batches, not every step: on a GPU a step can take a
    millisecond, and an agreement is a collective plus a device-to-host read. Alone, a process
    checks its own flag at every step (no collective).
    """

    def __init__(self, check_every_n_steps: int = 1) -> None:
        self.check_every_n_steps = check_every_n_steps
        self.requested: signal.Signals | None = None
        self._deferring = False  # True while training: stop at the next step boundary

    def handle(self, signum: int, frame: Any) -> None:
        first = self.requested is None
        self.requested = signal.Signals(signum)
        if first and self._deferring:
            log.warning(
                "%s received: stopping after the current training step, with a checkpoint "
                "(again to stop now)",
                self.requested.name,
            )
            return
        raise KeyboardInterrupt(self.requested.name)

    def install(self) -> None:
        if _in_main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self.handle)

    def _defer(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning installs its own SIGTERM handler when fit starts; ours replaces it, and
        # Lightning puts back the handlers of run_lifecycle when fit ends.
        self.install()
        self._deferring = True

    on_sanity_check_start = _defer
    on_train_start = _defer

    def _agreed(self, trainer: L.Trainer) -> bool:
        """Whether any rank was asked to stop (every rank calls this at the same point)."""
        if trainer.world_size == 1:
            return self.requested is not None
        if not trainer.strategy.reduce_boolean_decision(self.requested is not None, all=False):
            return False
        self.requested = self.requested or signal.SIGTERM  # another rank was asked
        return True

    def _stop(self) -> None:
        self._deferring = False
        raise KeyboardInterrupt(self.requested.name)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, index: int
    ) -> None:
        # The epoch's last step is left to the epoch end: a checkpoint written before its
        # validation would skip that validation on resume.
        due = trainer.world_size == 1 or (index + 1) % self.check_every_n_steps == 0
        if due and not epoch_finished(trainer) and self._agreed(trainer):
            save_last(trainer)
            self._stop()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._agreed(trainer):  # asked during the last epoch's end: its checkpoint is written
            self._stop()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._agreed(trainer):  # asked during the last epoch's end
            self._stop()
        self._deferring = False

    @property
    def exit_code(self) -> int:
        return 128 + (self.requested or signal.SIGINT)


class RankFailed(RuntimeError):
    """A rank process died; the message names it and how."""


def dead_ranks(trainer: L.Trainer, wait_s: float = 1.0) -> list[str]:
    """The rank processes this (launching) process started that have died, described."""
    procs = rank_processes(trainer)
    first = trainer.node_rank * trainer.num_devices + 1
    deadline = time.monotonic() + wait_s  # a rank's sockets close just before it is reaped
    while procs and all(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [
        describe_exit(first + index, index + 1, proc, trainer.default_root_dir)
        for index, proc in enumerate(procs)
        if proc.poll() not in (None, 0)
    ]


def describe_exit(rank: int, local_rank: int, proc: subprocess.Popen, output_dir: str) -> str:
    code = proc.returncode
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
    log_file = f"{output_dir}/*_ddp_process_{local_rank}.log"  # Hydra's log of that rank
    return f"rank {rank} (pid {proc.pid}) {how}; its log: {log_file}"


@contextmanager
def run_lifecycle(trainer: L.Trainer) -> Iterator[None]:
    """End the run KILLED on a stop signal, FAILED on any other error, never RUNNING.

    Lightning marks every interrupted run "failed" and exits 1; a stop request is told apart
    here, and the job exits 128 + signal number like any well-behaved command. An error caused
    by a rank process dying becomes a one-line :class:`RankFailed` naming that rank.
    """
    stop = next(c for c in trainer.callbacks if isinstance(c, StopOnSignal))
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if _in_main_thread() else {}
    stop.install()
    try:
        yield
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
            # Rank 0 tells the job's outcome. Other ranks leave quietly (their part, the
            # checkpoint, is written): under srun --kill-on-bad-exit a rank exiting non-zero
            # first would get rank 0 killed before it ends the run and exits.
            raise SystemExit(stop.exit_code if trainer.global_rank == 0 else 0) from error
        if dead := dead_ranks(trainer):
            kill(rank_processes(trainer))
            raise RankFailed(f"{'; '.join(dead)}. The job stopped.") from error
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_requested(trainer: L.Trainer) -> bool:
    return any(c.requested for c in trainer.callbacks if isinstance(c, StopOnSignal))


def rank_processes(trainer: L.Trainer) -> list[subprocess.Popen]:
    """The rank processes this process launched (none in a rank process or under torchrun)."""
    return getattr(trainer.strategy.launcher, "procs", None) or []


def kill(procs: list[subprocess.Popen]) -> None:
    """Kill the rank processes still running: only rank 0 writes checkpoints and runs."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class RankWatchdog(threading.Thread):
    """Watches the rank processes a launcher started; ends the job when one dies.

    It replaces Lightning's observer, which SIGKILLs the launching process within 5 s of a
    failure: that leaves the run RUNNING and never says which rank failed.
    """

    def __init__(
        self,
        procs: list[subprocess.Popen],
        first_rank: int,
        trainer: L.Trainer,
        every_s: float,
        grace_s: float,
    ) -> None:
        super().__init__(daemon=True, name="rank-watchdog")
        self.procs, self.first_rank, self.trainer = procs, first_rank, trainer
        self.every_s, self.grace_s = every_s, grace_s

    def run(self) -> None:
        while True:
            time.sleep(self.every_s)
            codes = [proc.poll() for proc in self.procs]
            if all(code == 0 for code in codes) or stop_requested(self.trainer):
                return  # finished, or stopping on request: the main thread ends the job
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                self._end_job(failed[0][0])
                return

    def _end_job(self, index: int) -> None:
        # Rank 0 usually fails on its own at its next collective and says which rank died
        # (run_lifecycle); this covers a rank 0 stuck where it cannot notice.
        time.sleep(self.grace_s)
        dead = describe_exit(
            self.first_rank + index, index + 1, self.procs[index], self.trainer.default_root_dir
        )
        print(
            f"Error: {dead}. Rank 0 did not stop within {self.grace_s:g} s; ending the job.",
            file=sys.stderr,
            flush=True,
        )
        for logger in self.trainer.loggers:
            logger.finalize("failed")
        kill(self.procs)
        os._exit(1)


def watch_launcher(every_s: float) -> None:
    """In a rank process started by the launcher: exit if the launcher disappears."""
    launcher = int(os.environ[LAUNCHER_PID_ENV])

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(every_s)
        print(
            f"Error: the launching process (rank 0, pid {launcher}) is gone; rank exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="launcher-watch").start()
