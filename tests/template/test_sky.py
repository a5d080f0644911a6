"""``sky/train.yaml``: its ``run:`` section, run on this host as SkyPilot runs it on 2 nodes; and
``sky/tracking-server.yaml``'s, the team's tracking service, run on this host as on its VM."""

import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import psutil
import pytest
import torch
import yaml
from lightning_exact.testing import processes
from lightning_exact.testing.instruments import SIGNAL_AT_STEP
from lightning_exact.testing.processes import kill_process_trees
from lightning_exact.testing.records import assert_same_metrics
from lightning_exact.testing.servers import free_port, free_service_port
from lightning_exact.testing.service import (
    ADMIN_PASSWORD,
    BUCKET_LOGIN,
    alive,
    answers,
    service_data,  # noqa: F401  (the service's data folder fixture)
    service_env,
    tracking,
)

from tests.conftest import HARNESS, PROJECT
from tests.template.launchers import assert_rank_logs


def launch_together(commands: list[list[str]], envs: list[dict[str, str]], cwd: Path) -> None:
    """Start processes the way a cluster launcher would, one per node, and wait."""
    processes.launch_together(commands, envs, cwd, project=PROJECT)


def only_run(store, experiment=HARNESS.data_name, task="train"):
    from lightning_exact.testing.records import only_run as only_run_in

    return only_run_in(store, experiment, task)


tiny_overrides = HARNESS.tiny_overrides

TASK = PROJECT / "sky" / "train.yaml"
MANAGED = PROJECT / "sky" / "train-managed.yaml"  # a managed job on spot nodes


def test_task_file_asks_for_what_the_readme_says() -> None:
    task = yaml.safe_load(TASK.read_text())
    assert task["num_nodes"] == 2 and task["resources"]["accelerators"] == "L4:4"
    # The library from its source where it is here (the template), else from the project's pin
    assert task["setup"] == (
        "pip install $(test -d lib && printf -- '-e ./lib') -e \".[dev]\" -c constraints.txt"
    )


def node_envs(task: dict, train_args: list[str], extra: dict[str, str] | None = None) -> list:
    """What SkyPilot sets on each node (here both "nodes" are this host, 1 process each)."""
    port = str(free_port())
    return [
        {
            **{key: str(value) for key, value in task["envs"].items()},
            "TRAIN_ARGS": " ".join(train_args),
            "MASTER_PORT": port,
            "SKYPILOT_NODE_RANK": str(node),
            "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
            "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            **(extra or {}),
        }
        for node in (0, 1)
    ]


