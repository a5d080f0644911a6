"""Where a training job starts: fresh, from a checkpoint of the same job (checked), or nowhere
(a finished job: its result is read back). Decided on every rank alike, before any run, rank
process or folder content exists, and said in one line where it is not what the command reads
as (docs/resuming.md)."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig

from lightning_exact.checkpoints import checkpoint
from lightning_exact.checkpoints.resume import LOGGED_SO_FAR
from lightning_exact.job import reporting
from lightning_exact.job.settings import JobSettings
from lightning_exact.sweeps import jobs as sweeps
from lightning_exact.tracking import run


@dataclass(frozen=True)
class Start:
    """What ``trainer.fit`` starts from, or the result of a job with nothing left to train."""

    ckpt_path: str | None = None  # the checkpoint fit resumes from (None: a fresh start)
    saved: dict[str, Any] | None = None  # its contents, read once
    # A finished job trained on (lengthened): its MLflow run ("" if unknown), never reopened.
    finished_run: str | None = None
    auto: bool = False  # ckpt_path=auto, asked for or implied by a job run again in its folder
    read_back: bool = False  # nothing left to train: ``result`` is the job's
    result: float | None = None
    logged: dict[str, float] = field(default_factory=dict)  # the record it resumes with


def where_to_start(cfg: DictConfig, settings: JobSettings, ran_before: bool) -> Start:
    """The start of the job ``cfg`` in its output folder (``ran_before``: a job.json there says
    it started once). A checkpoint of another job is refused in one line (CheckpointError)."""
    out = settings.output_dir
    requested = cfg.ckpt_path or ("auto" if ran_before else None)  # run again: it resumes
    ckpt_path = checkpoint.resume_path(requested, out)
    auto = requested == "auto"
    if not ckpt_path:
        if auto:
            say_auto_started_fresh(out)
        return Start(auto=auto)
    checkpoint.check_strategy(ckpt_path, cfg.strategy.name)
    saved = checkpoint.read_checkpoint(ckpt_path, weights=False)  # its weights: fit loads them
    checkpoint.check_same_job(saved, cfg, ckpt_path)
    finished_run = finished_job_run(saved, cfg.logger, settings, ckpt_path)
    folder = Path(ckpt_path).parent.parent
    limit = checkpoint.limit_reached(saved, cfg.trainer)
    if finished_run is not None and limit:
        say(
            f"{folder}: this job finished; its result is read back (metrics.json). "
            f"To train it longer, raise {limit}"
        )
        reporting.remove_attempt_record()  # a folder Hydra made for nothing
        result = sweeps.finished_result(folder, cfg.optimized_metric)
        return Start(read_back=True, result=result)
    logged = saved.get(LOGGED_SO_FAR, {})  # as the checkpoint was written
    if limit:  # stopped in its test, its fit ended: what all of that fit logged
        logged = sweeps.fitted_record(folder, saved["global_step"]) or logged
    say_world_change(saved, cfg, settings)  # not for a job read back: it trains nothing
    return Start(ckpt_path, saved, finished_run, auto, logged=logged)


def finished_job_run(
    saved: dict, logger_cfg: DictConfig, settings: JobSettings, ckpt_path: str
) -> str | None:
    """If the checkpoint's job finished: its run's id ("" if unknown); else None (the job goes on
    in its own run). Its folder's job.json says (the result is written last); a folder without
    one (a checkpoint moved, or older than job.json) asks whether its MLflow run FINISHED."""
    folder = Path(ckpt_path).parent.parent
    if (folder / sweeps.JOB_FILE).is_file():
        if not sweeps.job_finished(folder):
            return None  # Lightning ends the run FINISHED after fit, before testing: not done
        return (saved.get("mlflow") or {}).get("run_id", "")
    return run.finished_run(saved, logger_cfg, settings)


@rank_zero_only
def say(line: str) -> None:
    """One line on stdout, from rank 0 only (rank processes run the entry point again)."""
    print(line)


ELASTIC_DOC = "docs/resuming.md#on-another-number-of-ranks"


def ranks(world_size: int, num_nodes: int) -> str:
    """``2 ranks``, ``1 rank``, ``8 ranks (2 nodes)``."""
    nodes = f" ({num_nodes} nodes)" if num_nodes > 1 else ""
    return f"{world_size} rank{'s' if world_size > 1 else ''}{nodes}"


def say_world_change(saved: dict, cfg: DictConfig, settings: JobSettings) -> None:
    """A resume on another number of ranks or nodes (spot capacity) says so in one line: each
    rank's share of the same global batches changes, the result does not (``strategy.exact``);
    with ``strategy.exact=false`` it does. (A world size that does not divide the global batch
    is refused earlier: ``check_settings``.)"""
    world = ((saved.get("job") or {}).get("world")) or {}
    before = (world.get("world_size"), world.get("num_nodes"))
    now = (settings.world_size, settings.num_nodes)
    if None in before or before == now:
        return  # the same world, or a checkpoint older than this record
    batch = cfg.data.batch_size
    old = ranks(*before)
    new = ranks(*now)
    split = f"data.batch_size={batch}: {batch // now[0]} a rank, was {batch // before[0]}"
    if cfg.strategy.exact:
        outcome = f"the same global batches ({split}), so the same result as on {old}"
    else:
        outcome = (
            f"strategy.exact=false: BatchNorm statistics and dropout masks per rank ({split}), "
            f"so not the result it would have had on {old}"
        )
    say(f"Resuming a job of {old} on {new}: {outcome} ({ELASTIC_DOC})")


@rank_zero_only
def say_auto_started_fresh(out: Path) -> None:
    """``ckpt_path=auto`` in a folder Hydra just made finds nothing: say so, and how to continue
    this job next time (the same folder)."""
    if sweeps.sweep_job() is None and not any(
        override.startswith("hydra.run.dir=") for override in HydraConfig.get().overrides.hydra
    ):
        last = out / "checkpoints" / "last.ckpt"
        print(
            f"ckpt_path=auto: {out} is a new folder, with no last.ckpt: this job starts fresh. "
            f"To continue it after a stop, add hydra.run.dir={out} ckpt_path=auto "
            f"(or ckpt_path={last})"
        )
