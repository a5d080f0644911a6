"""``sky/train.yaml``: its ``run:`` section, run on this host as SkyPilot runs it on 2 nodes."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import (
    PROJECT,
    assert_rank_logs,
    assert_same_metrics,
    kill_process_trees,
    only_run,
    tiny_overrides,
)
from tests.test_distributed import free_port, launch_together
from tests.test_resume import SIGNAL_AT_STEP

TASK = PROJECT / "sky" / "train.yaml"
MANAGED = PROJECT / "sky" / "train-managed.yaml"  # a managed job on spot nodes


def test_task_file_asks_for_what_the_readme_says() -> None:
    task = yaml.safe_load(TASK.read_text())
    assert task["num_nodes"] == 2 and task["resources"]["accelerators"] == "L4:4"
    assert task["setup"] == 'pip install -e ".[dev]" -c constraints.txt'


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
