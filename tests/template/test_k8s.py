"""``k8s/train-jobset.yaml``: valid against the JobSet resource schema (offline), and its
container command run on this host as 2 "pods" x 1 process (its restart is the same command
again, with ckpt_path=auto: tests/test_sky.py kills and reruns that). No Kubernetes runs here."""

import gzip
import json
import os
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from lightning_exact.testing import processes
from lightning_exact.testing.records import assert_same_metrics
from lightning_exact.testing.servers import free_port

from tests.conftest import HARNESS, PROJECT


def launch_together(commands: list[list[str]], envs: list[dict[str, str]], cwd: Path) -> None:
    """Start processes the way a cluster launcher would, one per pod, and wait."""
    processes.launch_together(commands, envs, cwd, project=PROJECT)


def only_run(store, experiment=HARNESS.data_name, task="train"):
    from lightning_exact.testing.records import only_run as only_run_in

    return only_run_in(store, experiment, task)


tiny_overrides = HARNESS.tiny_overrides

MANIFEST = PROJECT / "k8s" / "train-jobset.yaml"
# The openAPIV3Schema of jobset.x-k8s.io/v1alpha2 from the JobSet v0.9.1 CRD
# (config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml of kubernetes-sigs/jobset).
SCHEMA = PROJECT / "tests" / "template" / "schemas" / "jobset.x-k8s.io_v1alpha2.json.gz"


def strict(schema: dict) -> dict:
    """The schema with unknown fields refused (``kubectl --validate=strict``): Kubernetes would
    silently drop a misspelled field."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [strict(item) for item in schema]
    return schema


def container(manifest: dict) -> dict:
    (job,) = manifest["spec"]["replicatedJobs"]
    (train,) = job["template"]["spec"]["template"]["spec"]["containers"]
    return train


def test_the_manifest_is_a_valid_jobset() -> None:
    manifest = yaml.safe_load(MANIFEST.read_text())
    schema = strict(json.loads(gzip.decompress(SCHEMA.read_bytes())))
    jsonschema.validate(manifest, schema)
    misspelled = {**manifest, "spec": {**manifest["spec"], "failurePolicy": {"maxRestart": 3}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(misspelled, schema)
    assert "ckpt_path=auto" in container(manifest)["args"][0]


@pytest.mark.slow
def test_the_container_command_on_two_pods_matches_two_devices(
    two_devices: dict[str, float], tiny_root: Path, tmp_path: Path
) -> None:
    train = container(yaml.safe_load(MANIFEST.read_text()))
    env = {item["name"]: item["value"] for item in train["env"]}
    train_args = " ".join([*tiny_overrides(tiny_root), "trainer.max_epochs=1"])
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env.update(
        GPUS_PER_NODE="1",
        MASTER_ADDR="127.0.0.1",
        RUN_DIR=str(tmp_path / "volume/train"),
        MLFLOW_TRACKING_URI=store,
        TRAIN_ARGS=train_args,
    )
    port = str(free_port())
    script = train["args"][0].replace("--master-port=29500", f"--master-port={port}")
    command = [*train["command"], script]
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    envs = [{**env, "JOB_COMPLETION_INDEX": str(pod), "PATH": path} for pod in (0, 1)]
    launch_together([command, command], envs, cwd=tmp_path)
    assert_same_metrics(tmp_path / "volume/train", two_devices)
    _, run = only_run(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
