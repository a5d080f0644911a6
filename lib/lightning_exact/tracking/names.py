"""What a run and its model are called in the MLflow UI. Its runs table shows about 16
characters of a name at its default width (1600 px), so a name leads with what tells a job
apart from the others of its experiment: a debug preset, what a sweep varies, the world size;
then what the task says of it (``run_label`` in conf/task.yaml), and the entry point when it is
not training. The experiment (the dataset) is never repeated in it."""

import re
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from lightning_exact.sweeps.jobs import swept_overrides
from lightning_exact.training.distributed import requested_processes


def debug_preset() -> str | None:
    """The ``debug=`` option this job runs with (a smoke run), if any."""
    if not HydraConfig.initialized():
        return None
    return HydraConfig.get().runtime.choices.get("debug") or None


def register_resolver() -> None:
    """``${run_name:...}``, logger.run_name's: registered before Hydra composes."""
    OmegaConf.register_new_resolver("run_name", run_name, replace=True)


def run_name(task_name: str, said: str, accelerator: str, devices: Any, num_nodes: int) -> str:
    """``${run_name:...}``: e.g. "convnet", "lr=0.003 convnet", "4 ranks convnet",
    "debug=fast convnet", "eval convnet". ``said``: what the task's run_label says."""
    swept = swept_overrides()
    varied = {override.split("=")[0] for override in swept}
    world = requested_processes(accelerator, devices, num_nodes)
    parts = [task_name] if task_name != "train" else []
    if preset := debug_preset():
        parts.append(f"debug={preset}")
    parts += swept
    if world > 1 and not varied & {"devices", "num_nodes"}:
        parts.append(f"{world} ranks")
    parts += str(said or "").split()
    return " ".join(parts) or task_name


def sweep_name(task_name: str, command: list[str]) -> str:
    """A sweep's parent run: what it sweeps, e.g. "sweep lr=0.01,0.02"."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(command))
    swept = []
    for typed, override in zip(command, parsed, strict=True):
        if override.is_sweep_override():
            key, _, values = typed.partition("=")
            swept.append(f"{key.lstrip('+~').rsplit('.', 1)[-1]}={values}")
    prefix = "sweep" if task_name == "train" else f"{task_name} sweep"
    preset = debug_preset()
    return " ".join([prefix, *([f"debug={preset}"] if preset else []), *swept])


# Characters MLflow refuses in a logged model's name (mlflow.utils.validation)
NOT_IN_MODEL_NAMES = re.compile(r"[/:.%\"']")


def model_name(run_name: str) -> str:
    """The logged model's name in the experiment's Models tab: its run's name, as MLflow takes
    it ("lr=0.003 convnet" becomes "lr=0_003 convnet")."""
    return NOT_IN_MODEL_NAMES.sub("_", run_name) or "model"
