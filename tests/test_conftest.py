"""The test harness itself: a hung job fails its test with where it hangs, and leaves nothing."""

import os
import sys
import time

import psutil
import pytest

from tests.conftest import PROJECT, run_job

HANGS = """
import multiprocessing, subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
subprocess.Popen(sleeper)  # a rank, say
orphan = f"import subprocess; subprocess.Popen({sleeper!r})"
subprocess.run([sys.executable, "-c", orphan])  # a loader worker whose rank was killed, say
multiprocessing.Queue().put(1)  # a thread that only waits to feed the queue
def stuck_in_a_collective():
    time.sleep(600)
stuck_in_a_collective()
"""


def test_a_hung_job_fails_with_every_processs_stack_and_leaves_nothing() -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        run_job([sys.executable, "-c", HANGS], cwd=PROJECT, env=dict(os.environ), timeout=3)
    message = str(failed.value)
    assert "still running after 3 s" in message
    # Each process dumps in turn (not all at once into one pipe, interleaved), whole.
    assert 'line 9 in stuck_in_a_collective\n  File "<string>", line 10 in <module>' in message
    assert message.count("Current thread") == 3, "the child's and the orphan's stacks too"
    assert message.count(" threads, stdout pipe:") == 3, "a line per process"
    assert "Extension modules:" not in message  # a few thousand characters per process
    assert "in _feed" not in message, "idle threads hid the stuck one"
    time.sleep(0.5)
    leftovers = [
        p
        for p in psutil.process_iter(["cmdline"])
        if any("time.sleep(600)" in arg for arg in p.info["cmdline"] or [])
    ]
    assert not leftovers
