"""Tracking never waits for an MLflow server: what a job writes to its run is appended to
``<output folder>/mlflow_outbox.jsonl``, fsynced, and sent in order by a background thread, so an
outage delays records, never a training step (a record sent twice is stored once: it keeps its
time). What is left at the end, ``python -m src.sync OUTPUT_DIR`` sends; ``logger.offline=true``
leaves it the run itself, a ``create_run`` record under a placeholder id."""

import fcntl
import json
import logging
import os
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_exact.files import write_text_atomically
from lightning_exact.tracking.store import EXPERIMENT_TAGS, first_line, http_status

log = logging.getLogger(__name__)

OUTBOX = "mlflow_outbox"  # the job's outbox: <output folder>/mlflow_outbox.jsonl (and .sent)
NODE_OUTBOX = "mlflow_outbox.node{}"  # node k > 0 of a job: its system metrics
OUTBOX_FILE = f"{OUTBOX}.jsonl"  # one JSON record per line, the first one a header
RUNS_FILE = "mlflow_outbox.runs.json"  # offline jobs: placeholder run id -> the real one
PLACEHOLDER_TAG = "outbox.placeholder"  # on a run src.sync created for an offline job
OFFLINE = "offline-"  # how a placeholder id starts
# The client calls the outbox carries, with the names of their arguments after the run id.
WRITES: dict[str, tuple[str, ...]] = {
    "log_batch": ("metrics", "params", "tags"),
    "set_tag": ("key", "value"),
    "update_run": ("status", "name"),
    "set_terminated": ("status", "end_time"),
    "log_artifact": ("local_path", "artifact_path"),
    "log_artifacts": ("local_dir", "artifact_path"),  # a folder: a sharded checkpoint
    "log_inputs": ("datasets",),
}
# Record kinds beyond the client's own calls: name -> (the names of their arguments after the
# run id, how one is sent: ``send(client, run_id, **arguments)``). The module that owns a kind
# registers it (mlflow_model.py: log_model; sweep_run.py: summarize); src.sync imports those.
KINDS: dict[str, tuple[tuple[str, ...], Callable[..., None]]] = {}
KEPT_ARRAY = "log_image"  # MlflowClient's: an array, kept in the job's folder first
ARRAY_ARGUMENTS = ("local_path", "artifact_file", "key", "step", "timestamp")


def register_kind(name: str, arguments: tuple[str, ...], send: Callable[..., None]) -> None:
    """A record kind of its own, queued with ``encode(name, run_id, **arguments)``."""
    KINDS[name] = (arguments, send)


def folder_of(artifact_file: str) -> str | None:
    """The run's artifact folder of ``artifact_file`` (None: the top)."""
    parent = Path(artifact_file).parent.as_posix()
    return None if parent == "." else parent


def send_array(client: Any, run_id: str, local_path: str, **kwargs: Any) -> None:
    """A ``log_image`` record: the array kept in the job's folder, given to MLflow."""
    import numpy as np

    getattr(client, KEPT_ARRAY)(run_id, np.load(local_path), **kwargs, synchronous=True)


def offline_run_id() -> str:
    """The id an offline job's run has until src.sync creates the run."""
    return f"{OFFLINE}{uuid.uuid4().hex}"


register_kind(KEPT_ARRAY, ARRAY_ARGUMENTS, send_array)


class OutboxBusy(RuntimeError):
    """Another process (the job itself, or another sync) is sending this outbox."""


def encode(method: str, run_id: str, **kwargs: Any) -> dict[str, Any]:
    """A client call as a JSON record, stamped with when it happened (not when it is sent)."""
    record = {"method": method, "run_id": run_id, **{k: json_ready(v) for k, v in kwargs.items()}}
    for key in {"local_path", "folder"} & set(record):
        record[key] = str(Path(record[key]).resolve())
    now = int(time.time() * 1000)
    if method == "set_terminated":
        record["status"] = record.get("status") or "FINISHED"
        record["end_time"] = record.get("end_time") or now
    elif method == "create_run":
        record["start_time"] = now
    return record


