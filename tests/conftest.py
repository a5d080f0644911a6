"""Shared fixtures: a tiny learnable dataset and a way to run the real entry points."""

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.forked_entry import ForkedEntry
from tests.local_servers import free_port, moto_s3

try:  # the task's tiny job, the one place the end-to-end tests learn what to train
    from tests.task import tiny_job
except ModuleNotFoundError as missing:
    if missing.name not in ("tests.task", "tests.task.tiny_job"):
        raise
    tiny_job = None

# torch's OpenMP threads wait for work by spinning. With several test jobs at once on 2 cores that
# spin took a quarter to a third of each job's CPU time; waiting passively changes no result.
# Set before any test imports torch, and inherited by every job the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

PROJECT = Path(__file__).resolve().parents[1]

FAKE_SECRET = "hunter2-do-not-log"
LONG_VALUE = "long" * 100  # longer than the 250 characters Lightning's MLflow logger keeps

# The tiny job's sizes (tests/task/tiny_job.py)
N_TRAIN = getattr(tiny_job, "N_TRAIN", 0)
N_TEST = getattr(tiny_job, "N_TEST", 0)
VAL_SIZE = getattr(tiny_job, "VAL_SIZE", 0)
BATCH_SIZE = getattr(tiny_job, "BATCH_SIZE", 1)
DATA_NAME = getattr(tiny_job, "DATA_NAME", "")  # its MLflow experiment
STEPS_PER_EPOCH = (N_TRAIN - VAL_SIZE) // BATCH_SIZE  # the last incomplete global batch dropped


def epoch_ends(epochs: int) -> list[int]:
    """The global steps at which the tiny job's first ``epochs`` epochs end: where its metrics
    are logged when ``trainer.log_every_n_steps`` (50) is more than an epoch."""
    return [STEPS_PER_EPOCH * (epoch + 1) for epoch in range(epochs)]


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
    if (PROJECT / "conf" / "local" / "default.yaml").is_file():
        lines.append("conf/local/default.yaml applies to the tests' jobs: move it aside first")
    return lines


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data root holding the tiny job's data (``tests/task/tiny_job.py``: for the shipped image
    task a learnable MNIST-format dataset of 403 train and 131 test images)."""
    if tiny_job is None:
        pytest.skip(
            "the end-to-end tests train the task's tiny job, and this project has no "
            "tests/task/tiny_job.py: write your task's (docs/make-it-yours.md, step 5)"
        )
    root = tmp_path_factory.mktemp("data")
    tiny_job.write_data(root)
    return root


def tiny_overrides(data_root: Path, *, logger: str = "mlflow", model: bool = False) -> list[str]:
    """Overrides for the task's seconds-long tiny job (``tests/task/tiny_job.py``) on the data of
    ``data_root``, logging to ``logger``. An MLflow job logs no MLflow model unless ``model``:
    the export takes about 3 s of a 10 s job, so only the tests that check the model pay for it."""
    tiny = tiny_job.overrides(data_root)
    if logger != "mlflow":
        return [*tiny, f"logger={logger}"]
    return tiny if model else [*tiny, "logger.log_model=false"]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The machinery's slow end-to-end tests check the shipped image task's own numbers and files
    (val/acc, its networks, its figures): in a project with another task they skip, saying so.
    The daily set's end-to-end tests check only what the machinery promises, on any task's tiny
    job."""
    fixtures = set(getattr(item, "fixturenames", ())) & TINY_JOB_FIXTURES
    machinery = not item.path.is_relative_to(PROJECT / "tests" / "task")  # not the task's own
    if fixtures and machinery and item.get_closest_marker("slow") and not IMAGE_TASK.is_file():
        pytest.skip(
            "checks the shipped image task's tiny MNIST job (its metrics and files), and this "
            "project has another task: adapt the test to yours or leave it skipped"
        )


TINY_JOB_FIXTURES = {"tiny_root", "trained", "two_devices", "job_factory"}
IMAGE_TASK = PROJECT / "conf" / "data" / "mnist.yaml"  # the shipped task is here


