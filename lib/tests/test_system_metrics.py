"""System metrics: MLflow's readings at every interval, from every node, through the outbox."""

import os
import sys
import time
from pathlib import Path

import pytest
from lightning_exact.tracking.outbox import NODE_OUTBOX, Outbox, OutboxClient, encode
from lightning_exact.tracking.sync import sync
from lightning_exact.tracking.system_metrics import Sampler
from mlflow import MlflowClient

from tests.conftest import DATA_NAME, PROJECT, SIGNAL_AT_STEP, run_entry, tiny_overrides
from tests.test_outbox import sqlite_run


class Recorder:
    """A client that keeps each metrics batch as ({key: value}, step)."""

    def __init__(self) -> None:
        self.written: list[tuple[dict[str, float], int]] = []

    def log_batch(self, run_id: str, metrics: list) -> None:
        self.written.append(({m.key: m.value for m in metrics}, metrics[0].step))


def test_the_sampler_writes_mlflows_readings_at_every_step() -> None:
    """MLflow's samplers, read here by name: if an upgrade renames them, this fails."""
    client = Recorder()
    written = client.written
    unused = "http://127.0.0.1:9"  # MLflow's monitor is given a store it never writes to
    sampler = Sampler(0.2, "system/", client, "run", 5, unused)
    sampler.start()
    deadline = time.monotonic() + 30
    while len(written) < 3:
        assert time.monotonic() < deadline and sampler.is_alive(), "no readings"
        time.sleep(0.1)
    sampler.stopping.set()
    sampler.join(timeout=10)
    assert not sampler.is_alive()
    assert [step for _, step in written] == list(range(5, 5 + len(written)))
    expected = {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"}
    assert all(expected <= set(metrics) for metrics, _ in written)


def test_a_job_shorter_than_the_interval_gets_a_first_and_a_last_reading() -> None:
    client = Recorder()
    written = client.written
    busy = "http://127.0.0.1:9"
    sampler = Sampler(60, "system/", client, "run", 0, busy)
    sampler.start()
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # keep a core busy: the readings are not 0 %
        sum(range(10_000))
    sampler.stopping.set()
    sampler.join(timeout=10)
    assert [step for _, step in written] == [0, 1], "one soon after start-up, one at the end"
    assert all(m["system/cpu_utilization_percentage"] > 0 for m, _ in written)


def test_src_sync_sends_the_other_nodes_outboxes_too(tmp_path: Path) -> None:
    client, run_id = sqlite_run(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = Outbox(tmp_path, uri)
    job.append(encode("set_terminated", run_id, status="FINISHED"))
    job.close()
    node = Outbox(tmp_path, uri, name=NODE_OUTBOX.format(1))
    sampler = Sampler(1, "system/node1/", OutboxClient(None, node), run_id, 0, uri)
    sampler.write({"cpu_utilization_percentage": 12.5})
    node.close()
    assert sync(tmp_path) == f"sent 2 record(s) to {uri}: run {run_id} is FINISHED"
    (point,) = client.get_metric_history(run_id, "system/node1/cpu_utilization_percentage")
    assert (point.value, point.step) == (12.5, 0)
    assert sync(tmp_path).startswith("sent 0 record(s)"), "sent once"


SLOW_STEPS = {  # each training step 0.2 s longer (tests/signal_at_step): a job lasts ~10 s
    "PYTHONPATH": os.pathsep.join([str(SIGNAL_AT_STEP), str(PROJECT)]),
    "SLEEP_PER_STEP": "0.2",
}


def system_metric_keys(client: MlflowClient) -> set[str]:
    (run,) = client.search_runs([client.get_experiment_by_name(DATA_NAME).experiment_id])
    key = "system/cpu_utilization_percentage"
    if key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert steps == list(range(len(steps))), f"one reading per step, no gap: {steps}"
    return {key for key in run.data.metrics if key.startswith("system/")}


@pytest.mark.slow
def test_system_metrics_are_sampled_while_a_job_trains(tiny_root: Path, tmp_path: Path) -> None:
    overrides = ["trainer.max_epochs=3", "logger.system_metrics_s=1", "hydra.run.dir=run"]
    run_entry("train", *tiny_overrides(tiny_root), *overrides, cwd=tmp_path, env=SLOW_STEPS)
    keys = system_metric_keys(MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}"))
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= keys


@pytest.mark.slow
def test_system_metrics_come_from_every_node(
    server_url: str, tiny_root: Path, tmp_path: Path
) -> None:
    """Two torchrun "nodes" on this host, one rank each, against a server: each node samples."""
    from lightning_exact.testing.servers import free_port

    from tests.test_distributed import launch_together

    port = free_port()
    train = [
        "-m",
        "src.train",
        *tiny_overrides(tiny_root),
        "trainer.max_epochs=3",
        "strategy=ddp",
        "devices=1",
        "num_nodes=2",
        f"logger.tracking_uri={server_url}",
        "logger.system_metrics_s=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            *train,
        ]
        for node in (0, 1)
    ]
    launch_together(commands, [SLOW_STEPS] * 2, cwd=tmp_path)
    keys = system_metric_keys(MlflowClient(server_url))
    for node in ("node0", "node1"):
        assert f"system/{node}/cpu_utilization_percentage" in keys, sorted(keys)
    node1 = Outbox(tmp_path / "run", name=NODE_OUTBOX.format(1))
    assert node1.pending == 0 and len(node1.records) > 1, "node 1 sent its readings itself"
    node1.close()
