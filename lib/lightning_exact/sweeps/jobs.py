"""Hydra multiruns (``-m``): what a sweep job needs beyond a single run. A sweep run again in its
folder skips finished jobs and resumes the rest (as a job with ``ckpt_path=auto`` does); a DDP
job runs as its own process tree. The sweep's summary: a table of every job, the best one by
``optimized_metric``, and the spread of the jobs that differ only in ``seed`` (or ``fold``)."""

import csv
import json
import logging
import math
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from statistics import mean, stdev
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf

from lightning_exact.files import write_text_atomically

log = logging.getLogger(__name__)

SWEEP_JOB_ENV = "TEMPLATE_SWEEP_JOB"  # "<sweep folder>/<job number>" for a sweep's DDP job
JOB_FILE = "job.json"  # in a job's folder: its overrides, and its result once done
JOBS_FILE = "jobs.csv"
SEEDS_FILE = "seeds.csv"  # the summary's tables: every job; their spread
FIELDS = ("job", "run_id", "overrides", "status")  # of a job, before its metrics
REPEATS = ("seed=", "fold=")  # jobs that differ only in these repeat one experiment


class SweepError(RuntimeError):
    """A sweep job's folder holds another sweep's output, or its own rank processes failed."""


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


def same_job_again(ckpt_path: str | None) -> bool:
    """Whether a job run again in its folder with the same overrides is the same job: a sweep's
    job, or one with ``ckpt_path=auto`` (its command, run again after any stop)."""
    return sweep_job() is not None or ckpt_path == "auto"


def earlier_run(output_dir: Path, ckpt_path: str | None) -> dict[str, Any] | None:
    """What an earlier run of this job left in its folder (``{"overrides"}``, and ``"result"``
    once it finished); None for a first run, or for a single job with other overrides (more
    epochs, say: ``ckpt_path=auto`` then resumes)."""
    path = output_dir / JOB_FILE
    if not same_job_again(ckpt_path) or not path.is_file():
        return None
    earlier = json.loads(path.read_text())
    if earlier["overrides"] == list(HydraConfig.get().overrides.task):
        return earlier
    if (job := sweep_job()) is None:
        return None
    raise SweepError(
        f"{output_dir} holds sweep job {job[1]} of another sweep "
        f"({' '.join(earlier['overrides'])}); run this one in a new folder (leave out "
        "hydra.sweep.dir) or run that sweep's command again"
    )


@rank_zero_only
def record_job(output_dir: Path, **entries: Any) -> None:
    """Every job's overrides in its folder once it starts, ``fitted=`` once its fit ended
    (:func:`fitted_record`), and ``result=`` once it finished: run again in its folder
    (:func:`same_job_again`), it resumes, or is not trained again; a finished job is never
    reopened (:func:`job_finished`)."""
    overrides = list(HydraConfig.get().overrides.task)
    write_text_atomically(output_dir / JOB_FILE, json.dumps({"overrides": overrides, **entries}))


def fit_record(step: int, logged: dict[str, float]) -> dict[str, Any]:
    """``record_job``'s ``fitted=``: the last value of each metric a fit logged, and its step."""
    return {"step": step, "logged": logged}


def fitted_record(folder: Path, step: int) -> dict[str, float] | None:
    """What the fit of the job in ``folder`` logged, if it ended at ``step`` (kept until the job
    has its result: one stopped in its test resumes with it). Its last checkpoint may hold less:
    an epoch cut by ``max_steps`` logs at its end, after it."""
    path = folder / JOB_FILE
    record = json.loads(path.read_text()).get("fitted") if path.is_file() else None
    return record["logged"] if record and record["step"] == step else None


def job_finished(folder: Path) -> bool:
    """Whether the job whose folder this is ended with a result (its ``job.json`` says so)."""
    path = folder / JOB_FILE
    return path.is_file() and "result" in json.loads(path.read_text())


def finished_result(folder: Path, metric: str) -> float | None:
    """A finished job's ``metric``, read back from its ``metrics.json`` (else its job.json)."""
    metrics = folder / "metrics.json"
    if metrics.is_file():
        return json.loads(metrics.read_text()).get(metric)
    path = folder / JOB_FILE
    return json.loads(path.read_text()).get("result") if path.is_file() else None


