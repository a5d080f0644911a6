"""One MLflow parent run per sweep: every job's run nests under it (the UI groups them), and
each job, as it ends, rewrites the sweep's summary there: a table of every job, the best one by
``optimized_metric``, and the spread over seeds of jobs that differ only in ``seed``.

The jobs do it themselves, under a lock on the sweep folder, so it works the same with every
launcher (in one process, as DDP process trees, as SLURM jobs) and for a sweep run again in its
folder, which continues the same parent.
"""

import csv
import json
import math
import time
from pathlib import Path
from statistics import mean, stdev
from typing import Any

from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from omegaconf import DictConfig, OmegaConf

from src.template.store import locked, mask_override, without_password
from src.template.sweeps import sweep_command, sweep_job, sweep_overrides, varied_overrides

PARENT_FILE = "mlflow_parent_run.json"  # in the sweep folder: the parent run and its store
JOBS_FILE = "jobs.csv"  # the parent's table of every job
SEEDS_FILE = "seeds.csv"  # per group of jobs that differ only in seed or fold: mean, std, 95% CI


def parent_run(cfg: DictConfig) -> str | None:
    """The id of this sweep job's parent run, made by the first job that asks; None outside a
    sweep. Called where the MLflow logger is built: on rank 0, once the store is prepared."""
    job = sweep_job()
    if job is None:
        return None
    from mlflow import MlflowClient

    folder, uri = job[0], cfg.logger.tracking_uri
    with locked(folder):
        path = folder / PARENT_FILE
        saved = json.loads(path.read_text()) if path.is_file() else {}
        if saved.get("tracking_uri") == without_password(uri):
            return saved["run_id"]
        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name(cfg.logger.experiment_name)
        command = " ".join(map(mask_override, sweep_command(folder, f"src.{cfg.task_name}")))
        run = client.create_run(
            experiment.experiment_id,
            run_name=f"{cfg.task_name} {cfg.data.name} sweep {folder.name}",
            tags={"sweep.parent": folder.name, "command": command},  # no task tag: not a job
        )
        path.write_text(
            json.dumps({"run_id": run.info.run_id, "tracking_uri": without_password(uri)})
        )
        return run.info.run_id


@rank_zero_only
def summarize(cfg: DictConfig, mode: str) -> None:
    """Rewrite the sweep's summary on its parent run from the job folders on disk. A store that
    does not answer now costs a warning: the next job to end writes it again."""
    job = sweep_job()
    path = job[0] / PARENT_FILE if job else None
    if path is None or not path.is_file():
        return
    from mlflow import MlflowClient

    parent = json.loads(path.read_text())
    if parent["tracking_uri"] != without_password(cfg.logger.tracking_uri):
        return  # this job logged to another store
    try:
        with locked(job[0]):
            jobs = read_jobs(job[0])
            write_summary(MlflowClient(cfg.logger.tracking_uri), parent["run_id"], job[0], jobs,
                          cfg.optimized_metric, mode)  # fmt: skip
    except Exception as error:
        rank_zero_warn(f"the sweep's summary on run {parent['run_id']} was not updated: {error}")


def read_jobs(folder: Path) -> list[dict[str, Any]]:
    """Each job of the sweep folder: its number, run, varied overrides, status and metrics."""
    command = sweep_overrides(folder)
    jobs = []
    for overrides_file in sorted(folder.glob("*/.hydra/overrides.yaml")):
        out = overrides_file.parent.parent
        metrics = out / "metrics.json"
        run_id = out / "mlflow_run_id.txt"
        jobs.append({
            "job": out.name,
            "run_id": run_id.read_text().strip() if run_id.is_file() else "",
            "overrides": " ".join(varied_overrides(OmegaConf.load(overrides_file), command)),
            "status": "finished" if metrics.is_file() else "unfinished",
            "metrics": json.loads(metrics.read_text()) if metrics.is_file() else {},
        })  # fmt: skip
    return sorted(jobs, key=lambda j: (len(j["job"]), j["job"]))


def write_summary(
    client: Any, run_id: str, folder: Path, jobs: list[dict[str, Any]], metric: str, mode: str
) -> None:
    keys = sorted({key for job in jobs for key in job["metrics"]})
    with (folder / JOBS_FILE).open("w", newline="") as file:
        table = csv.writer(file)
        table.writerow(["job", "run_id", "overrides", "status", *keys])
        for job in jobs:
            table.writerow([job[k] for k in ("job", "run_id", "overrides", "status")]
                           + [job["metrics"].get(key, "") for key in keys])  # fmt: skip
    client.log_artifact(run_id, str(folder / JOBS_FILE))
    scored = [job for job in jobs if metric in job["metrics"]]
    tags = {"sweep.jobs": str(len(jobs)), "sweep.finished": str(len(scored))}
    values: dict[str, float] = {}
    if scored:
        pick = max if mode == "max" else min
        best = pick(scored, key=lambda job: job["metrics"][metric])
        tags.update({"best.job": best["job"], "best.run_id": best["run_id"],
                     "best.overrides": best["overrides"] or "(none)"})  # fmt: skip
        values[f"best/{metric}"] = best["metrics"][metric]
    groups = seed_groups(scored)
    if groups:
        rows = [row for group, members in groups.items() for row in spread(group, members, keys)]
        with (folder / SEEDS_FILE).open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        client.log_artifact(run_id, str(folder / SEEDS_FILE))
        if len(groups) == 1:  # every job differs only in seed: the spread is the sweep's result
            for row in rows:
                for stat in ("mean", "std", "ci95_low", "ci95_high"):
                    values[f"{row['metric']}_{stat}"] = row[stat]
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in values.items()])
    client.set_terminated(run_id, "FINISHED")  # the summary of every job ended so far


REPEATS = ("seed=", "fold=")  # jobs that differ only in these repeat one experiment


def seed_groups(jobs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Finished jobs grouped by their overrides other than ``seed`` (or the k-fold ``fold``);
    groups of two or more."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for job in jobs:
        others = [o for o in job["overrides"].split() if not o.startswith(REPEATS)]
        if len(others) < len(job["overrides"].split()):  # it varies the seed
            groups.setdefault(" ".join(others) or "(all)", []).append(job)
    return {group: members for group, members in groups.items() if len(members) > 1}


def spread(group: str, jobs: list[dict[str, Any]], keys: list[str]) -> list[dict[str, Any]]:
    """Mean, sample standard deviation and Student-t 95% confidence interval of each metric."""
    from scipy.stats import t

    rows = []
    for key in keys:
        values = [job["metrics"][key] for job in jobs if key in job["metrics"]]
        if len(values) < 2:
            continue
        n, centre, sd = len(values), mean(values), stdev(values)
        half = float(t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
        rows.append({"group": group, "metric": key, "n": n, "mean": centre, "std": sd,
                     "ci95_low": centre - half, "ci95_high": centre + half})  # fmt: skip
    return rows
