"""The template as people fork it: Dockerfile, pre-commit hooks, Makefile."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from lightning_exact.testing.records import read_metrics

from tests.conftest import PROJECT
from tests.idx_data import make_dataset

README = (PROJECT / "README.md").read_text()
DOCKERFILE = (PROJECT / "Dockerfile").read_text()


def test_dockerfile_lints_clean() -> None:
    proc = subprocess.run(["hadolint", str(PROJECT / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_installs_as_the_readme_says() -> None:
    """One install step with the pinned constraints: the project, and the library from its
    source where it is here (the template: lib/), else from the project's pin."""
    readme_install = re.search(r'pip install -e \./lib -e "\.\[dev\]" -c constraints\.txt', README)
    assert readme_install, "the README's first screen installs with the pinned constraints"
    pip_lines = [line for line in DOCKERFILE.splitlines() if "pip install" in line]
    # LitData is installed --no-deps, as .ci/run does (pyproject.toml says why).
    pip_lines = [line for line in pip_lines if "--no-deps -c constraints.txt litdata" not in line]
    assert len(pip_lines) == 1, "one install step, nothing installed besides the project"
    assert "-c constraints.txt" in pip_lines[0] and pip_lines[0].rstrip(" \\").endswith("-e .")
    assert '${LIBRARY:+"$LIBRARY"}' in pip_lines[0], "the library's source where it is here"
    assert 'ENTRYPOINT ["python", "-m", "src.train"]' in DOCKERFILE
    assert re.search(r"^USER 1000", DOCKERFILE, re.MULTILINE), "runs as a non-root user"
    assert "ARG BASE_IMAGE=" in DOCKERFILE and "FROM ${BASE_IMAGE}" in DOCKERFILE


def test_ci_installs_what_the_readmes_first_command_does() -> None:
    """CI's install is the README's first command's: the daily tests import nothing else."""
    first = next(line for line in README.splitlines() if line.startswith("python3 -m venv"))
    readme = [f"pip install{step}" for step in first.split("pip install")[1:]]
    readme = [step.split(" && ")[0] for step in readme]
    ci_lines = (PROJECT / ".ci" / "run").read_text().splitlines()
    ci = [line.split("  #")[0] for line in ci_lines if line.startswith("pip install")]
    assert (
        ci
        == readme
        == [
            'pip install -e ./lib -e ".[dev]" -c constraints.txt',
            "pip install --no-deps -c constraints.txt litdata",
        ]
    )


def test_dockerignore_keeps_data_and_runs_out() -> None:
    text = (PROJECT / ".dockerignore").read_text().splitlines()
    lines = [line for line in text if line and not line.startswith("#")]
    assert lines[0] == "**", "everything is ignored unless listed"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    sources = {"pyproject.toml", "constraints.txt", "README.md", "src", "conf", "lib"}
    assert allowed == sources | {"wheelhouse"}, "no data, outputs, MLflow store, venv or cache"


def test_the_formatter_decides_every_lines_shape() -> None:
    """No formatter opt-out comments (fmt skip or off): hand-packed lines read worse."""
    skipped = [
        f"{path.relative_to(PROJECT)}:{number}"
        for path in sorted(PROJECT.rglob("*.py"))
        if ".venv" not in path.parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"#\s*fmt:\s*(skip|off)", line)
    ]
    assert not skipped, f"remove the formatter opt-outs: {skipped}"


@pytest.mark.skipif(not (PROJECT / ".git").exists(), reason="pre-commit needs a git checkout")
def test_pre_commit_hooks_pass_on_the_repo(tmp_path: Path) -> None:
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "pre-commit")}
    proc = subprocess.run(
        ["pre-commit", "run", "--all-files"], cwd=PROJECT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_makefile_lists_its_targets() -> None:
    proc = subprocess.run(["make", "-s", "help"], cwd=PROJECT, capture_output=True, text=True)
    targets = re.findall(r"make (\S+)", proc.stdout)
    assert targets == [
        "help",
        "install",
        "train",
        "test",
        "test-full",
        "test-slow",
        "gpu-check",
        "lint",
        "format",
        "ui",
        "clean",
    ]


IMAGE_TEST = os.environ.get("IMAGE_TEST") == "1"


@pytest.mark.slow
@pytest.mark.skipif(
    not IMAGE_TEST, reason="opt-in: IMAGE_TEST=1 with buildah/podman set up (docs/clusters.md)"
)
def test_image_builds_and_trains(tmp_path: Path) -> None:
    """Build the image daemonless on the local Debian base, then train in it on tiny data."""
    assert shutil.which("buildah") and shutil.which("podman"), "see docs/clusters.md: Docker"
    tag = "localhost/lightning-template-test"
    base = os.environ.get("BASE_IMAGE", "localhost/bookworm-min")
    subprocess.run(
        ["buildah", "bud", "--build-arg", f"BASE_IMAGE={base}", "-t", tag, str(PROJECT)],
        check=True,
    )
    make_dataset(tmp_path / "data", n_train=403, n_test=131, learnable=True)
    tmp_path.chmod(0o777)
    subprocess.run(
        [
            "podman",
            "run",
            "--rm",
            "--pull=never",
            "--shm-size=1g",
            "-v",
            f"{tmp_path}:/work",
            tag,
            "data.val_size=67",
            "data.batch_size=32",
            "trainer.max_epochs=1",
            "callbacks.progress_bar=none",
            "strategy=ddp",
            "devices=2",
            "hydra.run.dir=/work/run",
        ],
        check=True,
    )
    assert read_metrics(tmp_path / "run")["test/samples"] == 131
    assert (tmp_path / "mlflow.db").is_file()