def resume_folder(argv: Sequence[str]) -> Path | None:
    """Where a resume (``ckpt_path=<F>/checkpoints/<x>.ckpt``) writes: the stopped job's folder F,
    so one job is one folder. None (Hydra picks a new folder) for a sweep, a command naming its
    folder, a checkpoint outside a job's folder, or a job that finished (lengthening it starts
    a new record)."""
    if any(arg in ("-m", "--multirun") or arg.startswith("hydra.run.dir=") for arg in argv):
        return None
    paths = [arg.partition("=")[2] for arg in argv if arg.startswith("ckpt_path=")]
    if not paths or paths[-1] == "auto":
        return None
    ckpt = Path(paths[-1]).absolute()
    folder = ckpt.parent.parent
    if ckpt.suffix != ".ckpt" or ckpt.parent.name != "checkpoints" or not ckpt.exists():
        return None
    if not (folder / ".hydra").is_dir() or job_finished(folder):
        return None
    return folder


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
        "sweep job %s runs as its own process tree of ranks: %s", hydra.job.num, shlex.join(command)
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
    """``${gpus_for:...}``: GPUs per node for a scheduler (conf/hydra/launcher/slurm.yaml)."""
    OmegaConf.register_new_resolver("gpus_for", gpus_for, replace=True)


def read_jobs(folder: Path) -> list[dict[str, Any]]:
    """Each job of the sweep folder, in order: its number, run, varied overrides, status and
    metrics."""
    command = sweep_overrides(folder)
    jobs = []
    for overrides in folder.glob("*/.hydra/overrides.yaml"):
        out = overrides.parent.parent
        metrics = out / "metrics.json"
        run_id = out / "mlflow_run_id.txt"
        jobs.append(
            {
                "job": out.name,
                "run_id": run_id.read_text().strip() if run_id.is_file() else "",
                "overrides": " ".join(varied_overrides(OmegaConf.load(overrides), command)),
                "status": "finished" if metrics.is_file() else "unfinished",
                "metrics": json.loads(metrics.read_text()) if metrics.is_file() else {},
            }
        )
    return sorted(jobs, key=lambda j: (len(j["job"]), j["job"]))


def scored_jobs(jobs: Sequence[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """The jobs that ended with a value of ``metric`` (not NaN)."""
    return [
        job for job in jobs if metric in job["metrics"] and not math.isnan(job["metrics"][metric])
    ]


def best_job(jobs: Sequence[dict[str, Any]], metric: str, mode: str) -> dict[str, Any] | None:
    """The sweep's best job by ``metric``, the first of equals: highest if ``mode`` is "max"
    (the task's mode), else lowest; None if no job has a value. The sweep's parent run, its
    end-of-sweep report and ``src.register`` all take their best from here."""
    scored = scored_jobs(jobs, metric)
    if not scored:
        return None
    return (max if mode == "max" else min)(scored, key=lambda job: job["metrics"][metric])


def best_is(mode: str) -> str:
    """What ``mode`` makes best, in words."""
    return "highest" if mode == "max" else "lowest"


def write_jobs_table(folder: Path, jobs: Sequence[dict[str, Any]]) -> Path:
    """``jobs.csv`` in the sweep folder: each job's number, run, varied overrides, status and
    final metrics."""
    keys = sorted({key for job in jobs for key in job["metrics"]})
    rows = [{key: job[key] for key in FIELDS} | job["metrics"] for job in jobs]
    return write_table(folder / JOBS_FILE, rows, [*FIELDS, *keys])


def write_table(path: Path, rows: list[dict], fields: list) -> Path:
    with path.open("w", newline="") as file:
        table = csv.DictWriter(file, fieldnames=fields)
        table.writeheader()
        table.writerows(rows)
    return path


def spread(group: str, jobs: list[dict[str, Any]], keys: list[str]) -> list[dict[str, Any]]:
    """Mean, sample standard deviation and Student-t 95% confidence interval of each metric."""
    from scipy.stats import t

    rows = []
    for key in keys:
        values = [job["metrics"][key] for job in jobs if key in job["metrics"]]
        if len(values) > 1:
            n = len(values)
            centre = mean(values)
            sd = stdev(values)
            half = float(t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
            rows.append(
                {
                    "group": group,
                    "metric": key,
                    "n": n,
                    "mean": centre,
                    "std": sd,
                    "ci95_low": centre - half,
                    "ci95_high": centre + half,
                }
            )
    return rows
