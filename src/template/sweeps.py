"""Hydra multiruns (``-m``): what a sweep job needs beyond a single run. A sweep run again in its
folder skips finished jobs and resumes the rest; a DDP job runs as its own process tree."""

import json
import logging
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf

from src.template.files import write_text_atomically

log = logging.getLogger(__name__)

SWEEP_JOB_ENV = "TEMPLATE_SWEEP_JOB"  # "<sweep folder>/<job number>" for a sweep's DDP job
JOB_FILE = "sweep_job.json"  # in a sweep job's folder: its overrides, and its result once done


class SweepError(RuntimeError):
    """A sweep job's folder holds another sweep's output, or its own DDP process tree failed."""


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def sweep_job() -> tuple[Path, str] | None:
    """(sweep folder, job number) of a sweep's job, also of a DDP job run as its own process."""
    if in_multirun():
        hydra = HydraConfig.get()
        return Path(hydra.sweep.dir), str(hydra.job.num)
    if SWEEP_JOB_ENV in os.environ:
        folder, number = os.environ[SWEEP_JOB_ENV].rsplit("/", 1)
        return Path(folder), number
    return None


def earlier_run(output_dir: Path) -> dict[str, Any] | None:
    """What an earlier run of this sweep job left in its folder (``{"overrides"}``, and
    ``"result"`` once it finished); None for a first run or outside a sweep."""
    job, path = sweep_job(), output_dir / JOB_FILE
    if job is None or not path.is_file():
        return None
    earlier = json.loads(path.read_text())
    if earlier["overrides"] != list(HydraConfig.get().overrides.task):
        raise SweepError(
            f"{output_dir} holds sweep job {job[1]} of another sweep "
            f"({' '.join(earlier['overrides'])}); run this one in a new folder (leave out "
            "hydra.sweep.dir) or run that sweep's command again"
        )
    return earlier


@rank_zero_only
def record_job(output_dir: Path, **result: float | None) -> None:
    """A sweep job's overrides in its folder once it starts, and ``result=`` once it finished:
    run again in its folder, it resumes, or is not trained again."""
    path = output_dir / JOB_FILE
    if sweep_job() is not None:
        done = json.loads(path.read_text()) if path.is_file() else {}
        overrides = list(HydraConfig.get().overrides.task)
        write_text_atomically(path, json.dumps({"overrides": overrides, **done, **result}))


def sweep_overrides(folder: Path) -> list[str]:
    """The overrides of the command that started the sweep in ``folder`` (its multirun.yaml)."""
    return list(OmegaConf.load(folder / "multirun.yaml").hydra.overrides.task)


def varied_overrides(job: Sequence[str], command: Sequence[str]) -> list[str]:
    """A job's overrides whose key its sweep's command did not fix, each by its last key:
    ``lr=0.003``."""
    parsed = OverridesParser.create().parse_overrides(list(command))
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    fixed = {o.get_key_element() for o in parsed} - swept
    varied = [o.partition("=") for o in job]
    return [
        f"{key.lstrip('+~').rsplit('.', 1)[-1]}{sep}{value}"
        for key, sep, value in varied
        if key not in fixed
    ]


def sweep_command(folder: Path, entry_point: str) -> list[str]:
    """The command that started the sweep in ``folder``, as its ``multirun.yaml`` says."""
    return ["python", "-m", entry_point, "-m", *sweep_overrides(folder)]


def run_sweep_job_in_own_process(optimized_metric: str) -> float | None:
    """This multirun job as a single-run process tree (its overrides, its folder); its optimized
    metric. Lightning starts DDP ranks by re-running the command line (here: the whole sweep)
    and SIGKILLs the launcher when a rank fails: wrong for a sweep run in one process."""
    import __main__

    hydra = HydraConfig.get()
    out = Path(hydra.runtime.output_dir)
    command = [sys.executable, "-m", __main__.__spec__.name, *hydra.overrides.task]
    command.append(f"hydra.run.dir={out}")
    env = {**os.environ, SWEEP_JOB_ENV: f"{hydra.sweep.dir}/{hydra.job.num}"}
    log.info(
        "sweep job %s runs as its own DDP process tree: %s", hydra.job.num, shlex.join(command)
    )
    code = subprocess.run(command, env=env).returncode
    if code != 0:
        raise SweepError(f"sweep job {hydra.job.num} exited with code {code}; see {out}")
    return json.loads((out / "metrics.json").read_text()).get(optimized_metric)


def swept_overrides() -> list[str]:
    """What this sweep job's config differs by from its sweep's command, e.g. ``lr=0.003``."""
    job = sweep_job()
    if job is None or not HydraConfig.initialized():
        return []
    return varied_overrides(HydraConfig.get().overrides.task, sweep_overrides(job[0]))


def gpus_for(accelerator: str, devices: int) -> int:
    return 0 if accelerator == "cpu" else int(devices)


def register_resolvers() -> None:
    """``${gpus_for:...}``: GPUs per node for a scheduler (conf/hydra/launcher/slurm.yaml);
    ``${swept:}``: " lr=0.003" in a sweep job, "" in a single run (the MLflow run name)."""
    OmegaConf.register_new_resolver("gpus_for", gpus_for, replace=True)
    OmegaConf.register_new_resolver(
        "swept", lambda: "".join(f" {o}" for o in swept_overrides()), replace=True
    )
