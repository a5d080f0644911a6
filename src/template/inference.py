"""Loading a trained model and its data for eval and predict, from the checkpoint alone: the
model from its saved hyperparameters, the data from its saved data settings."""

import inspect
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from omegaconf import OmegaConf
from torchmetrics import Metric

from src.template.checkpoint import (
    CheckpointError,
    check_same_data,
    check_weights_fit,
    read_checkpoint,
)
from src.template.task import Task


def model_from_checkpoint(saved: Mapping[str, Any], name: str, task: Task) -> L.LightningModule:
    """The trained model, rebuilt from the checkpoint's hyperparameters. Keys added since take
    today's defaults (with a warning); keys this code does not know, or lacks without a default,
    are refused by name (``load_from_checkpoint`` would name tensors, not config keys)."""
    hparams = dict(saved.get("hyper_parameters", {}))
    unknown, missing, defaulted = [], [], []
    for section, (target, set_by_data) in task.config_targets(hparams).items():
        values = OmegaConf.select(OmegaConf.create({"model": hparams}), section) or {}
        prefix = section.removeprefix("model").lstrip(".")
        prefix += "." if prefix else ""
        defaults = {
            key: parameter.default
            for key, parameter in inspect.signature(target).parameters.items()
            if key not in ("self", *set_by_data)
        }
        unknown += [
            prefix + k for k in values if k not in defaults and k not in ("name", *set_by_data)
        ]
        absent = [key for key in defaults if key not in values]
        missing += [prefix + k for k in absent if defaults[k] is inspect.Parameter.empty]
        defaulted += [
            f"{prefix}{k}={defaults[k]}"
            for k in absent
            if defaults[k] is not inspect.Parameter.empty
        ]
    problems = [f"keys this code does not know: {', '.join(unknown)}"] if unknown else []
    problems += [f"keys it lacks: {', '.join(missing)}"] if missing else []
    if problems:
        raise CheckpointError(
            f"{name} was saved by a different version of the model: {'; '.join(problems)}. "
            "Load it with the code version that wrote it (its mlflow.source.git.commit tag)"
        )
    if defaulted:
        warnings.warn(
            f"{name} predates config keys {', '.join(defaulted)}: they take today's defaults",
            stacklevel=2,
        )
    model = task.model_class(**hparams)
    # The learned tensors only: metric states (torchmetrics) may be newer or older.
    metrics = tuple(
        f"{key}." for key, module in model.named_modules() if isinstance(module, Metric)
    )
    weights = {k: v for k, v in saved["state_dict"].items() if not k.startswith(metrics)}
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith(metrics)}
    check_weights_fit({**saved, "state_dict": weights}, expected, name, model.hparams)
    model.load_state_dict(weights, strict=False)
    return model


def load_for_inference(
    ckpt_path: str | None, data: Mapping[str, Any], typed: set[str], task: Task
) -> tuple[L.LightningModule, L.LightningDataModule, dict[str, str] | None]:
    """The checkpoint's model, a data module and the MLflow run the checkpoint came from (if
    tracked). The data settings are the checkpoint's, except the keys the command typed
    (``typed``: ``data.root=...``); typing one that changes what the data is is refused."""
    saved = read_checkpoint(ckpt_path)
    name = Path(ckpt_path).name
    values = dict(data)
    if trained := saved.get("datamodule_hyper_parameters"):  # none: an older checkpoint
        content = task.datamodule_class(trained["name"]).CONTENT_KEYS
        chosen = typed | ({"name"} if "" in typed else set())  # "": the command chose data=
        keys = [key for key in ("name", *content) if key in chosen]
        fix = "eval and predict use the checkpoint's data settings: leave these out"
        check_same_data(saved, data, keys, name, fix)
        # Keys newer than the checkpoint come from the command's config of the same dataset.
        base = values if data.get("name") == trained["name"] else {}
        values = {**base, **trained, **{key: data[key] for key in typed if key in data}}
    model = model_from_checkpoint(saved, name, task)
    datamodule = task.datamodule_class(values["name"])(**values)
    # Lightning saves the DataModule's state under its class name.
    datamodule.load_state_dict(saved.get(type(datamodule).__qualname__, {}))
    return model, datamodule, saved.get("mlflow")
