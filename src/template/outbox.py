"""Tracking never waits for the MLflow server: a durable outbox between the job and the server.

Once a job's run is open (that needs the server: one that does not answer is refused at
start), everything the job writes to the run -- metrics, params, tags, dataset inputs,
artifacts, the final status -- is appended to ``<output folder>/mlflow_outbox.jsonl``, fsynced,
and sent in order by a background thread. An outage of any length delays records, never a
training step. Records keep the time they were made, and MLflow stores a metric it already has
once, so a record sent twice (the server took it, its answer was lost) is not duplicated.
What a job could not send by its end, ``python -m src.sync OUTPUT_DIR`` sends later.

``logger.offline=true`` (machines that cannot reach the server): the job never contacts it;
its run is a ``create_run`` record under a placeholder id, and ``src.sync`` creates the run
(once: it looks for the placeholder's tag first) and sends everything under the real id.

SQLite stores are written directly: a local file has no outages.
"""

import fcntl
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

OUTBOX = "mlflow_outbox"  # the job's outbox: <output folder>/mlflow_outbox.jsonl (and .sent)
NODE_OUTBOX = "mlflow_outbox.node{}"  # node k > 0 of a job: its system metrics (see system_metrics)
OUTBOX_FILE = f"{OUTBOX}.jsonl"  # one JSON record per line, the first one a header
RUNS_FILE = "mlflow_outbox.runs.json"  # offline jobs: placeholder run id -> the real one
PLACEHOLDER_TAG = "outbox.placeholder"  # on a run src.sync created for an offline job
# The client calls the outbox carries, with the names of their arguments after the run id.
WRITES: dict[str, tuple[str, ...]] = {
    "log_batch": ("metrics", "params", "tags"),
    "set_tag": ("key", "value"),
    "update_run": ("status", "name"),
    "set_terminated": ("status", "end_time"),
    "log_artifact": ("local_path", "artifact_path"),
    "log_inputs": ("datasets", "models"),
    "log_model": ("folder", "step", "key", "registered_name", "metrics"),  # see export.py
}
# For a caller that must know within seconds whether the server answers (the job's start-up
# check, src.sync), instead of after MLflow's minutes of retries: one retry, 30 s per request
# (an upload of a large checkpoint is one request).
FAIL_FAST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


class OutboxBusy(RuntimeError):
    """Another process (the job itself, or another sync) is sending this outbox."""


# --- records: a client call as one line of JSON, and back


def encode(method: str, run_id: str, **kwargs: Any) -> dict[str, Any]:
    record: dict[str, Any] = {"method": method, "run_id": run_id}
    if method == "log_batch":
        record["metrics"] = [
            [m.key, m.value, m.timestamp, m.step] for m in kwargs.get("metrics") or ()
        ]
        record["params"] = [[p.key, p.value] for p in kwargs.get("params") or ()]
        record["tags"] = [[t.key, t.value] for t in kwargs.get("tags") or ()]
    elif method == "set_tag":
        record["key"], record["value"] = kwargs["key"], str(kwargs["value"])
    elif method == "update_run":
        record["status"], record["name"] = kwargs.get("status"), kwargs.get("name")
    elif method == "set_terminated":
        record["status"] = kwargs.get("status") or "FINISHED"
        record["end_time"] = kwargs.get("end_time") or int(time.time() * 1000)  # now, not sync time
    elif method == "log_artifact":
        record["local_path"] = str(Path(kwargs["local_path"]).resolve())
        record["artifact_path"] = kwargs.get("artifact_path")
    elif method == "log_model":
        record["folder"] = str(Path(kwargs["folder"]).resolve())
        record["step"], record["key"] = kwargs["step"], kwargs["key"]
        record["registered_name"] = kwargs.get("registered_name")
        record["metrics"] = list(kwargs.get("metrics") or ())
    elif method == "create_run":
        record["experiment_name"], record["run_name"] = (
            kwargs["experiment_name"],
            kwargs["run_name"],
        )
        record["tags"], record["start_time"] = kwargs["tags"], int(time.time() * 1000)
    elif method == "log_inputs":
        record["datasets"] = [
            {
                "name": d.dataset.name, "digest": d.dataset.digest, "source": d.dataset.source,
                "source_type": d.dataset.source_type, "tags": {t.key: t.value for t in d.tags},
            }
            for d in kwargs.get("datasets") or ()
        ]  # fmt: skip
    else:
        raise ValueError(f"the outbox does not carry {method}")
    return record