def json_ready(value: Any) -> Any:
    """MLflow entities (Metric, Param, DatasetInput, ...) as JSON-ready dicts, recursively."""
    if isinstance(value, list | tuple):
        return [json_ready(item) for item in value]
    if hasattr(type(value), "from_dictionary"):
        return {key: json_ready(item) for key, item in value}
    return value


def send(client: Any, record: dict[str, Any]) -> None:
    """Make the client call a record stands for."""
    from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag

    method = record["method"]
    run_id = record["run_id"]
    if method in KINDS:
        arguments, send_kind = KINDS[method]
        send_kind(client, run_id, **{key: record[key] for key in arguments if key in record})
        return
    kwargs = {key: record[key] for key in WRITES[method] if key in record}
    if method == "log_batch":
        for key, entity in (("metrics", Metric), ("params", Param), ("tags", RunTag)):
            kwargs[key] = [entity.from_dictionary(item) for item in kwargs.get(key) or ()]
    elif method == "log_inputs":
        kwargs["datasets"] = [
            DatasetInput(Dataset.from_dictionary(d["dataset"]), [InputTag(**t) for t in d["tags"]])
            for d in kwargs["datasets"]
        ]
    getattr(client, method)(run_id, **kwargs)


def create_run(client: Any, record: dict[str, Any]) -> str:
    """The id of the run an offline job's ``create_run`` record stands for: made by an earlier
    sync (found by its placeholder tag), else now; an offline sweep job's under the parent run
    that syncing its sweep folder made first."""
    name = record["experiment_name"]
    placeholder = record["run_id"]
    tags = dict(record["tags"])
    known = client.get_experiment_by_name(name)
    exp = known.experiment_id if known else client.create_experiment(name, tags=EXPERIMENT_TAGS)
    if found := created(client, exp, placeholder):
        return found
    if (parent := tags.get("mlflow.parentRunId", "")).startswith(OFFLINE):
        tags["mlflow.parentRunId"] = created(client, exp, parent)
        if tags["mlflow.parentRunId"] is None:
            raise LookupError(
                f"the sweep's parent run {parent} is not on the server yet: "
                "python -m src.sync <sweep folder> sends it first"
            )
    return client.create_run(
        exp,
        start_time=record["start_time"],
        run_name=record["run_name"],
        tags={**tags, PLACEHOLDER_TAG: placeholder},
    ).info.run_id


def created(client: Any, experiment_id: str, placeholder: str) -> str | None:
    """The run a sync made for an offline run's placeholder, if any."""
    found = client.search_runs([experiment_id], f"tags.`{PLACEHOLDER_TAG}` = '{placeholder}'")
    return found[0].info.run_id if found else None


class Outbox:
    """The records of one job's run, on disk, and how many of them the server has. Its process
    holds a lock on the file until it closes it (or dies): one sender at a time."""

    def __init__(self, folder: Path, tracking_uri: str | None = None, name: str = OUTBOX) -> None:
        self.path = folder / f"{name}.jsonl"
        self.sent_path = folder / f"{name}.sent"
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
        text = text[: text.rfind("\n") + 1]  # a record cut by a crash was never logged: dropped
        self.file.truncate(len(text.encode()))
        self.records = [json.loads(line) for line in text.splitlines() if line.strip()]
        self.changed = threading.Condition()
        if not self.records:
            self.append({"tracking_uri": tracking_uri})
        self.tracking_uri: str = self.records[0]["tracking_uri"]
        self.sent = int(self.sent_path.read_text()) if self.sent_path.is_file() else 1
        self.runs_path = folder / RUNS_FILE
        self.runs = json.loads(self.runs_path.read_text()) if self.runs_path.is_file() else {}

    def append(self, record: dict[str, Any]) -> None:
        with self.changed:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            os.fsync(self.file.fileno())
            self.records.append(record)
            self.changed.notify_all()

    @property
    def pending(self) -> int:
        return len(self.records) - self.sent

    @property
    def run_id(self) -> str | None:
        """The run's id on the server (None for an offline job's run not created yet)."""
        first = (self.records[1:] or [{"method": "", "run_id": None}])[0]
        return (
            self.runs.get(first["run_id"]) if first["method"] == "create_run" else first["run_id"]
        )

    @property
    def ended(self) -> bool:
        """Whether the last status the job set to its run was a final one."""
        statuses = [r for r in self.records[1:] if r["method"] in ("set_terminated", "update_run")]
        return bool(statuses) and statuses[-1]["method"] == "set_terminated"

    def send_next(self, client: Any) -> None:
        """Send the oldest unsent record; raises what the client raised if it was not taken."""
        record = self.records[self.sent]
        run_id = self.runs.get(record["run_id"], record["run_id"])
        try:
            if record["method"] == "create_run":
                self.runs[record["run_id"]] = create_run(client, record)
                write_text_atomically(self.runs_path, json.dumps(self.runs))
            else:
                send(client, {**record, "run_id": run_id})
        except Exception as error:  # refused (or the file is gone): sending again cannot help
            if not (refused_for_the_record(error) or isinstance(error, FileNotFoundError)):
                raise  # kept: the server away or busy, or the account's rights gone for now
            log.warning("MLflow refused a %s record, left out: %s", record["method"], error)
        with self.changed:
            self.sent += 1
            write_text_atomically(self.sent_path, str(self.sent))
            self.changed.notify_all()

    def close(self) -> None:
        self.file.close()  # and the lock with it


