"""What a job shows and leaves behind for people and scripts: the resolved config at start,
the results table and ``metrics.json`` at the end. Rank 0 only."""

import csv
import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
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
from rich.syntax import Syntax
from rich.table import Table
from rich.tree import Tree

from src.template.data import ImageBatches
from src.template.distributed import in_multirun

console = Console()
errors = Console(stderr=True)


@contextmanager
def short_errors(*expected: type[Exception]) -> Iterator[None]:
    """Show expected errors (bad data, a wrong checkpoint path) as their one-line message and
    exit 1, instead of a traceback through Lightning and Hydra; anything else still raises.

    A single run that fails this way leaves no output folder behind that holds only Hydra's
    record of the attempt (see :func:`remove_attempt_record`).
    """
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


_created_by_this_job: Path | None = None  # the top-most output folder this run created


class CheckOutputFolder(HydraCallback):
    """Hydra creates the job's output folder before the job starts, and where it cannot, ends in
    a traceback. This says so in one line, with the fix, before anything is written; and it
    notes which folders the run is about to create, for :func:`remove_attempt_record`."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _created_by_this_job
        folder = Path(config.hydra.run.dir).absolute()
        check_writable(folder)
        _created_by_this_job = None
        while not folder.exists():
            _created_by_this_job, folder = folder, folder.parent

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_writable(Path(config.hydra.sweep.dir))


def remove_attempt_record() -> None:
    """Delete the folders this run created if all they hold is Hydra's record of the attempt
    (``.hydra/``, the job's log) and ``config.yaml``: a job refused before any work leaves
    nothing behind. A folder that existed before the run, or holds anything else, is kept."""
    created = _created_by_this_job
    if created is None or rank_zero_only.rank != 0 or not HydraConfig.initialized():
        return
    hydra = HydraConfig.get()
    out = Path(hydra.runtime.output_dir)
    record = {out / "config.yaml", out / f"{hydra.job.name}.log"}
    files = [path for path in created.rglob("*") if not path.is_dir()]
    if out.is_relative_to(created) and all(
        path in record or path.is_relative_to(out / ".hydra") for path in files
    ):
        shutil.rmtree(created, ignore_errors=True)


def check_writable(folder: Path) -> None:
    existing = folder.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        problem = f"{existing} is a file"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing} is not writable"
    else:
        return
    show_error(
        f"output folder {folder} cannot be created: {problem}. Set paths.log_dir=... "
        "(or hydra.run.dir=...) to a folder you can write to"
    )
    raise SystemExit(1)


@rank_zero_only
def show_config(cfg: DictConfig) -> None:
    """Print the resolved config as a tree (one branch per group) and save it as YAML."""
    tree = Tree("config", guide_style="dim")
    for key, value in cfg.items():
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else value
        # Wrapped, not cut at the console's width: paths are read and copied from here.
        syntax = Syntax(str(text).rstrip(), "yaml", theme="ansi_dark", word_wrap=True)
        tree.add(f"[bold]{key}[/]").add(syntax)
    console.print(tree)
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


@rank_zero_only
def report_metrics(metrics: Mapping[str, float], output_dir: str | Path) -> None:
    """Print a results table and write ``metrics.json``: a flat object of final metric values."""
    table = Table("metric", "value", title="Results")
    for name, value in sorted(metrics.items()):
        table.add_row(name, f"{value:.6g}")
    console.print(table)
    path = Path(output_dir) / "metrics.json"
    path.write_text(json.dumps(dict(sorted(metrics.items())), indent=2) + "\n")
    console.print(f"metrics written to {path}", soft_wrap=True)


class PredictionWriter(BasePredictionWriter):
    """Writes all ranks' predictions as one CSV in dataset order.

    Each rank saves its share beside the CSV; after a barrier rank 0 merges them. Under
    multi-node runs the output folder must be on a filesystem every node can reach.
    """

    def __init__(self, path: Path) -> None:
        super().__init__(write_interval="epoch")
        self.path = path
        self.metrics: dict[str, float] = {}

    def _shard(self, rank: int) -> Path:
        return self.path.with_name(f".{self.path.stem}.rank{rank}.pt")

    def write_on_epoch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        predictions: Sequence[Mapping[str, torch.Tensor]],
        batch_indices: Sequence[Any],
    ) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        columns = {key: torch.cat([p[key] for p in predictions]).cpu() for key in COLUMNS}
        torch.save(columns, self._shard(trainer.global_rank))
        trainer.strategy.barrier("predictions_written")
        if trainer.is_global_zero:
            shards = [self._shard(rank) for rank in range(trainer.world_size)]
            parts = [torch.load(shard, weights_only=True) for shard in shards]
            merged = {key: torch.cat([part[key] for part in parts]) for key in COLUMNS}
            self.metrics = write_predictions(merged, self.path)
            for shard in shards:
                shard.unlink()


COLUMNS = ("index", "label", "predicted", "confidence")


def write_predictions(columns: Mapping[str, torch.Tensor], path: Path) -> dict[str, float]:
    """Write prediction columns as a CSV sorted by sample index; return count and accuracy."""
    order = columns["index"].argsort()
    index, label, predicted, confidence = (columns[key][order] for key in COLUMNS)
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(COLUMNS)
        confidences = (f"{c:.6f}" for c in confidence.tolist())
        rows = zip(index.tolist(), label.tolist(), predicted.tolist(), confidences, strict=True)
        writer.writerows(rows)
    console.print(f"predictions written to {path}", soft_wrap=True)
    return {
        "predict/samples": float(len(index)),
        "predict/acc": (predicted == label).double().mean().item(),
    }


@rank_zero_only
def save_test_figures(
    model: L.LightningModule, dataset: ImageBatches, classes: Sequence[str], out_dir: Path
) -> list[Path]:
    """A confusion matrix and a grid of misclassified images for the test split, as PNGs.

    Rank 0 runs the (best) model over the test split once more, outside the DDP wrapper:
    seconds on a CPU, and it keeps figure-making out of the training loop.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    was_training = model.training
    model.eval()
    outputs = []
    with torch.no_grad():
        for start in range(0, len(dataset), 1000):
            batch = dataset.__getitems__(list(range(start, min(start + 1000, len(dataset)))))
            batch = type(batch)(*(tensor.to(model.device) for tensor in batch))
            outputs.append(model.predict_step(batch, start // 1000))
    model.train(was_training)
    predicted, confidence = (torch.cat([o[key] for o in outputs]).cpu() for key in COLUMNS[2:])
    labels = dataset.labels
    n = len(classes)
    matrix = torch.bincount(labels * n + predicted, minlength=n * n).reshape(n, n)
    out_dir.mkdir(parents=True, exist_ok=True)

    fig, ax = plt.subplots(figsize=(7, 6))
    ax.imshow(matrix, cmap="Blues")
    for (row, col), count in zip(
        torch.cartesian_prod(torch.arange(n), torch.arange(n)).tolist(),
        matrix.flatten().tolist(),
        strict=True,
    ):
        color = "white" if count > matrix.max() / 2 else "black"
        ax.text(col, row, str(count), ha="center", va="center", fontsize=7, color=color)
    ax.set(
        xticks=range(n),
        yticks=range(n),
        xlabel="predicted",
        ylabel="true",
        title=f"Test confusion matrix ({len(labels)} samples)",
    )
    ax.set_xticklabels(classes, rotation=45, ha="right", fontsize=8)
    ax.set_yticklabels(classes, fontsize=8)
    fig.tight_layout()
    matrix_path = out_dir / "confusion_matrix_test.png"
    fig.savefig(matrix_path, dpi=110)
    plt.close(fig)

    wrong = (predicted != labels).nonzero().flatten()[:32].tolist()
    fig, axes = plt.subplots(4, 8, figsize=(12, 7))
    for ax, i in zip(axes.flatten(), wrong + [None] * (32 - len(wrong)), strict=True):
        ax.axis("off")
        if i is not None:
            image = dataset.images[i]  # uint8 [C, H, W] as read: no normalisation to undo
            if image.shape[0] == 1:
                ax.imshow(image[0], cmap="gray", vmin=0, vmax=255)
            else:
                ax.imshow(image.permute(1, 2, 0).numpy())
            ax.set_title(
                f"true {classes[labels[i]]}\npred {classes[predicted[i]]} {confidence[i]:.2f}",
                fontsize=7,
            )
    fig.suptitle(
        f"First {len(wrong)} misclassified test images of {int((predicted != labels).sum())}"
    )
    fig.tight_layout()
    grid_path = out_dir / "misclassified_test.png"
    fig.savefig(grid_path, dpi=110)
    plt.close(fig)
    return [matrix_path, grid_path]
