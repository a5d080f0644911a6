"""Ending early with real processes: stop signals, a killed rank, a killed launcher."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from lightning_exact.checkpoints.shutdown import run_lifecycle, stop_line
from lightning_exact.job.settings import JobSettings
from lightning_exact.tracking.run import build_loggers, log_config
from lightning_exact.training.trainer import build_callbacks, build_trainer
from mlflow import MlflowClient

from tests.conftest import PROJECT, only_run
from tests.test_config import compose_config


def test_errors_fail_the_run_and_interrupts_kill_it(tmp_path: Path) -> None:
    cfg = compose_config("train", ["model.lr=0.5"], tmp_path)
    client = MlflowClient(cfg.logger.tracking_uri)
    for error, status in ((RuntimeError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED")):
        callbacks = build_callbacks(cfg.callbacks, Path(cfg.paths.output_dir), monitor=None)
        settings = JobSettings.from_config(cfg)
        trainer = build_trainer(
            cfg, settings, build_loggers(cfg, settings), callbacks, fitting=False
        )
        with pytest.raises((RuntimeError, SystemExit)) as raised, run_lifecycle(trainer):
            log_config(trainer.loggers, cfg, trainer)
            raise error
        run = client.get_run(trainer.loggers[0].run_id)
        assert run.info.status == status
        assert run.data.params["model.lr"] == "0.5" and run.data.params["world_size"] == "1"
    assert raised.value.code == 128 + signal.SIGINT, "an interrupt exits like Ctrl-C"


# --- real jobs


def assert_gone(processes: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive, f"processes outlived the job: {alive}"


def assert_loadable(last: Path) -> None:
    saved = torch.load(last, weights_only=True)
    assert saved["epoch"] >= 0 and saved["state_dict"]
    assert not list(last.parent.glob(".*.tmp")), "no temporary checkpoint left behind"


def test_the_stop_line_is_the_whole_command_as_typed_ckpt_path_last(tmp_path: Path) -> None:
    overrides = ["data=fashion_mnist", "model.net.channels=[8,16]", "logger.notes=a b"]
    line = stop_line(overrides, "run/checkpoints/last.ckpt")
    last = Path.cwd() / "run/checkpoints/last.ckpt"
    assert line == (
        "Stopped. To continue: python -m src.train data=fashion_mnist "
        f"'model.net.channels=[8,16]' 'logger.notes=a b' ckpt_path={last} (docs/resuming.md)"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "devices"),
    [(signal.SIGINT, 1), (signal.SIGTERM, 1), (signal.SIGINT, 2), (signal.SIGTERM, 2)],
)
def test_stop_signal_on_the_launcher_stops_every_rank(
    stop: signal.Signals, devices: int, job_factory, tmp_path: Path
) -> None:
    job = job_factory("strategy=ddp", f"devices={devices}", "trainer.max_epochs=500")
    processes = job.wait_for_checkpoint(ranks=devices)
    job.proc.send_signal(stop)  # the launcher only, as `kill` or a scheduler would
    job.wait(timeout=60)
    assert job.proc.returncode == 128 + stop, job.stderr[-3000:]
    log = (job.run_dir / "train.log").read_text()
    assert f"rank 0: {stop.name} received: stopping after the current training step" in log
    assert "Stopped. To continue: python -m src.train " in job.stderr, job.stderr[-3000:]
    assert f"ckpt_path={job.last} (docs/resuming.md)" in job.stderr
    assert_gone(processes)
    _, run = only_run(tmp_path / "mlflow.db")
    assert run.info.status == "KILLED"
    assert_loadable(job.last)


@pytest.mark.slow
def test_killed_rank_fails_the_job_within_the_bound(job_factory, tmp_path: Path) -> None:
    watch_s, grace_s = 0.5, 5
    bound = [f"strategy.watch_s={watch_s}", f"strategy.exit_grace_s={grace_s}"]
    job = job_factory("strategy=ddp", "devices=2", "trainer.max_epochs=500", *bound)
    processes = job.wait_for_checkpoint(ranks=2)
    rank1 = processes[1]
    rank1.send_signal(signal.SIGKILL)
    seconds = job.wait(timeout=120)
    assert seconds < watch_s + grace_s + 5, f"the job took {seconds:.1f} s to end"
    assert job.proc.returncode == 1
    assert f"rank 1 (pid {rank1.pid}) was killed by SIGKILL" in job.stderr, job.stderr[-3000:]
    assert "Traceback" not in job.stderr
    assert_gone(processes)
    _, run = only_run(tmp_path / "mlflow.db")
    assert run.info.status == "FAILED"
    assert_loadable(job.last)


@pytest.mark.slow
def test_killed_launcher_takes_no_rank_with_it(job_factory) -> None:
    job = job_factory("strategy=ddp", "devices=2", "trainer.max_epochs=500", "strategy.watch_s=0.5")
    launcher, rank1 = job.wait_for_checkpoint(ranks=2)
    launcher.send_signal(signal.SIGKILL)
    rank1.wait(timeout=10)  # raises if rank 1 outlives its launcher by 10 s
    job.wait(timeout=10)
    # How rank 1 went: its watcher's line, or gloo's error in its traceback (whole on failure).
    said = "the launching process (rank 0" in job.stderr or "Connection" in job.stderr
    assert said, job.stderr[-4000:]


def test_watchdog_ends_a_job_whose_rank_zero_is_stuck(tmp_path: Path) -> None:
    # Rank 0 normally fails on its own when a peer dies; under NCCL it can wait in a collective
    # for the whole timeout. The watchdog must end such a job: here rank 0 just sleeps.
    script = f"""
import subprocess, sys, time
from types import SimpleNamespace
sys.path.insert(0, {str(PROJECT)!r})
from lightning_exact.checkpoints.shutdown import watch_ranks
from lightning_exact.job.settings import JobSettings
print(time.monotonic(), flush=True)  # imported (seconds under load): the watch starts now
rank = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), 9)"])
trainer = SimpleNamespace(loggers=[], callbacks=[], default_root_dir={str(tmp_path)!r})
watch_ranks([rank], 1, trainer, every_s=0.2, grace_s=1)
time.sleep(60)  # stuck
"""
    command = [sys.executable, "-c", script]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    watched = float(proc.stdout.split()[0])  # the same clock: CLOCK_MONOTONIC is system-wide
    assert time.monotonic() - watched < 20, "ended by the watchdog, not by its sleep"
    assert proc.returncode == 1
    assert "rank 1 (pid" in proc.stderr and "was killed by SIGKILL" in proc.stderr
    assert "did not stop within 1 s" in proc.stderr


LAUNCHER_GONE = """
import io, os, sys, time
from lightning_exact.checkpoints.shutdown import LAUNCHER_PID_ENV, watch_launcher
os.environ[LAUNCHER_PID_ENV] = "1"  # not this process's parent: its launcher is gone
sys.stderr = io.StringIO()  # as torch's excepthook does while it formats a rank's traceback
watch_launcher(0.01)
time.sleep(30)
"""


def test_a_rank_says_its_launcher_is_gone_while_its_traceback_is_formatted() -> None:
    """The rank's watcher writes its line to file descriptor 2 itself before it exits the
    process: through ``sys.stderr`` it went into torch's buffer and was lost with the process
    (test_killed_launcher_takes_no_rank_with_it failed so in CI, twice)."""
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCHER_GONE],
        cwd=PROJECT,
        env={**os.environ, "PYTHONPATH": str(PROJECT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "Error: the launching process (rank 0, pid 1) is gone; rank exiting" in proc.stderr
