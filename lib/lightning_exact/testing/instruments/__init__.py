"""Test instruments: folders put on ``PYTHONPATH`` of a job a test starts, whose
``sitecustomize.py`` patches the project's task there (a real signal at a chosen step, a pause,
a slower step), so a job's config stays as a user types it."""

import os
from pathlib import Path

SIGNAL_AT_STEP = Path(__file__).parent / "signal_at_step"
# RECORD_BATCHES / RECORD_METRICS: each training batch's samples or metric sums, one JSON line
RECORD_BATCHES = Path(__file__).parent / "record_batches"


def signal_at_step(at: str, project: Path) -> dict[str, str]:
    """The environment of a job of ``project`` whose rank 0 gets a real signal in a chosen
    training step (``"14:SIGTERM"``), or in its test's first step (``"test:SIGTERM"``): a stop at
    a known step, the job's config unchanged (``signal_at_step/sitecustomize.py``)."""
    return {
        "PYTHONPATH": os.pathsep.join([str(SIGNAL_AT_STEP), str(project)]),
        "SIGNAL_AT_STEP": at,
    }
