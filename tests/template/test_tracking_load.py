"""The tracking service's load benchmark (benchmarks/tracking_load.py, the template's, which a
forker keeps; the image task's benchmark, benchmarks/run.py, is tested in
tests/task/test_benchmarks.py)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PROJECT


@pytest.mark.slow
def test_tracking_load_survives_a_killed_server_a_restarted_database_and_a_stopped_bucket(
    tmp_path: Path,
) -> None:
    """``benchmarks.tracking_load --tiny`` against the whole service (the library's
    tracking.sh): 2 jobs and 4 nodes through the outbox while the MLflow server is SIGKILLed,
    PostgreSQL restarted and the S3 endpoint stopped; every point arrives once and every run
    ends FINISHED."""
    out = tmp_path / "load.json"
    command = [sys.executable, "-m", "benchmarks.tracking_load", "--tiny", "--backends"]
    proc = subprocess.run(
        [*command, "postgresql", "--out", str(out)],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = json.loads(out.read_text())
    assert [fault.split(": ", 1)[1] for fault in result["faults"]] == [
        "mlflow server SIGKILLed (supervisord restarts it)",
        "PostgreSQL restarted",
        "S3 endpoint stopped for 5 s",
    ]
    assert result["points_sent"] > 0 and result["records_left_unsent"] == 0
    assert result["points_missing"] == result["points_stored_twice"] == 0
    assert result["runs_finished"] == "3 of 3"
    uploaded, _, expected = result["checkpoints_uploaded"].partition(" (")[0].partition(" of ")
    assert uploaded == expected and int(expected) > 0, result["checkpoints_uploaded"]
    assert all(math.isfinite(value) for value in result["latency_ms"].values())
