"""System metrics from every node, read by MLflow's samplers. MLflow's own loop writes to the
server directly and stops at its first failed request; these readings go through the outbox (node
k > 0: its own, sent by a thread of its own and by ``src.sync``), so an outage loses none."""

import logging
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from omegaconf import DictConfig

from lightning_exact.tracking.outbox import NODE_OUTBOX, Outbox, OutboxClient, Sender, finish
from lightning_exact.tracking.store import sqlite_file

PREFIX = "system/"
FIRST_READING_S = 1.0  # the first reading, this long after start-up


class Sampler(threading.Thread):
    """MLflow's readings as metrics of run ``run_id`` through ``client`` (the logger's, or a node's
    outbox's) at the next step from ``first_step``: soon after start-up, every ``every_s`` seconds,
    and when stopped. Never waits for a server; a failed write is said once."""

    def __init__(
        self, every_s: float, prefix: str, client: Any, run_id: str, first_step: int, uri: str
    ) -> None:
        super().__init__(daemon=True, name="system-metrics")
        self.every_s = every_s
        self.prefix = prefix
        self.client = client
        self.run_id = run_id
        self.step = first_step
        self.uri = uri
        self.failed = False
        self.stopping = threading.Event()

    def run(self) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        # Its samplers only; not its INFO lines ("Skip logging GPU metrics" on a CPU machine).
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        source = SystemMetricsMonitor("", sampling_interval=self.every_s, tracking_uri=self.uri)
        wait = min(FIRST_READING_S, self.every_s)
        stopped = False
        source.collect_metrics()  # psutil's first CPU reading is always 0: not one to write
        while not stopped:
            for monitor in source.monitors:
                monitor.clear_metrics()
            stopped = self.stopping.wait(wait)
            source.collect_metrics()
            self.write(source.aggregate_metrics())
            self.step = self.step + 1
            wait = self.every_s

    def write(self, readings: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(self.prefix + key, v, now, self.step) for key, v in readings.items()]
        try:
            self.client.log_batch(self.run_id, metrics)
        except Exception as error:
            if not self.failed:
                self.failed = True
                rank_zero_warn(f"system metrics of run {self.run_id} could not be written: {error}")


class SystemMetrics(Callback):
    """Samples while the job trains, in the first process of every node (``system/node<k>/...``
    with several nodes), into rank 0's run; with SQLite (no writers elsewhere), rank 0's only."""

    def __init__(self, logger: Any, settings: DictConfig, folder: Path) -> None:
        self.logger = logger
        self.folder = folder
        self.tracking_uri = settings.tracking_uri
        self.every_s = settings.system_metrics_s
        self.settings = settings
        self.every_node = not sqlite_file(self.tracking_uri)
        self.sampler: Sampler | None = None
        self.outbox: Outbox | None = None  # node k > 0 against a server: its own
        self.sender: Sender | None = None
        self.run_id = ""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The other nodes learn the run and the next step (after a resumed run's last) from rank 0.
        done = getattr(self.logger, "last_step", {})
        steps = [step for key, step in done.items() if key.startswith(PREFIX)]
        start = (self.logger.run_id, max(steps, default=-1) + 1) if self.logger else None
        start = trainer.strategy.broadcast(start)
        if trainer.local_rank != 0 or start is None:
            return
        self.run_id, first_step = start
        if trainer.global_rank == 0:
            client = self.logger.experiment
        elif self.every_node:
            from mlflow import MlflowClient

            name = NODE_OUTBOX.format(trainer.node_rank)
            self.outbox = Outbox(self.folder, self.tracking_uri, name=name)
            self.sender = Sender(self.outbox, MlflowClient(self.tracking_uri))
            self.sender.start()
            client = OutboxClient(None, self.outbox)
        else:
            return
        prefix = PREFIX + (f"node{trainer.node_rank}/" if trainer.num_nodes > 1 else "")
        self.sampler = Sampler(
            self.every_s, prefix, client, self.run_id, first_step, self.tracking_uri
        )
        self.sampler.start()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.sampler is not None:
            self.sampler.stopping.set()
            self.sampler.join(timeout=10)  # its last reading, which never waits for a server
            self.sampler = None
        if self.outbox is not None:
            timeout_s = self.settings.get("send_timeout_s", 0)
            finish(self.outbox, self.sender, timeout_s, self.run_id)
            self.outbox = self.sender = None
