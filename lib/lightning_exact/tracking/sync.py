"""``python -m src.sync OUTPUT_DIR``: send what a job could not send to its MLflow server.

A job whose server was away at its end keeps the records in ``OUTPUT_DIR/mlflow_outbox.jsonl`` (see
lib/lightning_exact/tracking/outbox.py) and says so. This sends them, in order, and sets the run's
final status (FAILED for a job that died before it set one). A ``logger.offline=true`` job's run is
created here. Run it any time, from any machine that sees the folder and the server; run again, it
changes nothing. Given a sweep folder, it sends every job's, and an offline sweep's parent run: made
first, so the jobs nest under it, and summed up last, once the jobs' runs have their ids."""

import argparse
import sys
from pathlib import Path
from typing import Any

from lightning_exact.environment import environment
from lightning_exact.tracking import (
    mlflow_model,  # noqa: F401  (their outbox record kinds: log_model, summarize)
)
from lightning_exact.tracking.outbox import (
    NODE_OUTBOX,
    OUTBOX_FILE,
    Outbox,
    OutboxBusy,
    encode,
    refused_for_rights,
)
from lightning_exact.tracking.run import RUN_ID_FILE
from lightning_exact.tracking.store import (
    FAIL_FAST,
    TrackingError,
    credentials_moved,
    first_line,
    refuse_empty_certificate_path,
)


def sync(folder: Path, tracking_uri: str | None = None) -> str:
    """Send the outbox of ``folder`` (and its other nodes' system metrics); what was done, in one
    line."""
    from mlflow import MlflowClient

    if (folder / "multirun.yaml").is_file():
        return sync_sweep(folder, tracking_uri)
    outbox = Outbox(folder)
    try:
        uri = tracking_uri or outbox.tracking_uri
        refuse_empty_certificate_path(uri)
        if len(outbox.records) == 1:
            return f"nothing to send: {outbox.path} holds no record"
        if not outbox.ended:  # the job died before it could end its run
            recorded = outbox.records[1]["run_id"]  # an offline job's placeholder, mapped later
            outbox.append(encode("set_terminated", recorded, status="FAILED"))
        client = MlflowClient(uri)
        with environment(**FAIL_FAST):
            count = send_all(outbox, client, uri)
            for path in sorted(folder.glob(NODE_OUTBOX.format("*") + ".jsonl")):
                node = Outbox(folder, name=path.name.removesuffix(".jsonl"))
                try:
                    count += send_all(node, client, uri)
                finally:
                    node.close()
            run_id = outbox.run_id
            status = client.get_run(run_id).info.status
        run_file = folder / RUN_ID_FILE
        if run_file.is_file() and run_file.read_text().strip() != run_id:  # an offline job's
            run_file.write_text(run_id + "\n")
    finally:
        outbox.close()
    return f"sent {count} record(s) to {uri}: run {run_id} is {status}"


def sync_sweep(folder: Path, tracking_uri: str | None = None) -> str:
    """Each job of a sweep folder, and an offline sweep's parent run; one line each."""
    from mlflow import MlflowClient

    jobs = sorted(path.parent for path in folder.glob(f"*/{OUTBOX_FILE}"))
    if jobs and not (folder / OUTBOX_FILE).is_file():  # not offline: the parent is on the server
        return "\n".join(sync(job, tracking_uri) for job in jobs)
    parent = Outbox(folder)
    try:
        uri = tracking_uri or parent.tracking_uri
        client = MlflowClient(uri)
        with environment(**FAIL_FAST):
            count = send_all(parent, client, uri, 1 if parent.sent == 1 else 0)  # it, first
            done = [sync(job, tracking_uri) for job in jobs]
            count += send_all(parent, client, uri)  # its summary, naming the jobs' runs
            status = client.get_run(parent.run_id).info.status
    finally:
        parent.close()
    return "\n".join(
        [*done, f"sent {count} record(s): the sweep's run {parent.run_id} is {status}"]
    )


def send_all(outbox: Outbox, client: Any, uri: str, limit: int | None = None) -> int:
    """Send the pending records of ``outbox`` (the first ``limit`` of them), in order; how many."""
    count = outbox.pending if limit is None else min(limit, outbox.pending)
    for _ in range(count):
        try:
            outbox.send_next(client)
        except Exception as error:
            reason = first_line(error, 160)
            when = (
                "once the account may write to it"
                if refused_for_rights(error)
                else "when it answers"
            )
            raise ConnectionError(
                f"MLflow server {uri} did not take a record of {outbox.path.name} ({reason}); "
                f"{outbox.pending} still pending. Run this again {when}"
            ) from error
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path, help="a job's output folder, or a sweep's")
    parser.add_argument("--tracking-uri", help="the server, if not the one the job used")
    args = parser.parse_args(argv)
    if args.tracking_uri:  # a password typed in it is never printed or stored
        args.tracking_uri = credentials_moved(args.tracking_uri)
    try:
        print(sync(args.output_dir, args.tracking_uri))
    except (OutboxBusy, FileNotFoundError, ConnectionError, TrackingError) as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1
    return 0
