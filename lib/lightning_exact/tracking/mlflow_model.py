"""The task's model (:class:`~lightning_exact.task.ModelExport`) as an MLflow model people load and
serve without this project: a ``torch.export`` program, no pickled code; logged and registered."""

import io
import json
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from typing import Any

import torch

from lightning_exact.environment import environment, quiet
from lightning_exact.task import ModelExport
from lightning_exact.tracking.names import model_name
from lightning_exact.tracking.outbox import register_kind

MODEL_FOLDER = "model"  # the saved model in the output folder
SPLIT_CONTEXTS = {"val": "validation"}  # a metric's prefix -> its dataset input's context
KEY_TAG = "template.model_key"  # on a LoggedModel: which job's model it is (see log_model)


@contextmanager
def quietly() -> Iterator[None]:
    """Without MLflow's progress bars and INFO lines in the job's output."""
    with environment(MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false"), quiet("mlflow"):
        yield


def save_model(export: ModelExport, folder: Path) -> Path:
    """Export ``export.module`` (any batch size) as an MLflow pyfunc model in ``folder``, whole or
    not at all. Its requirements are given, not inferred: that would import it in a subprocess."""
    import mlflow

    dynamic = ({0: torch.export.Dim("batch")},)
    program = torch.export.export(export.module, (export.example,), dynamic_shapes=dynamic)
    with tempfile.TemporaryDirectory(dir=folder.parent) as staging:
        parts = {"program": f"{staging}/program.pt2", "metadata": f"{staging}/metadata.json"}
        torch.export.save(program, parts["program"])
        Path(parts["metadata"]).write_text(json.dumps(dict(export.metadata)))
        needs = [f"torch=={torch.__version__.split('+')[0]}", f"mlflow=={mlflow.__version__}"]
        with quietly():
            mlflow.pyfunc.save_model(
                path=Path(staging, MODEL_FOLDER),
                python_model=str(export.code),
                artifacts=parts,
                signature=export.signature,
                input_example=export.input_example,
                pip_requirements=[*needs, "pandas"],
                metadata={"model_type": export.model_type} if export.model_type else None,
            )
        shutil.rmtree(folder, ignore_errors=True)
        Path(staging, MODEL_FOLDER).rename(folder)
    return folder


def log_model(
    tracking_uri: str,
    run_id: str,
    folder: Path,
    step: int,
    key: str,
    registered_name: str | None,
    metrics: Sequence[str] = (),
) -> tuple[str, int | None]:
    """The model in ``folder`` as a LoggedModel of run ``run_id`` at ``step`` (``log_model`` needs
    a fluent run) and a version of ``registered_name``: their id and number. Sent again, a READY
    model tagged ``key`` is kept, a half-logged one replaced, and no version registered twice."""
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
        version = register(client, registered_name, model_id)[0] if registered_name else None
    return model_id, version


def send_logged_model(client: Any, run_id: str, folder: str, **arguments: Any) -> None:
    """A queued ``log_model`` record, sent (by the job's outbox, or src.sync)."""
    log_model(client.tracking_uri, run_id, Path(folder), **arguments)


register_kind(
    "log_model", ("folder", "step", "key", "registered_name", "metrics"), send_logged_model
)


def upload(client: Any, run: Any, folder: Path, step: int, key: str, metrics: Sequence[str]) -> str:
    """``folder``'s model as a LoggedModel of ``run``: its output at ``step``, linked to the
    final ``metrics``, its files uploaded, READY. Returns its id."""
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model

    run_id = run.info.run_id
    model = client.create_logged_model(
        run.info.experiment_id,
        name=model_name(run.info.run_name),  # the Models tab names it as the runs table does
        source_run_id=run_id,
        tags={KEY_TAG: key},
        params=run.data.params,
        model_type=(Model.load(folder).metadata or {}).get("model_type"),
    )
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=step)])
    client.log_batch(run_id, metrics=linked_metrics(client, run, model.model_id, step, metrics))
    with tempfile.TemporaryDirectory() as staging:  # its MLmodel file names the logged model
        copy = Path(shutil.copytree(folder, Path(staging, MODEL_FOLDER)))
        saved = Model.load(copy)
        saved.model_id = model.model_id
        saved.model_uuid = model.model_id
        saved.run_id = run_id
        saved.artifact_path = model.artifact_location
        saved.save(copy / "MLmodel")
        client.log_model_artifacts(model.model_id, str(copy))
    client.finalize_logged_model(model.model_id, "READY")
    return model.model_id


def linked_metrics(
    client: Any, run: Any, model_id: str, step: int, metrics: Sequence[str]
) -> list[Any]:
    """The final ``metrics`` of ``run`` (their values at ``step``, not system readings of that
    step) again, linked to the model and each to its split's dataset: the UI lists them as the
    model's "Datasets used"."""
    from mlflow.entities import Metric

    datasets = {
        t.value: d.dataset
        for d in run.inputs.dataset_inputs
        for t in d.tags
        if t.key == "mlflow.data.context"
    }
    linked = []
    for name in set(metrics) & set(run.data.metrics):
        prefix = name.split("/")[0]
        split = datasets.get(SPLIT_CONTEXTS.get(prefix, prefix))
        linked += [
            Metric(
                m.key,
                m.value,
                m.timestamp,
                m.step,
                model_id=model_id,
                run_id=run.info.run_id,
                dataset_name=split and split.name,
                dataset_digest=split and split.digest,
            )
            for m in client.get_metric_history(run.info.run_id, name)
            if m.step == step and m.model_id is None
        ]
    return linked


def register(client: Any, name: str, model_id: str) -> tuple[int, bool]:
    """The version of ``name`` that is the LoggedModel ``model_id``, made once (by MLflow's
    ``register_model``, which links model, version and run in the UI); whether it was made now."""
    import mlflow

    for version in client.search_model_versions(f"name = '{name}'"):
        if version.source == f"models:/{model_id}":
            return int(version.version), False
    with environment(MLFLOW_TRACKING_URI=client.tracking_uri), redirect_stderr(io.StringIO()):
        version = mlflow.register_model(f"models:/{model_id}", name)  # it prints what it did
    return int(version.version), True
