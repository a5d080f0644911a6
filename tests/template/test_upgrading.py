"""docs/upgrading.md's "From a fork made before 1.0", run as the page shows it, on a project
made as "Use this template" made them (one commit, no shared history) from the last version
before the library, its image task replaced by the text task as that version's
docs/make-it-yours.md said. After the steps, the project trains and resumes its own task with
the library of this working tree, and its task's files are as they were. The page's commands
run as typed but for what a test cannot type: the template's address (this repository), its
release (HEAD), copier's ``--defaults`` (no questions), and the library installed by pip from
the pin the steps wrote (offline, into a folder of its own)."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from lightning_exact.testing.processes import run_entry
from lightning_exact.testing.records import load_checkpoint, read_metrics

from tests.conftest import PROJECT
from tests.template.releases import PIP_OFFLINE, git, last_before_the_library, snapshot

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("upgrading")]
PAGE = PROJECT / "docs" / "upgrading.md"
PUBLIC = b"from lightning_exact import"  # what step 2 makes of a machinery import


def documented_steps() -> str:
    """The bash block of the page's "From a fork made before 1.0"."""
    section = PAGE.read_text().split("## From a fork made before 1.0", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def old_fork(base: str, folder: Path) -> Path:
    """The template at ``base`` (before the library), made a text-task project by that
    version's make-it-yours steps, committed once."""
    fork = folder / "fork"
    fork.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(PROJECT), "archive", base], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(fork)], input=archive, check=True)
    text = fork / "tests" / "text_task"  # that version's text task, laid out as a project
    shutil.rmtree(fork / "src" / "task")
    shutil.rmtree(fork / "tests" / "task")
    for group in ("data", "model", "experiment", "hparams_search"):
        for path in (fork / "conf" / group).glob("*.yaml"):
            path.unlink()
    shutil.rmtree(fork / "notebooks")
    shutil.copytree(text, fork, dirs_exist_ok=True)
    for entry in ("train", "eval", "predict", "prepare"):
        config = fork / "conf" / f"{entry}.yaml"
        lines = config.read_text()
        lines = re.sub(r"(?m)^  - data: .*$", "  - data: chars", lines)
        config.write_text(re.sub(r"(?m)^  - model: .*$", "  - model: gpt", lines))
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "text project"]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *command], cwd=fork, check=True
        )
    return fork


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("upgrading")
    template = snapshot(PROJECT, folder)  # this working tree, as the last commit of a clone
    fork = old_fork(last_before_the_library(PROJECT), folder)
    before = {
        path.relative_to(fork): path.read_bytes() for path in (fork / "src" / "task").rglob("*.py")
    }
    steps = documented_steps()
    steps = steps.replace("gh:OWNER/lightning-ddp-template", str(template))
    release = f"--vcs-ref HEAD --defaults --data template_url=file://localhost{template}"
    steps = steps.replace("--vcs-ref v1.1.0", release)
    before_install, after_install = steps.split('pip install -e ".[dev]" -c constraints.txt\n')
    after_install = after_install.replace("python -m pytest --full -n 3\n", "")
    output = bash(before_install, fork)
    site = folder / "site"  # the library the steps pinned, installed by pip
    dependencies = tomllib.loads((fork / "pyproject.toml").read_text())["project"]["dependencies"]
    (library,) = [d for d in dependencies if d.startswith("lightning-exact")]
    subprocess.run([*PIP_OFFLINE, str(site), library], cwd=fork, check=True, capture_output=True)
    output += bash(after_install, fork)
    return {"fork": fork, "site": site, "before": before, "output": output, "template": template}


def bash(script: str, cwd: Path) -> str:
    """``script`` as a user's shell runs it: this environment's python, pip and copier first."""
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env |= {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, f"{script}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout + done.stderr


def test_the_steps_leave_the_task_as_it_was_and_nothing_of_the_old_machinery(moved: dict) -> None:
    fork = moved["fork"]
    after = {
        path.relative_to(fork): path.read_bytes() for path in (fork / "src" / "task").rglob("*.py")
    }
    assert after.keys() == moved["before"].keys()
    for path, content in after.items():
        old = moved["before"][path]
        public = re.sub(
            rb"from src\.template(\.[a-z_]+)* import", b"from lightning_exact import", old
        )
        assert content == public, path
    for gone in ("src/template", "hydra_plugins", "server", "conf/trainer", "conf/train.yaml"):
        assert not (fork / gone).exists(), gone
    assert git(fork, "status", "--porcelain") == "", "the steps end with a commit"
    answers = (fork / ".copier-answers.yml").read_text()
    assert "task: empty" in answers
    dependencies = tomllib.loads((fork / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = f"lightning-exact @ git+file://localhost{moved['template']}@"
    assert any(d.startswith(pin) for d in dependencies)


def test_the_moved_project_trains_and_resumes_its_own_task(moved: dict, tmp_path: Path) -> None:
    """Its text task, counted in steps, stopped by SIGTERM and resumed by the same command."""
    fork = moved["fork"]
    env = {"PYTHONPATH": os.pathsep.join([str(moved["site"]), str(fork)])}
    steps = [
        "trainer.max_epochs=-1",
        "trainer.max_steps=8",
        "callbacks.progress_bar=none",
        "logger=csv",
        f"hydra.run.dir={tmp_path / 'run'}",
        "ckpt_path=auto",
    ]
    from lightning_exact.testing.instruments import SIGNAL_AT_STEP

    stop = {**env, "PYTHONPATH": os.pathsep.join([str(SIGNAL_AT_STEP), env["PYTHONPATH"]])}
    stop["SIGNAL_AT_STEP"] = "4:SIGTERM"
    stopped = run_entry("train", *steps, project=fork, cwd=tmp_path, check=False, env=stop)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 5
    run_entry("train", *steps, project=fork, cwd=tmp_path, env=env)
    assert load_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 8
    assert "test/loss" in read_metrics(tmp_path / "run")
