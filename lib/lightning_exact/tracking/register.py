"""``python -m src.register SWEEP_DIR --name NAME``: register the best job of a sweep.

Best by the sweep's ``optimized_metric`` (the value each job returned to Hydra, also in its
``metrics.json``) in the task's direction (``task.mode``): the job the sweep's parent run and
its end-of-sweep report name best (:func:`lightning_exact.sweeps.jobs.best_job`). That job's MLflow
model (logged by every training job, see lib/lightning_exact/tracking/mlflow_model.py) becomes a new
version of NAME in the store the jobs logged to; registering the same model again changes
nothing.
"""

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf

from lightning_exact.job.entry import use_task_in_config
from lightning_exact.sweeps import jobs as sweeps
from lightning_exact.task import Task
from lightning_exact.tracking.mlflow_model import KEY_TAG, register
from lightning_exact.tracking.run import RUN_ID_FILE
from lightning_exact.tracking.store import (
    TrackingError,
    credentials_moved,
    refuse_empty_certificate_path,
)


class NoModel(RuntimeError):
    """Nothing in the sweep can be registered: the message says why."""


def best_job(sweep_dir: Path, mode: str) -> tuple[Path, str, float]:
    """The folder of the sweep's best finished job by its ``optimized_metric`` in ``mode``
    ("max" or "min"), the metric and its value."""
    if not (sweep_dir / "multirun.yaml").is_file():
        problem = "holds no multirun.yaml" if sweep_dir.is_dir() else "is not a folder"
        raise NoModel(f"{sweep_dir} {problem}: pass a sweep's, outputs/train/multiruns/<time>")
    metric = OmegaConf.load(sweep_dir / "multirun.yaml").optimized_metric
    if metric is None:
        raise NoModel(
            f"{sweep_dir} ranks no job: its optimized_metric is null (the task names no metric); "
            "sweep again with optimized_metric=<a metric the jobs log>"
        )
    best = sweeps.best_job(sweeps.read_jobs(sweep_dir), metric, mode)
    if best is None:
        raise NoModel(f"{sweep_dir} holds no finished job (no <job>/metrics.json with {metric})")
    return sweep_dir / best["job"], metric, best["metrics"][metric]


def register_best(sweep_dir: Path, name: str, mode: str, tracking_uri: str | None) -> str:
    from mlflow import MlflowClient

    job, metric, value = best_job(sweep_dir, mode)
    run_file = job / RUN_ID_FILE
    if not run_file.is_file():
        raise NoModel(f"the best job, {job} ({metric}={value:.6g}), has no MLflow run")
    run_id = run_file.read_text().strip()
    uri = tracking_uri or OmegaConf.load(job / "config.yaml").logger.tracking_uri
    refuse_empty_certificate_path(uri)
    client = MlflowClient(uri)
    experiment_id = client.get_run(run_id).info.experiment_id
    models = client.search_logged_models(
        [experiment_id],
        filter_string=f"source_run_id = '{run_id}'",
        order_by=[{"field_name": "creation_timestamp", "ascending": False}],
    )
    # The job's own model (named for its run), not another a task logged in the run
    ready = [m for m in models if str(m.status) == "READY" and KEY_TAG in m.tags]
    if not ready:
        raise NoModel(
            f"run {run_id} of the best job ({job}) has no MLflow model yet: it was trained with "
            f"logger.log_model=false, or its records wait (python -m src.sync {job})"
        )
    version, new = register(client, name, ready[0].model_id)
    done = f"registered {name} version {version}" if new else f"{name} version {version} already is"
    return (
        f"{done}: {job} ({metric}={value:.6g}), run {run_id}. "
        f"Serve it: mlflow models serve -m models:/{name}/{version} --env-manager local"
    )


def main(task: Task, argv: list[str] | None = None) -> int:
    """The command, for ``task`` (its ``mode`` says which is best)."""
    parser = argparse.ArgumentParser(
        prog="python -m src.register",
        description="Register the MLflow model of a sweep's best job, by the value of its "
        f"optimized_metric in each job's metrics.json ({sweeps.best_is(task.mode)} is best: "
        "the task's mode).",
    )
    parser.add_argument(
        "sweep_dir", type=Path, help="the sweep's folder: outputs/train/multiruns/<time>"
    )
    parser.add_argument("--name", required=True, help="the registered model's name")
    parser.add_argument("--tracking-uri", help="the store, if not the one the jobs used")
    args = parser.parse_args(argv)
    use_task_in_config(task)  # multirun.yaml's optimized_metric: ${task:optimized_metric}
    if args.tracking_uri:  # a password typed in it is never printed or stored
        args.tracking_uri = credentials_moved(args.tracking_uri)
    try:
        print(register_best(args.sweep_dir, args.name, task.mode, args.tracking_uri))
    except (NoModel, TrackingError) as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1
    return 0