def run_job(
    command: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` for a job that may start
    rank and data-loader processes. A job still running after ``timeout`` seconds fails the
    test with where each of its processes is stuck (orphans included: its whole process
    group): each gets SIGABRT in turn, and Python's faulthandler prints its threads' stacks.
    Nothing outlives it."""
    __tracebackhide__ = True  # the failure shows the stacks, not this function's source
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        group = process_group(proc.pid)
        table = "\n".join(filter(None, map(describe, group)))
        for process in group:  # one at a time: each dump whole, not interleaved
            with suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGABRT)
            time.sleep(0.3)  # its dump is written (milliseconds) before the next begins
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(map(str, command))} still running after {timeout:g} s. Its processes:\n"
            f"{table}\nTheir stacks (idle queue feeder threads left out):\n"
            f"{busy_stacks(err)[-60000:]}\n--- stdout ---\n{out[-3000:]}"
        )
    finally:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a rank or worker left behind
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def process_group(pgid: int) -> list[psutil.Process]:
    """The processes of a process group, newest (children) first: a job's ranks and loader
    workers, also those orphaned by a dead parent (psutil's ``children`` misses them)."""

    def in_group(process: psutil.Process) -> bool:
        with suppress(ProcessLookupError, psutil.Error):
            return os.getpgid(process.pid) == pgid
        return False

    return sorted(filter(in_group, psutil.process_iter()), key=lambda p: -p.pid)


def describe(process: psutil.Process) -> str:
    """A process in one line: its parent, state, threads, where its stdout and stderr go."""
    outputs = []
    for fd in (1, 2):
        try:
            outputs.append(os.readlink(f"/proc/{process.pid}/fd/{fd}"))
        except OSError:
            outputs.append("(none)")  # closed, or a zombie's
    with suppress(psutil.Error):
        return (
            f"  pid {process.pid} ppid {process.ppid()} {process.status()} "
            f"{process.num_threads()} threads, stdout {outputs[0]} stderr {outputs[1]}: "
            + " ".join(process.cmdline()).replace("\n", " ")[:120]
        )
    return ""


def busy_stacks(stderr: str) -> str:
    """faulthandler's dumps in ``stderr`` without the noise that hid the stuck thread: the
    extension-module lists, and the threads that only wait to feed a multiprocessing queue."""
    blocks = stderr.split("\n\n")  # faulthandler ends each thread's stack with a blank line
    idle = ("Extension modules:", "in _feed\n")
    return "\n\n".join(b for b in blocks if not any(mark in b + "\n" for mark in idle))


def kill_process_trees(*procs: subprocess.Popen) -> None:
    """SIGKILL processes and every process they started, at once (a lost node gives no
    signal), and wait until all are gone."""
    tree = []
    for proc in procs:
        with suppress(psutil.NoSuchProcess):
            root = psutil.Process(proc.pid)
            tree += [root, *root.children(recursive=True)]
    for process in tree:
        with suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(tree, timeout=30)
    for proc in procs:
        proc.wait()


@pytest.fixture(scope="module")
def forked() -> Iterator[ForkedEntry]:
    """Entry points run in forks of one process that imported them (tests/forked_entry.py)."""
    entry = ForkedEntry(PROJECT)
    yield entry
    entry.close()


def one_error_line(stderr: str) -> str:
    """The one ``Error:`` line of a refused job's stderr (and no traceback)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("Error:")]
    return line


# Test instruments put on PYTHONPATH: a signal, a pause or a slower step at a chosen point.
SIGNAL_AT_STEP = PROJECT / "tests" / "signal_at_step"


def signal_at_step(at: str) -> dict[str, str]:
    """``run_entry``'s ``env`` for a job whose rank 0 gets a real signal in a chosen training
    step (``"14:SIGTERM"``), or in its test's first step (``"test:SIGTERM"``): a stop at a known
    step, the job's config unchanged (tests/signal_at_step)."""
    path = os.pathsep.join([str(SIGNAL_AT_STEP), str(PROJECT)])
    return {"PYTHONPATH": path, "SIGNAL_AT_STEP": at}


def run_entry(
    module: str,
    *overrides: str,
    cwd: Path,
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python -m src.<module>`` in a subprocess, as a user would; fail with its output.
    ``env`` adds or replaces environment variables (``PYTHONPATH`` is this project's)."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT), **(env or {})}
    proc = run_job([sys.executable, "-m", f"src.{module}", *overrides], cwd=cwd, env=env)
    if check and proc.returncode != 0:
        pytest.fail(
            f"src.{module} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


class Job:
    """A training job running in the background, in its own session so nothing outlives it."""

    def __init__(self, workdir: Path, *overrides: str, env: dict[str, str] | None = None) -> None:
        self.run_dir = workdir / "run"
        self.last = self.run_dir / "checkpoints" / "last.ckpt"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "src.train", *overrides, f"hydra.run.dir={self.run_dir}"],
            cwd=workdir,
            env={**os.environ, "PYTHONPATH": str(PROJECT), **(env or {})},
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
def job_factory(tiny_root: Path, tmp_path: Path) -> Iterator:
    jobs: list[Job] = []

    def start(*overrides: str, env: dict[str, str] | None = None) -> Job:
        # The model too: it is the last record, the one an outage at the end leaves to src.sync.
        jobs.append(Job(tmp_path, *tiny_overrides(tiny_root, model=True), *overrides, env=env))
        return jobs[-1]

    yield start
    for job in jobs:
        job.kill_all()


def load_checkpoint(path: Path) -> dict:
    """A checkpoint's contents; a sharded folder (strategy=fsdp) as ``src.consolidate`` makes it
    one file (optimizer states keyed as torch's own)."""
    import torch  # here: the daily tests that need no checkpoint start faster

    from src.template.sharded import consolidate

    if not path.is_dir():
        return torch.load(path, weights_only=True)
    with tempfile.TemporaryDirectory() as folder:
        consolidate(path, Path(folder) / "whole.ckpt")
        return torch.load(Path(folder) / "whole.ckpt", weights_only=True)


def files_holding(secret: str, folder: Path, max_size: float = float("inf")) -> list[Path]:
    """The files under ``folder`` (up to ``max_size`` bytes) whose bytes contain ``secret``: a
    password must be in none of them."""
    files = [path for path in folder.rglob("*") if path.is_file()]
    small = [path for path in files if path.stat().st_size <= max_size]
    return [path for path in small if secret.encode() in path.read_bytes()]


def read_metrics(run_dir: Path) -> dict[str, float]:
    return json.loads((run_dir / "metrics.json").read_text())


def only_run(store: Path, experiment: str = DATA_NAME, task: str = "train"):
    """The single MLflow run of ``task`` in a SQLite store (fails if there are several); the
    tiny job's experiment unless ``experiment``."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    runs = client.search_runs(
        [client.get_experiment_by_name(experiment).experiment_id], f"tags.task = '{task}'"
    )
    assert len(runs) == 1, [run.info.run_name for run in runs]
    return client, runs[0]


# The trained job is validated twice an epoch (after half its steps, and at its end), its training
# metrics logged every 4 steps: what a job counted in steps records (test_train.py).
TRAINED_STEPS = ["trainer.val_check_interval=0.5", "trainer.log_every_n_steps=4"]


@pytest.fixture(scope="session")
def trained(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One real training job, launched from a fresh folder so the MLflow store (mlflow.db) and
    outputs/ land where the defaults put them. Yields its working folder and run folder."""
    workdir = tmp_path_factory.mktemp("trained")
    run_dir = workdir / "run"
    # seed=0 on purpose: a falsy seed must still seed (a classic `if cfg.seed:` bug).
    # The two extra keys carry fake credentials that must never reach MLflow.
    proc = run_entry(
        "train",
        *tiny_overrides(tiny_root, model=True),
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


def local_server_argv(port: int, folder: Path) -> list[str]:
    """``mlflow server`` on 127.0.0.1:``port`` with its store and artifacts in ``folder``."""
    return [
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{folder / 'server.db'}",
        "--artifacts-destination",
        str(folder / "server-artifacts"),
    ]


@contextmanager
def mlflow_server(
    argv: Sequence[str], port: int, cwd: Path, certificate: Path | None = None
) -> Iterator[str]:
    """Run an ``mlflow server ...`` command until it answers ``/health``; yield its URL, then
    stop its whole process group (its workers share it, so one signal stops them all). With the
    ``certificate`` it serves with, its URL is https://."""
    log = cwd / "mlflow-server.log"
    venv_bin = Path(sys.executable).parent  # the `mlflow` command of this environment
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}"}
    # Tracking only, as docs/mlflow.md advises: without its GenAI job runners a server is 2
    # processes and 0.5 GB instead of 10 and 2 GB, and answers 3 s sooner.
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    with log.open("w") as out:
        server = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"{'https' if certificate else 'http'}://127.0.0.1:{port}"
    trust = ssl.create_default_context(cafile=certificate) if certificate else None
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2, context=trust) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not start in 120 s"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@pytest.fixture
def server_url(tmp_path: Path) -> Iterator[str]:
    """A real ``mlflow server`` on 127.0.0.1 with its own store, stopped by its process group."""
    port = free_port()
    argv = local_server_argv(port, tmp_path)
    with mlflow_server(argv, port, tmp_path) as url:
        yield url


def invoke(url: str, images: np.ndarray) -> list[dict]:
    body = json.dumps({"inputs": images.tolist()}).encode()
    request = urllib.request.Request(
        f"{url}/invocations", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["predictions"]


def served(model_uri: str, cwd: Path, images: np.ndarray) -> list[dict]:
    """Predictions of ``mlflow models serve -m model_uri --env-manager local``, run in ``cwd``
    (its default store is ./mlflow.db there) on 127.0.0.1, stopped afterwards."""
    port = free_port()
    argv = [
        "mlflow",
        "models",
        "serve",
        "-m",
        model_uri,
        "--env-manager",
        "local",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with mlflow_server(argv, port, cwd) as url:
        return invoke(url, images)


# --- a reference for jobs started by cluster launchers (torchrun, srun)


@pytest.fixture(scope="module")
def two_devices(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """Metrics of a 1-epoch job with devices=2 on one node, started by Lightning itself."""
    workdir = tmp_path_factory.mktemp("two_devices")
    overrides = [*tiny_overrides(tiny_root, logger="none"), "trainer.max_epochs=1"]
    overrides += ["strategy=ddp", "devices=2"]
    run_entry("train", *overrides, f"hydra.run.dir={workdir / 'run'}", cwd=workdir)
    return read_metrics(workdir / "run")


def assert_same_metrics(run_dir: Path, expected: dict[str, float]) -> None:
    metrics = read_metrics(run_dir)
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, abs=1e-6), name


def processes_with_env(**match: str) -> list[psutil.Process]:
    """Running ``src.train`` processes whose environment has all of ``match`` (a launcher's
    rank variables, e.g. ``SLURM_JOB_ID`` and ``SLURM_PROCID``)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if "src.train" in " ".join(proc.cmdline()) and all(
                proc.environ().get(key) == value for key, value in match.items()
            ):
                found.append(proc)
        except psutil.Error:  # gone, or not ours to read
            continue
    return found


def wait_for_file(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout} s"
        time.sleep(0.2)


def assert_rank_logs(run_dir: Path, node: int, local: int) -> None:
    """Ranks started by torchrun or srun each log to their own file: rank 1 to train_rank1.log."""
    assert "rank 0/2 (node 0, local 0)" in (run_dir / "train.log").read_text()
    assert "rank 1/2" not in (run_dir / "train.log").read_text()
    assert f"rank 1/2 (node {node}, local {local})" in (run_dir / "train_rank1.log").read_text()


FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def wait_for_job(job: str, timeout: float = 300) -> str:
    """The states a SLURM job went through, up to its final one, polled every 0.5 s (``sbatch
    --wait`` backs off to 32 s). A requeued job waits ~11 s (its begin time; cred_expire in
    slurm/local-cluster.sh): starting it sooner by hand gets it killed with "Job credential
    revoked" when that falls in the requeue's second."""
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        info = subprocess.run(
            ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=True
        ).stdout
        state, reason, restarts = (
            re.search(rf"{key}=(\S+)", info).group(1) for key in ("JobState", "Reason", "Restarts")
        )
        if not seen or seen[-1] != (state, reason, restarts):
            seen.append((state, reason, restarts))
        if state in FINAL_STATES:
            return " -> ".join("/".join(s) for s in seen)
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], check=False)
            pytest.fail(f"job {job} still {state} after {timeout} s: {seen}")
        time.sleep(0.5)


@pytest.fixture
def s3_server() -> Iterator[dict[str, str]]:
    """A local moto S3 server (started and stopped here) and the environment that points boto3
    and LitData at it."""
    with moto_s3() as (env, _):
        yield env
