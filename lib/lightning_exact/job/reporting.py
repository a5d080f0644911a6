"""What a job shows and leaves behind for people and scripts: one-line errors, the resolved
config at start, the results table and ``metrics.json`` at the end, a quiet console."""

import csv
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback as HydraCallback
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from lightning_exact.sweeps.jobs import JOB_FILE, in_multirun, sweep_overrides
from lightning_exact.task import Task

console = Console()
errors = Console(stderr=True)


@contextmanager
def short_errors(*expected: type[Exception]) -> Iterator[None]:
    """Expected errors (bad data, a wrong ckpt_path) as their one-line message and exit 1, not a
    traceback; a single run leaves no folder holding only Hydra's record of the attempt."""
    try:
        yield
    except expected as error:
        show_error(str(error))
        if in_multirun():
            raise  # Hydra records the failed job, runs the others, and reports it at the end
        remove_attempt_record()
        raise SystemExit(1) from error


def show_error(message: str) -> None:
    """``Error: <message>`` on stderr, one line however long (no wrapping, no highlighting)."""
    errors.print(f"[bold red]Error:[/] {message}", highlight=False, soft_wrap=True)


def show_warning(message: str) -> None:
    """``Warning: <message>`` on stderr, one line: something a user should know, not an end."""
    errors.print(f"[bold yellow]Warning:[/] {message}", highlight=False, soft_wrap=True)


_created_by_this_job: Path | None = None  # the top-most output folder this run created
_created_for_sweep: Path | None = None  # the top-most folder this sweep's folder added


class CheckOutputFolder(HydraCallback):
    """One line with the fix where Hydra would end in a traceback creating the output folder."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _created_by_this_job
        _created_by_this_job = check_writable(Path(config.hydra.run.dir).absolute())

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep folder is run again only by its own sweep's command, so each job folder
        holds that job's earlier run (an exception here, Hydra would turn into a warning)."""
        global _created_for_sweep
        folder = Path(config.hydra.sweep.dir)
        _created_for_sweep = check_writable(folder)
        earlier = sweep_overrides(folder) if (folder / "multirun.yaml").is_file() else None
        if earlier is not None and earlier != list(config.hydra.overrides.task):
            show_error(
                f"{folder} holds another sweep ({' '.join(earlier) or 'no overrides'}); run this "
                "one in a new folder (leave out hydra.sweep.dir) or that sweep's command again"
            )
            raise SystemExit(1)


def check_writable(folder: Path) -> Path | None:
    """Exit with one line if ``folder`` cannot be created; else the top-most folder it adds."""
    created = None
    existing = folder.absolute()
    while not existing.exists():
        created = existing
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        problem = "is not writable" if existing.is_dir() else "is a file"
        show_error(
            f"output folder {folder} cannot be created: {existing} {problem}. Set "
            "paths.log_dir=... (or hydra.run.dir=...) to a folder you can write to"
        )
        raise SystemExit(1)
    return created


def remove_attempt_record() -> None:
    """Delete the folders this run created if all they hold is Hydra's record of the attempt
    (``.hydra/``, the job's log), ``config.yaml`` and ``job.json`` (the job started, with no
    result): a refused job leaves nothing behind."""
    created = _created_by_this_job
    if created is None or rank_zero_only.rank != 0 or not HydraConfig.initialized():
        return
    hydra = HydraConfig.get()
    out = Path(hydra.runtime.output_dir)
    record = {out / "config.yaml", out / f"{hydra.job.name}.log", out / JOB_FILE}
    files = [path for path in created.rglob("*") if not path.is_dir()]
    if out.is_relative_to(created) and all(
        path in record or path.is_relative_to(out / ".hydra") for path in files
    ):
        shutil.rmtree(created, ignore_errors=True)


def remove_refused_sweep() -> None:
    """Hydra writes a sweep's folder and ``multirun.yaml`` before it checks that every job's
    overrides compose (``model.nokey=1,2``): a sweep refused so leaves no folder either."""
    created = _created_for_sweep
    if created is None or not created.is_dir():
        return
    if all(path.name == "multirun.yaml" for path in created.rglob("*") if not path.is_dir()):
        shutil.rmtree(created, ignore_errors=True)


@rank_zero_only
def show_config(cfg: DictConfig) -> None:
    """Save the resolved config in the output folder and say where, in one line."""
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    console.print(f"{cfg.task_name}: config and outputs in {out}", soft_wrap=True, highlight=False)


