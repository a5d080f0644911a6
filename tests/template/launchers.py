"""What the template's own tests of its launch recipes (SLURM, torchrun, SkyPilot, Kubernetes)
share."""

import re
import subprocess
import time

import pytest
from lightning_exact.testing.records import assert_rank_logs

__all__ = ["FINAL_STATES", "assert_rank_logs", "wait_for_job"]

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def wait_for_job(job: str, timeout: float = 300) -> str:
    """The states a SLURM job went through, up to its final one, polled every 0.5 s (``sbatch
    --wait`` backs off to 32 s). A requeued job waits ~11 s (its begin time; cred_expire in
    slurm/local-cluster.sh): starting it sooner by hand gets it killed with "Job credential
    revoked" when that falls in the requeue's second."""
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        info = subprocess.run(
            ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=True
        ).stdout
        state, reason, restarts = (
            re.search(rf"{key}=(\S+)", info).group(1) for key in ("JobState", "Reason", "Restarts")
        )
        if not seen or seen[-1] != (state, reason, restarts):
            seen.append((state, reason, restarts))
        if state in FINAL_STATES:
            return " -> ".join("/".join(s) for s in seen)
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], check=False)
            pytest.fail(f"job {job} still {state} after {timeout} s: {seen}")
        time.sleep(0.5)