def create_run(client: Any, record: dict[str, Any]) -> str:
    """The run an offline job's ``create_run`` record stands for: found by its placeholder tag
    if an earlier sync made it, else made now. Its id."""
    experiment = client.get_experiment_by_name(record["experiment_name"])
    experiment_id = (
        experiment.experiment_id
        if experiment is not None
        else client.create_experiment(record["experiment_name"])
    )
    placeholder = record["run_id"]
    found = client.search_runs(
        [experiment_id], f"tags.`{PLACEHOLDER_TAG}` = '{placeholder}'", max_results=1
    )
    if found:
        return found[0].info.run_id
    tags = {**record["tags"], PLACEHOLDER_TAG: placeholder}
    run = client.create_run(
        experiment_id, start_time=record["start_time"], tags=tags, run_name=record["run_name"]
    )
    return run.info.run_id


def send(client: Any, record: dict[str, Any]) -> None:
    """Make the client call a record stands for."""
    from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag

    method, run_id = record["method"], record["run_id"]
    if method == "log_batch":
        client.log_batch(
            run_id,
            metrics=[Metric(k, v, ts, step) for k, v, ts, step in record["metrics"]],
            params=[Param(k, v) for k, v in record["params"]],
            tags=[RunTag(k, v) for k, v in record["tags"]],
        )
    elif method == "set_tag":
        client.set_tag(run_id, record["key"], record["value"])
    elif method == "update_run":
        client.update_run(run_id, status=record["status"], name=record["name"])
    elif method == "set_terminated":
        client.set_terminated(run_id, record["status"], end_time=record["end_time"])
    elif method == "log_artifact":
        client.log_artifact(run_id, record["local_path"], record["artifact_path"])
    elif method == "log_model":
        from src.template.export import log_model

        log_model(client.tracking_uri, run_id, Path(record["folder"]), record["step"],
                  record["key"], record["registered_name"], record.get("metrics", ()))  # fmt: skip
    elif method == "log_inputs":
        datasets = [
            DatasetInput(
                Dataset(d["name"], d["digest"], d["source_type"], d["source"]),
                [InputTag(key, value) for key, value in d["tags"].items()],
            )
            for d in record["datasets"]
        ]
        client.log_inputs(run_id, datasets=datasets)


def refused(error: Exception) -> bool:
    """The server answered and said no (or the file is gone): sending again cannot help."""
    from mlflow.exceptions import RestException

    if isinstance(error, FileNotFoundError):
        return True
    return isinstance(error, RestException) and error.get_http_status_code() < 500


# --- the outbox


class Outbox:
    """The records of one job's run, on disk, and how many of them the server has.

    The process that opens it holds an exclusive lock on the file until it closes it (or dies),
    so the job and ``src.sync`` never send the same outbox at once.
    """

    def __init__(self, folder: Path, tracking_uri: str | None = None, name: str = OUTBOX) -> None:
        self.path, self.sent_path = folder / f"{name}.jsonl", folder / f"{name}.sent"
        if tracking_uri is None and not self.path.is_file():
            raise FileNotFoundError(f"{self.path} does not exist: nothing was queued there")
        self.file = self.path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise OutboxBusy(f"{self.path} is being sent by a running job or sync") from None
        self.file.seek(0)
        text = self.file.read()
        if not text.endswith("\n"):  # a record cut by a crash was never logged: drop it
            text = text[: text.rfind("\n") + 1]
            self.file.truncate(len(text.encode()))
        self.records = [json.loads(line) for line in text.splitlines() if line.strip()]
        if not self.records:
            self._write({"tracking_uri": tracking_uri})
        self.tracking_uri: str = self.records[0]["tracking_uri"]
        self.sent = int(self.sent_path.read_text()) if self.sent_path.is_file() else 1
        self.runs_path = folder / RUNS_FILE
        self.runs: dict[str, str] = (
            json.loads(self.runs_path.read_text()) if self.runs_path.is_file() else {}
        )
        self.changed = threading.Condition()

    def _write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.records.append(record)

    def append(self, record: dict[str, Any]) -> None:
        with self.changed:
            self._write(record)
            self.changed.notify_all()

    @property
    def pending(self) -> int:
        return len(self.records) - self.sent

    @property
    def run_id(self) -> str | None:
        """The run's id on the server (None for an offline job's run not created yet)."""
        first = next((r["run_id"] for r in self.records[1:]), None)
        if self.records[1:] and self.records[1]["method"] == "create_run":
            return self.runs.get(first)
        return first

    @property
    def ended(self) -> bool:
        """Whether the job recorded the run's final status (the last status it set)."""
        statuses = [r for r in self.records[1:] if r["method"] in ("set_terminated", "update_run")]
        return bool(statuses) and statuses[-1]["method"] == "set_terminated"

    def send_next(self, client: Any) -> None:
        """Send the oldest unsent record; raises what the client raised if it was not taken."""
        record = self.records[self.sent]
        try:
            if record["method"] == "create_run":
                self.runs[record["run_id"]] = create_run(client, record)
                temporary = self.runs_path.with_suffix(".tmp")
                temporary.write_text(json.dumps(self.runs))
                temporary.replace(self.runs_path)
            else:
                send(
                    client, {**record, "run_id": self.runs.get(record["run_id"], record["run_id"])}
                )
        except Exception as error:
            if not refused(error):
                raise
            log.warning("MLflow refused a %s record, left out: %s", record["method"], error)
        with self.changed:
            self.sent += 1
            temporary = self.sent_path.with_suffix(".tmp")
            temporary.write_text(str(self.sent))
            temporary.replace(self.sent_path)
            self.changed.notify_all()

    def close(self) -> None:
        self.file.close()  # and the lock with it


