"""The test conventions and fixtures a project's tests share with the library's: ``python -m
pytest`` runs the daily set (slow end-to-end tests left out; ``--full`` or a named file runs
them too), and fixtures that train the task's tiny job. A ``tests/conftest.py`` loads it with
``pytest_plugins = ["lightning_exact.testing.plugin"]`` and defines the ``harness`` fixture
(:class:`~lightning_exact.testing.harness.Harness`)."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from lightning_exact.testing.forked_entry import ForkedEntry
from lightning_exact.testing.harness import Harness
from lightning_exact.testing.records import read_metrics
from lightning_exact.testing.servers import free_port, local_server_argv, mlflow_server, moto_s3

# torch's OpenMP threads wait for work by spinning. With several test jobs at once on 2 cores that
# spin took a quarter to a third of each job's CPU time; waiting passively changes no result.
# Set before any test imports torch, and inherited by every job the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

FAKE_SECRET = "hunter2-do-not-log"
LONG_VALUE = "long" * 100  # longer than the 250 characters Lightning's MLflow logger keeps
# The trained job is validated twice an epoch (after half its steps, and at its end), its training
# metrics logged every 4 steps: what a job counted in steps records (test_train.py).
TRAINED_STEPS = ["trainer.val_check_interval=0.5", "trainer.log_every_n_steps=4"]


DAILY = pytest.StashKey[bool]()  # whether this run is the daily set


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="run the slow end-to-end tests too (what CI runs); naming a path or -m does as well",
    )


def pytest_configure(config: pytest.Config) -> None:
    """``python -m pytest`` alone runs the daily set: every test but those marked slow (real
    training jobs, clusters, servers, browsers). ``--full``, a path (``tests/test_slurm.py``,
    one test's id) or a ``-m`` expression of your own runs what it names, slow tests included.
    xdist's workers parse the same command line, so they decide alike."""
    named = config.args_source != pytest.Config.ArgsSource.TESTPATHS
    if not (config.getoption("full") or config.option.markexpr or named):
        config.option.markexpr = "not slow"
        config.stash[DAILY] = True


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In parallel runs (``-n``), the tests that inspect the session's ``trained`` job run on one
    worker, so it trains once (a session fixture is per worker). And the slow tests come first:
    xdist hands tests out in this order, one at a time, so the run does not end with one worker
    finishing a three-minute test while the others wait. (Serial runs keep the file order.)"""
    for item in items:
        if "trained" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("trained"))
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = ["slow end-to-end tests included"]
    if config.stash.get(DAILY, False):
        lines = ["daily set: slow end-to-end tests left out (--full -n 3 runs them too)"]
    if (Path(config.rootpath) / "conf" / "local" / "default.yaml").is_file():
        lines.append("conf/local/default.yaml applies to the tests' jobs: move it aside first")
    return lines


@pytest.fixture(scope="session")
def tiny_root(harness: Harness, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data root holding the tiny job's data (``tests/task/tiny_job.py``)."""
    if harness.tiny_job is None:
        pytest.skip(
            "the end-to-end tests train the task's tiny job, and this project has no "
            "tests/task/tiny_job.py: write your task's (docs/make-it-yours.md)"
        )
    root = tmp_path_factory.mktemp("data")
    harness.tiny_job.write_data(root)
    return root


@pytest.fixture(scope="module")
def forked(harness: Harness) -> Iterator[ForkedEntry]:
    """Entry points run in forks of one process that imported them (:mod:`.forked_entry`)."""
    entry = ForkedEntry(harness.project)
    yield entry
    entry.close()


class Job:
    """A training job running in the background, in its own session so nothing outlives it."""

    def __init__(
        self, project: Path, workdir: Path, *overrides: str, env: dict[str, str] | None = None
    ) -> None:
        self.run_dir = workdir / "run"
        self.last = self.run_dir / "checkpoints" / "last.ckpt"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "src.train", *overrides, f"hydra.run.dir={self.run_dir}"],
            cwd=workdir,
            env={**os.environ, "PYTHONPATH": str(project), **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.stderr = ""

    def wait_for_checkpoint(self, ranks: int) -> list[psutil.Process]:
        """Wait until last.ckpt exists; return the job's processes (launcher first)."""
        deadline = time.monotonic() + 120
        while not self.last.exists() and self.proc.poll() is None:
            assert time.monotonic() < deadline, "training never reached the end of an epoch"
            time.sleep(0.1)
        assert self.proc.poll() is None, self.proc.communicate()[1][-3000:]
        launcher = psutil.Process(self.proc.pid)
        processes = [launcher, *launcher.children()]
        assert len(processes) == ranks, processes
        return processes

    def wait(self, timeout: float) -> float:
        """Seconds until the job exited (fails after ``timeout``)."""
        start = time.monotonic()
        _, self.stderr = self.proc.communicate(timeout=timeout)
        return time.monotonic() - start

    def kill_all(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def job_factory(harness: Harness, tiny_root: Path, tmp_path: Path) -> Iterator:
    jobs: list[Job] = []

    def start(*overrides: str, env: dict[str, str] | None = None) -> Job:
        # The model too: it is the last record, the one an outage at the end leaves to src.sync.
        overrides = (*harness.tiny_overrides(tiny_root, model=True), *overrides)
        jobs.append(Job(harness.project, tmp_path, *overrides, env=env))
        return jobs[-1]

    yield start
    for job in jobs:
        job.kill_all()


@pytest.fixture(scope="session")
def trained(harness: Harness, tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One real training job, launched from a fresh folder so the MLflow store (mlflow.db) and
    outputs/ land where the defaults put them. Yields its working folder and run folder."""
    workdir = tmp_path_factory.mktemp("trained")
    run_dir = workdir / "run"
    # seed=0 on purpose: a falsy seed must still seed (a classic `if cfg.seed:` bug).
    # The two extra keys carry fake credentials that must never reach MLflow.
    proc = harness.run_entry(
        "train",
        *harness.tiny_overrides(tiny_root, model=True),
        *TRAINED_STEPS,
        "seed=0",
        f"+service.api_token={FAKE_SECRET}",
        f"+service.url=https://user:{FAKE_SECRET}@example.com/data",
        f"+service.note={LONG_VALUE}",
        f"hydra.run.dir={run_dir}",
        cwd=workdir,
    )
    log = proc.stdout + proc.stderr
    return {"workdir": workdir, "run_dir": run_dir, "log": log, "tiny_root": tiny_root}


@pytest.fixture(scope="module")
def two_devices(
    harness: Harness, tiny_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, float]:
    """Metrics of a 1-epoch job with devices=2 on one node, started by Lightning itself."""
    workdir = tmp_path_factory.mktemp("two_devices")
    overrides = [*harness.tiny_overrides(tiny_root, logger="none"), "trainer.max_epochs=1"]
    overrides += ["strategy=ddp", "devices=2"]
    harness.run_entry("train", *overrides, f"hydra.run.dir={workdir / 'run'}", cwd=workdir)
    return read_metrics(workdir / "run")


@pytest.fixture
def server_url(tmp_path: Path) -> Iterator[str]:
    """A real ``mlflow server`` on 127.0.0.1 with its own store, stopped by its process group."""
    port = free_port()
    argv = local_server_argv(port, tmp_path)
    with mlflow_server(argv, port, tmp_path) as url:
        yield url


@pytest.fixture
def s3_server() -> Iterator[dict[str, str]]:
    """A local moto S3 server (started and stopped here) and the environment that points boto3
    and LitData at it."""
    with moto_s3() as (env, _):
        yield env