# SQLAlchemy's pool timeout (its error code 3o7r), which MLflow's store answers with a 400
# BAD_REQUEST: the server's database connections were all busy, not a record it refuses.
POOL_TIMEOUT = re.compile(
    r"QueuePool limit of size \d+ overflow \d+ reached|sqlalche\.me/e/\d+/3o7r"
)


def server_overloaded(error: BaseException | None) -> bool:
    """The server answered 400 because its database was busy (a 2-core server past its load,
    docs/tracking-server.md): the record waits and is sent again, like one for a server away."""
    return http_status(error) == 400 and bool(POOL_TIMEOUT.search(str(error)))


def refused_for_the_record(error: BaseException) -> bool:
    """The server refused the record itself (a 4xx that is neither the account's rights nor its
    busy database): sending it again cannot help."""
    from mlflow.exceptions import RestException

    refused = isinstance(error, RestException) and http_status(error) < 500
    return refused and not (refused_for_rights(error) or server_overloaded(error))


def refused_for_rights(error: BaseException | None) -> bool:
    """The server refused the account (HTTP 401 or 403): its rights may come back, so the
    records wait, like records for a server that is away."""
    return http_status(error) in (401, 403)


class Sender(threading.Thread):
    """Sends an outbox's records in the background, in order, retrying until each is taken."""

    def __init__(self, outbox: Outbox, client: Any) -> None:
        super().__init__(daemon=True, name="mlflow-outbox")
        self.outbox = outbox
        self.client = client
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
                backoff = 1.0
                self.last_error = None
            except Exception as error:  # the server is away: keep the record, try again
                if refused_for_rights(error) and not refused_for_rights(self.last_error):
                    log.warning(
                        "MLflow server %s refused this run's records for the account's rights "
                        "(%s); they are kept and sent when it takes them again",
                        self.outbox.tracking_uri,
                        first_line(error),
                    )
                self.last_error = error
                self.stopping.wait(backoff)
                backoff = min(2 * backoff, 10.0)

    def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every record to be sent; the number still pending."""
        with self.outbox.changed:
            self.outbox.changed.wait_for(lambda: not self.outbox.pending, timeout_s)
            return self.outbox.pending


FILES = "mlflow_outbox.files"  # beside the outbox: what a job logged as an object, as a file


class OutboxClient:
    """An ``MlflowClient`` whose writes to the run go through the outbox; reads go to the server.
    What a task logs during training as an object (MLflow's ``log_image``, ``log_figure``,
    ``log_text``, ``log_dict``) is written to a file in the job's folder first and sent from
    there, in order: an outage, or an offline job, loses none of it."""

    def __init__(self, client: Any, outbox: Outbox) -> None:
        self._client = client
        self._outbox = outbox

    def kept(self, name: str) -> Path:
        """A new file ``name`` of the job's folder, kept until its record is sent (and after)."""
        folder = self._outbox.path.parent / FILES / uuid.uuid4().hex
        folder.mkdir(parents=True)
        return folder / name

    def log_image(
        self,
        run_id: str,
        image: Any,
        artifact_file: str | None = None,
        key: str | None = None,
        step: int | None = None,
        timestamp: int | None = None,
        synchronous: Any = None,
    ) -> None:
        """MLflow's ``log_image`` (a numpy array or PIL image; with ``key`` and ``step``, a step
        of MLflow's series, at the time it was logged), kept as a numpy array (a PIL image's
        pixels: MLflow makes the same image of them) and sent as MLflow converts it. (Sent
        twice, after a crash between sending and counting it sent, a step of a series is there
        twice: MLflow names each anew.)"""
        import numpy as np

        if (artifact_file is None) == (key is None) or (artifact_file and step is not None):
            raise TypeError("give artifact_file, or key (and step): one of them, as MLflow asks")
        path = self.kept("array.npy")
        np.save(path, np.asarray(image))
        series = {} if key is None else {"key": key, "step": step or 0}
        when = {"timestamp": timestamp or int(time.time() * 1000)} if key is not None else {}
        record = encode(KEPT_ARRAY, run_id, local_path=path, artifact_file=artifact_file)
        self._outbox.append(record | series | when)

    def log_figure(
        self, run_id: str, figure: Any, artifact_file: str, *, save_kwargs: Any = None
    ) -> None:
        """A matplotlib (or plotly) figure, saved as ``artifact_file`` says, then an artifact."""
        path = self.kept(Path(artifact_file).name)
        if hasattr(figure, "savefig"):  # matplotlib
            figure.savefig(path, **(save_kwargs or {}))
        elif path.suffix == ".html":  # plotly
            figure.write_html(path)
        else:
            figure.write_image(path)
        self.log_artifact(run_id, path, folder_of(artifact_file))

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        path = self.kept(Path(artifact_file).name)
        path.write_text(text, encoding="utf-8")
        self.log_artifact(run_id, path, folder_of(artifact_file))

    def log_dict(self, run_id: str, dictionary: Any, artifact_file: str) -> None:
        """JSON, or YAML for a ``.yaml``/``.yml`` name, as MLflow's ``log_dict`` writes it."""
        path = self.kept(Path(artifact_file).name)
        if path.suffix in (".yaml", ".yml"):
            import yaml

            path.write_text(yaml.safe_dump(dictionary, default_flow_style=False))
        else:
            path.write_text(json.dumps(dictionary, indent=2))
        self.log_artifact(run_id, path, folder_of(artifact_file))

    def __getattr__(self, name: str) -> Any:
        if name not in WRITES:
            return getattr(self._client, name)

        def queued(run_id: str, *args: Any, synchronous: Any = None, **kwargs: Any) -> None:
            named = dict(zip(WRITES[name], args, strict=False))
            self._outbox.append(encode(name, run_id, **named, **kwargs))

        return queued


def finish(
    outbox: Outbox, sender: Sender | None, timeout_s: float, run_id: str, offline: bool = False
) -> int:
    """At a job's end: wait up to ``timeout_s`` for the records to be sent, stop sending, and say
    in one line what is left, with the command that sends it. The number left."""
    pending = sender.drain(timeout_s) if sender else outbox.pending
    if sender:
        sender.stopping.set()
    outbox.close()
    folder = outbox.path.parent
    if pending:
        last_error = sender.last_error if sender else None
        error = first_line(last_error) if last_error else "a request still unanswered or retried"
        say = (
            f"logger.offline=true: {pending} MLflow record(s) wait in {folder}"
            if offline
            else f"MLflow server {outbox.tracking_uri} did not take {pending} record(s) of run "
            f"{run_id} ({error}); they are kept in {folder}"
        )
        when = (
            "Once the account may write to the run's experiment again"
            if refused_for_rights(last_error)
            else f"Send them from a machine that reaches {outbox.tracking_uri}"
        )
        print(f"{say}. {when}: python -m src.sync {folder}", file=sys.stderr, flush=True)
    return pending
