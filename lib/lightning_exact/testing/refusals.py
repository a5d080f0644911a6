"""Bad input refused as a user types it: one ``Error:`` line, no traceback, exit code 1, and
nothing left behind (no output folder, MLflow store, checkpoint, or folder a mistyped path
names)."""

from collections.abc import Callable
from pathlib import Path

from lightning_exact.testing.forked_entry import ForkedEntry
from lightning_exact.testing.harness import Harness

# A proxy on a closed local port: every download fails at once, as on a machine offline.
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}


def fails_before_any_work(
    harness: Harness,
    workdir: Path,
    *overrides: str,
    data_root: Path,
    env: dict[str, str] | None = None,
    base: list[str] | None = None,
    forked: ForkedEntry | None = None,
) -> str:
    """Run training with ``overrides`` (after ``base``, by default the tiny job's), in a fork of
    ``forked`` if given; return its stderr, unwrapped, after checking nothing was started."""
    args = [*(harness.tiny_overrides(data_root) if base is None else base), *overrides]
    if forked and env is None:
        proc = forked.run("train", *args, cwd=workdir)
    else:
        proc = harness.run_entry("train", *args, cwd=workdir, check=False, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert not (workdir / "outputs").is_dir(), "a refused job leaves no output folder"
    assert not (workdir / "mlflow.db").exists(), "a refused job creates no MLflow store or run"
    written = [p for p in workdir.rglob("*") if p.suffix in (".ckpt", ".tmp")]
    assert not [p for p in written if "given" not in p.parts], f"checkpoints written: {written}"
    return " ".join(proc.stderr.split())  # unwrapped


TYPED = {"relative": "typo/a/b", "absolute": "{elsewhere}/typo/a/b"}  # neither exists yet


def typed_path(form: str, workdir: Path) -> str:
    """A path whose first two folders do not exist: relative to the launch folder, or absolute
    in a folder beside it."""
    elsewhere = workdir.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    return TYPED[form].format(elsewhere=elsewhere)


def typed_arguments(
    overrides: list[str], typed: str, ckpt: Path, base: Callable[[list[str]], list[str]]
) -> list[str]:
    """A command's arguments with ``{typed}`` and ``{ckpt}`` filled in: its flags (``-m``)
    before every override, then ``base(overrides)`` (what the job needs besides), then them."""
    filled = [o.format(typed=typed, ckpt=ckpt) for o in overrides]
    flags = [o for o in filled if o.startswith("-")]
    rest = [o for o in filled if o not in flags]
    return [*flags, *base(rest), *rest]


def tree(folder: Path) -> set[Path]:
    """Everything under ``folder`` but the forked commands' own stdout and stderr files."""
    return {path for path in folder.rglob("*") if path.suffix not in (".stdout", ".stderr")}


def refused_leaving_nothing(
    harness: Harness,
    module: str,
    args: list[str],
    workdir: Path,
    forked: ForkedEntry | None,
    env: dict | None,
) -> str:
    """Run ``src.<module> args`` in ``workdir`` (a fork, unless ``env`` is given); check it was
    refused in one line and that nothing was added beside or under the launch folder."""
    before = tree(workdir.parent)
    if forked and env is None:
        proc = forked.run(module, *args, cwd=workdir)
    else:
        proc = harness.run_entry(module, *args, cwd=workdir, check=False, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert sorted(tree(workdir.parent) - before) == [], "a refused job creates nothing"
    return " ".join(proc.stderr.split())
