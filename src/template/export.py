"""A trained model as an MLflow model people can load and serve without this project.

The task says what the served model is (:class:`~src.template.task.ModelExport`): a module from
raw inputs to outputs, its signature and the "models from code" file that loads it.
:func:`save_model` exports it (``torch.export``: a program, no pickled code) into the job's
output folder; :func:`log_model` makes that folder a LoggedModel of the job's run (MLflow links
the run's final metrics to it) and registers it.
"""

import io
import json
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from typing import Any

import torch

from src.template.environment import environment, quiet
from src.template.task import ModelExport

MODEL_FOLDER = "model"  # in the output folder: the saved MLflow model
MODEL_NAME = "model"  # its name in the run
SPLIT_CONTEXTS = {"val": "validation"}  # a metric's prefix -> its dataset input's context
KEY_TAG = "template.model_key"  # on a LoggedModel: which job's model it is (see log_model)


def requirements() -> list[str]:
    """What the model needs to load (given, not inferred: inference imports it in a subprocess)."""
    import mlflow

    return [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}", "pandas"]


@contextmanager
def quietly() -> Iterator[None]:
    """Without MLflow's progress bars and INFO lines in the job's output."""
    with environment(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false"), quiet("mlflow"):
        yield


def save_model(export: ModelExport, folder: Path) -> Path:
    """Export ``export.module`` (``torch.export``, any batch size) and save it as an MLflow
    pyfunc model in ``folder``, whole or not at all."""
    import mlflow

    batch = torch.export.Dim("batch")
    program = torch.export.export(export.module, (export.example,), dynamic_shapes=({0: batch},))
    with tempfile.TemporaryDirectory(dir=folder.parent) as staging:
        parts = Path(staging, "parts")
        parts.mkdir()
        torch.export.save(program, parts / "program.pt2")
        (parts / "metadata.json").write_text(json.dumps(dict(export.metadata)))
        with quietly():
            mlflow.pyfunc.save_model(
                path=Path(staging, MODEL_FOLDER),
                python_model=str(export.code),
                artifacts={
                    "program": str(parts / "program.pt2"),
                    "metadata": str(parts / "metadata.json"),
                },
                signature=export.signature,
                input_example=export.input_example,
                pip_requirements=requirements(),
                metadata={"model_type": export.model_type} if export.model_type else None,
            )
        shutil.rmtree(folder, ignore_errors=True)
        Path(staging, MODEL_FOLDER).rename(folder)
    return folder


def log_model(
    tracking_uri: str, run_id: str, folder: Path, step: int, key: str, registered_name: str | None,
    metrics: Sequence[str] = (),
) -> tuple[str, int | None]:  # fmt: skip
    """Log the saved model in ``folder`` as a LoggedModel of run ``run_id`` at ``step``, with the
    run's ``metrics`` of that step linked to it (as ``mlflow.pyfunc.log_model`` links them), and
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
        model_id = ready[0].model_id if ready else upload(client, run, folder, step, key, metrics)
        registered = (
            register(client, registered_name, run_id, model_id) if registered_name else None
        )
    return model_id, registered[0] if registered else None


def upload(client: Any, run: Any, folder: Path, step: int, key: str, metrics: Sequence[str]) -> str:
    from mlflow.entities import LoggedModelOutput, Metric
    from mlflow.models import Model

    run_id = run.info.run_id
    model_type = Model.load(folder).metadata or {}
    model = client.create_logged_model(
        run.info.experiment_id, name=MODEL_NAME, source_run_id=run_id, tags={KEY_TAG: key},
        params=run.data.params, model_type=model_type.get("model_type"),
    )  # fmt: skip
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=step)])
    # The job's final metrics (e.g. test/*), not system readings of the same step, each with the
    # dataset of its split, which the UI lists as the model's "Datasets used".
    datasets = {
        tag.value: d.dataset
        for d in run.inputs.dataset_inputs
        for tag in d.tags
        if tag.key == "mlflow.data.context"
    }
    linked = []
    for key in metrics:
        split = datasets.get(SPLIT_CONTEXTS.get(key.split("/")[0], key.split("/")[0]))
        for m in client.get_metric_history(run_id, key) if key in run.data.metrics else ():
            if m.step == step and m.model_id is None:
                linked.append(
                    Metric(m.key, m.value, m.timestamp, m.step, model_id=model.model_id,
                           run_id=run_id, dataset_name=split and split.name,
                           dataset_digest=split and split.digest)
                )  # fmt: skip
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
    once (by MLflow's own ``register_model``, which links model, version and run in the UI);
    and whether it was made now."""
    import mlflow

    for version in client.search_model_versions(f"name = '{name}'"):
        if version.source == f"models:/{model_id}":
            return int(version.version), False
    with environment(MLFLOW_TRACKING_URI=client.tracking_uri), redirect_stderr(io.StringIO()):
        version = mlflow.register_model(f"models:/{model_id}", name)  # it prints what it did
    return int(version.version), True
