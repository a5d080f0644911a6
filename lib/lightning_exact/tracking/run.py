"""A job's run, set up: the loggers (``logger.kind``, TensorBoard, ``logger.extra``), where the run
came from as tags, which run a job continues, the config as params, and the records sent while
the job runs. What a run records at the end: outcome.py."""

import socket
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from omegaconf import DictConfig, OmegaConf

from lightning_exact.files import write_text_atomically
from lightning_exact.job.clock import job_started
from lightning_exact.job.config import as_config_error, flatten
from lightning_exact.job.settings import JobSettings
from lightning_exact.sweeps.jobs import sweep_job
from lightning_exact.tracking import store, sweep_run
from lightning_exact.tracking.logger import (
    OneFileTensorBoardLogger,
    RunBookkeeping,
    RunLogger,
    mlflow_logger,
)
from lightning_exact.tracking.names import debug_preset
from lightning_exact.tracking.outbox import offline_run_id
from lightning_exact.tracking.store import TrackingError, first_line, sqlite_file, without_password
from lightning_exact.tracking.system_metrics import SystemMetrics

PARAM_LIMIT = 6000  # MLflow's longest param value


RUN_ID_FILE = "mlflow_run_id.txt"  # in the output folder: the run a job (re)opened


RUN_NAME_TAG = "mlflow.runName"  # MLflow's: a run's name, changed by setting it
NOTE_TAG = "mlflow.note.content"  # what the MLflow UI shows and edits as a run's description

RESUMED_TAG = "resumed_from_step"  # a resumed job's: the step of the checkpoint it resumed from


def build_loggers(
    cfg: DictConfig,
    settings: JobSettings,
    extra_tags: Mapping[str, str] | None = None,
    continue_run: str | None = None,
) -> list[Logger]:
    """``logger.kind=mlflow|csv|none`` (MLflow continues ``continue_run``), plus
    ``logger.tensorboard`` and ``logger.extra``: any Lightning logger by ``_target_``."""
    with as_config_error("logger.extra"):
        loggers = [instantiate(spec) for spec in cfg.logger.get("extra", {}).values()]
    if cfg.logger.get("tensorboard"):  # events in <output folder>/tensorboard/
        tensorboard = OneFileTensorBoardLogger(
            settings.output_dir, name="tensorboard", version="", default_hp_metric=False
        )
        loggers.insert(0, tensorboard)
    kind = cfg.logger.kind
    if kind == "csv":
        return [CSVLogger(save_dir=settings.output_dir, name="csv", version=""), *loggers]
    if kind not in ("mlflow", "none"):
        raise ValueError(f"logger.kind={kind!r} is not one of mlflow, csv, none")
    if kind == "none" or not settings.opens_store:
        return loggers
    return [mlflow_run_logger(cfg, settings, extra_tags or {}, continue_run), *loggers]


def mlflow_run_logger(
    cfg: DictConfig, settings: JobSettings, extra_tags: Mapping[str, str], run_id: str | None
) -> "RunLogger":
    """Rank 0's MLflow logger, its store made ready (a server: checked to answer), its run's tags
    set; ``run_id``: the run it continues. A sweep job's run nests under its sweep's."""
    uri = cfg.logger.tracking_uri
    offline = bool(cfg.logger.get("offline"))
    if offline and sqlite_file(uri):
        raise TrackingError(
            "logger.offline=true is for an MLflow server (logger.tracking_uri=http://...); "
            "a SQLite store is written directly"
        )
    tags = {**run_tags(cfg, settings), **extra_tags}
    tags = {**user_tags(cfg.logger, reserved=list(tags)), **tags}
    store.refuse_password_in_config(uri)  # one typed on the command line is gone by now
    if not offline:
        store.prepare_store(uri, cfg.logger.experiment_name)
    if parent := sweep_run.parent_run(cfg):
        tags["mlflow.parentRunId"] = parent
    return RunLogger(
        experiment_name=cfg.logger.experiment_name,
        run_name=" ".join(str(cfg.logger.run_name).split()),  # a part left empty: no gap
        tracking_uri=uri,
        artifact_location=store.artifact_location(uri),
        tags=tags,
        run_id=offline_run_id() if offline else run_id,
        start_time=job_started(),
        offline=offline,
        outbox_folder=settings.output_dir,
    )


def run_tags(cfg: DictConfig, settings: JobSettings) -> dict[str, str]:
    """Where a run came from: command, overrides, output folder, host, sweep."""
    command = [f"python -m src.{Path(sys.argv[0]).stem}", *map(store.mask_override, sys.argv[1:])]
    tags = {
        "command": " ".join(command),
        "hydra.overrides": " ".join(map(store.mask_override, HydraConfig.get().overrides.task)),
        "hydra.output_dir": str(settings.output_dir),
        "host": socket.gethostname(),
        "task": str(cfg.task_name),
        "world_size": str(settings.world_size),
    }
    tags["hydra.overrides"] = tags["hydra.overrides"] or "(none)"
    if preset := debug_preset():  # a smoke run, marked as one (its name leads with it too)
        tags["debug"] = preset
    if job := sweep_job():
        tags["sweep.id"] = job[0].name
        tags["sweep.job"] = job[1]
    return tags


