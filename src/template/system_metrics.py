"""System metrics in the job's MLflow run: CPU, memory, disk, network and, per GPU, utilisation,
memory and power (the UI's "System metrics" tab), from every node, through the outbox.

MLflow's own monitor starts only for runs of ``mlflow.start_run``, writes to the server
directly, and stops for good at the first request that fails. Here MLflow's samplers take the
readings and the records go where the job's other records go: against a server, into an outbox
(rank 0's node: the job's; node k: ``mlflow_outbox.node<k>.jsonl`` in the output folder, sent
by a thread of its own and by ``src.sync``), so an outage delays them and loses none.
"""

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from src.template.outbox import NODE_OUTBOX, Outbox, OutboxClient, Sender, finish

PREFIX = "system/"
FIRST_READING_S = 1.0  # the first reading, this long after start-up

Write = Callable[[dict[str, float], int], None]  # metrics at a step, to the run


class Sampler(threading.Thread):
    """MLflow's system readings, written at the next step: soon after start-up, then every
    ``every_s`` seconds, and when stopped. Never waits for a server."""

    def __init__(
        self, every_s: float, prefix: str, write: Write, first_step: int, tracking_uri: str
    ) -> None:
        super().__init__(daemon=True, name="system-metrics")
        self.every_s, self.prefix, self.write, self.step = every_s, prefix, write, first_step
        self.tracking_uri = tracking_uri
        self.stopping = threading.Event()

    def run(self) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # Its samplers only (GPU: NVIDIA or AMD, if any): its own loop, which logs, never runs.
        # Its INFO lines ("Skip logging GPU metrics" on a CPU machine) are not for the job's log.
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        source = SystemMetricsMonitor(
            "", sampling_interval=self.every_s, tracking_uri=self.tracking_uri
        )
        source.collect_metrics()  # psutil's first CPU reading is always 0: not one to write
        for monitor in source.monitors:
            monitor.clear_metrics()
        wait, stopped = min(FIRST_READING_S, self.every_s), False
        while not stopped:  # a reading soon after start-up, then every every_s, a last at the end
            stopped = self.stopping.wait(wait)
            source.collect_metrics()
            readings = source.aggregate_metrics()
            for monitor in source.monitors:
                monitor.clear_metrics()
            self.write({self.prefix + key: value for key, value in readings.items()}, self.step)
            self.step, wait = self.step + 1, self.every_s


def writer(client: Any, run_id: str) -> Write:
    """Readings as a metrics batch of the run, through ``client``: the logger's own (an outbox's
    with a server, the store's with SQLite) or a node's outbox. A failure is said once; the
    sampler goes on."""
    from mlflow.entities import Metric

    failed: list[Exception] = []

    def write(metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        try:
            client.log_batch(
                run_id, [Metric(key, value, now, step) for key, value in metrics.items()]
            )
        except Exception as error:
            if not failed:
                failed.append(error)
                rank_zero_warn(f"system metrics of run {run_id} could not be written: {error}")

    return write


class SystemMetrics(Callback):
    """Samples while the job trains, in the first process of every node (``system/node<k>/...``
    when there are several nodes), into the run of rank 0's logger. ``every_node=False`` (a
    SQLite store: no place for writers on other machines) samples rank 0's node only."""

    def __init__(
        self, logger: Any, tracking_uri: str, every_s: float, folder: Path, send_timeout_s: float,
        every_node: bool,
    ) -> None:  # fmt: skip
        self.logger, self.tracking_uri, self.every_s = logger, tracking_uri, every_s
        self.every_node = every_node
        self.folder, self.send_timeout_s = folder, send_timeout_s
        self.sampler: Sampler | None = None
        self.outbox: Outbox | None = None  # node k > 0 against a server: its own
        self.sender: Sender | None = None
        self.run_id: str | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Once per job: the other nodes learn the run and the next step from rank 0.
        start = (self.logger.run_id, next_step(self.logger)) if self.logger else None
        start = trainer.strategy.broadcast(start)
        if trainer.local_rank != 0 or start is None:
            return
        self.run_id, first_step = start
        if trainer.global_rank == 0:
            write = writer(self.logger.experiment, self.run_id)
        elif self.every_node:
            from mlflow import MlflowClient

            name = NODE_OUTBOX.format(trainer.node_rank)
            self.outbox = Outbox(self.folder, self.tracking_uri, name=name)
            self.sender = Sender(self.outbox, MlflowClient(self.tracking_uri))
            self.sender.start()
            write = writer(OutboxClient(None, self.outbox), self.run_id)
        else:
            return
        prefix = PREFIX + (f"node{trainer.node_rank}/" if trainer.num_nodes > 1 else "")
        self.sampler = Sampler(self.every_s, prefix, write, first_step, self.tracking_uri)
        self.sampler.start()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.sampler is not None:
            self.sampler.stopping.set()
            self.sampler.join(timeout=10)  # its last reading, which never waits for a server
            self.sampler = None
        if self.outbox is not None:
            finish(self.outbox, self.sender, self.send_timeout_s, self.run_id or "")
            self.outbox = self.sender = None


def next_step(logger: Any) -> int:
    """A resumed job's first step: after the last one of its run (read when it reopened it)."""
    steps = [step for key, step in logger.last_step.items() if key.startswith(PREFIX)]
    return max(steps, default=-1) + 1