@pytest.mark.slow
def test_run_section_on_two_nodes_matches_two_devices(
    two_devices: dict[str, float], tiny_root: Path, tmp_path: Path
) -> None:
    task = yaml.safe_load(TASK.read_text())
    envs = node_envs(task, [*tiny_overrides(tiny_root), "trainer.max_epochs=1"])
    command = ["bash", "-euc", task["run"]]
    launch_together([command, command], envs, cwd=tmp_path)
    run_dir = tmp_path / "outputs/train/runs/sky"
    assert_same_metrics(run_dir, two_devices)
    assert_rank_logs(run_dir, node=1, local=0)
    _, run = only_run(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"


def test_managed_job_recovers_from_its_bucket_into_its_server() -> None:
    task = yaml.safe_load(MANAGED.read_text())
    assert task["resources"]["use_spot"] and task["resources"]["job_recovery"]
    assert task["file_mounts"]["/checkpoints"]["mode"] == "MOUNT_CACHED"
    assert "ckpt_path=auto" in task["run"] and "$SKYPILOT_TASK_ID" in task["run"]


@pytest.mark.slow
def test_a_preempted_managed_job_run_again_continues_exactly(
    two_devices: dict[str, float], tiny_root: Path, tmp_path: Path
) -> None:
    """A preemption gives no signal: every process of both nodes is SIGKILLed mid-epoch, after a
    step checkpoint; SkyPilot's recovery runs the same section again (same task id, same bucket
    folder, new nodes), which continues exactly in the same MLflow run."""
    task = yaml.safe_load(MANAGED.read_text())
    task["envs"].update(
        RUN_ROOT=str(tmp_path / "bucket"),
        SKYPILOT_TASK_ID="sky-managed-1",
        MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}",
    )
    args = [
        *tiny_overrides(tiny_root),
        "trainer.max_epochs=1",
        "callbacks.checkpoint.every_n_train_steps=3",
    ]
    command = ["bash", "-euc", task["run"]]
    slow = {
        "PYTHONPATH": os.pathsep.join([str(SIGNAL_AT_STEP), str(PROJECT)]),
        "SLEEP_PER_STEP": "0.5",
    }
    run_dir = tmp_path / "bucket" / "sky-managed-1"
    last = run_dir / "checkpoints" / "last.ckpt"
    nodes = [
        subprocess.Popen(
            command,
            cwd=tmp_path,
            env={**os.environ, **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for env in node_envs(task, args, slow)
    ]
    try:
        deadline = time.monotonic() + 240
        while not last.is_file():
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes)
            time.sleep(0.1)
    finally:  # every process of each node: bash, torchrun and its workers (their own sessions)
        kill_process_trees(*nodes)
    step = torch.load(last, weights_only=True)["global_step"]
    assert 0 < step < 10, "killed mid-epoch, after a step checkpoint"
    launch_together([command, command], node_envs(task, args), cwd=tmp_path)
    assert_same_metrics(run_dir, two_devices)
    _, run = only_run(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED" and run.data.tags["resume.count"] == "1"


SERVICE = PROJECT / "sky" / "tracking-server.yaml"  # the team's tracking service on a VM


def test_service_task_opens_its_https_port_and_asks_for_its_secrets() -> None:
    task = yaml.safe_load(SERVICE.read_text())
    assert task["resources"]["ports"] == task["envs"]["TRACKING_PORT"] == 8443
    assert task["envs"]["TRACKING_ARTIFACTS"] is None, "required: sky launch refuses it unset"
    assert task["secrets"] == {"MLFLOW_AUTH_ADMIN_PASSWORD": None}
    assert "MLFLOW_AUTH_ADMIN_PASSWORD" not in task["envs"], "a secret, never an env SkyPilot logs"


@pytest.mark.slow
def test_service_tasks_run_section_serves_until_the_service_is_stopped(
    s3_server: dict[str, str],  # noqa: F811
    service_data: Path,  # noqa: F811
) -> None:
    """The run section as SkyPilot runs it on the VM, with the task's envs and secret (here the
    bucket is moto's, the host this one): it starts the whole service, prints the URL and what
    clients set, and lasts until ``python -m lightning_exact.server stop``, which ends it and the
    service."""
    task = yaml.safe_load(SERVICE.read_text())
    boto3.client("s3", **BUCKET_LOGIN, endpoint_url=s3_server["AWS_ENDPOINT_URL"]).create_bucket(
        Bucket="team"
    )
    port = free_service_port()  # as root, one under 1024 (tracking.sh refuses others)
    given = {  # sky launch --env ... --secret MLFLOW_AUTH_ADMIN_PASSWORD
        "TRACKING_ARTIFACTS": "s3://team/mlflow",
        "TRACKING_HOST": "127.0.0.1",
        "TRACKING_PORT": str(port),
        "TRACKING_WORKERS": "1",
        "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN_PASSWORD,
    }
    envs = {key: str(value) for key, value in task["envs"].items() if value is not None}
    bucket = {**s3_server, "MLFLOW_S3_ENDPOINT_URL": s3_server["AWS_ENDPOINT_URL"]}
    env = service_env(service_data, **{**envs, **given, **bucket})
    job = subprocess.Popen(
        ["bash", "-euc", task["run"]], cwd=PROJECT, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        url = f"https://127.0.0.1:{port}"
        deadline = time.monotonic() + 150
        cert = service_data / "ca.crt"  # copied from caddy's authority once it made one
        while not (cert.is_file() and answers(url, str(cert))):
            assert job.poll() is None, f"the run section ended: {job.stdout.read()}"
            assert time.monotonic() < deadline, "the service did not answer in 150 s"
            time.sleep(0.5)
        time.sleep(2)
        assert job.poll() is None, "the job lasts as long as the service"
        supervisor = psutil.Process(int((service_data / "supervisord.pid").read_text()))
        running = [supervisor, *supervisor.children(recursive=True)]
        assert "Stopped" in tracking("stop", env=env).stdout
        assert job.wait(timeout=60) == 0
        assert not [p for p in running if alive(p)], "stop left processes running"
        printed = job.stdout.read()
        assert f"MLflow tracking service: {url} " in printed
        assert f"python -m src.train logger.tracking_uri={url}" in printed
        assert ADMIN_PASSWORD not in printed
    finally:
        if job.poll() is None:
            job.kill()