def user_tags(logger: DictConfig, reserved: Sequence[str]) -> dict[str, str]:
    """``logger.tags`` (name -> value) and ``logger.notes`` as run tags; the names the template
    sets (``reserved``) are refused."""
    given = logger.get("tags") or {}
    if not isinstance(given, Mapping):
        raise TrackingError(
            f"logger.tags={given} is not a set of name: value pairs; use e.g. "
            "'logger.tags={team: vision}' or +logger.tags.team=vision"
        )
    for key in given:
        if key in reserved or key == NOTE_TAG:
            use = "logger.notes" if key == NOTE_TAG else "another name"
            raise TrackingError(f"logger.tags.{key} is a tag the template sets; use {use}")
    notes = {NOTE_TAG: str(logger.notes)} if logger.get("notes") else {}
    return {str(k): str(v) for k, v in given.items()} | notes


def run_to_continue(
    saved: Mapping[str, Any] | None,
    logger_cfg: DictConfig,
    settings: JobSettings,
    auto: bool = False,
) -> str | None:
    """``logger.run_id`` (refused if not a run of the store); else a resumed job's checkpoint's
    run if it is in this store and ``logger.continue_run``; with ``ckpt_path=auto`` and no
    checkpoint yet, the run a job in this output folder opened (it stopped before one)."""
    if logger_cfg.kind != "mlflow" or logger_cfg.get("offline"):
        return None  # an offline placeholder's run does not exist on the server yet
    uri = logger_cfg.tracking_uri
    named = logger_cfg.get("run_id")
    opened = settings.output_dir / RUN_ID_FILE
    here = without_password(uri)
    if not named:
        source = (saved or {}).get("mlflow")
        if auto and not saved and opened.is_file():
            source = {"run_id": opened.read_text().strip(), "tracking_uri": here}
        if not logger_cfg.get("continue_run", True) or (source or {}).get("tracking_uri") != here:
            return None
    run_id = str(named or source["run_id"])
    if not settings.opens_store:
        return run_id
    from mlflow import MlflowClient

    try:
        if named and (database := sqlite_file(uri)) and not database.is_file():
            raise FileNotFoundError("no such store")
        MlflowClient(uri).get_run(run_id)
    except Exception as error:
        if named:
            raise TrackingError(
                f"logger.run_id={run_id} is not a run of {here} "
                f"({first_line(error)}). Leave it out to start a new run"
            ) from error
        rank_zero_warn(f"run {run_id} of the checkpoint is gone; starting a new run")
        return None
    return run_id


def finished_run(
    saved: Mapping[str, Any], logger_cfg: DictConfig, settings: JobSettings
) -> str | None:
    """The checkpoint's MLflow run if it FINISHED, in this store, when the store answers (a
    finished run is never reopened: a lengthened job records into a new run)."""
    source = saved.get("mlflow") or {}
    uri = logger_cfg.get("tracking_uri", "")
    if logger_cfg.kind != "mlflow" or logger_cfg.get("offline") or not source:
        return None
    if source.get("tracking_uri") != without_password(uri) or not settings.opens_store:
        return None
    if (database := sqlite_file(uri)) and not database.is_file():
        return None  # no store here yet: asking would create one
    from mlflow import MlflowClient

    try:
        run = MlflowClient(uri).get_run(source["run_id"])
    except Exception:  # gone, or the store does not answer: nothing to protect
        return None
    return run.info.run_id if run.info.status == "FINISHED" else None


@rank_zero_only
def copy_history(loggers: list[Logger], tracking_uri: str, old_run: str, through_step: int) -> None:
    """A lengthened job's new run starts with its finished run's points up to ``through_step``
    (the step it trains on from; its test metrics too, at that step): the new run shows every
    step once, and the old run is left as it was."""
    from mlflow import MlflowClient

    logger = mlflow_logger(loggers)
    if logger is None or getattr(logger, "offline", False):
        return
    source = MlflowClient(tracking_uri)
    points = [
        point
        for key in source.get_run(old_run).data.metrics
        for point in source.get_metric_history(old_run, key)
        if point.step <= through_step
    ]
    for start in range(0, len(points), 1000):  # MLflow's most metrics in one batch
        logger.experiment.log_batch(logger.run_id, metrics=points[start : start + 1000])


def log_config(loggers: list[Logger], cfg: DictConfig, trainer: L.Trainer) -> None:
    """The resolved config and what the hardware made of it as params; the run's id in the output
    folder: a job stopped before its first checkpoint continues it (``ckpt_path=auto``)."""
    params = flatten(OmegaConf.to_container(cfg, resolve=True))
    params.update(
        world_size=trainer.world_size,
        num_devices=trainer.num_devices,
        num_nodes=trainer.num_nodes,
        strategy=type(trainer.strategy).__name__,
        precision=trainer.precision,
        accelerator=type(trainer.accelerator).__name__,
    )
    params = store.mask_secrets(params)
    for logger in loggers:
        if not isinstance(logger, MLFlowLogger):
            logger.log_hyperparams(params)
            continue
        log_params(logger, params)
        write_text_atomically(Path(cfg.paths.output_dir, RUN_ID_FILE), logger.run_id + "\n")
        show_run_page(logger, cfg.logger.tracking_uri)


