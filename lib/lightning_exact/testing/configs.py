"""A project's configs composed as its entry points compose them (Hydra's compose API, the
library's config groups found through the search path), for tests that check what a command line
resolves to without running a job."""

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_exact.job.config import describe_config_error
from lightning_exact.job.entry import SET_ELSEWHERE, use_task_in_config
from lightning_exact.sweeps.jobs import register_resolvers
from lightning_exact.task import Task
from lightning_exact.tracking.names import register_resolver

# A machine's own settings (conf/local/default.yaml, git-ignored) for the tests of local settings
LOCAL_SETTINGS = """# @package _global_
paths:
  data_dir: /datasets/here  # every dataset's data.root
  log_dir: /scratch/outputs  # output folders
logger:
  tracking_uri: http://mlflow.example:5000  # the store
"""


def compose_config(
    name: str, overrides: list[str], workdir: Path, *, conf: Path, task: Task
) -> DictConfig:
    """Compose ``<name>.yaml`` of the project's ``conf`` like ``@hydra.main`` does, with the
    runtime folders a real launch from ``workdir`` would set."""
    register_resolvers()  # as every entry point does before Hydra composes
    register_resolver()
    use_task_in_config(task)
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(name, overrides=overrides, return_hydra_config=True)
    OmegaConf.set_readonly(cfg.hydra, False)
    with open_dict(cfg):
        cfg.hydra.runtime.cwd = str(workdir)
        cfg.hydra.runtime.output_dir = str(workdir / "out")
    (workdir / "out").mkdir(exist_ok=True)  # Hydra creates it before the task function runs
    HydraConfig.instance().set_config(cfg)  # keeps its own copy of cfg.hydra
    OmegaConf.set_readonly(cfg, False)
    with open_dict(cfg):
        del cfg["hydra"]  # the task function never sees it either
    return cfg


def conf_copy(folder: Path, conf: Path, local: str | None) -> Path:
    """A copy of the project's ``conf`` in ``folder`` with ``local`` as its
    conf/local/default.yaml (None: without one)."""
    copy = folder / "conf"
    shutil.copytree(conf, copy)
    (copy / "local").mkdir(exist_ok=True)
    (copy / "local" / "default.yaml").unlink(missing_ok=True)  # a developer's own, if any
    if local is not None:
        (copy / "local" / "default.yaml").write_text(local)
    return copy


def refusal(override: str, *, conf: Path, task: Task) -> str:
    """The line an entry point shows for a command-line ``override`` Hydra refuses."""
    register_resolvers()
    register_resolver()
    use_task_in_config(task)
    with (
        initialize_config_dir(config_dir=str(conf), version_base="1.3"),
        pytest.raises(HydraException) as info,
    ):
        compose("train", overrides=[override])
    return describe_config_error(info.value, SET_ELSEWHERE)
