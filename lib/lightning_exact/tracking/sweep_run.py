"""One MLflow parent run per sweep: every job's run nests under it, and each job, as it ends,
rewrites the sweep's summary there (:func:`write_summary`), under a lock on
the sweep folder, so it works with every launcher, and a sweep run again continues it."""

import json
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from omegaconf import DictConfig

from lightning_exact.files import write_text_atomically
from lightning_exact.sweeps.jobs import (
    REPEATS,
    SEEDS_FILE,
    best_job,
    read_jobs,
    scored_jobs,
    spread,
    sweep_command,
    sweep_job,
    sweep_overrides,
    write_jobs_table,
    write_table,
)
from lightning_exact.tracking.names import sweep_name
from lightning_exact.tracking.outbox import Outbox, encode, offline_run_id, register_kind
from lightning_exact.tracking.store import locked, mask_override, without_password
from lightning_exact.tracking.views import save_sweep_view

PARENT_FILE = "mlflow_parent_run.json"  # in the sweep folder: the parent run and its store


def parent_run(cfg: DictConfig) -> str | None:
    """The id of this sweep job's parent run, made by the first job that asks; None outside a
    sweep. Called on rank 0 once the store is prepared. An offline sweep's is a placeholder: a
    record in the sweep folder's outbox, which ``python -m src.sync <sweep folder>`` sends."""
    if (job := sweep_job()) is None:
        return None
    from mlflow import MlflowClient

    folder = job[0]
    uri = cfg.logger.tracking_uri
    with locked(folder):
        path = folder / PARENT_FILE
        saved = json.loads(path.read_text()) if path.is_file() else {}
        if saved.get("tracking_uri") == without_password(uri):
            return saved["run_id"]
        command = " ".join(map(mask_override, sweep_command(folder, f"src.{cfg.task_name}")))
        run = {
            "run_name": sweep_name(cfg.task_name, sweep_overrides(folder)),
            "tags": {"sweep.parent": folder.name, "command": command},  # no task tag: not a job
        }
        saved: dict[str, str] = {"tracking_uri": without_password(uri)}
        if cfg.logger.get("offline"):  # a record for src.sync, as an offline job's own run is
            run_id = offline_run_id()
            name = cfg.logger.experiment_name
            with closing(Outbox(folder, without_password(uri))) as outbox:
                outbox.append(encode("create_run", run_id, experiment_name=name, **run))
        else:
            client = MlflowClient(uri)
            experiment = client.get_experiment_by_name(cfg.logger.experiment_name)
            run_id = client.create_run(experiment.experiment_id, **run).info.run_id
            saved["experiment_id"] = experiment.experiment_id  # its page's link, at the sweep's end
            metric = cfg.get("optimized_metric")
            save_sweep_view(client, experiment.experiment_id, folder.name, metric)
            saved["view"] = folder.name
        saved["run_id"] = run_id
        write_text_atomically(path, json.dumps(saved))
        return run_id


@rank_zero_only
def summarize(cfg: DictConfig, mode: str) -> None:
    """Rewrite the sweep's summary on its parent run from the job folders on disk (an offline
    sweep's: src.sync does, once its jobs' runs exist). A store that does not answer costs a
    warning: the next job to end writes it again."""
    job = sweep_job()
    if job is None or not (job[0] / PARENT_FILE).is_file():
        return
    from mlflow import MlflowClient

    parent = json.loads((job[0] / PARENT_FILE).read_text())
    uri = cfg.logger.tracking_uri
    if parent["tracking_uri"] != without_password(uri):
        return  # this job logged to another store
    try:
        with locked(job[0]):
            if not cfg.logger.get("offline"):
                client = MlflowClient(uri)
                return write_summary(client, parent["run_id"], job[0], cfg.optimized_metric, mode)
            with closing(Outbox(job[0], without_password(uri))) as outbox:
                record = encode(
                    "summarize",
                    parent["run_id"],
                    folder=job[0],
                    metric=cfg.optimized_metric,
                    mode=mode,
                )
                if not (outbox.pending and outbox.records[-1] == record):  # else one is queued
                    outbox.append(record)
    except Exception as error:
        rank_zero_warn(f"the sweep's summary on run {parent['run_id']} was not updated: {error}")


def write_summary(client: Any, run_id: str, folder: Path, metric: str, mode: str) -> None:
    from mlflow.entities import Metric, RunTag

    jobs = read_jobs(folder)
    keys = sorted({key for job in jobs for key in job["metrics"]})
    client.log_artifact(run_id, str(write_jobs_table(folder, jobs)))
    scored = scored_jobs(jobs, metric)
    tags = {"sweep.jobs": str(len(jobs)), "sweep.finished": str(len(scored))}
    values: dict[str, float] = {}
    if best := best_job(jobs, metric, mode):
        tags |= {
            "best.job": best["job"],
            "best.run_id": best["run_id"],
            "best.overrides": best["overrides"] or "(none)",
        }
        values[f"best/{metric}"] = best["metrics"][metric]
    groups: dict[str, list[dict[str, Any]]] = {}
    for job in scored:  # by the overrides other than the repeated ones, if it varies one
        others = [o for o in job["overrides"].split() if not o.startswith(REPEATS)]
        if len(others) < len(job["overrides"].split()):
            groups.setdefault(" ".join(others) or "(all)", []).append(job)
    groups = {group: members for group, members in groups.items() if len(members) > 1}
    spreads = [row for group, members in groups.items() for row in spread(group, members, keys)]
    if spreads:
        client.log_artifact(
            run_id, str(write_table(folder / SEEDS_FILE, spreads, list(spreads[0])))
        )
    if len(groups) == 1:  # every job differs only in seed: the spread is the sweep's result
        for row in spreads:
            for stat in ("mean", "std", "ci95_low", "ci95_high"):
                values[f"{row['metric']}_{stat}"] = row[stat]
    now = int(time.time() * 1000)
    client.log_batch(
        run_id,
        [Metric(k, float(v), now, 0) for k, v in values.items()],
        tags=[RunTag(k, v) for k, v in tags.items()],
    )
    client.set_terminated(run_id, "FINISHED")  # the summary of every job ended so far


def send_summary(client: Any, run_id: str, folder: str, metric: str, mode: str) -> None:
    """A queued ``summarize`` record (an offline sweep's summary), sent by src.sync."""
    write_summary(client, run_id, Path(folder), metric, mode)


register_kind("summarize", ("folder", "metric", "mode"), send_summary)
