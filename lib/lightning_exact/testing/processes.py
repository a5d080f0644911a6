"""Real processes for tests: a job run as a user runs it (``python -m src.<entry>`` in a project),
failing its test with every process's stack when it hangs, and leaving nothing behind."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

import psutil
import pytest


def run_job(
    command: Sequence[str], *, cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True)`` for a job that may start
    rank and data-loader processes. A job still running after ``timeout`` seconds fails the
    test with where each of its processes is stuck (orphans included: its whole process
    group): each gets SIGABRT in turn, and Python's faulthandler prints its threads' stacks.
    Nothing outlives it."""
    __tracebackhide__ = True  # the failure shows the stacks, not this function's source
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        fail_with_stacks(proc, command, timeout)
    finally:
        end_group(proc)  # a rank or worker left behind
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def end_group(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGKILL the process group ``proc`` leads, and return once each of its processes has
    ended: a signalled process runs until the kernel schedules it, seconds on a busy machine."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()  # the group's leader is this process's child: reaped here
    deadline = time.monotonic() + timeout
    while running := [p for p in process_group(proc.pid) if not ended(p)]:
        assert time.monotonic() < deadline, f"SIGKILL left {running} running for {timeout:g} s"
        time.sleep(0.05)


def ended(process: psutil.Process) -> bool:
    """Gone, or a zombie: dead, its parent yet to reap it (an orphan's init, for one)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def fail_with_stacks(proc: subprocess.Popen, command: Sequence[str], timeout: float) -> None:
    """Fail the test with where each process of a hung job's group is stuck: each gets SIGABRT
    in turn, and Python's faulthandler prints its threads' stacks."""
    __tracebackhide__ = True
    group = process_group(proc.pid)
    table = "\n".join(filter(None, map(describe, group)))
    for process in group:  # one at a time: each dump whole, not interleaved
        with suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGABRT)
        deadline = time.monotonic() + 10  # faulthandler dumps, then the process dies
        while not ended(process) and time.monotonic() < deadline:
            time.sleep(0.05)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    pytest.fail(
        f"{' '.join(map(str, command))} still running after {timeout:g} s. Its processes:\n"
        f"{table}\nTheir stacks (idle queue feeder threads left out):\n"
        f"{busy_stacks(err)[-60000:]}\n--- stdout ---\n{out[-3000:]}"
    )


def process_group(pgid: int) -> list[psutil.Process]:
    """The processes of a process group, newest (children) first: a job's ranks and loader
    workers, also those orphaned by a dead parent (psutil's ``children`` misses them)."""

    def in_group(process: psutil.Process) -> bool:
        with suppress(ProcessLookupError, psutil.Error):
            return os.getpgid(process.pid) == pgid
        return False

    return sorted(filter(in_group, psutil.process_iter()), key=lambda p: -p.pid)


def describe(process: psutil.Process) -> str:
    """A process in one line: its parent, state, threads, where its stdout and stderr go."""
    outputs = []
    for fd in (1, 2):
        try:
            outputs.append(os.readlink(f"/proc/{process.pid}/fd/{fd}"))
        except OSError:
            outputs.append("(none)")  # closed, or a zombie's
    with suppress(psutil.Error):
        return (
            f"  pid {process.pid} ppid {process.ppid()} {process.status()} "
            f"{process.num_threads()} threads, stdout {outputs[0]} stderr {outputs[1]}: "
            + " ".join(process.cmdline()).replace("\n", " ")[:120]
        )
    return ""


def busy_stacks(stderr: str) -> str:
    """faulthandler's dumps in ``stderr`` without the noise that hid the stuck thread: the
    extension-module lists, and the threads that only wait to feed a multiprocessing queue."""
    blocks = stderr.split("\n\n")  # faulthandler ends each thread's stack with a blank line
    idle = ("Extension modules:", "in _feed\n")
    return "\n\n".join(b for b in blocks if not any(mark in b + "\n" for mark in idle))


def kill_process_trees(*procs: subprocess.Popen) -> None:
    """SIGKILL processes and every process they started, at once (a lost node gives no
    signal), and wait until all are gone."""
    tree = []
    for proc in procs:
        with suppress(psutil.NoSuchProcess):
            root = psutil.Process(proc.pid)
            tree += [root, *root.children(recursive=True)]
    for process in tree:
        with suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(tree, timeout=30)
    for proc in procs:
        proc.wait()


def one_error_line(stderr: str) -> str:
    """The one ``Error:`` line of a refused job's stderr (and no traceback)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("Error:")]
    return line


def run_entry(
    module: str,
    *overrides: str,
    project: Path,
    cwd: Path,
    check: bool = True,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """Run ``python -m src.<module>`` of ``project`` in a subprocess, as a user would; fail with
    its output. ``env`` adds or replaces environment variables (``PYTHONPATH`` is ``project``)."""
    env = {**os.environ, "PYTHONPATH": str(project), **(env or {})}
    command = [sys.executable, "-m", f"src.{module}", *overrides]
    proc = run_job(command, cwd=cwd, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(
            f"src.{module} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def processes_with_env(**match: str) -> list[psutil.Process]:
    """Running ``src.train`` processes whose environment has all of ``match`` (a launcher's
    rank variables, e.g. ``SLURM_JOB_ID`` and ``SLURM_PROCID``)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if "src.train" in " ".join(proc.cmdline()) and all(
                proc.environ().get(key) == value for key, value in match.items()
            ):
                found.append(proc)
        except psutil.Error:  # gone, or not ours to read
            continue
    return found


def wait_for_file(path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout} s"
        time.sleep(0.2)


def launch_together(
    commands: list[list[str]], envs: list[dict[str, str]], cwd: Path, *, project: Path
) -> None:
    """Start processes the way a cluster launcher would, one per node or task, each with its
    ``envs`` entry and ``project`` importable, and wait; fail with their logs' tails if one
    fails (the others are then killed: they would wait for it until their rendezvous times
    out)."""
    logs = [cwd / f"process{i}.log" for i in range(len(commands))]
    procs = [
        subprocess.Popen(
            command,
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": str(project), **env},
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        for command, env, log in zip(commands, envs, logs, strict=True)
    ]
    deadline = time.monotonic() + 300
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    outputs = "\n".join(log.read_text()[-3000:] for log in logs)
    assert [p.returncode for p in procs] == [0] * len(procs), outputs


def sync(run_dir: Path, *options: str, project: Path) -> subprocess.CompletedProcess:
    """``python -m src.sync RUN_DIR [options]`` of ``project``, from the run folder's parent."""
    return subprocess.run(
        [sys.executable, "-m", "src.sync", str(run_dir), *options],
        cwd=run_dir.parent,
        env={**os.environ, "PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
        timeout=300,
    )
