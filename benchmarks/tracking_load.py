"""The team's tracking service under load, with faults: ``python -m benchmarks.tracking_load``.

Drives an MLflow server as the cloud write-up's setup does: several concurrent jobs (a sweep's
children under its parent run), each with a rank-0 metric stream and checkpoint uploads, and
simulated nodes sending system metrics into their job's run, every record through the project's
outbox (``lib/lightning_exact/tracking/outbox.py``: fsynced, sent in order, kept while the server is
away).

* ``postgresql``: the whole service, ``python -m lightning_exact.server start`` (PostgreSQL,
  MLflow's basic-auth server with artifacts proxied to an S3 bucket, caddy's TLS, supervisord).
  During the run the MLflow server is SIGKILLed (supervisord starts it again), PostgreSQL is
  restarted, and the S3 endpoint is stopped (SIGSTOP) for a while.
* ``sqlite``: the single-user default, ``mlflow server`` on a SQLite file, the same load, no
  faults (nothing would restart it).

The S3 endpoint is moto's server, started here. Each prints records sent and stored (metric
points: missing or stored twice), the latency of the client's calls as the senders saw them
(through MLflow's own retries), calls that failed and were sent again, the server's peak memory
(its whole process group) and whether every run ended FINISHED. Figures: docs/tracking-server.md.
"""

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
from lightning_exact.server import SCRIPT
from lightning_exact.testing.servers import (
    free_port,
    free_service_port,
    let_the_service_user_reach,
    moto_s3,
    wait_for_port,
)

MIB = 2**20
SYSTEM_METRICS = ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes")
JOB_METRICS = ("train/loss", "train/acc", "train/lr", "train/samples")


@contextmanager
def s3_endpoint() -> Iterator[tuple[dict[str, str], subprocess.Popen]]:
    """moto's S3 server with a bucket ``bench``, and the environment that reaches it."""
    import boto3

    with moto_s3() as (env, proc):
        env = {**env, "MLFLOW_S3_ENDPOINT_URL": env["AWS_ENDPOINT_URL"]}
        boto3.client(
            "s3",
            endpoint_url=env["AWS_ENDPOINT_URL"],
            region_name=env["AWS_DEFAULT_REGION"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        ).create_bucket(Bucket="bench")
        yield env, proc


class Service:
    """A running MLflow server: its URL, the environment clients need, its process group."""

    def __init__(
        self,
        url: str,
        client_env: dict[str, str],
        pgid: Callable[[], int],
        supervisor_conf: Path | None = None,
    ) -> None:
        self.url = url
        self.client_env = client_env
        self.pgid = pgid
        self.supervisor_conf = supervisor_conf  # supervisord's, where it keeps the parts running

    def rss_mib(self) -> float:
        """The server's resident memory: every process of its group."""
        total = 0
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) == self.pgid():
                    total += process.memory_info().rss
            except (psutil.Error, ProcessLookupError):
                continue
        return total / MIB


def mlflow_pgid(data: Path) -> int:
    """The MLflow server's process group (its file is empty for a moment while supervisord
    starts it again: then read once more)."""
    for _ in range(50):
        if written := (data / "mlflow.pgid").read_text().strip():
            return int(written)
        time.sleep(0.1)
    raise RuntimeError(f"{data / 'mlflow.pgid'} stays empty")


