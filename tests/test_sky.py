"""``sky/train.yaml``: its ``run:`` section, run on this host as SkyPilot runs it on 2 nodes."""

import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import PROJECT, assert_rank_logs, assert_same_metrics, only_run, tiny_overrides
from tests.test_distributed import free_port, launch_together

TASK = PROJECT / "sky" / "train.yaml"


def test_task_file_asks_for_what_the_readme_says() -> None:
    task = yaml.safe_load(TASK.read_text())
    assert task["num_nodes"] == 2 and task["resources"]["accelerators"] == "L4:4"
    assert task["setup"] == 'pip install -e ".[dev]" -c constraints.txt'


@pytest.mark.slow
def test_run_section_on_two_nodes_matches_two_devices(
    two_devices: dict[str, float], tiny_root: Path, tmp_path: Path
) -> None:
    task = yaml.safe_load(TASK.read_text())
    train_args = [*tiny_overrides(tiny_root), "trainer.max_epochs=1"]
    port = str(free_port())
    # What SkyPilot sets on each node (here both "nodes" are this host, 1 process each).
    envs = [
        {
            **{key: str(value) for key, value in task["envs"].items()},
            "TRAIN_ARGS": " ".join(train_args),
            "MASTER_PORT": port,
            "SKYPILOT_NODE_RANK": str(node),
            "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.1",
            "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        }
        for node in (0, 1)
    ]
    command = ["bash", "-euc", task["run"]]
    launch_together([command, command], envs, cwd=tmp_path)
    run_dir = tmp_path / "outputs/train/runs/sky"
    assert_same_metrics(run_dir, two_devices)
    assert_rank_logs(run_dir, node=1, local=0)
    _, run = only_run(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
