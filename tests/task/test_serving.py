"""From a run to a served model: the exported MLflow model, LoggedModels, the registry and
``mlflow models serve``, against the default SQLite store and a real ``mlflow server``."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlflow
import numpy as np
import pytest
import torch
from lightning_exact.testing import processes
from lightning_exact.testing.instruments import SIGNAL_AT_STEP
from lightning_exact.testing.servers import free_port, local_server_argv, mlflow_server, served
from lightning_exact.tracking.mlflow_model import MODEL_FOLDER, save_model
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from src.task import nets
from src.task.data.image_folder import ImageFolderDataModule
from src.task.export import export
from tests.conftest import HARNESS, PROJECT
from tests.image_data import make_image_folder
from tests.task.test_mnist import make_module

epoch_ends = HARNESS.epoch_ends
run_entry = HARNESS.run_entry
tiny_overrides = HARNESS.tiny_overrides
SLOW_STEPS = {  # each training step 0.2 s longer (the signal_at_step instrument)
    "PYTHONPATH": os.pathsep.join([str(SIGNAL_AT_STEP), str(PROJECT)]),
    "SLEEP_PER_STEP": "0.2",
}


def sync(run_dir: Path, *options: str) -> subprocess.CompletedProcess:
    return processes.sync(run_dir, *options, project=PROJECT)


SHOWN = 16  # test images sent to the served model


def expected(net: torch.nn.Module, datamodule) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities and classes as src.predict computes them: the data module's batches."""
    batch = datamodule.test_set.__getitems__(list(range(SHOWN)))
    with torch.no_grad():
        probabilities = net.eval()(batch.inputs).softmax(dim=1)
    return probabilities, probabilities.argmax(dim=1)


@pytest.mark.parametrize("kind", ["grayscale-convnet", "rgb-resnet"])
def test_the_saved_model_takes_raw_images_and_loads_without_pickles(
    kind: str, tiny_root: Path, tmp_path: Path
) -> None:
    if kind == "grayscale-convnet":
        datamodule, net_name = make_module(tiny_root), "convnet"
    else:
        make_image_folder(tmp_path / "images", n_train=6, n_test=4)
        datamodule = ImageFolderDataModule(
            name="image_folder",
            root=str(tmp_path / "images"),
            image_size=[32, 32],
            channels=3,
            batch_size=8,
            val_size=5,
        )
        net_name = "resnet"
    datamodule.prepare_data()
    datamodule.load()
    channels, *size = datamodule.image_shape
    net = nets.build({"name": net_name}, channels, tuple(size), datamodule.num_classes)
    folder = save_model(export(SimpleNamespace(net=net), datamodule), tmp_path / MODEL_FOLDER)

    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert {"MLmodel", "artifacts/program.pt2", "served_model.py"} <= files
    assert not [name for name in files if name.endswith((".pkl", ".pickle"))], files
    assert "loader_module: mlflow.pyfunc.loaders.code_model" in (folder / "MLmodel").read_text()

    model = mlflow.pyfunc.load_model(str(folder))
    raw = datamodule.test_set.inputs[:SHOWN]  # uint8 [N, C, H, W]
    people_have = raw[:, 0] if channels == 1 else raw  # [N, H, W] for one channel
    rows = model.predict(people_have.numpy())
    probabilities, classes = expected(net, datamodule)
    assert rows["predicted"].tolist() == classes.tolist()
    assert rows["class_name"].tolist() == [datamodule.classes[i] for i in classes]
    assert np.allclose(np.stack(rows["probabilities"]), probabilities.numpy(), atol=1e-6)
    assert len(model.predict(people_have[:1].numpy())) == 1, "any batch size"
    with pytest.raises(MlflowException, match="does not match expected dtype uint8"):
        model.predict(people_have.numpy().astype(np.float32))
    if channels == 1:
        with pytest.raises(MlflowException, match="Shape of input"):
            model.predict(raw.numpy())  # one-channel models take [N, H, W]


def predicted_by_src_predict(workdir: Path, job: Path) -> list[int]:
    """The classes ``src.predict`` writes for the first test images, from the job's best
    checkpoint (the one its model was exported from)."""
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    run_id = (job / "mlflow_run_id.txt").read_text().strip()
    (best,) = [a.path for a in client.list_artifacts(run_id, "checkpoints")]
    out = workdir / "predict"
    run_entry("predict", f"ckpt_path={job / best}", f"hydra.run.dir={out}", cwd=workdir)
    with (out / "predictions_test.csv").open() as file:
        rows = list(csv.DictReader(file))
    return [int(row["predicted"]) for row in rows[:SHOWN]]


