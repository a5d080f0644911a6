"""``python -m src.train ...`` without paying its ~3 s of imports for each of many short runs.

A server process imports ``src.train`` once; for each request it forks, and the child runs the
module as ``python -m`` does (``runpy``, as ``__main__``, with the request's argv, folder and
environment, stdout and stderr to files) and exits as that interpreter would: a real process
with its own exit code, output and exit handlers. Used for commands refused before any work
(tests/test_bad_input.py); their environment must not matter at import time, so requests with
an environment of their own go through a fresh ``python`` (``run_entry``) instead.
"""

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

SERVER = r"""
import json, os, runpy, sys
import src.train  # the imports each child shares
requests, replies = sys.stdin, os.fdopen(os.dup(1), "w")
for line in requests:
    request = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, request["out"]), (2, request["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["-m", *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        sys.exit(0)  # from here the child ends as `python -m` would, exceptions included
    replies.write(f"{os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}\n")
    replies.flush()
"""


class ForkedEntry:
    """Runs ``src.<module>`` commands in forks of one process that imported it."""

    def __init__(self, project: Path) -> None:
        self.project = project
        env = {**os.environ, "PYTHONPATH": str(project)}
        self.server = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            cwd=project,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )

    def run(
        self, module: str, *args: str, cwd: Path, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        out = cwd.parent / f"{cwd.name}.stdout"
        err = cwd.parent / f"{cwd.name}.stderr"
        env = {**os.environ, "PYTHONPATH": str(self.project), "PYTHONFAULTHANDLER": "1"}
        request = {"module": f"src.{module}", "args": list(args), "cwd": str(cwd), "env": env}
        self.server.stdin.write(json.dumps({**request, "out": str(out), "err": str(err)}) + "\n")
        self.server.stdin.flush()
        if not select.select([self.server.stdout], [], [], timeout)[0]:
            os.killpg(self.server.pid, signal.SIGKILL)
            pytest.fail(f"src.{module} {' '.join(args)} still running after {timeout:g} s")
        code = int(self.server.stdout.readline())
        command = [sys.executable, "-m", f"src.{module}", *args]
        return subprocess.CompletedProcess(command, code, out.read_text(), err.read_text())

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=30)