@contextmanager
def postgresql_service(workdir: Path, s3: dict[str, str], workers: int) -> Iterator[Service]:
    """``python -m lightning_exact.server start`` in a folder of its own, an account for the
    clients."""
    # Not under workdir: the service's user (as root: a user of its own) must pass through every
    # parent folder.
    parent = Path(tempfile.mkdtemp(prefix="tracking-load-service-"))
    parent.chmod(0o711)
    data = parent / "service"
    port = free_service_port()  # as root, one under 1024 (tracking.sh refuses others)
    env = {
        **os.environ,
        **s3,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "TRACKING_DATA": str(data),
        "TRACKING_HOST": "127.0.0.1",
        "TRACKING_PORT": str(port),
        "TRACKING_ARTIFACTS": "s3://bench/postgresql",
        "TRACKING_WORKERS": str(workers),
        "MLFLOW_AUTH_ADMIN_PASSWORD": secrets.token_urlsafe(16),
        "TRACKING_USER_PASSWORD": secrets.token_urlsafe(16),
    }
    script = [sys.executable, "-m", "lightning_exact.server"]
    let_the_service_user_reach(Path(sys.executable), SCRIPT, data)
    try:
        for command in (["start"], ["add-user", "bench"]):
            proc = subprocess.run([*script, *command], env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"tracking.sh {command[0]}: {proc.stderr.strip()}")
        yield Service(
            f"https://127.0.0.1:{port}",
            {
                "MLFLOW_TRACKING_SERVER_CERT_PATH": str(data / "ca.crt"),
                "MLFLOW_TRACKING_USERNAME": "bench",
                "MLFLOW_TRACKING_PASSWORD": env["TRACKING_USER_PASSWORD"],
            },
            lambda: mlflow_pgid(data),
            data / "supervisord.conf",
        )
    finally:
        subprocess.run([*script, "stop"], env=env, capture_output=True)
        shutil.rmtree(parent, ignore_errors=True)