class Sender(threading.Thread):
    """Sends an outbox's records in the background, in order, retrying until each is taken."""

    def __init__(self, outbox: Outbox, client: Any) -> None:
        super().__init__(daemon=True, name="mlflow-outbox")
        self.outbox, self.client = outbox, client
        self.stopping = threading.Event()
        self.last_error: Exception | None = None

    def run(self) -> None:
        backoff = 1.0
        while not self.stopping.is_set():
            with self.outbox.changed:
                if not self.outbox.pending:
                    self.outbox.changed.wait(timeout=1.0)
                    continue
            try:
                self.outbox.send_next(self.client)
                backoff, self.last_error = 1.0, None
            except Exception as error:  # the server is away: keep the record, try again
                self.last_error = error
                self.stopping.wait(backoff)
                backoff = min(2 * backoff, 10.0)

    def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every record to be sent; the number still pending."""
        deadline = time.monotonic() + timeout_s
        with self.outbox.changed:
            while self.outbox.pending and time.monotonic() < deadline:
                self.outbox.changed.wait(timeout=min(1.0, deadline - time.monotonic()))
            return self.outbox.pending


class OutboxClient:
    """An ``MlflowClient`` whose writes to the run go through the outbox; reads go to the server."""

    def __init__(self, client: Any, outbox: Outbox) -> None:
        self._client, self._outbox = client, outbox

    def __getattr__(self, name: str) -> Any:
        if name not in WRITES:
            return getattr(self._client, name)

        def queued(run_id: str, *args: Any, **kwargs: Any) -> None:
            kwargs.pop("synchronous", None)  # queued calls return at once anyway
            named = dict(zip(WRITES[name], args, strict=False))
            self._outbox.append(encode(name, run_id, **named, **kwargs))

        return queued


def finish(
    outbox: Outbox, sender: Sender | None, timeout_s: float, run_id: str, offline: bool = False
) -> int:
    """At the end of a job: wait up to ``timeout_s`` for the records to be sent, stop sending,
    and say in one line what is left, with the command that sends it. The number left."""
    pending = sender.drain(timeout_s) if sender else outbox.pending
    if sender:
        sender.stopping.set()
    outbox.close()
    folder = outbox.path.parent
    if not pending:
        return 0
    if offline:
        say = f"logger.offline=true: {pending} MLflow record(s) wait in {folder}"
    else:
        reason = str(sender.last_error or "").strip().splitlines()[:1] if sender else []
        say = (
            f"MLflow server {outbox.tracking_uri} did not take {pending} record(s) of "
            f"run {run_id} ({reason[0][:120] if reason else 'no answer yet'}); "
            f"they are kept in {folder}"
        )
    print(
        f"{say}. Send them from a machine that reaches {outbox.tracking_uri}: "
        f"python -m src.sync {folder}",
        file=sys.stderr,
        flush=True,
    )
    return pending
