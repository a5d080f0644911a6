"""The project's own configuration files: conf/local/example.yaml (this machine's settings, in
conf/local/default.yaml, git-ignored) composes, and each of its settings applies (the library's
``optional local`` default: lib/tests/test_config.py)."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from lightning_exact.job.config import flatten
from lightning_exact.testing import configs
from omegaconf import DictConfig, OmegaConf

from src.task import TASK
from tests.conftest import PROJECT

CONF = PROJECT / "conf"


def compose_config(name: str, overrides: list[str], workdir: Path, conf: Path = CONF) -> DictConfig:
    return configs.compose_config(name, overrides, workdir, conf=conf, task=TASK)


def conf_copy(folder: Path, local: str | None) -> Path:
    return configs.conf_copy(folder, CONF, local)


def uncommented_example() -> str:
    """conf/local/example.yaml with its commented settings switched on."""
    lines = (CONF / "local" / "example.yaml").read_text().splitlines()
    settings = [line.removeprefix("# ") for line in lines if re.match(r"# ( *)\w+:", line)]
    return "# @package _global_\n" + "\n".join(settings) + "\n"


def test_the_local_example_composes_and_each_of_its_settings_applies(tmp_path: Path) -> None:
    plain = compose_config("train", ["local=example"], tmp_path)  # all commented: changes nothing
    assert plain == compose_config("train", [], tmp_path, conf_copy(tmp_path / "a", None))
    example = uncommented_example()
    settings = flatten(yaml.safe_load(example))
    assert {"paths.data_dir", "paths.log_dir", "logger.tracking_uri"} <= set(settings)
    cfg = compose_config("train", [], tmp_path, conf_copy(tmp_path / "b", example))
    for key, value in settings.items():
        assert key in flatten(OmegaConf.to_container(plain)), f"{key}: not a config key"
        assert OmegaConf.select(cfg, key) == value, key


def test_local_settings_are_not_committed() -> None:
    if not (PROJECT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "conf/local/default.yaml"], cwd=PROJECT, check=False
    )
    assert ignored.returncode == 0, "conf/local/default.yaml must be git-ignored"
