"""A trained network as an MLflow model people can load and serve without this project.

:func:`save_model` exports the network with its normalisation (``torch.export``: a program,
no pickled code) and saves it with :mod:`src.template.mlflow_model` as an MLflow pyfunc model
in the job's output folder. :func:`log_model` makes that folder a LoggedModel of the job's run
(MLflow links the run's metrics of the model's step to it: the test metrics) and registers it.
"""

import copy
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

from src.template.data import ImageDataModule
from src.template.system_metrics import PREFIX as SYSTEM_PREFIX

MODEL_FOLDER = "model"  # in the output folder: the saved MLflow model
MODEL_NAME = "model"  # its name in the run
CODE = Path(__file__).with_name("mlflow_model.py")
KEY_TAG = "template.model_key"  # on a LoggedModel: which job's model it is (see log_model)
EXAMPLES = 2  # images in the input example


class RawImageClassifier(nn.Module):
    """uint8 images ``[N, C, H, W]`` -> (class probabilities ``[N, K]``, predicted class ``[N]``),
    normalised exactly as the data module does for training."""

    def __init__(self, net: nn.Module, mean: Any, std: Any) -> None:
        super().__init__()
        self.net = net
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = images.float().div(255).sub(self.mean).div(self.std)
        probabilities = self.net(pixels).softmax(dim=1)
        return probabilities, probabilities.argmax(dim=1)


def requirements() -> list[str]:
    """What the model needs to load (given, not inferred: inference imports it in a subprocess)."""
    import mlflow

    return [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}", "pandas"]


def signature(image_shape: tuple[int, ...]) -> Any:
    """uint8 images of ``image_shape`` in; predicted class, its name, all probabilities out."""
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema, TensorSpec
    from mlflow.types.schema import Array

    outputs = [
        ColSpec("long", "predicted"),
        ColSpec("string", "class_name"),
        ColSpec(Array("float"), "probabilities"),
    ]
    return ModelSignature(
        Schema([TensorSpec(np.dtype(np.uint8), (-1, *image_shape))]), Schema(outputs)
    )


@contextmanager
def quietly() -> Iterator[None]:
    """Without MLflow's progress bars and INFO lines in the job's output."""
    mlflow_log = logging.getLogger("mlflow")
    level = mlflow_log.level
    with mock.patch.dict(os.environ, {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}):
        mlflow_log.setLevel(logging.WARNING)
        try:
            yield
        finally:
            mlflow_log.setLevel(level)


def save_model(net: nn.Module, data: ImageDataModule, folder: Path) -> Path:
    """Export ``net`` (a copy, on the CPU) and save it as an MLflow model in ``folder``, whole or
    not at all. The input example is the first test images, as people have them."""
    import mlflow

    wrapper = RawImageClassifier(copy.deepcopy(net).cpu().float().eval(), data.mean, data.std)
    images = data.test_set.images[:EXAMPLES].cpu()
    batch = torch.export.Dim("batch")
    program = torch.export.export(wrapper, (images,), dynamic_shapes=({0: batch},))
    example = images[:, 0] if data.image_shape[0] == 1 else images  # [N, H, W] for one channel
    with tempfile.TemporaryDirectory(dir=folder.parent) as staging:
        parts = Path(staging, "parts")
        parts.mkdir()
        torch.export.save(program, parts / "program.pt2")
        labels = {"classes": list(data.classes), "image_shape": list(data.image_shape)}
        (parts / "labels.json").write_text(json.dumps(labels))
        with quietly():
            mlflow.pyfunc.save_model(
                path=Path(staging, MODEL_FOLDER),
                python_model=str(CODE),
                artifacts={
                    "program": str(parts / "program.pt2"),
                    "labels": str(parts / "labels.json"),
                },
                signature=signature(tuple(example.shape[1:])),
                input_example=example.numpy(),
                pip_requirements=requirements(),
            )
        shutil.rmtree(folder, ignore_errors=True)
        Path(staging, MODEL_FOLDER).rename(folder)
    return folder


def log_model(
    tracking_uri: str, run_id: str, folder: Path, step: int, key: str, registered_name: str | None
) -> tuple[str, int | None]:
    """Log the saved model in ``folder`` as a LoggedModel of run ``run_id`` at ``step``, with the
    run's metrics of that step linked to it (as ``mlflow.pyfunc.log_model`` links them), and
    register it as a new version of ``registered_name``; the model's id and that version.

    Through the client, not ``log_model`` itself: that writes to the fluent API's current store
    and experiment, which a job never sets. Sent again (an outage cut the first try), it changes
    nothing: a READY model of the run tagged ``key`` is kept, a half-logged one is deleted and
    logged anew, and a version of that model is not registered twice.
    """
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    earlier = client.search_logged_models(
        [run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'"
    )
    mine = [model for model in earlier if model.tags.get(KEY_TAG) == key]
    ready = [model for model in mine if str(model.status) == "READY"][:1]
    for model in mine:
        if model not in ready:
            client.delete_logged_model(model.model_id)
    with quietly():
        model_id = ready[0].model_id if ready else upload(client, run, folder, step, key)
        registered = (
            register(client, registered_name, run_id, model_id) if registered_name else None
        )
    return model_id, registered[0] if registered else None


def upload(client: Any, run: Any, folder: Path, step: int, key: str) -> str:
    from mlflow.entities import LoggedModelOutput, Metric
    from mlflow.models import Model

    run_id = run.info.run_id
    model = client.create_logged_model(
        run.info.experiment_id, name=MODEL_NAME, source_run_id=run_id, tags={KEY_TAG: key},
        params=run.data.params, model_type="image-classifier",
    )  # fmt: skip
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=step)])
    linked = [  # the test metrics (system metrics have steps of their own)
        Metric(m.key, m.value, m.timestamp, m.step, model_id=model.model_id, run_id=run_id)
        for key in run.data.metrics
        if not key.startswith(SYSTEM_PREFIX)
        for m in client.get_metric_history(run_id, key)
        if m.step == step and m.model_id is None
    ]
    client.log_batch(run_id, metrics=linked)
    with tempfile.TemporaryDirectory() as staging:
        copy_ = Path(shutil.copytree(folder, Path(staging, MODEL_FOLDER)))
        saved = Model.load(copy_)  # the MLmodel file says which logged model it is
        saved.model_id, saved.model_uuid, saved.run_id = model.model_id, model.model_id, run_id
        saved.artifact_path = model.artifact_location
        saved.save(copy_ / "MLmodel")
        client.log_model_artifacts(model.model_id, str(copy_))
    client.finalize_logged_model(model.model_id, "READY")
    return model.model_id


def register(client: Any, name: str, run_id: str, model_id: str) -> tuple[int, bool]:
    """The version of the registered model ``name`` that is the LoggedModel ``model_id``, made
    once; and whether it was made now."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    for version in client.search_model_versions(f"name = '{name}'"):
        if version.source == f"models:/{model_id}":
            return int(version.version), False
    version = client.create_model_version(
        name, source=f"models:/{model_id}", run_id=run_id, model_id=model_id
    )
    return int(version.version), True
