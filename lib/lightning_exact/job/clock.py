"""When the job began: its MLflow run starts then, so the run's duration is the job's. A
process's first job began when the process did (its imports and config included); a sweep's
later jobs in the same process when Hydra called them."""

import time

import psutil

_started: float | None = None


def start_job_clock() -> None:
    """At the start of each job Hydra runs (the entry point's task function)."""
    global _started
    _started = psutil.Process().create_time() if _started is None else time.time()


def job_started() -> float:
    """The job's start (seconds since the epoch); this process's, if no job began yet."""
    return psutil.Process().create_time() if _started is None else _started
