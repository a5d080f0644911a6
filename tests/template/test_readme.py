"""Every shell command the README and the ``docs/`` pages show, run as typed on tiny data or
skipped with the reason; and every relative link of those pages, checked.

The commands are read from README.md and docs/*.md when the tests are collected: each fenced
``bash``, ``sh``, ``shell`` or ``console`` block is split into commands, and every distinct command
becomes one test, whose id names the pages that show it (a command shown on several pages runs
once). A command that runs ``src.train``, ``src.eval`` or ``src.predict`` (sweeps included) runs in
a fresh launch folder (where the pages say ``outputs/``, ``mlflow.db`` and ``optuna.db`` land) with
only ``APPENDED`` added at its end and the placeholders a reader fills in (``ckpt_path=PATH``,
``[same overrides]``) replaced; a new one is covered without writing a test. Any other command
(``mlflow ui``, ``mlflow models serve``, ``curl``, ``src.register``, ``make``, ``sbatch``, ...) runs
through its runner in ``RUNNERS``, as typed, after what a reader runs first. A command that cannot
run here is listed in ``SKIPPED`` with the reason and the test that runs the same thing; a command
with neither a runner nor a reason fails ``test_every_command_is_run_or_skipped``, and any other
placeholder fails its test.
"""

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import pytest
import yaml
from lightning_exact.job.entry import LIBRARY_CONF
from lightning_exact.testing.processes import ended, process_group, run_job
from lightning_exact.testing.servers import mlflow_server, started_server
from lightning_exact.training.sharded import is_sharded_checkpoint

from tests.conftest import HARNESS, PROJECT
from tests.idx_data import make_dataset
from tests.image_data import make_image_folder
from tests.template.launchers import wait_for_job

N_TEST = HARNESS.n_test
N_TRAIN = HARNESS.n_train
VAL_SIZE = HARNESS.val_size