# Log records that tell a user of this template nothing: Lightning's hardware summary, tips and
# checkpoint-restoring chatter (and the loader a schedule's estimated_stepping_batches builds);
# urllib3's retries of an MLflow request (the job says itself, in
# one line, that a server is unreachable or what an outage left unsent).
QUIET_LOGS = ("lightning.pytorch.utilities.rank_zero", "urllib3.connectionpool")
QUIET_INFO = (
    "GPU available",
    "TPU available",
    "HPU available",
    "💡 Tip",
    "`Trainer(limit_",
    "Trainer already configured with model summary",
    "Restoring states from the checkpoint",
    "Loaded model weights from the checkpoint",
    "Loading `train_dataloader` to estimate number of stepping batches",
    "\nDetected KeyboardInterrupt, attempting graceful shutdown",  # the job says what stopped it
    "Retrying (",
)
QUIET_WARNINGS = (
    # SLURM is installed here but this job is not one of its tasks: that is a choice.
    (r"The `srun` command is available on your system but is not used", UserWarning),
    # Lightning 2.6's own use of a torch API torch deprecated: nothing a user can change.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    # The step axis's keys are the same on every rank (steps.py): nothing to sync.
    (r"It is recommended to use `self.log\('(step|epoch)', \.\.\., sync_dist=True\)`", Warning),
)


@dataclass(frozen=True)
class DropNotices:
    """A logging filter: drops records whose message starts with one of ``prefixes`` (equal
    filters are equal, so adding one twice to a logger adds it once)."""

    prefixes: tuple[str, ...]

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_library_notices() -> None:
    """Silence the notices above by message; every other warning and message still shows."""
    for message, category in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message, category)
    for name in QUIET_LOGS:
        logging.getLogger(name).addFilter(DropNotices(QUIET_INFO))


@rank_zero_only
def figures(task: Task, model: L.LightningModule, datamodule: Any, out_dir: Path) -> list[Path]:
    """The task's figures of the test split (rank 0, after testing); their paths."""
    return task.figures(model, datamodule, out_dir) if task.figures else []


@rank_zero_only
def report_metrics(
    metrics: Mapping[str, float], output_dir: str | Path, best_checkpoint: str | None = None
) -> None:
    """Print a results table and write ``metrics.json``: a flat object of final metric values;
    after training, say which checkpoint they test (what eval, predict and serving start from)."""
    table = Table("metric", "value", title="Results")
    for name, value in sorted(metrics.items()):
        table.add_row(name, f"{value:.6g}")
    console.print(table)
    path = Path(output_dir) / "metrics.json"
    path.write_text(json.dumps(dict(sorted(metrics.items())), indent=2) + "\n")
    console.print(f"metrics written to {path}", soft_wrap=True)
    if best_checkpoint:
        console.print(f"best checkpoint: {best_checkpoint}", soft_wrap=True)


@rank_zero_only
def show_written(what: str, path: Path) -> None:
    """``predictions written to PATH``, once the progress bar has ended its line (printed from
    inside the loop, it landed on the bar's last line)."""
    console.print(f"{what} written to {path}", soft_wrap=True)


class PredictionWriter(BasePredictionWriter):
    """All ranks' ``predict_step`` outputs (dicts of 1-D tensors with an ``index``) as one CSV in
    dataset order; the task's ``columns`` turn them into the CSV's columns and metrics."""

    def __init__(self, path: Path, columns: Callable | None, datamodule: Any) -> None:
        super().__init__(write_interval="epoch")
        self.path = path
        self.columns = columns
        self.datamodule = datamodule
        self.metrics: dict[str, float] = {}

    def write_on_epoch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        predictions: Sequence[Mapping[str, torch.Tensor]],
        batch_indices: Sequence[Any],
    ) -> None:
        mine = {key: torch.cat([p[key] for p in predictions]).cpu() for key in predictions[0]}
        parts = [mine] * trainer.world_size  # all_gather_object fills it in
        if trainer.world_size > 1:
            torch.distributed.all_gather_object(parts, mine)
        if not trainer.is_global_zero:
            return
        order = torch.cat([part["index"] for part in parts]).argsort()
        merged = {key: torch.cat([part[key] for part in parts])[order] for key in mine}
        table, self.metrics = (
            self.columns(merged, self.datamodule)
            if self.columns
            else ({key: value.tolist() for key, value in merged.items()}, {})
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="") as file:
            writer = csv.writer(file)
            writer.writerow(table)
            writer.writerows(zip(*table.values(), strict=True))