@contextmanager
def sqlite_service(workdir: Path, s3: dict[str, str], workers: int) -> Iterator[Service]:
    """``mlflow server`` on a SQLite file, artifacts proxied to the same bucket."""
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="tracking-load-sqlite-", dir=workdir))
    command = [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(workers),
        "--backend-store-uri",
        f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination",
        "s3://bench/sqlite",
    ]
    env = {**os.environ, **s3, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_port(port, proc, "mlflow server", timeout_s=120)
        yield Service(f"http://127.0.0.1:{port}", {}, lambda: proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


class TimedClient:
    """An MLflow client whose calls are timed; a call that raised is counted (its sender sends
    the record again)."""

    def __init__(self, client: Any, latencies: list[float], failures: Counter) -> None:
        self.client = client
        self.latencies = latencies
        self.failures = failures

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                result = method(*args, **kwargs)
            except Exception:
                self.failures[name] += 1
                raise
            self.latencies.append(time.perf_counter() - start)
            return result

        return timed


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else float("nan")


# The request path's parts a profile reports, each by the frames that are all on a sample's
# stack (a function, and the end of its file's path, as py-spy names a frame). A sample counts
# once for a part however often the part is on its stack.
FLASK = ("wsgi_app", "flask/app.py")
STORE = "store/tracking/sqlalchemy_store.py"
PROFILED = {
    "request in Flask (all of it)": [FLASK],
    "  MLflow's before_request: sign-in and checks": [("_before_request", "auth/__init__.py")],
    "    tracking_auth: sign-in, limits, refusals": [("authenticate", "tracking_auth.py")],
    "      the limits' query": [("seconds_refused", "tracking_auth.py")],
    "      a password checked (scrypt)": [("_authenticate_cached", "auth/__init__.py")],
    "      the body parsed as JSON": [("json_object_sent", "tracking_auth.py")],
    "      artifact and trace refusals": [("artifact_refusal", "tracking_auth.py")],
    "      account refusals": [("account_refusal", "tracking_auth.py")],
    "    MLflow's permission check (log-batch's)": [("validate_can_log_batch", "auth/__init__.py")],
    "      the run's experiment": [("_run_requirement", "auth/__init__.py")],
    "      the account's grants read": [("list_grants", "auth/sqlalchemy_store.py")],
    "  MLflow's handler: log-batch": [("_log_batch", "server/handlers.py")],
    "    the store's log_batch": [("log_batch", STORE)],
    "      the run read (is it active?)": [("log_batch", STORE), ("_get_run", STORE)],
    "      the points written": [("log_batch", STORE), ("_insert_metrics", STORE)],
    "      its latest values updated": [("_update_latest_metrics_if_necessary", STORE)],
    "  MLflow's handler: an artifact's upload": [("_upload_artifact", "server/handlers.py")],
    "  after_request hooks": [("process_response", "flask/app.py")],
    "SQL sent and answered, all of it": [("do_execute", "sqlalchemy/engine/default.py")],
    "a pooled connection pinged before use": [("do_ping", "postgresql/_psycopg_common.py")],
    "outside Flask: uvicorn, the WSGI bridge": [("run_forever", "asyncio/base_events.py")],
}
FRAME = re.compile(r"(?:[\w.<>]+\.)?([\w<>]+) \(([^:]*):\d+\)")


def server_processes(service: Service) -> dict[str, list[psutil.Process]]:
    """The MLflow server's workers (its uvicorn processes) and the service's PostgreSQL (its
    postmaster, which names the data folder, and the processes it started)."""
    found: dict[str, list[psutil.Process]] = {"workers": [], "postgres": []}
    data = str(service.supervisor_conf.parent) if service.supervisor_conf else None
    for process in psutil.process_iter(["pid", "cmdline"]):
        command = process.info["cmdline"] or []
        with contextlib.suppress(ProcessLookupError, psutil.Error):
            if os.getpgid(process.pid) == service.pgid() and "--multiprocessing-fork" in command:
                found["workers"].append(process)
            elif data and f"{data}/postgres" in command:
                found["postgres"] += [process, *process.children(recursive=True)]
    return found


def cpu_s(processes: list[psutil.Process]) -> dict[int, float]:
    """The CPU seconds each process used so far (user and system), by pid."""
    used = {}
    for process in processes:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            used[process.pid] = times.user + times.system
    return used


class Profile:
    """py-spy's samples of each MLflow worker (their stacks, 100 a second, without pausing
    them) for ``seconds``, into ``folder``, and the CPU the workers and PostgreSQL used."""

    def __init__(self, service: Service, folder: Path, seconds: float, calls: int) -> None:
        spy = shutil.which("py-spy")
        if spy is None:
            raise SystemExit("--profile needs py-spy: pip install py-spy")
        folder.mkdir(parents=True, exist_ok=True)
        self.service, self.folder, self.calls = service, folder, calls
        processes = server_processes(service)
        self.cpu_s = {part: cpu_s(processes[part]) for part in processes}
        self.spies = [
            subprocess.Popen(
                [spy, "record", "--pid", str(worker.pid), "--rate", "100", "--nonblocking"]
                + ["--format", "raw", "--duration", str(round(seconds))]
                + ["--output", str(folder / f"{worker.pid}.txt")],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for worker in processes["workers"]
        ]

    def over(self) -> bool:
        return all(spy.poll() is not None for spy in self.spies)

    def ended(self, calls: int) -> dict[str, Any]:
        """At the window's end: the calls answered in it, and the CPU per call of the workers
        and of PostgreSQL (a process started meanwhile counts whole, one ended is missed)."""
        calls -= self.calls
        processes = server_processes(self.service)
        cpu_ms = {}
        for part, before in self.cpu_s.items():
            now = cpu_s(processes[part])
            used = sum(seconds - before.get(pid, 0.0) for pid, seconds in now.items())
            cpu_ms[part] = round(1000 * used / max(calls, 1), 1)
        return {"calls": calls, "cpu_ms_per_call": cpu_ms}

    def shares(self) -> dict[str, float]:
        """Each part of PROFILED: its share of the workers' samples, in per cent (a sample of a
        thread that waits for a core counts too, one that waits for a socket not)."""
        samples: Counter = Counter()
        total = 0
        for stacks in self.folder.glob("*.txt"):
            for line in stacks.read_text().splitlines():
                stack, _, count = line.rpartition(" ")
                total += int(count)
                frames = {(m[1], m[2]) for m in map(FRAME.fullmatch, stack.split(";")) if m}
                for part, wanted in PROFILED.items():
                    if all(
                        any(f == function and path.endswith(file) for f, path in frames)
                        for function, file in wanted
                    ):
                        samples[part] += int(count)
        return {part: round(100 * samples[part] / max(total, 1), 1) for part in PROFILED}


def faults(service: Service, s3_proc: subprocess.Popen, seconds: float) -> list:
    """The faults of the postgresql run, at 25 %, 50 % and 70 % of it: what was done, when."""
    done = []
    supervisorctl = str(Path(sys.executable).parent / "supervisorctl")
    supervisor = [supervisorctl, "-c", str(service.supervisor_conf)]

    def run() -> None:
        time.sleep(0.25 * seconds)
        os.killpg(service.pgid(), signal.SIGKILL)
        done.append((round(0.25 * seconds), "mlflow server SIGKILLed (supervisord restarts it)"))
        time.sleep(0.25 * seconds)
        restart = subprocess.run([*supervisor, "restart", "postgres"], capture_output=True)
        said = (restart.stdout + restart.stderr).decode().strip().replace("\n", "; ")
        restarted = "PostgreSQL restarted" if restart.returncode == 0 else f"failed: {said}"
        done.append((round(0.5 * seconds), restarted))
        time.sleep(0.2 * seconds)
        os.killpg(s3_proc.pid, signal.SIGSTOP)
        stopped = max(5.0, 0.1 * seconds)
        time.sleep(stopped)
        os.killpg(s3_proc.pid, signal.SIGCONT)
        done.append((round(0.7 * seconds), f"S3 endpoint stopped for {stopped:.0f} s"))

    thread = threading.Thread(target=run, daemon=True, name="faults")
    thread.start()
    done.append(thread)
    return done


def drive(
    service: Service,
    workdir: Path,
    jobs: int,
    nodes: int,
    seconds: float,
    pace_s: float,
    checkpoint_mib: int,
    start_faults: Callable[[], list] | None,
    profile: Path | None = None,
) -> dict[str, Any]:
    """The load, then the check of what the server stored; with ``profile``, py-spy's samples
    of the server's workers from 5 s into the load until its first fault (a fifth of it)."""
    from lightning_exact.tracking.outbox import Outbox, Sender, encode
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    os.environ.update(service.client_env)
    plain = MlflowClient(service.url)
    experiment = plain.create_experiment(f"load-{secrets.token_hex(4)}")
    parent = plain.create_run(experiment, run_name="sweep").info.run_id
    runs = [
        plain.create_run(
            experiment, run_name=f"job{j}", tags={"mlflow.parentRunId": parent}
        ).info.run_id
        for j in range(jobs)
    ]
    latencies: list[float] = []
    failures: Counter = Counter()
    streams = []  # (outbox, sender, run, metric keys)
    for index in range(jobs + nodes):
        folder = workdir / f"outbox{index}"
        folder.mkdir(parents=True)
        outbox = Outbox(folder, service.url)
        sender = Sender(outbox, TimedClient(MlflowClient(service.url), latencies, failures))
        sender.start()
        job = index if index < jobs else index % jobs
        keys = JOB_METRICS if index < jobs else tuple(f"{k}/node{index}" for k in SYSTEM_METRICS)
        streams.append((outbox, sender, runs[job], keys))
    checkpoint = workdir / "checkpoint.ckpt"
    checkpoint.write_bytes(os.urandom(checkpoint_mib * MIB))
    peak_rss = service.rss_mib()
    events = start_faults() if start_faults else []
    started = time.monotonic()
    step = 0
    profiling: Profile | None = None
    profiled: dict[str, Any] = {}
    while time.monotonic() - started < seconds:
        if profile and not profiling and time.monotonic() - started >= 5:
            profiling = Profile(service, profile, 0.2 * seconds - 5, len(latencies))
        if profiling and not profiled and profiling.over():
            profiled = profiling.ended(len(latencies))
        now = int(time.time() * 1000)
        for index, (outbox, _, run, keys) in enumerate(streams):
            metrics = [Metric(key, float(step + i), now, step) for i, key in enumerate(keys)]
            outbox.append(encode("log_batch", run, metrics=metrics))
            if index < jobs and step % 10 == 9:
                outbox.append(
                    encode("log_artifact", run, local_path=checkpoint, artifact_path=f"s{step}")
                )
        step += 1
        peak_rss = max(peak_rss, service.rss_mib())
        time.sleep(max(0.0, started + step * pace_s - time.monotonic()))
    for outbox, _, run, _ in streams[:jobs]:
        outbox.append(encode("set_terminated", run))
    sent_at = time.monotonic()
    left = sum(sender.drain(600) for _, sender, _, _ in streams)
    drained_s = time.monotonic() - sent_at
    plain.set_terminated(parent)
    for thread in [e for e in events if isinstance(e, threading.Thread)]:
        thread.join()
    records = sum(len(outbox.records) - 1 for outbox, _, _, _ in streams)
    missing = twice = 0
    for _, _, run, keys in streams:
        for key in keys:
            steps = Counter(m.step for m in plain.get_metric_history(run, key))
            missing += sum(1 for s in range(step) if steps[s] == 0)
            twice += sum(count - 1 for count in steps.values() if count > 1)
    uploads = sum(len(plain.list_artifacts(run)) for run in runs)
    finished = sum(plain.get_run(run).info.status == "FINISHED" for run in [*runs, parent])
    for outbox, _, _, _ in streams:
        outbox.close()
    if profiling and profiled:
        profiled = {"profile": {**profiled, "share_of_worker_samples_pct": profiling.shares()}}
    return {
        "jobs": jobs,
        "nodes": nodes,
        "seconds": round(seconds),
        "records_sent": records,
        "points_sent": step * sum(len(keys) for _, _, _, keys in streams),
        "points_missing": missing,
        "points_stored_twice": twice,
        "checkpoints_uploaded": f"{uploads} of {jobs * (step // 10)} ({checkpoint_mib} MiB each)",
        "runs_finished": f"{finished} of {jobs + 1}",
        "records_left_unsent": left,
        "drain_after_load_s": round(drained_s, 1),
        "calls": len(latencies),
        "calls_failed_and_sent_again": dict(failures),
        "latency_ms": {
            "p50": round(1000 * percentile(latencies, 0.50), 1),
            "p95": round(1000 * percentile(latencies, 0.95), 1),
            "p99": round(1000 * percentile(latencies, 0.99), 1),
            "max": round(1000 * max(latencies, default=float("nan")), 1),
        },
        "server_peak_rss_mib": round(peak_rss),
        "faults": [f"at {t} s: {what}" for t, what in (e for e in events if isinstance(e, tuple))],
        **profiled,
    }


def measure(
    backend: str,
    workdir: Path,
    jobs: int,
    nodes: int,
    seconds: float,
    pace_s: float,
    checkpoint_mib: int,
    workers: int,
    profile: Path | None = None,
) -> dict[str, Any]:
    with s3_endpoint() as (s3, s3_proc):
        saved = dict(os.environ)
        start = postgresql_service if backend == "postgresql" else sqlite_service
        try:
            with start(workdir, s3, workers) as service:
                # Faults only where supervisord starts again what they break.
                inject = None
                if service.supervisor_conf:
                    inject = lambda: faults(service, s3_proc, seconds)  # noqa: E731
                result = drive(
                    service,
                    workdir / backend,
                    jobs,
                    nodes,
                    seconds,
                    pace_s,
                    checkpoint_mib,
                    inject,
                    profile / backend if profile else None,
                )
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return {"backend": backend, "workers": workers, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.tracking_load", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--backends", default="postgresql,sqlite", help="comma-separated")
    parser.add_argument("--jobs", type=int, default=4, help="concurrent jobs (sweep children)")
    parser.add_argument("--nodes", type=int, default=20, help="simulated nodes (system metrics)")
    parser.add_argument("--seconds", type=float, default=180, help="how long the load runs")
    parser.add_argument("--pace-s", type=float, default=1.0, help="one record per stream every")
    parser.add_argument("--checkpoint-mib", type=int, default=20, help="each upload's size")
    parser.add_argument("--workers", type=int, default=4, help="mlflow server workers")
    parser.add_argument("--tiny", action="store_true", help="2 jobs, 4 nodes, 40 s (the test)")
    parser.add_argument("--out", type=Path, help="also write the results here as JSON")
    parser.add_argument(
        "--profile",
        type=Path,
        help="py-spy's samples of the server's workers (5 s into the load to its first fault) "
        "into this folder, and the CPU per call of each part of the request path",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.jobs, args.nodes, args.seconds, args.checkpoint_mib, args.workers = 2, 4, 40, 1, 2
    results = []
    with tempfile.TemporaryDirectory(prefix="tracking-load-") as workdir:
        for backend in args.backends.split(","):
            result = measure(
                backend,
                Path(workdir),
                args.jobs,
                args.nodes,
                args.seconds,
                args.pace_s,
                args.checkpoint_mib,
                args.workers,
                args.profile,
            )
            print(json.dumps(result, indent=2), flush=True)
            results.append(result)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
