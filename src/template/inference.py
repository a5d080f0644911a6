"""Loading a trained model and its data for eval and predict, from the checkpoint alone.

Checkpoints hold plain values only, so they load with ``weights_only=True``; the model is rebuilt
from its saved hyperparameters and the data from the checkpoint's data settings.
"""

import inspect
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from omegaconf import OmegaConf
from torchmetrics import Metric

from src.template.checkpoint import (
    CheckpointError,
    check_dataset,
    check_weights_fit,
    data_differences,
    read_checkpoint,
)
from src.template.task import Task


def model_from_checkpoint(saved: Mapping[str, Any], name: str, task: Task) -> L.LightningModule:
    """Rebuild the trained model from a checkpoint's own hyperparameters.

    A checkpoint from an older config may lack keys added since: they take today's defaults
    (with a warning naming them). Keys this code no longer knows, or a missing key that has no
    default, are refused by name (``task.config_targets`` says what to compare against).
    Not ``load_from_checkpoint``: its errors name tensors, not the config keys behind them.
    """
    hparams = dict(saved.get("hyper_parameters", {}))
    unknown, missing, defaulted = [], [], []
    for section, (target, set_by) in task.config_targets(hparams).items():
        values = OmegaConf.select(OmegaConf.create({"model": hparams}), section) or {}
        prefix = section.removeprefix("model").lstrip(".")
        found = compare_keys(values, target, f"{prefix}." if prefix else "", set_by)
        unknown, missing, defaulted = unknown + found[0], missing + found[1], defaulted + found[2]
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


def compare_keys(
    values: Mapping[str, Any], target: Callable, prefix: str, set_by_data: tuple[str, ...]
) -> tuple[list[str], list[str], list[str]]:
    """(unknown, missing without default, missing with default) keys of ``target``'s init;
    ``name`` (which network) and keys set from the data are not config keys of ``target``."""
    parameters = dict(inspect.signature(target).parameters)
    parameters.pop("self", None)
    for key in set_by_data:
        parameters.pop(key, None)
    unknown = [prefix + key for key in values if key not in parameters and key != "name"]
    unknown = [key for key in unknown if key.removeprefix(prefix) not in set_by_data]
    absent = [key for key in parameters if key not in values]
    missing = [prefix + key for key in absent if parameters[key].default is inspect.Parameter.empty]
    defaulted = [
        f"{prefix}{key}={parameters[key].default}"
        for key in absent
        if parameters[key].default is not inspect.Parameter.empty
    ]
    return unknown, missing, defaulted


def data_for_inference(
    saved: Mapping[str, Any],
    data: Mapping[str, Any],
    typed: set[str],
    task: Task,
    name: str,
) -> dict[str, Any]:
    """The data settings eval and predict use: the checkpoint's (what the data is and where it
    was), except the keys the command typed (``data.root=...``, ``data.batch_size=...``). A
    typed key that changes what the data is (``CONTENT_KEYS``: image size, channels, the
    validation split, ...) is refused: the model was trained on the checkpoint's."""
    trained = saved.get("datamodule_hyper_parameters")
    if not trained:  # written before checkpoints held their data settings
        return dict(data)
    if typed & {"", "name"}:  # the command chose a dataset: it must be the checkpoint's
        check_dataset(saved, data["name"], name)
    typed_content = [k for k in task.datamodule_class(trained["name"]).CONTENT_KEYS if k in typed]
    differing = data_differences(trained, data, typed_content)
    if differing:
        raise CheckpointError(
            f"{name} was trained with {', '.join(differing)}; eval and predict use the "
            "checkpoint's data settings: leave these out"
        )
    # Keys newer than the checkpoint come from the command's config of the same dataset.
    base = dict(data) if data.get("name") == trained["name"] else {}
    return {**base, **trained, **{key: data[key] for key in typed if key in data}}


def load_for_inference(
    ckpt_path: str | None,
    data: Mapping[str, Any],
    typed: set[str],
    task: Task,
) -> tuple[L.LightningModule, L.LightningDataModule, dict[str, str] | None]:
    """The checkpoint's model, a data module with the checkpoint's data settings (see
    :func:`data_for_inference`; ``typed``: the ``data`` keys the command set) and the MLflow
    run the checkpoint came from, if it was tracked.

    Checkpoints hold plain values only, so they load with ``weights_only=True``.
    """
    saved = read_checkpoint(ckpt_path)
    name = Path(ckpt_path).name
    values = data_for_inference(saved, data, typed, task, name)
    model = model_from_checkpoint(saved, name, task)
    datamodule = task.datamodule_class(values["name"])(**values)
    # Lightning saves the DataModule's state under its class name.
    datamodule.load_state_dict(saved.get(type(datamodule).__qualname__, {}))
    return model, datamodule, saved.get("mlflow")