README = PROJECT / "README.md"
# The guide and its reference pages, README first: the pages whose commands are run.
PAGES = [README, *sorted((PROJECT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
ENTRY_POINTS = ("src.train", "src.eval", "src.predict")
N_TRIALS = 2
TIMEOUT_S = 300

# The only additions to a README command, in this order, at its end: sizes for a job of seconds
# on tiny generated data. ``{data_root}`` is the session's tiny data folder. An entry with a
# condition is appended only to commands with a token starting with it.
APPENDED: list[tuple[str, str | None]] = [
    ("data.root={data_root}", None),
    (f"data.val_size={VAL_SIZE}", None),
    ("trainer.max_epochs=1", None),
    # A size override like the ones above: 2 Optuna trials instead of the search's 20.
    (f"hydra.sweeper.n_trials={N_TRIALS}", "hparams_search="),
]

# Commands of the pages that cannot run here, as a regex searched in the command, with the reason
# and, where there is one, the test that runs the same thing. Every other command runs: an entry
# point as typed (below), any other command through its runner in ``RUNNERS``; a command with
# neither fails ``test_every_command_is_run_or_skipped``.
SKIPPED: dict[str, str] = {
    r"^torchrun\b.*--nnodes[ =](?!1\b)": "two machines (node rank K, HOST_OF_NODE_0)",
    r"^srun\b": "runs inside an sbatch allocation on a SLURM cluster",
    r"\bmodel=mlp\b": "the network that 'Make it yours' adds: tests/template/test_make_it_yours.py "
    "adds it to a copy of the project and runs these",
    r"accelerator=gpu|trainer=gpu\b|--gpus(?![\w-])": "needs a GPU",
    r"\$SKYPILOT_": "runs on the nodes of a SkyPilot cluster",
    r"\bdata=shards\b|\bimages=|\binputs=new_images/|-m src\.prepare\b": "writes or reads "
    "shards, or reads new image files: "
    "tests/task/test_shards.py runs these",
    r"^sbatch\b(?!.*--gpus-per-node=0)": "needs GPU nodes (--gpus-per-node of 2 or 4); the same "
    "script runs on CPU nodes here: 'sbatch --gpus-per-node=0 slurm/train.sbatch' below and "
    "tests/template/test_slurm.py (1 node x 2 tasks, 2 nodes x 1)",
    r"^python3? -m venv\b|^\. \.venv/bin/activate$|^pip install\b": "the install: CI "
    "(.ci/run) makes a fresh venv and installs the project exactly so, then runs the tests in it",
    r"^python3? -m pytest\b(?!.*tests/)": "the test suite itself (what CI's .ci/run runs)",
    r"^TEMPLATE_DATA_DIR=\S+ python3? -m pytest\b": "reads the real Fashion-MNIST/MNIST files, "
    "not here; tests/task/test_mnist.py::test_real_data_folder_is_taken_from_the_environment runs "
    "one "
    "of these tests with TEMPLATE_DATA_DIR set to another folder and checks it looks there",
    r"^sky\b": "needs a cloud account; tests/template/test_sky.py runs sky/train.yaml's run: "
    "section on "
    "this host as 2 nodes x 1 process, and sky/tracking-server.yaml's as on its VM",
    r"^export MLFLOW_AUTH_ADMIN_PASSWORD=\.\.\.": "the admin's password a reader types, for the "
    "sky commands after it (tests/template/test_sky.py gives the task its secret)",
    r"^python -m src\.consolidate\b": "needs the sharded checkpoint of a 2-rank FSDP job: "
    "lib/tests/test_sharded.py::test_fsdp_checkpoint_folders_resume_on_one_rank_evaluate_and_"
    "consolidate consolidates one and evaluates the file",
    r"^kubectl\b": "needs a Kubernetes cluster; tests/template/test_k8s.py validates the manifest "
    "against "
    "the JobSet resource schema and runs its container command on this host as 2 pods",
    r"^docker\b": "no Docker engine here or on CI; IMAGE_TEST=1 tests/template/test_tooling.py::"
    "test_image_builds_and_trains builds the same Dockerfile with buildah and trains in it",
    r"^sudo\b": "a VM's system packages and systemd unit (root's): .ci/run installs postgresql "
    "and caddy, and lib/tests/test_server.py runs the supervisord that the unit starts",
    r"^python -m benchmarks\.tracking_load\b": "minutes against the whole service; tests/"
    "template/test_tracking_load.py::test_tracking_load_survives_a_killed_server_a_restarted_database_and_a_"
    "stopped_bucket runs it with --tiny",
    r"^python3? -m benchmarks\.run$": "about 10 minutes on 2 cores; tests/task/test_benchmarks.py "
    "runs 'python -m benchmarks.run --tiny', every row on tiny data",
    r"^python -m benchmarks\.data_scale --memory$": "about 15 minutes of 1-, 2- and 4-rank jobs "
    "on 2 cores; tests/task/test_benchmarks.py runs its rows on one rank and tiny folders "
    "('python -m benchmarks.run --tiny': '10. in memory')",
    r"^copier (copy --vcs-ref v\d+\.\d+\.\d+ |update$)|^cd my-project$": "needs GitHub; "
    "tests/template/test_copier.py makes a project with copier copy from a snapshot of this "
    "repository, then takes the next version with copier update",
    r"^cd lib$": "the library's own tests: CI runs them (.ci/run: cd lib && python -m pytest)",
    r"^git (commit -am Release|tag v)": "a release of the template (docs/development.md): "
    "tests/template/test_releases.py checks that its versions and CHANGELOG agree",
    r"^git (init|add -A|commit -m|-C \.\./lightning-ddp-template diff|switch -c|rm )|^grep "
    r"|^xargs sed |^copier copy --overwrite |^printf defaults": "moves a fork made before 1.0 "
    "(docs/upgrading.md): tests/template/test_upgrading.py runs these steps on such a fork",
}

# Page commands that another test runs as written (it takes them from the pages with
# ``page_command``, adds tiny-data overrides) and checks more closely: run once, there.
RUN_ELSEWHERE: dict[str, str] = {
    r"^python -m src\.train -m strategy=ddp devices=1,2,4 ": "tests/template/test_sweep_guides.py::"
    "test_the_guides_ddp_sweep_runs_every_job_once_with_its_own_world",
    r"study_name=convnet-ddp2$": "tests/template/test_sweep_guides.py::"
    "test_optuna_search_trains_each_trial_on_every_rank",
    r"^python -m src\.train -m hydra/launcher=slurm .*accelerator=cpu model\.lr=": "tests/"
    "template/test_slurm.py::test_sweep_jobs_run_as_slurm_jobs_whose_tasks_are_the_ranks",
    r"^python -m src\.train -m hparams_search=convnet_optuna hydra/launcher=slurm .*=cpu$": "tests/"
    "template/test_slurm.py::test_optuna_trials_run_as_slurm_jobs",
    r"\bdata=my_mnist\b": "tests/template/test_make_it_yours.py::"
    "test_another_idx_dataset_is_one_entry_and_one_config",
}
SKIPPED |= {pattern: f"{test} runs it as written" for pattern, test in RUN_ELSEWHERE.items()}

# Page commands of the library's features that its own tests run, on its test task (a regression:
# its experiment is "synthetic", not the image task's "mnist"): the same commands, written there.
RUN_BY_THE_LIBRARY: dict[str, str] = {
    r"^MLFLOW_TRACKING_USERNAME=ann ": "lib/tests/test_store.py::"
    "test_a_team_server_with_accounts_as_docs_mlflow_md_shows",
    r"^python -m lightning_exact\.server ": "lib/tests/test_server.py::"
    "test_the_service_serves_a_users_job_over_tls_and_comes_back_after_a_crash",
    r"^MLFLOW_TRACKING_SERVER_CERT_PATH=ca\.crt ": "lib/tests/test_server.py::"
    "test_the_service_serves_a_users_job_over_tls_and_comes_back_after_a_crash",
}
SKIPPED |= {
    pattern: f"{test} runs the same command on the library's test task"
    for pattern, test in RUN_BY_THE_LIBRARY.items()
}

# Placeholders a reader fills in, and what the tests fill in.
CKPT_PLACEHOLDER = re.compile(r"^ckpt_path=(PATH|\S*<[^<>]+>\S*/last\.ckpt)$")
DROPPED_GROUP = ("[same", "overrides]")
UNKNOWN_PLACEHOLDER = re.compile(r"<[^<>]*>|\.\.\.|^\[|(?:^|=)[A-Z][A-Z0-9_]*$")

# Signs of a failure that an exit code 0 can hide.
# A model export that failed is a warning, never a failed job: here it is a failure.
LOG_PROBLEMS = re.compile(
    r"Traceback|InterpolationResolutionError|Callback \w+\.\w+ raised|not logged as an MLflow model"
)
PRINT_ONLY = {"--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i"}


@dataclass(frozen=True)
class ReadmeCommand:
    """One command of a README shell block (continuations joined, comments and prompt dropped)."""

    tokens: tuple[str, ...]
    server: tuple[str, ...] | None = None  # the block's `mlflow server ...` command, if any
    # The commands before this one in its block (what a reader has run first); not part of what
    # the command is, so a command shown in two blocks is still one test.
    previous: tuple[tuple[str, ...], ...] = field(default=(), compare=False)

    @property
    def text(self) -> str:
        return " ".join(self.tokens)


# --- reading the README ---------------------------------------------------------------------


def shell_blocks(markdown: str) -> Iterator[list[str]]:
    """The lines of each fenced block whose info string names a shell."""
    fence, info, lines = None, "", []
    for line in markdown.splitlines():
        stripped = line.strip()
        if fence is None:
            if match := re.match(r"^(`{3,}|~{3,})\s*([\w+-]*)", stripped):
                fence, info, lines = match.group(1), match.group(2).lower(), []
        elif stripped.startswith(fence) and not stripped.strip(fence[0]):
            if info in SHELL_BLOCKS:
                yield lines
            fence = None
        else:
            lines.append(line)


def logical_lines(lines: list[str]) -> list[str]:
    """Lines with each ``\\``-continuation joined; in a block with ``$ `` prompts, only the
    prompted lines (the others are output), without the prompt."""
    joined, current = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        joined.append(current + line)
        current = ""
    if current:
        joined.append(current)
    prompted = [line.lstrip()[2:] for line in joined if line.lstrip().startswith("$ ")]
    return prompted or joined


def split_commands(line: str) -> list[list[str]]:
    """The commands of one shell line as tokens: comments dropped, split at ``&&``, ``||``,
    ``;`` and ``|`` (written as separate words)."""
    commands: list[list[str]] = [[]]
    for token in shlex.split(line, comments=True):
        if token in {"&&", "||", ";", "|"}:
            commands.append([])
        else:
            commands[-1].append(token)
    return [command for command in commands if command]


def block_commands(markdown: str) -> list[ReadmeCommand]:
    """Every command of the shell blocks, once, in page order."""
    found: list[ReadmeCommand] = []
    for block in shell_blocks(markdown):
        commands = [c for line in logical_lines(block) for c in split_commands(line)]
        server = next((tuple(c) for c in commands if c[:2] == ["mlflow", "server"]), None)
        for i, tokens in enumerate(commands):
            previous = tuple(tuple(c) for c in commands[:i])
            command = ReadmeCommand(tuple(tokens), server, previous)
            if command not in found:
                found.append(command)
    return found


def is_entry_point(tokens: tuple[str, ...] | list[str]) -> bool:
    return bool(set(tokens) & set(ENTRY_POINTS))


def readme_commands(markdown: str) -> list[ReadmeCommand]:
    """Every command of the shell blocks that runs an entry point, once, in README order."""
    return [command for command in block_commands(markdown) if is_entry_point(command.tokens)]


def page_commands(pages: list[Path], root: Path = PROJECT) -> dict[ReadmeCommand, list[str]]:
    """Every distinct command of ``pages``, in page order, with the pages (relative to ``root``)
    that show it: a command on several pages is one test."""
    shown: dict[ReadmeCommand, list[str]] = {}
    for page in pages:
        name = page.relative_to(root).as_posix()
        for command in block_commands(page.read_text()):
            shown.setdefault(command, []).append(name)
    return shown


def command_id(text: str, width: int = 100) -> str:
    """The command as a test id; past ``width`` characters its middle words become ``...``."""
    if len(text) <= width:
        return text
    words = text.split()
    head, tail = [], []
    while len(" ".join([*head, words[len(head)]])) <= width // 2:
        head.append(words[len(head)])
    while not tail or len(" ".join([words[-1 - len(tail)], *tail])) <= width // 2 - 5:
        tail.insert(0, words[-1 - len(tail)])
    return " ".join([*head, "...", *tail])


# --- what a command does --------------------------------------------------------------------


def skip_reason(text: str) -> str | None:
    """Why a README command cannot run here (from ``SKIPPED``), or None."""
    return next((why for pattern, why in SKIPPED.items() if re.search(pattern, text)), None)


def substitute(tokens: tuple[str, ...] | list[str], checkpoint: Path | None) -> list[str]:
    """The command with the reader's placeholders filled in: ``ckpt_path=PATH`` (or a
    ``<time>`` path to a last.ckpt) becomes ``checkpoint``, ``[same overrides]`` goes."""
    out: list[str] = []
    for token in tokens:
        if CKPT_PLACEHOLDER.match(token) and checkpoint is not None:
            token = f"ckpt_path={checkpoint}"
        out.append(token)
    n = len(DROPPED_GROUP)
    for i in range(len(out) - n, -1, -1):
        if tuple(out[i : i + n]) == DROPPED_GROUP:
            del out[i : i + n]
    return out


def unknown_placeholders(tokens: list[str]) -> list[str]:
    """Tokens that still hold a placeholder (``<...>``, ``PATH``, ``HOST_OF_NODE_0``, ``...``)."""
    return [token for token in tokens if UNKNOWN_PLACEHOLDER.search(token)]


def needs_checkpoint(tokens: tuple[str, ...] | list[str]) -> bool:
    return any(CKPT_PLACEHOLDER.match(token) for token in tokens)


def entry_index(tokens: list[str]) -> int:
    """Where the entry point module (``src.train`` ...) is in the command."""
    return next(i for i, token in enumerate(tokens) if token in ENTRY_POINTS)


def task_of(tokens: list[str]) -> str:
    """``train``, ``eval`` or ``predict``."""
    return tokens[entry_index(tokens)].removeprefix("src.")


def arguments(tokens: list[str]) -> list[str]:
    """What the entry point itself gets: the words after its module name."""
    return tokens[entry_index(tokens) + 1 :]


def override(tokens: list[str], key: str) -> str | None:
    """The value a command gives ``key`` (the last one wins, as in Hydra), or None."""
    values = [t.split("=", 1)[1] for t in arguments(tokens) if t.startswith(f"{key}=")]
    return values[-1] if values else None


def is_multirun(tokens: list[str]) -> bool:
    return bool({"-m", "--multirun"} & set(arguments(tokens)))


def is_print_only(tokens: list[str]) -> bool:
    """``--cfg job``, ``--help`` and the like: Hydra prints and runs nothing."""
    return bool(PRINT_ONLY & set(arguments(tokens)))


def split_top_level(value: str) -> list[str]:
    """``value`` split at the commas outside brackets, parentheses and quotes."""
    parts, depth, quote, current = [], 0, "", ""
    for char in value:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[({":
            depth += 1
        elif char in "])}":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += char
    return [*parts, current]


def sweep_size(value: str) -> int:
    """How many values one override sweeps: ``a,b,c`` 3, ``choice(a,b)`` 2, ``range(0,6,2)`` 3."""
    if match := re.fullmatch(r"choice\((.*)\)", value):
        return len(split_top_level(match.group(1)))
    if match := re.fullmatch(r"range\(([-\d, ]+)\)", value):
        return len(range(*(int(n) for n in match.group(1).split(","))))
    return len(split_top_level(value))


def expected_jobs(tokens: list[str]) -> int:
    """The number of jobs a command runs: 1, ``N_TRIALS`` for an Optuna search, or the product
    of the swept values' counts."""
    if not is_multirun(tokens):
        return 1
    if override(tokens, "hparams_search"):
        return N_TRIALS
    sweeps = [t.split("=", 1)[1] for t in arguments(tokens) if "=" in t and t[0] not in "-~"]
    return prod(sweep_size(value) for value in sweeps)


def appended(tokens: list[str], data_root: Path) -> list[str]:
    """The overrides of ``APPENDED`` this command gets."""
    return [
        text.format(data_root=data_root)
        for text, condition in APPENDED
        if condition is None or any(token.startswith(condition) for token in tokens)
    ]


def default_logger(task: str) -> str:
    """The logger an entry point's config picks when the command names none."""
    config = PROJECT / "conf" / f"{task}.yaml"  # the project's own, else the library's
    config = config if config.is_file() else LIBRARY_CONF / f"{task}.yaml"
    defaults = yaml.safe_load(config.read_text())["defaults"]
    return next(d["logger"] for d in defaults if isinstance(d, dict) and "logger" in d)


def tracking_uri(tokens: list[str], workdir: Path) -> str | None:
    """The MLflow store a command's runs go to, or None when it logs to none."""
    logger = override(tokens, "logger") or default_logger(task_of(tokens))
    if logger != "mlflow":
        return None
    return override(tokens, "logger.tracking_uri") or f"sqlite:///{workdir / 'mlflow.db'}"


# --- running a command ----------------------------------------------------------------------


def command_env() -> dict[str, str]:
    """The environment of a user in the project's venv: ``src`` importable from anywhere."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PYTHONPATH": str(PROJECT), "PATH": path}


def executable(tokens: list[str]) -> list[str]:
    """The command with a leading ``python`` as this interpreter."""
    if tokens[0] in {"python", "python3"}:
        return [sys.executable, *tokens[1:]]
    return list(tokens)


def run_command(argv: list[str], workdir: Path) -> subprocess.CompletedProcess:
    """Run a command from ``workdir`` as a user would (``run_job``: a hang fails with stacks)."""
    return run_job(executable(argv), cwd=workdir, env=command_env(), timeout=TIMEOUT_S)


def port_answers(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def readme_server(tokens: tuple[str, ...], workdir: Path) -> Iterator[None]:
    """Run the README's ``mlflow server ...`` command, verbatim, from ``workdir``."""
    port = int(tokens[tokens.index("--port") + 1]) if "--port" in tokens else 5000
    if port_answers(port):
        pytest.skip(f"port {port} of the README's mlflow server is already in use")
    with mlflow_server(tokens, port, workdir):
        yield


# --- what a command must leave behind -------------------------------------------------------


def check_log(proc: subprocess.CompletedProcess) -> None:
    """Exit code 0 and no sign of a hidden failure in the output."""
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{output[-6000:]}"
    problems = sorted({m.group(0) for m in LOG_PROBLEMS.finditer(output)})
    assert not problems, f"{problems} in the output:\n{output[-6000:]}"


def job_dirs(tokens: list[str], workdir: Path) -> list[Path]:
    """The job folders a command wrote, checked against its expected layout."""
    task = task_of(tokens)
    root = workdir / (override(tokens, "paths.log_dir") or "outputs") / task
    if run_dir := override(tokens, "hydra.run.dir"):
        return [workdir / run_dir]
    if not is_multirun(tokens):
        runs = sorted((root / "runs").glob("*/"))
        assert len(runs) == 1, f"expected one folder in {root / 'runs'}: {runs}"
        return runs
    sweeps = sorted((root / "multiruns").glob("*/"))
    assert len(sweeps) == 1, f"expected one sweep folder in {root / 'multiruns'}: {sweeps}"
    assert (sweeps[0] / "multirun.yaml").is_file(), "no multirun.yaml in the sweep folder"
    jobs = sorted(p for p in sweeps[0].iterdir() if p.is_dir() and p.name.isdigit())
    assert len(jobs) == expected_jobs(tokens), [p.name for p in jobs]
    return jobs


def listing(folder: Path) -> list[str]:
    """Everything under ``folder``, relative to it."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def split_size(split: str) -> int:
    return {"test": N_TEST, "val": VAL_SIZE, "train": N_TRAIN - VAL_SIZE}[split]


def check_job(task: str, split: str, job: Path, resumed: bool) -> None:
    """What one job folder of ``task`` must hold (a resume of a finished job trains nothing, so
    it writes no new ``last.ckpt``)."""
    if task == "train":
        expected = ("metrics.json", "config.yaml") + (() if resumed else ("checkpoints/last.ckpt",))
        for name in expected:
            found = (job / name).is_file() or is_sharded_checkpoint(job / name)  # FSDP: a folder
            assert found, f"{job} has no {name}: {listing(job)}"
    elif task == "eval":
        metrics = json.loads((job / "metrics.json").read_text())
        assert f"{split}/acc" in metrics, metrics
    else:
        csvs = list(job.glob("predictions_*.csv"))
        assert [p.name for p in csvs] == [f"predictions_{split}.csv"], listing(job)
        rows = csvs[0].read_text().splitlines()[1:]
        assert len(rows) == split_size(split), f"{len(rows)} rows in {csvs[0]}"


def check_mlflow(uri: str, task: str, jobs: int) -> None:
    """Every run in the store ended FINISHED, and there is one run of ``task`` per job."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    ids = [experiment.experiment_id for experiment in client.search_experiments()]
    runs = client.search_runs(ids)
    unfinished = [(r.info.run_name, r.info.status) for r in runs if r.info.status != "FINISHED"]
    assert not unfinished, f"runs not FINISHED in {uri}: {unfinished}"
    if task in {"train", "eval"}:
        ours = [r for r in runs if r.data.tags.get("task") == task]
        assert len(ours) == jobs, f"{len(ours)} runs tagged task={task} in {uri}, {jobs} jobs"


def check_outputs(tokens: list[str], proc: subprocess.CompletedProcess, workdir: Path) -> None:
    """The files a command leaves in its launch folder and its MLflow store."""
    if is_print_only(tokens):
        if {"--cfg", "-c"} & set(tokens):  # a config; --info and --help print tables and text
            assert isinstance(yaml.safe_load(proc.stdout), dict), proc.stdout[-3000:]
        else:
            assert proc.stdout.strip(), "it printed what it was asked for"
        assert not list(workdir.iterdir()), f"wrote {listing(workdir)}"
        return
    task, split = task_of(tokens), override(tokens, "split") or "test"
    if "this job finished; its result is read back" in proc.stdout:  # resuming a finished job
        assert not list(workdir.glob("outputs/*/runs/*")), "nothing trained: no new folder"
        return
    jobs = job_dirs(tokens, workdir)
    resumed = override(tokens, "ckpt_path") is not None
    for job in jobs:
        check_job(task, split, job, resumed)
    uri = tracking_uri(tokens, workdir)
    if uri is None:
        return
    if uri.startswith("sqlite:///"):
        assert Path(uri.removeprefix("sqlite:///")).is_file(), f"no MLflow store at {uri}"
    check_mlflow(uri, task, len(jobs))


# --- commands that are not entry points ------------------------------------------------------
#
# Each runs as typed, from a fresh launch folder, after what a reader runs first (the block's
# entry-point commands before it, or the page's command it names); the only changes: a port the
# command names is swapped for a free one if something else here holds it, a ``<time>`` folder is
# the one that exists, ``JOB`` is the job id sbatch printed.

SERVER_START_S = 180
SLURM_WAIT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def with_free_port(tokens: list[str], default: int) -> tuple[list[str], int]:
    """The command and the port it serves on: its ``--port`` (or ``default``), or, if that port
    is taken here, a free one in its place."""
    port = int(tokens[tokens.index("--port") + 1]) if "--port" in tokens else default
    if not port_answers(port):
        return tokens, port
    new = free_port()
    if "--port" in tokens:
        i = tokens.index("--port") + 1
        return [*tokens[:i], str(new), *tokens[i + 1 :]], new
    return [*tokens, "--port", str(new)], new


def fill_times(tokens: list[str], workdir: Path) -> list[str]:
    """Each ``<time>`` of a path (also after ``@`` or ``key=``) as the one folder of ``workdir``
    that matches."""
    out = []
    for token in tokens:
        if "<time>" in token:
            prefix, path = re.match(r"^(@|[\w.]+=)?(.*)$", token).groups()
            matches = sorted(workdir.glob(path.replace("<time>", "*")))
            assert len(matches) == 1, f"{path}: {matches} in {workdir}"
            token = (prefix or "") + matches[0].relative_to(workdir).as_posix()
        out.append(token)
    return out


def assignments(tokens: list[str]) -> tuple[dict[str, str], list[str]]:
    """A command's leading ``NAME=value`` words (its environment, as the shell reads them) and
    the command after them."""
    env: dict[str, str] = {}
    while tokens and re.match(r"^[A-Za-z_]\w*=", tokens[0]):
        name, _, value = tokens[0].partition("=")
        env[name], tokens = value, tokens[1:]
    return env, tokens


@contextmanager
def typed_server(
    tokens: list[str], port: int, workdir: Path
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A server command as typed, from ``workdir``, until it answers ``/health`` (else the
    test fails with its log); then its whole process group is stopped and the port is free.
    Tracking only (no GenAI job runners) unless the command sets MLflow's switch itself."""
    env, argv = assignments(tokens)
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **env}
    with started_server(argv, port, workdir, env=env) as (url, server):
        yield url, server
    deadline = time.monotonic() + 30
    while port_answers(port):
        assert time.monotonic() < deadline, f"port {port} still answers after the server stopped"
        time.sleep(0.5)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200, url
        return response.read().decode()


def run_entry_commands(commands: Iterator[tuple[str, ...]], workdir: Path, data: Path) -> None:
    """The entry-point commands a reader runs first, as typed with ``APPENDED``, checked."""
    for tokens in commands:
        if is_entry_point(tokens):
            proc = run_command([*tokens, *appended(list(tokens), data)], workdir)
            check_log(proc)
            check_outputs(list(tokens), proc, workdir)


def shown(pattern: str) -> ReadmeCommand:
    """The page command that ``pattern`` finds (a runner that needs another command's result
    takes it from the pages, so the two cannot drift apart)."""
    found = [command for command in COMMANDS if re.search(pattern, command.text)]
    assert len(found) == 1, f"{pattern}: {[c.text for c in found]}"
    return found[0]


def page_command(test: str) -> list[str]:
    """The tokens of the page command that ``test`` (a function name in ``RUN_ELSEWHERE``)
    runs (``arguments`` and ``override`` read them)."""
    (pattern,) = [p for p, t in RUN_ELSEWHERE.items() if t.endswith(f"::{test}")]
    return list(shown(pattern).tokens)


def run_mlflow_ui(command: ReadmeCommand, workdir: Path, request: pytest.FixtureRequest) -> None:
    """``mlflow ui`` (or ``mlflow server ...``) answers, its page too, and opens its store in the
    launch folder."""
    tokens, port = with_free_port(list(command.tokens), 5000)
    with typed_server(tokens, port, workdir) as (url, server):
        assert "<html" in get(f"{url}/").lower()
        experiments = get(f"{url}/ajax-api/2.0/mlflow/experiments/search?max_results=10")
        assert "Default" in experiments, experiments
        env, argv = assignments(tokens)
        if env.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION") == "false" and "--workers" in argv:
            # The light UI the pages show: no job runner, and 2 processes for one worker.
            running = [p for p in process_group(server.pid) if not ended(p)]
            commands = [" ".join(p.cmdline()) for p in running]
            assert not [c for c in commands if "mlflow.server.jobs" in c or "huey" in c]
            if argv[argv.index("--workers") + 1] == "1":
                assert len(running) == 2, commands
    store = "sqlite:///mlflow.db"  # what `mlflow ui` opens unless told otherwise
    if "--backend-store-uri" in tokens:
        store = tokens[tokens.index("--backend-store-uri") + 1]
    assert (workdir / store.removeprefix("sqlite:///")).is_file(), listing(workdir)


@dataclass(frozen=True)
class Served:
    workdir: Path
    port: int


@pytest.fixture(scope="session")
def served_model(readme_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The pages' ``mlflow models serve ...`` as typed, after the training command before it
    (which registers the model), answering; stopped at the end of the session."""
    command = shown(r"^mlflow models serve\b")
    workdir = tmp_path_factory.mktemp("readme-serve")
    run_entry_commands(command.previous, workdir, readme_data)
    tokens, port = with_free_port(list(command.tokens), 5000)
    with typed_server(tokens, port, workdir):
        yield Served(workdir, port)


def run_models_serve(command: ReadmeCommand, workdir: Path, request: pytest.FixtureRequest) -> None:
    served = request.getfixturevalue("served_model")
    assert get(f"http://127.0.0.1:{served.port}/ping") is not None


def run_curl(command: ReadmeCommand, workdir: Path, request: pytest.FixtureRequest) -> None:
    """``curl ... /invocations`` with the input example against the served model: one answer
    per example image, each a class, its name and every class's probability."""
    served = request.getfixturevalue("served_model")
    tokens = [t.replace("127.0.0.1:5001", f"127.0.0.1:{served.port}") for t in command.tokens]
    tokens = fill_times(tokens, served.workdir)
    proc = run_command(tokens, served.workdir)
    check_log(proc)
    answers = json.loads(proc.stdout)["predictions"]
    example = tokens[-1].removeprefix("@")
    inputs = json.loads((served.workdir / example).read_text())["inputs"]
    assert len(answers) == len(inputs) > 0, proc.stdout[:3000]
    for answer in answers:
        assert set(answer) == {"predicted", "class_name", "probabilities"}, answer
        assert len(answer["probabilities"]) == 10 and answer["predicted"] in range(10)


def run_register(command: ReadmeCommand, workdir: Path, request: pytest.FixtureRequest) -> None:
    """``src.register <sweep folder>`` after the block's sweep: the best job's model is version 1
    of the name in the launch folder's store."""
    from mlflow import MlflowClient

    run_entry_commands(command.previous, workdir, request.getfixturevalue("readme_data"))
    tokens = fill_times(list(command.tokens), workdir)
    proc = run_command(tokens, workdir)
    check_log(proc)
    name = tokens[tokens.index("--name") + 1]
    assert proc.stdout.startswith(f"registered {name} version 1"), proc.stdout
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (version,) = client.search_model_versions(f"name = '{name}'")
    sweep = workdir / tokens[tokens.index("src.register") + 1]
    jobs = [(sweep / job / "mlflow_run_id.txt").read_text().strip() for job in ("0", "1")]
    assert version.run_id in jobs


def run_make(command: ReadmeCommand, workdir: Path, request: pytest.FixtureRequest) -> None:
    """``make ...`` from the project root (where the Makefile is), with this environment as the
    Makefile's ``VENV`` (CI's ``.ci/run`` makes it ``.venv``, the default)."""
    env = {**command_env(), "VENV": sys.prefix, "PRE_COMMIT_HOME": str(workdir / "pre-commit")}
    proc = subprocess.run(
        list(command.tokens),
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    check_log(proc)
    if command.tokens[1:] == ("help",):
        assert re.findall(r"make (\S+)", proc.stdout)[:1] == ["help"], proc.stdout
    if command.tokens[1:] == ("lint",):
        assert re.search(r"ruff check\.+Passed", proc.stdout), proc.stdout[-3000:]
    if command.tokens[1:] == ("gpu-check",):  # here: no GPU (CI has none)
        assert "no CUDA GPU here" in proc.stdout or "GPU check" in proc.stdout, proc.stdout


def run_pre_commit_install(
    command: ReadmeCommand, workdir: Path, request: pytest.FixtureRequest
) -> None:
    """``pre-commit install`` in a fresh git checkout with the project's hook config."""
    subprocess.run(["git", "init", "-q"], cwd=workdir, check=True)
    (workdir / ".pre-commit-config.yaml").write_text(
        (PROJECT / ".pre-commit-config.yaml").read_text()
    )
    env = {**command_env(), "PRE_COMMIT_HOME": str(workdir / "pre-commit")}
    proc = subprocess.run(
        list(command.tokens), cwd=workdir, env=env, capture_output=True, text=True, timeout=120
    )
    check_log(proc)
    assert "pre-commit" in (workdir / ".git" / "hooks" / "pre-commit").read_text()


def run_pytest(command: ReadmeCommand, workdir: Path, request: pytest.FixtureRequest) -> None:
    """``python -m pytest tests/...`` (one file, one test) from the project root, as typed: what
    it names runs, slow tests included, and passes."""
    proc = run_job(executable(list(command.tokens)), cwd=PROJECT, env=command_env())
    check_log(proc)
    counts = re.search(r"(\d+) passed", proc.stdout)
    assert counts and "deselected" not in proc.stdout, proc.stdout[-3000:]
    if "::" in command.text:
        assert counts.group(1) == "1", proc.stdout[-3000:]


def slurm_running() -> None:
    """The live local SLURM cluster, started if it is not (as tests/test_slurm.py does)."""
    if (
        shutil.which("sinfo")
        and subprocess.run(["sinfo", "-h"], capture_output=True).returncode == 0
    ):
        return
    if os.geteuid() != 0 or not (shutil.which("apt-get") or shutil.which("slurmctld")):
        pytest.skip(
            "no SLURM cluster here, and no root and apt to start one (slurm/local-cluster.sh)"
        )
    proc = subprocess.run(
        ["bash", PROJECT / "slurm" / "local-cluster.sh"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def run_sbatch(tokens: list[str], workdir: Path) -> tuple[str, str]:
    """``sbatch ...`` from ``workdir`` (with the project's ``slurm/`` there, as in the project
    root), waiting for the job: (job id, its output); the job must have COMPLETED with 0."""
    if not (workdir / "slurm").exists():
        (workdir / "slurm").symlink_to(PROJECT / "slurm")
    proc = run_command(tokens, workdir)
    check_log(proc)
    job = re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)
    wait_for_job(job, SLURM_WAIT_S)
    output = (workdir / f"slurm-{job}.out").read_text()
    state = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state + output[-5000:]
    problems = sorted({m.group(0) for m in LOG_PROBLEMS.finditer(output)})
    assert not problems, f"{problems} in slurm-{job}.out:\n{output[-5000:]}"
    return job, output


@dataclass(frozen=True)
class SlurmTrained:
    workdir: Path
    job: str


@pytest.fixture(scope="session")
def slurm_trained(readme_data: Path, tmp_path_factory: pytest.TempPathFactory) -> SlurmTrained:
    """The pages' ``sbatch --gpus-per-node=0 slurm/train.sbatch`` with ``APPENDED``, on the live
    cluster: one 2-rank job, its folder, its checkpoints and one FINISHED MLflow run."""
    slurm_running()
    command = shown(r"^sbatch --gpus-per-node=0 slurm/train\.sbatch$")
    workdir = tmp_path_factory.mktemp("readme-sbatch")
    tokens = [*command.tokens, *appended(list(command.tokens), readme_data)]
    job, _ = run_sbatch(tokens, workdir)
    run_dir = workdir / "outputs" / "train" / "slurm" / job
    check_job("train", "test", run_dir, resumed=False)
    check_mlflow(f"sqlite:///{workdir / 'mlflow.db'}", "train", 1)
    return SlurmTrained(workdir, job)


def run_sbatch_train(command: ReadmeCommand, workdir: Path, request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("slurm_trained")


def run_sbatch_eval(command: ReadmeCommand, workdir: Path, request: pytest.FixtureRequest) -> None:
    """``slurm/eval.sbatch ckpt_path=outputs/train/slurm/JOB/...`` after the page's training job,
    from its launch folder: the test metrics, one FINISHED eval run."""
    trained = request.getfixturevalue("slurm_trained")
    tokens = [t.replace("/JOB/", f"/{trained.job}/") for t in command.tokens]
    tokens += appended(tokens, request.getfixturevalue("readme_data"))
    job, _ = run_sbatch(tokens, trained.workdir)
    check_job("eval", "test", trained.workdir / "outputs" / "eval" / "slurm" / job, False)
    check_mlflow(f"sqlite:///{trained.workdir / 'mlflow.db'}", "eval", 1)


Runner = Callable[[ReadmeCommand, Path, pytest.FixtureRequest], None]

# The commands that are not entry points and run here, as a regex searched in the command.
RUNNERS: dict[str, Runner] = {
    r"^([A-Za-z_]\w*=\S* )*mlflow (ui|server)\b": run_mlflow_ui,
    r"^mlflow models serve\b": run_models_serve,
    r"^curl\b.*/invocations\b": run_curl,
    r"^python3? -m src\.register\b": run_register,
    r"^make (help|lint|gpu-check)$": run_make,  # others build, train or delete: look first
    r"^pre-commit install$": run_pre_commit_install,
    r"^python -m pytest tests/": run_pytest,
    r"^sbatch --gpus-per-node=0 slurm/train\.sbatch$": run_sbatch_train,
    r"^sbatch --gpus-per-node=0 slurm/eval\.sbatch\b": run_sbatch_eval,
}


def runner_of(text: str) -> Runner | None:
    return next((run for pattern, run in RUNNERS.items() if re.search(pattern, text)), None)


def how_run(command: ReadmeCommand) -> str | None:
    """``skipped``, ``entry point``, ``runner``, or None: nothing runs it and nothing says why."""
    if skip_reason(command.text):
        return "skipped"
    if is_entry_point(command.tokens):
        return "entry point"
    if runner_of(command.text):
        return "runner"
    return None


# --- fixtures and tests ---------------------------------------------------------------------


SHOWN = page_commands(PAGES)
COMMANDS = list(SHOWN)


@pytest.fixture(scope="session")
def readme_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data root with tiny learnable MNIST and Fashion-MNIST (403 train, 131 test images) and
    an RGB image folder (``train/`` and ``test/``, 5 classes, 300 and 35 images)."""
    root = tmp_path_factory.mktemp("readme-data")
    for seed, folder in enumerate(("MNIST", "FashionMNIST")):
        make_dataset(root, folder, n_train=N_TRAIN, n_test=N_TEST, seed=seed, learnable=True)
    make_image_folder(root, n_train=60, n_test=7)
    return root


@pytest.fixture(scope="session")
def readme_checkpoint(
    readme_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str | None], Path]:
    """The last.ckpt of the README's plain ``python -m src.train`` (with ``APPENDED``), for the
    dataset a command names (``data=...``); trained once per dataset."""
    trained: dict[str | None, Path] = {}

    def checkpoint(data: str | None) -> Path:
        if data not in trained:
            workdir = tmp_path_factory.mktemp("readme-train")
            tokens = ["python", "-m", "src.train", *([f"data={data}"] if data else [])]
            check_log(run_command([*tokens, *appended(tokens, readme_data)], workdir))
            (trained[data],) = workdir.glob("outputs/train/runs/*/checkpoints/last.ckpt")
        return trained[data]

    return checkpoint


def shared_with_others(command: ReadmeCommand) -> list[pytest.MarkDecorator]:
    """An xdist group for a command whose test shares a session fixture's job (a checkpoint, the
    served model) or the SLURM cluster with others: in parallel runs (-n) one worker runs them
    all, so each such job runs once, and SLURM jobs one at a time (as in tests/test_slurm.py)."""
    if command.tokens[0] == "sbatch":
        group = "slurm"
    elif command.text.startswith(("mlflow models serve", "curl")):
        group = "served-model"
    elif needs_checkpoint(command.tokens):
        group = f"checkpoint-{override(list(command.tokens), 'data') or 'default'}"
    else:
        return []
    return [pytest.mark.xdist_group(group)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [
        pytest.param(
            c, id=f"{'+'.join(SHOWN[c])}: {command_id(c.text)}", marks=shared_with_others(c)
        )
        for c in COMMANDS
    ],
)
def test_readme_command(
    command: ReadmeCommand, readme_data: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The command runs as typed, from a fresh launch folder, on tiny data."""
    if reason := skip_reason(command.text):
        pytest.skip(reason)
    if not is_entry_point(command.tokens):
        run = runner_of(command.text)
        if run is None:
            pytest.fail(f"no runner in RUNNERS and no reason in SKIPPED for: {command.text}")
        run(command, tmp_path, request)
        return
    checkpoint = None
    if needs_checkpoint(command.tokens):
        data = override(list(command.tokens), "data")
        checkpoint = request.getfixturevalue("readme_checkpoint")(data)
    tokens = substitute(command.tokens, checkpoint)
    if unknown := unknown_placeholders(tokens):
        pytest.fail(
            f"README command has an unknown placeholder {unknown}: {command.text}\n"
            "fill it in in substitute() or list the command in SKIPPED with the reason"
        )
    server = readme_server(command.server, tmp_path) if command.server else nullcontext()
    with server:
        proc = run_command([*tokens, *appended(tokens, readme_data)], tmp_path)
        check_log(proc)
        check_outputs(tokens, proc, tmp_path)


# --- the parser, on a literal README --------------------------------------------------------

SAMPLE = """\
Text with `python -m src.train inline` that is not a block.

```bash
# set up, then train
pip install -e . && python -m src.train
python -m src.train -m model.lr=0.001,0.003 \\
  data.batch_size=64,128   # four jobs
python -m src.eval ckpt_path=PATH
```

```yaml
run: python -m src.train
```

```
outputs/train/runs/<time>/
```

```console
$ python -m src.predict ckpt_path=PATH split=val
predictions written to outputs/predict/runs/x/predictions_val.csv
```

```sh
mlflow server --port 5001 \\
  --backend-store-uri sqlite:///s.db
python -m src.train logger.tracking_uri=http://127.0.0.1:5001
```

```bash
torchrun --nnodes 2 --node-rank K --master-addr HOST_OF_NODE_0 -m src.train num_nodes=2
srun python -m src.train strategy=ddp devices=4
python -m src.train ckpt_path=outputs/train/runs/<time>/checkpoints/last.ckpt [same overrides]
python -m src.train data.root=/datasets/<name>
```
"""


def sample_texts() -> list[str]:
    return [command.text for command in readme_commands(SAMPLE)]


def test_parser_finds_commands_of_shell_blocks_only() -> None:
    assert sample_texts() == [
        "python -m src.train",
        "python -m src.train -m model.lr=0.001,0.003 data.batch_size=64,128",
        "python -m src.eval ckpt_path=PATH",
        "python -m src.predict ckpt_path=PATH split=val",
        "python -m src.train logger.tracking_uri=http://127.0.0.1:5001",
        "torchrun --nnodes 2 --node-rank K --master-addr HOST_OF_NODE_0 -m src.train num_nodes=2",
        "srun python -m src.train strategy=ddp devices=4",
        "python -m src.train ckpt_path=outputs/train/runs/<time>/checkpoints/last.ckpt "
        "[same overrides]",
        "python -m src.train data.root=/datasets/<name>",
    ]


def test_parser_attaches_the_blocks_mlflow_server() -> None:
    servers = {command.text: command.server for command in readme_commands(SAMPLE)}
    server = servers["python -m src.train logger.tracking_uri=http://127.0.0.1:5001"]
    assert server == ("mlflow", "server", "--port", "5001", "--backend-store-uri", "sqlite:///s.db")
    assert servers["python -m src.train"] is None


def test_placeholders_are_filled_in_or_reported() -> None:
    commands = {command.text: command.tokens for command in readme_commands(SAMPLE)}
    ckpt = Path("/tmp/last.ckpt")
    resume = commands[
        "python -m src.train ckpt_path=outputs/train/runs/<time>/checkpoints/last.ckpt "
        "[same overrides]"
    ]
    assert substitute(resume, ckpt) == ["python", "-m", "src.train", f"ckpt_path={ckpt}"]
    evaluate = substitute(commands["python -m src.eval ckpt_path=PATH"], ckpt)
    assert not unknown_placeholders(evaluate)
    unknown = substitute(commands["python -m src.train data.root=/datasets/<name>"], ckpt)
    assert unknown_placeholders(unknown) == ["data.root=/datasets/<name>"]
    torchrun = next(tokens for text, tokens in commands.items() if text.startswith("torchrun"))
    assert unknown_placeholders(substitute(torchrun, ckpt)) == ["K", "HOST_OF_NODE_0"]


def test_skip_list_names_only_what_cannot_run_here() -> None:
    reasons = {text: skip_reason(text) for text in sample_texts()}
    assert [text.split()[0] for text, why in reasons.items() if why] == ["torchrun", "srun"]
    assert skip_reason("python -m src.train strategy=ddp devices=4") is None


def test_expected_jobs_and_appended_overrides() -> None:
    sweep = ["python", "-m", "src.train", "-m", "model.lr=0.001,0.003", "data.batch_size=64,128"]
    assert expected_jobs(sweep) == 4
    assert expected_jobs(["python", "-m", "src.train", "-m", "devices=1,2,4", "x=choice(1,2)"]) == 6
    assert expected_jobs(["python", "-m", "src.train", "model.net.channels=[8,16]"]) == 1
    search = ["python", "-m", "src.train", "-m", "hparams_search=convnet_optuna"]
    assert expected_jobs(search) == N_TRIALS
    assert appended(search, Path("/d"))[0] == "data.root=/d"
    assert appended(search, Path("/d"))[-1] == f"hydra.sweeper.n_trials={N_TRIALS}"
    assert not any("n_trials" in o for o in appended(sweep, Path("/d")))


def test_parser_collects_every_command_with_what_came_before() -> None:
    commands = block_commands(SAMPLE)
    texts = [command.text for command in commands]
    assert texts[:2] == ["pip install -e .", "python -m src.train"]
    assert "mlflow server --port 5001 --backend-store-uri sqlite:///s.db" in texts
    served = next(c for c in commands if c.text.startswith("python -m src.train logger"))
    assert served.previous == (served.server,)
    assert commands[1].previous == (("pip", "install", "-e", "."),)


def test_every_command_is_run_or_skipped() -> None:
    """Each command of the pages is an entry point, has a runner, or is in SKIPPED with why."""
    assert [c.text for c in COMMANDS if how_run(c) is None] == []
    assert [c.text for c in COMMANDS if not is_entry_point(c.tokens) and how_run(c) == "runner"]
    for test in [*RUN_ELSEWHERE.values(), *RUN_BY_THE_LIBRARY.values()]:  # tests that exist
        path, name = test.split("::")
        assert f"def {name}(" in (PROJECT / path).read_text(), test
    unknown = ReadmeCommand(("rsync", "-a", "outputs/", "host:"))
    assert how_run(unknown) is None, "a new command with neither fails"


def test_runners_and_skips_split_the_sbatch_and_server_commands() -> None:
    assert skip_reason("sbatch --gpus-per-node=0 slurm/train.sbatch") is None
    assert runner_of("sbatch --gpus-per-node=0 slurm/train.sbatch")
    assert skip_reason("sbatch slurm/train.sbatch model.lr=0.01")
    assert skip_reason("docker run --rm --gpus all img") == "needs a GPU"
    assert skip_reason("python -m pytest tests/test_data.py") is None
    assert skip_reason("python -m pytest tests/task/test_nets.py") is None
    assert skip_reason("python -m pytest -m not slow")
    assert runner_of("mlflow ui") and runner_of("mlflow server --port 5000")
    assert runner_of("MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --workers 1")


def test_placeholders_of_runners_are_filled_in(tmp_path: Path) -> None:
    (tmp_path / "outputs" / "train" / "runs" / "2026-01-01_00-00-00" / "model").mkdir(parents=True)
    tokens = ["curl", "-d", "@outputs/train/runs/<time>/model", "x=outputs/train/runs/<time>"]
    assert fill_times(tokens, tmp_path) == [
        "curl",
        "-d",
        "@outputs/train/runs/2026-01-01_00-00-00/model",
        "x=outputs/train/runs/2026-01-01_00-00-00",
    ]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        tokens, new = with_free_port(["mlflow", "ui", "--port", str(port)], 5000)
        assert new != port and tokens == ["mlflow", "ui", "--port", str(new)]


def test_readme_shows_every_entry_point() -> None:
    in_readme = readme_commands(README.read_text())
    shown = {task_of(list(command.tokens)) for command in in_readme}
    assert shown == {"train", "eval", "predict"}, [command.text for command in in_readme]


def test_commands_on_several_pages_run_once(tmp_path: Path) -> None:
    pages = [tmp_path / "README.md", tmp_path / "docs" / "a.md"]
    pages[1].parent.mkdir()
    pages[0].write_text("```bash\npython -m src.train   # train\n```\n")
    pages[1].write_text("```bash\npython -m src.train\npython -m src.eval ckpt_path=PATH\n```\n")
    shown = page_commands(pages, root=tmp_path)
    assert {c.text: where for c, where in shown.items()} == {
        "python -m src.train": ["README.md", "docs/a.md"],
        "python -m src.eval ckpt_path=PATH": ["docs/a.md"],
    }


# --- links ----------------------------------------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^()\s]+)\)")


def without_fences(markdown: str) -> str:
    """``markdown`` without its fenced blocks (a ``# comment`` there is no heading)."""
    return re.sub(r"(?ms)^ *(`{3,}|~{3,}).*?^ *\1", "", markdown)


def prose(markdown: str) -> str:
    """``markdown`` without its fenced blocks and inline code spans: where links are."""
    return re.sub(r"(`+).+?\1", "", without_fences(markdown))


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown``: lowercase, punctuation dropped,
    spaces as ``-``, a repeated one suffixed ``-1``, ``-2``, ..."""
    found: set[str] = set()
    for heading in re.findall(r"(?m)^#{1,6} +(.+?) *#* *$", without_fences(markdown)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file, or heading in it, does not exist."""
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (
            anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text())
        ):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(PROJECT).as_posix() for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    assert not broken_links(page), f"links in {page.name} to no file or heading"


def test_readme_links_every_docs_page() -> None:
    linked = {
        (README.parent / t.partition("#")[0]).resolve()
        for t in LINK.findall(prose(README.read_text()))
    }
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


# --- the configuration page ------------------------------------------------------------------

CONF = PROJECT / "conf"  # the project's; the library's groups: LIBRARY_CONF
SETUPS = ("experiment", "hparams_search")  # whole setups: values of keys set elsewhere
TASK_GROUPS = ("data", "model")  # the task's own keys (tests/task/test_conf.py)
# Keys whose mapping is one setting: a table of other keys (resume_may_differ: key -> why)
TABLES = ("resume_may_differ",)


def leaf_keys(node: dict, prefix: str = "") -> Iterator[str]:
    """The dotted keys of a YAML mapping's leaves (an empty mapping is a leaf)."""
    for key, value in node.items():
        if key == "defaults" and not prefix:
            continue
        if isinstance(value, dict) and value and f"{prefix}{key}" not in TABLES:
            yield from leaf_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def config_keys() -> set[str]:
    """Every key a config file sets, the project's (``conf/``) and the library's, as typed on
    the command line."""
    keys: set[str] = set()
    files = [(conf, path) for conf in (CONF, LIBRARY_CONF) for path in sorted(conf.rglob("*.yaml"))]
    for conf, path in files:
        group = path.parent.relative_to(conf).as_posix()
        if group.split("/")[0] in SETUPS or path == conf / "hydra" / "default.yaml":
            continue  # hydra/default.yaml: Hydra's own output layout
        text = path.read_text()
        is_global = group == "." or "# @package _global_" in text
        prefix = "" if is_global else group.replace("/", ".") + "."
        keys.update(prefix + key for key in leaf_keys(yaml.safe_load(text) or {}))
    return keys


def test_configuration_page_names_every_key() -> None:
    """Every key of the machinery's configs; the task's are checked with the task."""
    page = (PROJECT / "docs" / "configuration.md").read_text()
    keys = [key for key in sorted(config_keys()) if key.split(".")[0] not in TASK_GROUPS]
    assert "trainer.max_epochs" in keys and "callbacks.checkpoint.save_top_k" in keys
    assert [key for key in keys if f"`{key}`" not in page] == []


def test_link_checker_on_a_sample(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text(
        "# B page\n\n## Sweeps on SLURM\n\n## `src.sync` (outbox)\n"
    )
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n\n```bash\n# not a heading\n```\n[a](docs/b.md) [b](docs/b.md#sweeps-on-slurm) "
        "[c](docs/b.md#srcsync-outbox) [d](#top) [e](https://x.org/y) `[f](nowhere.md)` "
        "[g](docs/c.md) [h](docs/b.md#nope) [i](#not-a-heading)\n"
    )
    assert broken_links(page) == ["docs/c.md", "docs/b.md#nope", "#not-a-heading"]
