"""A project made with copier from the template's previous release, its task replaced by a text
model as docs/make-it-yours.md says, committed, then updated with ``copier update`` to this
working tree: no conflict, nothing of its task written, the library's new version installed by
pip from the template's git repository, its tests and the library's conformance checks green on
its own task (a tiny job trained on 2 ranks, stopped, resumed). Real copier, git and pip, no
network."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from lightning_exact.testing import conformance

from tests.conftest import PROJECT
from tests.template.releases import PIP_OFFLINE, git, previous_release, snapshot, version_at

TEXT = PROJECT / "tests" / "template" / "text_task"  # laid out as a project: src/task/, conf/
TASK_FILES = ("src/task", "conf/task.yaml", "conf/data", "conf/model", "tests/task")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("copier")]


def run(*command: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        list(command), cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    assert proc.returncode == 0, (
        f"{' '.join(command)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc.stdout + proc.stderr


def copier(*args: str, cwd: Path) -> str:
    return run(str(Path(sys.executable).parent / "copier"), *args, cwd=cwd)


def make_it_a_text_task(project: Path) -> None:
    """docs/make-it-yours.md for another kind of task, in a project of the smallest task: its
    task package and configs replaced, conf/task.yaml naming the new ones."""
    shutil.rmtree(project / "src" / "task")
    shutil.copytree(TEXT / "src" / "task", project / "src" / "task")
    for group in ("data", "model"):
        shutil.copytree(TEXT / "conf" / group, project / "conf" / group)
    (project / "conf" / "task.yaml").write_text(
        "# The text task: next-token prediction on a generated text.\n"
        "defaults:\n  - data: chars\n  - model: gpt\n"
    )
    shutil.copy(TEXT / "tests" / "task" / "tiny_job.py", project / "tests" / "task" / "tiny_job.py")


def library_requirement(project: Path) -> str:
    (line,) = [
        dep
        for dep in tomllib.loads((project / "pyproject.toml").read_text())["project"][
            "dependencies"
        ]
        if dep.startswith("lightning-exact")
    ]
    return line


@pytest.fixture(scope="module")
def updated(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The text project made from the previous release (this tree's HEAD where there is none
    yet), committed, and updated to this working tree; its library installed by pip."""
    base = tmp_path_factory.mktemp("copier")
    template = snapshot(PROJECT, base)  # this working tree, as the last commit of a clone
    # Without a release before this version: from this tree's last commit.
    previous = previous_release(PROJECT)
    version, commit = previous or (version_at(PROJECT), git(PROJECT, "rev-parse", "HEAD"))
    project = base / "text-project"
    copier(
        "copy",
        "--defaults",
        "--vcs-ref",
        commit,
        "--data",
        "project_name=text-project",
        "--data",
        "task=empty",
        "--data",
        f"template_url=file://localhost{template}",
        str(template),
        str(project),
        cwd=base,
    )
    made_from = (project / ".copier-answers.yml").read_text()
    assert previous is None or f"_commit: v{version}" in made_from or commit in made_from
    make_it_a_text_task(project)
    run("git", "init", "-q", cwd=project)
    run("git", "add", "-A", cwd=project)
    run("git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "mine", cwd=project)
    before = {path: (project / path).read_bytes() for path in task_files(project)}
    output = copier("update", "--defaults", "--vcs-ref", "HEAD", cwd=project)
    site = base / "site"  # the library of the updated pin, as pip installs it
    run(*PIP_OFFLINE, str(site), library_requirement(project), cwd=base)
    return {
        "project": project,
        "output": output,
        "before": before,
        "site": site,
        "previous": version,
        "template": template,
    }


def task_files(project: Path) -> list[str]:
    return sorted(
        str(path.relative_to(project))
        for name in TASK_FILES
        for path in (
            [project / name] if (project / name).is_file() else (project / name).rglob("*")
        )
        if path.is_file()
    )


def test_the_update_merges_without_conflict_and_writes_nothing_of_the_task(updated: dict) -> None:
    project = updated["project"]
    print(updated["output"])  # what copier said it did, for the record
    assert not list(project.rglob("*.rej")), "a hunk copier could not apply"
    markers = subprocess.run(
        ["git", "grep", "-l", "-e", "^<<<<<<< ", "--", "."],
        cwd=project,
        capture_output=True,
        text=True,
    )
    assert markers.returncode == 1, f"conflict markers in: {markers.stdout}"  # 1: none found
    assert task_files(project) == sorted(updated["before"])
    for path, content in updated["before"].items():
        assert (project / path).read_bytes() == content, path
    answers = (project / ".copier-answers.yml").read_text()
    assert "task: empty" in answers and "project_name: text-project" in answers


def test_the_library_of_the_new_pin_is_what_the_project_runs(updated: dict) -> None:
    version = version_at(PROJECT, "")
    requirement = library_requirement(updated["project"])
    head = git(updated["template"], "rev-parse", "HEAD")
    assert (
        requirement
        == f"lightning-exact @ git+file://localhost{updated['template']}@{head}#subdirectory=lib"
    )
    (dist,) = updated["site"].glob("lightning_exact-*.dist-info")
    assert dist.name == f"lightning_exact-{version}.dist-info"
    env = {"PYTHONPATH": os.pathsep.join([str(updated["site"]), str(updated["project"])])}
    said = "import lightning_exact as le; print(le.__version__, le.__file__)"
    out = run(sys.executable, "-c", said, cwd=updated["project"], env=env)
    assert out.split() == [version, str(updated["site"] / "lightning_exact" / "__init__.py")]


def test_its_tests_and_the_conformance_checks_pass_on_its_own_task(
    updated: dict, tmp_path: Path
) -> None:
    """The project's whole suite (its task's tiny job, the conformance checks: 2 ranks, a stop
    and resume, training points, evaluation) in the project, with the updated library."""
    project = updated["project"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(updated["site"]), str(project)])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--full",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--basetemp={tmp_path / 'inner'}",
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    checks = [name for name in conformance.__all__ if name.startswith("test_")]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= len(checks), "the conformance checks ran"
    assert "skipped" not in proc.stdout.splitlines()[-1]
