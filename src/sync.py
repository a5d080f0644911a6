"""``python -m src.sync OUTPUT_DIR``: send what a job could not send to its MLflow server.

A job whose server was away at its end keeps the records in ``OUTPUT_DIR/mlflow_outbox.jsonl``
(see src/template/outbox.py) and says so. This sends them, in order, and sets the run's final
status (FAILED for a job that died before it set one). A ``logger.offline=true`` job's run is
created here. Run it any time, from any machine that sees the folder and the server; run again,
it changes nothing.
"""

import argparse
import sys
from pathlib import Path
from typing import Any

from src.template.environment import environment
from src.template.outbox import NODE_OUTBOX, Outbox, OutboxBusy, encode
from src.template.store import FAIL_FAST
from src.template.tracking import RUN_ID_FILE


def sync(folder: Path, tracking_uri: str | None = None) -> str:
    """Send the outbox of ``folder`` (and its other nodes' system metrics); what was done, in one
    line."""
    from mlflow import MlflowClient

    outbox = Outbox(folder)
    try:
        uri = tracking_uri or outbox.tracking_uri
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


def send_all(outbox: Outbox, client: Any, uri: str) -> int:
    """Send every pending record of ``outbox``, in order; how many."""
    count = outbox.pending
    while outbox.pending:
        try:
            outbox.send_next(client)
        except Exception as error:
            reason = str(error).strip().splitlines()[0][:160]
            raise ConnectionError(
                f"MLflow server {uri} did not take a record of {outbox.path.name} ({reason}); "
                f"{outbox.pending} still pending. Run this again when it answers"
            ) from error
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path, help="the job's output folder")
    parser.add_argument("--tracking-uri", help="the server, if not the one the job used")
    args = parser.parse_args(argv)
    try:
        print(sync(args.output_dir, args.tracking_uri))
    except (OutboxBusy, FileNotFoundError, ConnectionError) as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
