"""Every shell command the README and the ``docs/`` pages show that runs an entry point, run as
typed on tiny data; and every relative link of those pages, checked.

The commands are read from README.md and docs/*.md when the tests are collected: each fenced
``bash``, ``sh``, ``shell`` or ``console`` block is split into commands, and every distinct command
that runs ``src.train``, ``src.eval`` or ``src.predict`` becomes one test, whose id names the pages
that show it (a command shown on several pages runs once). A new command in the README or a docs
page is covered without writing a test. Each runs in a fresh launch folder (where the pages say
``outputs/``, ``mlflow.db`` and ``optuna.db`` land) with only ``APPENDED`` added at its end and the
placeholders a reader fills in (``ckpt_path=PATH``, ``[same overrides]``) replaced. A command that
cannot run here is listed in ``SKIPPED`` with the reason; any other placeholder fails its test.
"""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from math import prod
from pathlib import Path

import pytest
import yaml

from tests.conftest import N_TEST, N_TRAIN, PROJECT, VAL_SIZE, mlflow_server
from tests.idx_data import make_dataset
from tests.image_data import make_image_folder

README = PROJECT / "README.md"
# The guide and its reference pages, README first: the pages whose commands are run.
PAGES = [README, *sorted((PROJECT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}
ENTRY_POINTS = ("src.train", "src.eval", "src.predict")
N_TRIALS = 2
TIMEOUT_S = 600

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

# README commands that cannot run on a CPU-only machine, as a regex searched in the command.
SKIPPED: dict[str, str] = {
    r"^torchrun\b.*--nnodes[ =](?!1\b)": "two machines (node rank K, HOST_OF_NODE_0)",
    r"^srun\b": "runs inside an sbatch allocation on a SLURM cluster",
    r"\bmodel=mlp\b": "the network that 'Make it yours' adds: tests/test_make_it_yours.py adds it "
    "to a copy of the project and runs these",
    r"accelerator=gpu|trainer=gpu\b|--gpus\b": "needs a GPU",
    r"\$SKYPILOT_": "runs on the nodes of a SkyPilot cluster",
    r"\bdata=shards\b|\bimages=": "reads shards that src.prepare wrote or new image files: "
    "tests/test_shards.py runs these",
}

# Placeholders a reader fills in, and what the tests fill in.
CKPT_PLACEHOLDER = re.compile(r"^ckpt_path=(PATH|\S*<[^<>]+>\S*/last\.ckpt)$")
DROPPED_GROUP = ("[same", "overrides]")
UNKNOWN_PLACEHOLDER = re.compile(r"<[^<>]*>|\.\.\.|^\[|(?:^|=)[A-Z][A-Z0-9_]*$")

# Signs of a failure that an exit code 0 can hide.
LOG_PROBLEMS = re.compile(r"Traceback|InterpolationResolutionError|Callback \w+\.\w+ raised")
PRINT_ONLY = {"--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i"}


@dataclass(frozen=True)
class ReadmeCommand:
    """One command of a README shell block (continuations joined, comments and prompt dropped)."""

    tokens: tuple[str, ...]
    server: tuple[str, ...] | None = None  # the block's `mlflow server ...` command, if any

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


def readme_commands(markdown: str) -> list[ReadmeCommand]:
    """Every command of the shell blocks that runs an entry point, once, in README order."""
    found: list[ReadmeCommand] = []
    for block in shell_blocks(markdown):
        commands = [c for line in logical_lines(block) for c in split_commands(line)]
        server = next((tuple(c) for c in commands if c[:2] == ["mlflow", "server"]), None)
        for tokens in commands:
            command = ReadmeCommand(tuple(tokens), server)
            if set(tokens) & set(ENTRY_POINTS) and command not in found:
                found.append(command)
    return found


def page_commands(pages: list[Path], root: Path = PROJECT) -> dict[ReadmeCommand, list[str]]:
    """Every distinct entry-point command of ``pages``, in page order, with the pages (relative
    to ``root``) that show it: a command on several pages is one test."""
    shown: dict[ReadmeCommand, list[str]] = {}
    for page in pages:
        name = page.relative_to(root).as_posix()
        for command in readme_commands(page.read_text()):
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
    defaults = yaml.safe_load((PROJECT / "conf" / f"{task}.yaml").read_text())["defaults"]
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
    """Run a command in its own session from ``workdir``; kill all it started on a timeout."""
    proc = subprocess.Popen(
        executable(argv), cwd=workdir, env=command_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(
            f"still running after {TIMEOUT_S} s: {argv}\n{stdout[-3000:]}\n{stderr[-3000:]}"
        )
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


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
            assert (job / name).is_file(), f"{job} has no {name}: {listing(job)}"
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
        assert isinstance(yaml.safe_load(proc.stdout), dict), proc.stdout[-3000:]
        assert not list(workdir.iterdir()), f"wrote {listing(workdir)}"
        return
    task, split = task_of(tokens), override(tokens, "split") or "test"
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "command", [pytest.param(c, id=f"{'+'.join(SHOWN[c])}: {command_id(c.text)}") for c in COMMANDS]
)  # fmt: skip
def test_readme_command(
    command: ReadmeCommand, readme_data: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The command runs as typed, from a fresh launch folder, on tiny data."""
    if reason := skip_reason(command.text):
        pytest.skip(reason)
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

CONF = PROJECT / "conf"
SETUPS = ("experiment", "hparams_search")  # whole setups: values of keys set elsewhere


def leaf_keys(node: dict, prefix: str = "") -> Iterator[str]:
    """The dotted keys of a YAML mapping's leaves (an empty mapping is a leaf)."""
    for key, value in node.items():
        if key == "defaults" and not prefix:
            continue
        if isinstance(value, dict) and value:
            yield from leaf_keys(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def config_keys() -> set[str]:
    """Every key a config file under ``conf/`` sets, as typed on the command line."""
    keys: set[str] = set()
    for path in sorted(CONF.rglob("*.yaml")):
        group = path.parent.relative_to(CONF).as_posix()
        if group.split("/")[0] in SETUPS or path == CONF / "hydra" / "default.yaml":
            continue  # hydra/default.yaml: Hydra's own output layout
        text = path.read_text()
        is_global = group == "." or "# @package _global_" in text
        prefix = "" if is_global else group.replace("/", ".") + "."
        keys.update(prefix + key for key in leaf_keys(yaml.safe_load(text) or {}))
    return keys


def test_configuration_page_names_every_key() -> None:
    page = (PROJECT / "docs" / "configuration.md").read_text()
    assert "model.net.channels" in config_keys()
    assert [key for key in sorted(config_keys()) if f"`{key}`" not in page] == []


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
