"""A sweep (``-m``) reports back at its end, with any launcher or sweeper: one table of its jobs
(what each varied, its ``optimized_metric``, the best marked), the sweep folder, ``jobs.csv``
and the link to the sweep's MLflow parent run.

Hydra calls ``on_multirun_end`` only when every job succeeded (its basic sweeper raises the
first failed job's error instead), so the callback only remembers the sweep it starts, and the
entry point reports it when Hydra returns or raises (:func:`reported_at_end`)."""

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig
from rich.table import Table

from lightning_exact.job.reporting import console, show_error, show_warning
from lightning_exact.sweeps.jobs import best_is, best_job, read_jobs, write_jobs_table
from lightning_exact.tracking.outbox import OFFLINE
from lightning_exact.tracking.store import run_page
from lightning_exact.tracking.sweep_run import PARENT_FILE
from lightning_exact.tracking.views import view_page


@dataclass(frozen=True)
class Sweep:
    folder: Path
    metric: str | None  # optimized_metric: train's; none for a sweep of another entry point


_started: list[Sweep] = []  # the sweep this process launched, until it is reported


BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"  # runs a grid, ranks none


class RememberSweep(HydraCallback):
    """conf/hydra/default.yaml: the sweep's folder and metric, for its report at the end. A
    sweeper that optimizes (Optuna's) is refused in one line, before any job, for a training
    task that names no metric (``optimized_metric`` null: ``Task.monitor=None``)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        metric = config.get("optimized_metric")
        sweeper = config.hydra.sweeper.get("_target_")
        if "optimized_metric" in config and metric is None and sweeper != BASIC_SWEEPER:
            show_error(
                "optimized_metric is null: the task names no metric (Task.monitor=None, no "
                "Task.optimized_metric), so this sweeper has nothing to optimize; name one the "
                "jobs log: optimized_metric=<metric>"
            )
            raise SystemExit(1)
        folder = Path(config.hydra.sweep.dir).absolute()
        _started.append(Sweep(folder, metric))


@contextmanager
def reported_at_end(mode: str) -> Iterator[None]:
    """Report the sweep Hydra ran in this block (``mode``: the task's), also one that ended in
    a failed job's error: after that error's line. A report that fails costs a warning."""
    try:
        yield
    finally:
        while _started:
            sweep = _started.pop()
            try:
                report(sweep, mode)
            except Exception as error:
                show_warning(f"the sweep in {sweep.folder} was not summed up: {error}")


def report(sweep: Sweep, mode: str) -> None:
    """The table, the folder, jobs.csv (written here: also for a sweep without MLflow) and the
    parent run; nothing if the sweep ran no job (an Optuna study that holds its trials)."""
    if not (sweep.folder / "multirun.yaml").is_file():
        return
    jobs = read_jobs(sweep.folder)
    metric = sweep.metric
    best = best_job(jobs, metric, mode) if metric else None
    table = Table("job", "overrides", metric or "status", "", title=f"Sweep: {len(jobs)} jobs")
    marker = f"best ({best_is(mode)})"
    for job in jobs:
        value = job["metrics"].get(metric) if metric else None
        shown = job["status"] if value is None else f"{value:.6g}"
        table.add_row(
            job["job"], job["overrides"] or "(none)", shown, marker if job is best else ""
        )
    console.print(table)
    unfinished = [job["job"] for job in jobs if job["status"] != "finished"]
    if unfinished:
        show_warning(
            f"job(s) {', '.join(unfinished)} did not finish: see the log in each one's folder"
        )
    console.print(f"sweep folder: {sweep.folder}", soft_wrap=True, highlight=False)
    jobs_file = write_jobs_table(sweep.folder, jobs)
    console.print(f"every job: {jobs_file}", soft_wrap=True, highlight=False)
    if line := parent_run(sweep.folder):
        console.print(line, soft_wrap=True, highlight=False)


def parent_run(folder: Path) -> str | None:
    """Where the sweep's parent run is; None if no job logged to MLflow."""
    path = folder / PARENT_FILE
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    run_id = saved["run_id"]
    if run_id.startswith(OFFLINE):
        return f"parent run: not sent yet; python -m src.sync {folder} sends it"
    if "experiment_id" not in saved:  # a sweep folder written before its link was kept
        return f"parent run: {run_id} in {saved['tracking_uri']}"
    line = f"parent run: {run_page(saved['tracking_uri'], saved['experiment_id'], run_id)}"
    if "view" in saved:  # its jobs, their metric a column
        view = view_page(saved["tracking_uri"], saved["experiment_id"], saved["view"])
        line += f"\nits jobs, optimized_metric a column: {view}"
    return line