@rank_zero_only
def show_run_page(logger: MLFlowLogger, tracking_uri: str) -> None:
    """The run's page in the MLflow UI, on its training side: MLflow 3.17's UI opens on GenAI
    whatever the experiment's kind says (mlflow/mlflow#24498). An offline run has no page yet."""
    if getattr(logger, "offline", False):
        return
    print(f"MLflow run: {store.run_page(tracking_uri, logger.experiment_id, logger.run_id)}")


@rank_zero_only
def log_params(logger: MLFlowLogger, params: Mapping[str, Any]) -> None:
    """In full: Lightning's log_hyperparams cuts values at 250 characters, silently. A continued
    run is RUNNING again, and as MLflow never changes a logged param, what differs from the
    first job (params, tags) goes into ``resume.<n>.`` tags."""
    from mlflow.entities import Param, RunTag

    client = logger.experiment
    run_id = logger.run_id
    tags = {}
    if getattr(logger, "continued", False):
        run = client.get_run(run_id)
        old = run.data.params
        count = int(run.data.tags.get("resume.count", "0")) + 1
        changed = [
            f"{k}: {old[k]} -> {v}" for k, v in params.items() if old.get(k, str(v)) != str(v)
        ]
        client.update_run(run_id, status="RUNNING")
        for key in run.data.metrics:  # now, while the server answers: see log_metrics
            steps = [m.step for m in client.get_metric_history(run_id, key)]
            logger.last_step[key] = max(steps, default=-1)
        tags = {
            f"resume.{count}.{key}": value
            for key, value in logger.tags.items()
            if run.data.tags.get(key) != value and not key.startswith("mlflow.")
        }
        tags["resume.count"] = str(count)
        # Its name says what it is now: the world it finishes on, its history in the description
        if (name := getattr(logger, "run_name", None)) and name != run.info.run_name:
            tags[RUN_NAME_TAG] = name
        tags[NOTE_TAG] = resume_note(run.data.tags, logger.tags, count)
        tags[f"resume.{count}.changed_params"] = "\n".join(changed)[:5000] or "(none)"
        params = {k: v for k, v in params.items() if k not in old}
    entries = []
    for key, value in params.items():
        text = str(value)
        if len(text) > PARAM_LIMIT:
            rank_zero_warn(f"param {key} is {len(text)} characters; logged cut to {PARAM_LIMIT}")
            text = text[: PARAM_LIMIT - 30] + " ...[cut: see config.yaml]"
        entries.append(Param(key, text))
    client.log_batch(run_id, params=entries, tags=[RunTag(k, v) for k, v in tags.items()])


def resume_note(before: Mapping[str, str], now: Mapping[str, str], count: int) -> str:
    """The run's description (the MLflow UI's, ``logger.notes`` at first) with a line for this
    resume: where it resumed and on how many ranks, e.g. "Resume 1: from step 50 on 1 rank (was
    2)"."""
    world = now.get("world_size", "?")
    # The last job's: a resume's own tag where it differed from the first job's.
    was = before.get(f"resume.{count - 1}.world_size", before.get("world_size", world))
    line = f"Resume {count}: from step {now.get(RESUMED_TAG, '?')} on {world} rank"
    line += ("s" if world != "1" else "") + (f" (was {was})" if was != world else "")
    note = before.get(NOTE_TAG, "")
    return f"{note}\n\n{line}" if note else line


@contextmanager
def sending(loggers: list[Logger], send_timeout_s: float) -> Iterator[None]:
    """Against a server, the run's records go through the outbox (SQLite is written directly);
    at the end, wait up to ``send_timeout_s`` (``logger.send_timeout_s``) for them, and close
    TensorBoard's file."""
    logger = mlflow_logger(loggers)
    outboxed = isinstance(logger, RunLogger) and not sqlite_file(logger.uri)
    if outboxed:
        logger.start_sending()
    try:
        yield
    finally:
        for tensorboard in loggers:
            if isinstance(tensorboard, OneFileTensorBoardLogger):
                tensorboard.close()
        if outboxed:
            logger.stop_sending(send_timeout_s)


def callbacks(loggers: list[Logger], logger_cfg: DictConfig, output_dir: Path) -> list[Callback]:
    """On rank 0, the run's bookkeeping; on every rank, system metrics (one sampler per node)."""
    logger = mlflow_logger(loggers)
    uri = logger_cfg.get("tracking_uri", "")
    found: list[Callback] = [RunBookkeeping(logger, uri)] if logger else []
    if logger_cfg.kind == "mlflow" and logger_cfg.system_metrics_s and not logger_cfg.offline:
        found.append(SystemMetrics(logger, logger_cfg, output_dir))
    return found
