"""The one contract between a task (``src/task/``, yours; its ``TASK``) and the machinery
(``lib/lightning_exact/``), as torchtitan's ``TrainSpec``: the machinery knows ranks, steps,
checkpoints and runs; what is learned, from what data, and how it is judged, comes through here."""

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from torch import Tensor, nn

# section -> (what its values are passed to, the keys set from the data instead of config)
ConfigTargets = dict[str, tuple[Callable, tuple[str, ...]]]
Columns = tuple[dict[str, Sequence], dict[str, float]]  # a CSV's columns, metrics


@dataclass(frozen=True)
class ModelExport:
    """The served MLflow model: ``module`` (raw inputs such as ``example`` to outputs), exported
    with ``torch.export``, loaded by ``code``, an MLflow "models from code" file that needs only
    torch, numpy, pandas and mlflow (its artifacts: ``program.pt2``, ``metadata.json``)."""

    module: nn.Module
    example: Tensor
    code: Path
    signature: Any  # mlflow.models.ModelSignature
    input_example: Any  # what the MLflow UI shows and REST users copy (e.g. a numpy array)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    model_type: str = ""


# A keyword of Task renamed since: its old name -> its name now.
RENAMED_FIELDS = {"predict_files": "predict_inputs"}


def refusing_renamed_fields(cls: type) -> type:
    """``cls`` whose constructor answers a renamed keyword with one line naming the new one,
    instead of the dataclass's "unexpected keyword argument"."""
    init = cls.__init__

    @functools.wraps(init)
    def checked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        for old in sorted(kwargs.keys() & RENAMED_FIELDS.keys()):
            new = RENAMED_FIELDS[old]
            raise TypeError(f"Task({old}=...) is now Task({new}=...): rename it in src/task/")
        init(self, *args, **kwargs)

    cls.__init__ = checked_init
    return cls


def best_of(monitor: str | None) -> str | None:
    """The name of the best value of ``monitor`` so far, the best checkpoint's score."""
    return f"{monitor}_best" if monitor else None


@refusing_renamed_fields
@dataclass(frozen=True)
class Task:
    """How to build and judge what a job learns. Every callable gets plain config values."""

    # data.name -> class, built as ``cls(**cfg.data)`` (the contract of lib/lightning_exact/data.py)
    datamodules: Mapping[str, type[L.LightningDataModule]]
    # The class checkpoints are loaded with; how to build it from ``model`` and the loaded data
    model_class: type[L.LightningModule]
    build_model: Callable[[dict[str, Any], L.LightningDataModule], L.LightningModule]
    # What each ``model`` config section is passed to, so typed keys are checked by name.
    config_targets: Callable[[Mapping[str, Any]], ConfigTargets]
    # The validation metric that picks the best checkpoint (tested, logged, registered); the
    # machinery logs its best so far as ``<monitor>_best``. None: a task without one (a GAN's
    # losses say little of its images) keeps the last checkpoint.
    monitor: str | None
    mode: str  # "max" if higher is better, else "min" (of ``monitor`` and ``optimized_metric``)
    # What a job returns to Hydra's sweepers (conf/train.yaml's ``optimized_metric`` follows it
    # unless set there); None: ``<monitor>_best``, the score of the best checkpoint (a task
    # without ``monitor`` and without this cannot be swept). Optuna's direction and src.register
    # follow ``mode``.
    optimized_metric: str | None = None
    errors: tuple[type[Exception], ...] = ()  # bad input: shown as one line, no traceback
    # strategy=fsdp: what the model's configure_model shards as units (with
    # lib/lightning_exact/training/distributed.py's shard): module types, each submodule of one a
    # unit, and tuples of submodule names sharded together (modules that tie weights, e.g.
    # ("embedding", "lm_head")). A model with parameters outside them, or weights tied between two
    # units, is refused before any run or rank exists.
    sharded_blocks: tuple[type[nn.Module] | tuple[str, ...], ...] = ()
    # The served model (None: jobs log no MLflow model).
    export: Callable[[L.LightningModule, L.LightningDataModule], ModelExport] | None = None
    # Figures of the test split, written by rank 0 after testing; their paths.
    figures: Callable[[L.LightningModule, L.LightningDataModule, Path], list[Path]] | None = None
    # All ranks' ``predict_step`` outputs (dicts of 1-D tensors with a stable sample ``index``),
    # merged and sorted by it, to the CSV's columns and the ``predict/*`` metrics.
    predictions: Callable[[Mapping[str, Tensor], L.LightningDataModule], Columns] | None = None
    # ``src.predict inputs=...``: new inputs (whatever the user typed: paths, a glob, a string)
    # predicted with a checkpoint alone, as (ckpt_path, the inputs= value, the CSV to write,
    # this Task) -> the CSV written; None: the task predicts its data splits only.
    predict_inputs: Callable[[str, str, Path, "Task"], Path] | None = None

    def config_values(self) -> dict[str, str | None]:
        """What conf/ reads as ``${task:KEY}``: the metric is named once, by the task."""
        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "optimized_metric": self.optimized_metric or best_of(self.monitor),
            "direction": "maximize" if self.mode == "max" else "minimize",  # Optuna's words
        }

    def datamodule_class(self, name: str) -> type[L.LightningDataModule]:
        from lightning_exact.data import DataError

        if name not in self.datamodules:
            raise DataError(f"data.name={name} is unknown; known: {', '.join(self.datamodules)}")
        return self.datamodules[name]
