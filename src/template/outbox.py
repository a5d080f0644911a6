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

from src.template.store import EXPERIMENT_TAGS

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
    "log_inputs": ("datasets",),
    "log_model": ("folder", "step", "key", "registered_name", "metrics"),  # see export.py
}


class OutboxBusy(RuntimeError):
    """Another process (the job itself, or another sync) is sending this outbox."""


# --- records: a client call as one line of JSON, and back


def encode(method: str, run_id: str, **kwargs: Any) -> dict[str, Any]:
    """A client call as a JSON record."""
    if method not in WRITES and method != "create_run":
        raise ValueError(f"the outbox does not carry {method}")
    record = {"method": method, "run_id": run_id}
    for key, value in kwargs.items():
        if key == "synchronous":
            continue
        value = plain(value)
        record[key] = str(Path(value).resolve()) if key in ("local_path", "folder") else value
    now = int(time.time() * 1000)  # when it happened, not when it is sent
    if method == "set_tag":
        record["value"] = str(record["value"])
    elif method == "set_terminated":
        record["status"] = record.get("status") or "FINISHED"
        record["end_time"] = record.get("end_time") or now
    elif method == "create_run":
        record["start_time"] = now
    return record


def plain(value: Any) -> Any:
    """MLflow entities (Metric, Param, DatasetInput, ...) as JSON-ready dicts, recursively."""
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    if hasattr(type(value), "from_dictionary"):
        return {key: plain(item) for key, item in value}
    return value


def create_run(client: Any, record: dict[str, Any]) -> str:
    """The run an offline job's ``create_run`` record stands for: found by its placeholder tag
    if an earlier sync made it, else made now. Its id."""
    name = record["experiment_name"]
    experiment = client.get_experiment_by_name(name)
    experiment_id = (
        experiment.experiment_id
        if experiment
        else client.create_experiment(name, tags=EXPERIMENT_TAGS)
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
    kwargs = {key: record[key] for key in WRITES[method] if key in record}
    if method == "log_batch":
        for key, entity in (("metrics", Metric), ("params", Param), ("tags", RunTag)):
            kwargs[key] = [entity.from_dictionary(item) for item in kwargs.get(key) or ()]
    elif method == "log_inputs":
        kwargs["datasets"] = [
            DatasetInput(
                Dataset.from_dictionary(d["dataset"]),
                [InputTag.from_dictionary(t) for t in d["tags"]],
            )
            for d in kwargs.get("datasets") or ()
        ]
    elif method == "log_model":
        from src.template.export import log_model

        log_model(client.tracking_uri, run_id, Path(kwargs.pop("folder")), **kwargs)
        return
    getattr(client, method)(run_id, **kwargs)


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