@pytest.mark.slow
def test_the_best_job_of_a_sweep_is_registered_and_served(tiny_root: Path, tmp_path: Path) -> None:
    """The path of docs/mlflow.md: a sweep (each job logs its model), src.register picks the best
    job by optimized_metric, and `mlflow models serve` answers as src.predict does."""
    run_entry(
        "train",
        "-m",
        *tiny_overrides(tiny_root, model=True),
        "seed=1,2",
        "logger.registered_model_name=every-job",
        cwd=tmp_path,
    )
    (sweep,) = (tmp_path / "outputs" / "train" / "multiruns").iterdir()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("mnist").experiment_id
    models = client.search_logged_models([experiment])
    runs = {(sweep / job / "mlflow_run_id.txt").read_text().strip(): job for job in ("0", "1")}
    assert sorted(m.source_run_id for m in models) == sorted(runs), "one model per job"
    for model in models:
        assert str(model.status) == "READY"
        test_metrics = {m.key: m.value for m in model.metrics}
        job_metrics = json.loads((sweep / runs[model.source_run_id] / "metrics.json").read_text())
        assert test_metrics == {k: v for k, v in job_metrics.items() if k.startswith("test/")}
        run = client.get_run(model.source_run_id)
        assert [o.model_id for o in run.outputs.model_outputs] == [model.model_id]
        # The UI's "Datasets used" on the model: its metrics name the split they were measured on.
        test_set = next(
            d.dataset for d in run.inputs.dataset_inputs if d.dataset.name.endswith("/test")
        )
        assert {(m.dataset_name, m.dataset_digest) for m in model.metrics} == {
            (test_set.name, test_set.digest)
        }
        # Registered by MLflow's register_model: the model names its version (the UI's link).
        (linked,) = json.loads(model.tags["mlflow.modelVersions"])
        assert linked["name"] == "every-job"
    versions = client.search_model_versions("name = 'every-job'")
    assert sorted(v.run_id for v in versions) == sorted(runs), "one version per job"
    kind = client.get_experiment(experiment).tags["mlflow.experimentKind"]
    assert kind == "custom_model_development", "the UI opens the experiment on its training runs"

    scores = {
        job: json.loads((sweep / job / "metrics.json").read_text())["val/acc_best"]
        for job in ("0", "1")
    }
    best = max(scores, key=scores.get)
    argv = [sys.executable, "-m", "src.register", str(sweep), "--name", "best"]
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    # Registering the same model again changes nothing, and says so.
    for said in ("registered best version 1", "best version 1 already is"):
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"{said}: {sweep / best} (val/acc_best="), done.stdout
    (version,) = client.search_model_versions("name = 'best'")
    assert version.run_id == (sweep / best / "mlflow_run_id.txt").read_text().strip()

    datamodule = make_module(tiny_root)
    datamodule.prepare_data()
    datamodule.load("test")
    images = datamodule.test_set.inputs[:SHOWN, 0].numpy()  # uint8 [N, 28, 28]
    classes = predicted_by_src_predict(tmp_path, sweep / best)
    answers = served("models:/best/1", tmp_path, images)
    assert [answer["predicted"] for answer in answers] == classes
    assert all(len(answer["probabilities"]) == 10 for answer in answers)
    # In a notebook cell:
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        rows = mlflow.pyfunc.load_model("models:/best/1").predict(images)
    finally:
        mlflow.set_tracking_uri(None)
    assert rows["predicted"].tolist() == classes


@pytest.mark.slow
def test_a_ddp_job_logs_one_model_to_a_server_once(tiny_root: Path, tmp_path: Path) -> None:
    """2 ranks against a real server: rank 0 logs one model through the outbox; sending every
    record again (as after a crash) logs no second model and registers no second version."""
    port = free_port()
    run_dir = tmp_path / "run"
    with mlflow_server(local_server_argv(port, tmp_path), port, tmp_path) as url:
        run_entry(
            "train",
            *tiny_overrides(tiny_root, model=True),
            "strategy=ddp",
            "devices=2",
            "accelerator=cpu",
            f"logger.tracking_uri={url}",
            "logger.system_metrics_s=1",
            "logger.registered_model_name=ddp",
            f"hydra.run.dir={run_dir}",
            cwd=tmp_path,
            env=SLOW_STEPS,
        )
        client = MlflowClient(url)
        run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
        experiment = client.get_run(run_id).info.experiment_id

        def assert_one_model() -> None:
            (model,) = client.search_logged_models([experiment])
            assert model.source_run_id == run_id and str(model.status) == "READY"
            # Only the test metrics, at the job's last step (not the system readings).
            assert {m.key for m in model.metrics} == {"test/acc", "test/loss", "test/samples"}
            (step,) = {m.step for m in model.metrics}
            assert step == epoch_ends(2)[-1]
            (version,) = client.search_model_versions("name = 'ddp'")
            assert version.run_id == run_id and version.source == f"models:/{model.model_id}"

        assert_one_model()
        (run_dir / "mlflow_outbox.sent").write_text("1")
        assert sync(run_dir).returncode == 0
        assert_one_model()
        assert client.get_run(run_id).info.status == "FINISHED"
        datamodule = make_module(tiny_root)
        datamodule.prepare_data()
        datamodule.load("test")
        images = datamodule.test_set.inputs[:SHOWN, 0].numpy()
        mlflow.set_tracking_uri(url)
        try:
            rows = mlflow.pyfunc.load_model("models:/ddp/1").predict(images)
        finally:
            mlflow.set_tracking_uri(None)
        local = mlflow.pyfunc.load_model(str(run_dir / MODEL_FOLDER)).predict(images)
        assert rows["predicted"].tolist() == local["predicted"].tolist()
