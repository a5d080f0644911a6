"""Rank 0's MLflow logger: metrics at the global step, its run's records kept in an outbox and
sent in the background against a server (it opens and closes both), offline runs as records only;
TensorBoard in one file; the run's id in every checkpoint."""

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

from lightning_exact.private import run_context_tags
from lightning_exact.tracking import store
from lightning_exact.tracking.outbox import Outbox, OutboxClient, Sender, encode, finish
from lightning_exact.tracking.store import TrackingError, without_password

STATUS = {"success": "FINISHED", "failed": "FAILED", "finished": "FINISHED"}  # Lightning's


class RunLogger(MLFlowLogger):
    """Metrics at the step Lightning gives (the global step:
    :mod:`~lightning_exact.training.steps`), each at most once a step: a continued run skips the
    steps it has (a job killed between logging a step and checkpointing it trains that step
    again), and a value Lightning logs again at the same step (``epoch`` beside an epoch's last
    points) is kept once."""

    def __init__(
        self,
        experiment_name: str,
        run_name: str | None,
        tracking_uri: str,
        outbox_folder: Path,
        offline: bool = False,
        start_time: float | None = None,
        **kwargs: Any,
    ) -> None:
        names = {"experiment_name": experiment_name, "run_name": run_name}
        continued = kwargs.get("run_id") is not None and not offline
        if kwargs.get("run_id") is None and start_time is not None:  # a new run, begun with its job
            tags = run_context_tags(kwargs.get("tags") or {})
            kwargs["run_id"] = new_run(tracking_uri, experiment_name, run_name, tags, start_time)
        super().__init__(**names, tracking_uri=tracking_uri, **kwargs)
        self.uri = tracking_uri
        self.run_name = run_name  # a continued run takes it: the world it finishes on
        self.experiment_name = experiment_name
        self.offline = offline  # the outbox is all there is: nothing contacts the server
        self.continued = continued
        self.last_step: dict[str, int] = {}  # per metric (a continued run's read when reopened)
        self.outbox_folder = outbox_folder
        self.outbox: Outbox | None = None  # with a server: opened by start_sending
        self.sender: Sender | None = None
        if offline:  # the run is a record for src.sync to create later
            self.outbox = Outbox(outbox_folder, without_password(tracking_uri))
            tags = run_context_tags(kwargs.get("tags") or {})
            self.outbox.append(encode("create_run", self.run_id, **names, tags=tags))

    def start_sending(self) -> None:
        """Against a server: open the run, then send its records from the outbox in the
        background, in order (:mod:`~lightning_exact.tracking.outbox`); the job never waits for the
        server."""
        if self.outbox is not None:  # offline: nothing is sent
            return
        client = opened_run(self, self.uri, self.experiment_name)
        self.outbox = Outbox(self.outbox_folder, without_password(self.uri))
        self.sender = Sender(self.outbox, client)
        self.sender.start()

    def stop_sending(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the records, then say in one line what is left, if any."""
        if self.outbox is not None:
            finish(self.outbox, self.sender, timeout_s, self.run_id, self.offline)

    @property
    def experiment(self) -> Any:
        client = None if self.offline else super().experiment
        return OutboxClient(client, self.outbox) if self.outbox else client

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        """Lightning's, at the end of ``fit`` and of ``test`` ("success"), is not the job's end:
        the run ends FINISHED when the job's outcome is recorded (:func:`end_run`), so its
        duration is the job's. A failure or a stop ends it at once (FAILED, KILLED)."""
        if status == "success":
            return
        if self.outbox is None:
            return super().finalize(status)
        # Lightning's finalize asks the server whether the run exists first: it may be away.
        self.experiment.set_terminated(self.run_id, STATUS.get(status, "KILLED"))

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        if step is not None:
            metrics = {k: v for k, v in metrics.items() if step > self.last_step.get(k, -1)}
        if metrics:
            super().log_metrics(metrics, step=step)
            self.last_step.update(dict.fromkeys(metrics, -1 if step is None else step))


class OneFileTensorBoardLogger(TensorBoardLogger):
    """One events file per job (rank 0's): Lightning closes the writer after fitting and opens a
    second file for testing; this flushes instead, and :func:`sending` closes it at the end."""

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._experiment is not None:  # not `experiment`: it would open a file to flush
            self._experiment.flush()
        self.save()

    def close(self) -> None:
        if self._experiment is not None:
            self._experiment.close()


def new_run(
    tracking_uri: str, experiment_name: str, run_name: str | None, tags: dict, start_time: float
) -> str:
    """A new run of the experiment (the store prepared it), started at ``start_time``: Lightning
    creates its runs when first used, after the job's imports, config and data. An account that
    may read the experiment but not write runs into it is refused here, in one line."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    with refused_in_one_line(tracking_uri, experiment_name):
        experiment = client.get_experiment_by_name(experiment_name)
        started = int(start_time * 1000)
        run = client.create_run(experiment.experiment_id, started, tags, run_name)
    return run.info.run_id


def mlflow_logger(loggers: list[Logger]) -> MLFlowLogger | None:
    return next((logger for logger in loggers if isinstance(logger, MLFlowLogger)), None)


def opened_run(logger: MLFlowLogger, tracking_uri: str, experiment_name: str) -> Any:
    """The server's client, once it opened the run; an account that may read the experiment but
    not write runs into it is refused here, in one line."""
    with refused_in_one_line(tracking_uri, experiment_name):
        return logger.experiment


@contextmanager
def refused_in_one_line(tracking_uri: str, experiment_name: str) -> Iterator[None]:
    """An error of the block that is the server refusing the account becomes one line
    (:func:`store.refusal`); any other error stays as it is."""
    try:
        yield
    except Exception as error:
        if refused := store.refusal(tracking_uri, experiment_name, error):
            raise TrackingError(refused) from error
        raise


class RunBookkeeping(Callback):
    """Stores the run in every checkpoint: eval and predict link back to it."""

    def __init__(self, logger: MLFlowLogger, tracking_uri: str) -> None:
        self.logger = logger
        self.tracking_uri = tracking_uri

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.is_global_zero:
            uri = without_password(self.tracking_uri)
            checkpoint["mlflow"] = {"run_id": self.logger.run_id, "tracking_uri": uri}
