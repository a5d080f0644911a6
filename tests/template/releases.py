"""The template's releases, read from its git history: a release is a commit tagged ``vX.Y.Z``
or, in a clone without tags, the commit whose message starts with ``Release X.Y.Z``
(docs/development.md, "Releasing"); its version is ``lib/pyproject.toml``'s."""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

RELEASE_MESSAGE = re.compile(r"^Release (\d+\.\d+\.\d+)\b")
# pip installing a project's library pin into a folder (``--target``), offline: no index, its
# build with this environment's setuptools
PIP_OFFLINE = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
PIP_OFFLINE += ["--no-build-isolation", "--target"]


def git(project: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(project), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def version_at(project: Path, commit: str = "HEAD") -> str:
    """The library's version at ``commit`` (the working tree's for ``commit=""``)."""
    if commit:
        text = git(project, "show", f"{commit}:lib/pyproject.toml")
    else:
        text = (project / "lib" / "pyproject.toml").read_text()
    return tomllib.loads(text)["project"]["version"]


def as_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def releases(project: Path) -> dict[str, str]:
    """Version -> release commit, from tags, else from release commits' messages."""
    found = {}
    for line in git(project, "log", "--format=%H %s").splitlines():
        commit, _, subject = line.partition(" ")
        if match := RELEASE_MESSAGE.match(subject):
            found.setdefault(match.group(1), commit)
    for tag in git(project, "tag", "--list", "v*.*.*").split():
        found[tag[1:]] = git(project, "rev-list", "-n", "1", tag)
    return found


def previous_release(project: Path) -> tuple[str, str] | None:
    """(version, commit) of the newest release before the working tree's version, if any."""
    current = as_tuple(version_at(project, ""))
    older = [(as_tuple(v), v, c) for v, c in releases(project).items() if as_tuple(v) < current]
    return max(older)[1:] if older else None


def last_before_the_library(project: Path) -> str:
    """The last commit before the machinery became the library (a pre-1.0 project's base)."""
    added = git(project, "log", "--diff-filter=A", "--format=%H", "--", "lib/pyproject.toml")
    return git(project, "rev-parse", f"{added.splitlines()[-1]}^")


def snapshot(project: Path, folder: Path) -> Path:
    """A clone of ``project`` whose last commit is its working tree, uncommitted changes and new
    files included: copier and pip take a template by commit, and a developer's tree is seldom
    clean. Its history (releases, tags) is the project's."""
    clone = folder / "template"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(project), str(clone)], check=True)
    files = git(project, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for name in filter(None, files.split("\0")):
        source, target = project / name, clone / name
        if source.is_symlink() or source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            if source.is_symlink():
                target.symlink_to(source.readlink())
            else:
                shutil.copy2(source, target)
    for name in git(project, "ls-files", "-z", "--deleted").split("\0"):
        if name:
            (clone / name).unlink(missing_ok=True)
    git(clone, "add", "-A")
    if git(clone, "status", "--porcelain"):
        git(clone, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "working tree")
    return clone
