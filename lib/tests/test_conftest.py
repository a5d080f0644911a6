"""The test harness itself: a hung job fails its test with where it hangs, and leaves nothing;
tests that share a job or a service run on one xdist worker, which starts it once."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import PROJECT, run_job

HANGS = """
import multiprocessing, subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(600)  # " + sys.argv[1]]
subprocess.Popen(sleeper)  # a rank, say
orphan = f"import subprocess; subprocess.Popen({sleeper!r})"
subprocess.run([sys.executable, "-c", orphan])  # a loader worker whose rank was killed, say
multiprocessing.Queue().put(1)  # a thread that only waits to feed the queue
def stuck_in_a_collective():
    time.sleep(600)
stuck_in_a_collective()
"""


def test_a_hung_job_fails_with_every_processs_stack_and_leaves_nothing() -> None:
    job = uuid.uuid4().hex  # in each of its command lines: not another test's or checkout's
    with pytest.raises(pytest.fail.Exception) as failed:
        run_job([sys.executable, "-c", HANGS, job], cwd=PROJECT, env=dict(os.environ), timeout=3)
    message = str(failed.value)
    assert "still running after 3 s" in message
    # Each process dumps in turn (not all at once into one pipe, interleaved), whole.
    assert 'line 9 in stuck_in_a_collective\n  File "<string>", line 10 in <module>' in message
    assert message.count("Current thread") == 3, "the child's and the orphan's stacks too"
    assert message.count(" threads, stdout pipe:") == 3, "a line per process"
    assert "Extension modules:" not in message  # a few thousand characters per process
    assert "in _feed" not in message, "idle threads hid the stuck one"
    # run_job returns once they have ended: no wait here, on an idle or a busy machine.
    leftovers = [
        p
        for p in psutil.process_iter(["cmdline", "status"])
        if any(job in arg for arg in p.info["cmdline"] or [])
        and p.info["status"] != psutil.STATUS_ZOMBIE
    ]
    assert not leftovers


GROUPED = """
import os, pathlib, pytest

@pytest.fixture(scope="module")
def service():
    return os.getpid()  # a server or a job, started once per worker that runs the module

@pytest.mark.xdist_group("service")
@pytest.mark.parametrize("n", range(4))
def test_uses_the_service(service, n):
    said = f"worker {os.environ['PYTEST_XDIST_WORKER']} service {service}"
    pathlib.Path(f"said-{n}").write_text(said)
"""


def test_tests_of_one_xdist_group_run_on_one_worker(tmp_path: Path) -> None:
    """``--dist loadgroup`` (the pytest settings' addopts): the tests marked with one
    ``xdist_group`` share one worker, so its module fixture starts once. With pytest 9.2 and
    xdist 3.8 the mark was silently ignored (pytest-xdist issue 1386): each worker started its
    own tracking service or reference job, and the suites took minutes longer."""
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q"]
        + ["-p", "no:cacheprovider", "--rootdir", str(tmp_path), "test_grouped.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = {path.read_text() for path in tmp_path.glob("said-*")}
    assert len(said) == 1, f"one worker, one service: {sorted(said)}"
