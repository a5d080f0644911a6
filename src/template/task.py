"""The one contract between a task (``src/task/``, yours) and the machinery (``src/template/``).

``src/task/__init__.py`` exports a :class:`Task` as ``TASK`` and the entry points hand it to the
machinery, as torchtitan's ``TrainSpec`` does. The machinery knows ranks, steps, checkpoints,
runs and artifacts; what is learned, from what data, and how it is judged, comes through here.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from torch import Tensor, nn

# section -> (what its values are passed to, the keys set from the data instead of config)
ConfigTargets = dict[str, tuple[Callable, tuple[str, ...]]]


@dataclass(frozen=True)
class ModelExport:
    """What the served MLflow model is: ``module`` maps a batch of raw inputs (``example``, as
    people send them) to its outputs, and is exported with ``torch.export`` (no pickled code);
    ``code`` is the MLflow "models from code" file that loads it (``program.pt2`` and
    ``metadata.json`` are its artifacts) and needs only torch, numpy, pandas and mlflow."""

    module: nn.Module
    example: Tensor
    code: Path
    signature: Any  # mlflow.models.ModelSignature
    input_example: Any  # what the MLflow UI shows and REST users copy (e.g. a numpy array)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    model_type: str = ""


@dataclass(frozen=True)
class Task:
    """How to build and judge what a job learns. Every callable gets plain config values."""

    # data.name -> LightningDataModule class, built as ``cls(**cfg.data)``; each follows the
    # data contract of :mod:`src.template.data`.
    datamodules: Mapping[str, type[L.LightningDataModule]]
    # The LightningModule class (checkpoints are loaded with it) and how to build it from the
    # ``model`` config section and the loaded data module.
    model_class: type[L.LightningModule]
    build_model: Callable[[dict[str, Any], L.LightningDataModule], L.LightningModule]
    # What each ``model`` config section is passed to, so typed keys are checked by name.
    config_targets: Callable[[Mapping[str, Any]], ConfigTargets]
    # The validation metric that picks the best checkpoint, and whether higher is better.
    monitor: str
    mode: str
    # Errors that mean bad input: shown as one line, no traceback.
    errors: tuple[type[Exception], ...] = ()
    # The served model (None: jobs log no MLflow model).
    export: Callable[[L.LightningModule, L.LightningDataModule], ModelExport] | None = None
    # Figures of the test split, written by rank 0 after testing; their paths.
    figures: Callable[[L.LightningModule, L.LightningDataModule, Path], list[Path]] | None = None
    # ``predict_step`` returns a dict of 1-D tensors with an ``index`` (stable sample index);
    # this turns all ranks' merged columns, sorted by index, into the CSV's columns and the
    # ``predict/*`` metrics.
    predictions: (
        Callable[
            [Mapping[str, Tensor], L.LightningDataModule],
            tuple[dict[str, Sequence], dict[str, float]],
        ]
        | None
    ) = None

    def datamodule_class(self, name: str) -> type[L.LightningDataModule]:
        from src.template.data import DataError

        if name not in self.datamodules:
            raise DataError(f"data.name={name} is unknown; known: {', '.join(self.datamodules)}")
        return self.datamodules[name]
