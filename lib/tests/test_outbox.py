"""The MLflow outbox: records on disk, sent in order, once, whatever the server does.

The jobs below run against a real ``mlflow server`` that the test stops (its whole process
group) and starts again on the same port and store, as an outage would.
"""

import csv
import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
from lightning_exact.testing import processes
from lightning_exact.tracking import sync as src_sync
from lightning_exact.tracking.outbox import (
    OUTBOX_FILE,
    Outbox,
    OutboxBusy,
    OutboxClient,
    Sender,
    encode,
)
from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.exceptions import RestException

from tests.conftest import (
    DATA_NAME,
    PROJECT,
    SIGNAL_AT_STEP,
    TRAIN_RUN_NAME,
    epoch_ends,
    local_server_argv,
    mlflow_server,
    read_metrics,
    run_entry,
    training_points,
)
from tests.test_sweeps import sweep_folders, sweep_overrides

INSTRUMENT = SIGNAL_AT_STEP
EPOCHS = 5
OUTAGE_EPOCHS = 8  # each takes ~2.5 s: the 15 s outage ends before training does


# --- the outbox on its own, against a SQLite store


def sqlite_run(tmp_path: Path) -> tuple[MlflowClient, str]:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("outbox")
    return client, client.create_run(experiment).info.run_id


def test_records_are_sent_in_order_once_and_survive_a_restart(tmp_path: Path) -> None:
    client, run_id = sqlite_run(tmp_path)
    outbox = Outbox(tmp_path, "sqlite:///x")
    queued = OutboxClient(client, outbox)
    for step in range(3):
        queued.log_batch(run_id, metrics=[Metric("loss", 1.0 / (step + 1), 1000 + step, step)])
    queued.set_tag(run_id, "note", "hello")
    assert client.get_run(run_id).data.metrics == {}, "queued, not sent"
    outbox.send_next(client)
    outbox.close()  # as if the job died here

    again = Outbox(tmp_path)
    assert again.pending == 3 and again.tracking_uri == "sqlite:///x"
    again.sent -= 1  # the server took a record but its answer was lost: sent again
    while again.pending:
        again.send_next(client)
    again.close()
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == [0, 1, 2], "each step once"
    assert client.get_run(run_id).data.tags["note"] == "hello"


def test_one_process_sends_an_outbox_at_a_time(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, "sqlite:///x")
    with pytest.raises(OutboxBusy, match="is being sent by a running job or sync"):
        Outbox(tmp_path)
    outbox.close()
    Outbox(tmp_path).close()


def test_src_sync_refuses_an_empty_certificate_path_before_sending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Empty, MLflow would check no certificate at all: nothing is sent, in one line."""
    outbox = Outbox(tmp_path, "https://127.0.0.1:9")
    outbox.append(encode("set_tag", "run", key="note", value="x"))
    outbox.close()
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", "")
    assert src_sync.main([str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith(
        "Error: MLFLOW_TRACKING_SERVER_CERT_PATH is set but empty"
    )
    assert Outbox(tmp_path).pending == 1, "the record waits"


def test_the_sender_skips_a_record_the_server_refuses(tmp_path: Path) -> None:
    client, run_id = sqlite_run(tmp_path)
    outbox = Outbox(tmp_path, "sqlite:///x")
    sender = Sender(outbox, client)
    sender.start()
    outbox.append(encode("log_artifact", run_id, local_path=tmp_path / "gone.txt"))
    outbox.append(encode("set_terminated", run_id, status="FINISHED"))
    assert sender.drain(30) == 0
    sender.stopping.set()
    assert client.get_run(run_id).info.status == "FINISHED"


class BusyOnce:
    """A client whose server answers its first log_batch as MLflow's store does when its
    database connections are all busy (a 400, SQLAlchemy's pool timeout), then takes them."""

    def __init__(self, client: MlflowClient) -> None:
        self.client, self.busy = client, True

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def log_batch(self, *args, **kwargs):
        if self.busy:
            self.busy = False
            message = (
                "QueuePool limit of size 5 overflow 10 reached, connection timed out, timeout "
                "30.00 (Background on this error at: https://sqlalche.me/e/21/3o7r)"
            )
            raise RestException({"error_code": "BAD_REQUEST", "message": message})
        return self.client.log_batch(*args, **kwargs)


def test_a_record_the_busy_server_answers_400_is_kept_and_sent_again(tmp_path: Path) -> None:
    """At 100 requests/s a 2-core service's MLflow answered log_batch calls 400 for its busy
    database pool: the outbox had left those points out, as if the server refused them."""
    client, run_id = sqlite_run(tmp_path)
    outbox = Outbox(tmp_path, "sqlite:///x")
    outbox.append(encode("log_batch", run_id, metrics=[Metric("train/loss", 0.5, 0, 4)]))
    busy = BusyOnce(client)
    with pytest.raises(RestException, match="QueuePool"):
        outbox.send_next(busy)
    assert outbox.pending == 1, "kept"
    outbox.send_next(busy)
    assert outbox.pending == 0
    assert [m.value for m in client.get_metric_history(run_id, "train/loss")] == [0.5]


def test_images_and_files_logged_while_training_wait_in_the_outbox(tmp_path: Path) -> None:
    """An offline job's task logs an image of a step (MLflow's image series), a fixed image, a
    figure, a text and a dict through its logger's ``experiment``, as docs/make-it-yours.md
    shows: each is kept in the job's folder and sent by src.sync, as it was given."""
    import matplotlib.pyplot as plt
    import numpy as np
    from lightning_exact.tracking.logger import RunLogger
    from PIL import Image

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    job = tmp_path / "job"
    job.mkdir()
    logger = RunLogger("outbox", "images", store, job, offline=True)
    grid = np.arange(28 * 56, dtype=np.uint8).reshape(28, 56)
    figure, axes = plt.subplots()
    axes.plot([1, 2, 3])
    logger.experiment.log_image(logger.run_id, grid, key="generated", step=20)
    logger.experiment.log_image(logger.run_id, Image.fromarray(grid), artifact_file="first.png")
    logger.experiment.log_figure(logger.run_id, figure, "figures/curve.png")
    logger.experiment.log_text(logger.run_id, "hello", "notes/hello.txt")
    logger.experiment.log_dict(logger.run_id, {"a": 1}, "notes/config.yaml")
    plt.close(figure)
    with pytest.raises(TypeError, match="give artifact_file, or key"):
        logger.experiment.log_image(logger.run_id, grid)
    logger.finalize("success")
    logger.stop_sending(0)
    assert src_sync.sync(job, store).startswith("sent 7 record(s)"), "the run, 5, its end"

    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("outbox").experiment_id])
    images = {Path(f.path).suffix: f.path for f in client.list_artifacts(run.info.run_id, "images")}
    assert images.keys() == {".png", ".webp"}, "the image and its preview"
    assert images[".png"].startswith("images/generated+step+20+timestamp+")
    folder = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "got")))
    for path in (folder / images[".png"], folder / "first.png"):
        assert np.array_equal(np.asarray(Image.open(path)), grid), path.name
    assert (folder / "figures" / "curve.png").stat().st_size > 1000
    assert (folder / "notes" / "hello.txt").read_text() == "hello"
    assert (folder / "notes" / "config.yaml").read_text() == "a: 1\n"


# --- jobs against a real server that goes away


@pytest.fixture
def server(tmp_path: Path) -> Iterator:
    """``with server():`` runs the same ``mlflow server`` (port, store, artifacts) each time."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = local_server_argv(port, tmp_path)

    @contextmanager
    def running() -> Iterator[str]:
        with mlflow_server(argv, port, tmp_path) as url:
            yield url

    running.url = f"http://127.0.0.1:{port}"
    return running


def slow_job_env() -> dict[str, str]:
    # Each step takes 0.2 s longer (tests/signal_at_step), and MLflow gives up on a request
    # after seconds instead of minutes: an outage of 15 s outlasts its retries.
    return {
        "PYTHONPATH": f"{INSTRUMENT}{os.pathsep}{PROJECT}",
        "SLEEP_PER_STEP": "0.2",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    }


def wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def epochs_queued(run_dir: Path) -> int:
    path = run_dir / OUTBOX_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    return sum('"train/loss"' in line for line in lines)


def assert_complete_run(client: MlflowClient, run_id: str, epochs: int, status: str) -> None:
    run = client.get_run(run_id)
    assert run.info.status == status
    for key, points in (("train/loss", training_points), ("val/loss", epoch_ends)):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert sorted(steps) == points(epochs), f"{key}: {steps}"


def sync(run_dir: Path, *options: str) -> subprocess.CompletedProcess:
    return processes.sync(run_dir, *options, project=PROJECT)


@pytest.mark.slow
def test_an_outage_mid_training_delays_records_not_training(server, job_factory) -> None:
    with server() as url:
        job = job_factory(
            f"trainer.max_epochs={OUTAGE_EPOCHS}",
            f"logger.tracking_uri={url}",
            "logger.system_metrics_s=1",
            env=slow_job_env(),
        )
        wait_for(lambda: epochs_queued(job.run_dir) >= 1, "the first epoch")
    # The server is gone: training goes on, and its records wait in the outbox.
    outage_start, queued = time.time(), epochs_queued(job.run_dir)
    wait_for(lambda: job.last.exists() and job.last.stat().st_mtime > outage_start + 1, "a step")
    time.sleep(max(0.0, outage_start + 15 - time.time()))
    assert job.proc.poll() is None, "the job still trains when the server comes back"
    assert epochs_queued(job.run_dir) > queued, "epochs went on during the outage"
    outage_end = time.time()
    with server() as url:
        job.wait(timeout=300)
        assert job.proc.returncode == 0, job.stderr[-3000:]
        assert "src.sync" not in job.stderr, "everything was sent before the job ended"
        client = MlflowClient(url)
        run_id = (job.run_dir / "mlflow_run_id.txt").read_text().strip()
        assert_complete_run(client, run_id, OUTAGE_EPOCHS, "FINISHED")
        artifacts = {a.path for a in client.list_artifacts(run_id)}
        assert {"config.yaml", "metrics.json", "checkpoints", "figures"} <= artifacts
        assert len(client.get_run(run_id).inputs.dataset_inputs) == 3
        readings = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
        steps = sorted(m.step for m in readings)
        assert steps == list(range(len(steps))), "system metrics: one per step, none lost"
        assert any(outage_start < m.timestamp / 1000 < outage_end for m in readings)


@pytest.mark.slow
def test_a_server_away_at_the_end_leaves_its_records_to_src_sync(server, job_factory) -> None:
    with server():
        job = job_factory(
            "trainer.max_epochs=2",
            f"logger.tracking_uri={server.url}",
            "logger.send_timeout_s=3",
            env=slow_job_env(),
        )
        wait_for(lambda: (job.run_dir / "mlflow_run_id.txt").exists(), "the run")
    job.wait(timeout=300)
    assert job.proc.returncode == 0, job.stderr[-3000:]
    (line,) = [line for line in job.stderr.splitlines() if "python -m src.sync" in line]
    assert line.endswith(f"python -m src.sync {job.run_dir}"), line
    assert "Retrying" not in job.stderr, "urllib3's warning per retried request is silenced"
    assert (job.run_dir / "metrics.json").exists() and job.last.exists()

    refused = sync(job.run_dir)  # still away: says so, keeps everything
    assert refused.returncode == 1 and "Run this again when it answers" in refused.stderr
    assert "Retrying" not in refused.stderr
    with server() as url:
        done = sync(job.run_dir)
        assert done.returncode == 0, done.stderr
        run_id = (job.run_dir / "mlflow_run_id.txt").read_text().strip()
        assert done.stdout.strip().endswith(f"run {run_id} is FINISHED")
        client = MlflowClient(url)
        assert_complete_run(client, run_id, 2, "FINISHED")
        before = client.get_run(run_id).to_dictionary()
        again = sync(job.run_dir)
        assert again.returncode == 0 and "sent 0 record(s)" in again.stdout
        assert client.get_run(run_id).to_dictionary() == before, "a second sync changes nothing"


@pytest.mark.slow
def test_a_job_killed_during_an_outage_loses_nothing_it_logged(server, job_factory) -> None:
    with server():
        job = job_factory(
            f"trainer.max_epochs={EPOCHS}", f"logger.tracking_uri={server.url}", env=slow_job_env()
        )
        wait_for(lambda: (job.run_dir / "mlflow_run_id.txt").exists(), "the run")
    wait_for(lambda: epochs_queued(job.run_dir) >= 2, "two epochs")
    # Frozen, not yet killed: src.sync takes seconds to start, and a busy machine would let
    # the job finish its epochs meanwhile (then its run is rightly FINISHED, not FAILED).
    os.killpg(job.proc.pid, signal.SIGSTOP)
    busy = sync(job.run_dir)
    assert busy.returncode == 1 and "is being sent by a running job" in busy.stderr
    os.killpg(job.proc.pid, signal.SIGKILL)
    job.proc.wait()
    logged = epochs_queued(job.run_dir)
    with server() as url:
        done = sync(job.run_dir)
        assert done.returncode == 0, done.stderr
        run_id = (job.run_dir / "mlflow_run_id.txt").read_text().strip()
        client = MlflowClient(url)
        run = client.get_run(run_id)
        assert run.info.status == "FAILED", "the job died before it ended its run"
        steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
        assert steps == epoch_ends(logged), "every epoch it had logged, once"
        records = (job.run_dir / OUTBOX_FILE).read_text().splitlines()
        assert json.loads(records[-1])["status"] == "FAILED"


@pytest.mark.slow
def test_an_offline_job_leaves_its_whole_run_to_src_sync(server, job_factory) -> None:
    """logger.offline=true: no server at all while the job runs (none is listening); src.sync
    creates the run later, once, even when it has to send everything again."""
    job = job_factory("logger.offline=true", f"logger.tracking_uri={server.url}")
    job.wait(timeout=300)
    assert job.proc.returncode == 0, job.stderr[-3000:]
    assert f"wait in {job.run_dir}" in job.stderr and f"src.sync {job.run_dir}" in job.stderr
    placeholder = (job.run_dir / "mlflow_run_id.txt").read_text().strip()
    assert placeholder.startswith("offline-")
    with server() as url:
        done = sync(job.run_dir)
        assert done.returncode == 0, done.stderr
        run_id = (job.run_dir / "mlflow_run_id.txt").read_text().strip()
        assert run_id != placeholder and done.stdout.strip().endswith(f"run {run_id} is FINISHED")
        client = MlflowClient(url)
        assert_complete_run(client, run_id, 2, "FINISHED")
        run = client.get_run(run_id)
        assert run.info.run_name == TRAIN_RUN_NAME and run.data.params["model.lr"] == "0.01"
        assert {a.path for a in client.list_artifacts(run_id)} >= {"config.yaml", "checkpoints"}
        # MLflow's source tags are the job's, taken where it ran, not src.sync's.
        assert run.data.tags["mlflow.source.name"].endswith("src/train.py"), run.data.tags
        assert len(run.data.tags["mlflow.source.git.commit"]) == 40, run.data.tags
        # Everything sent again, as after a crash right after the run was made: still one run,
        # each metric once.
        (job.run_dir / "mlflow_outbox.runs.json").unlink()
        (job.run_dir / "mlflow_outbox.sent").write_text("1")
        assert sync(job.run_dir).returncode == 0
        (again,) = client.search_runs([run.info.experiment_id])
        assert again.info.run_id == run_id
        assert_complete_run(client, run_id, 2, "FINISHED")


@pytest.mark.slow
def test_an_offline_seed_sweep_once_synced_is_the_online_sweep(server, tiny_root, tmp_path) -> None:
    """logger.offline=true in a sweep: no server while it runs; src.sync on the sweep folder then
    makes on the server what an online sweep makes: the parent, every job nested under it, the
    summary naming the jobs' runs. Synced again, nothing is made twice."""
    run_entry(
        "train",
        "-m",
        *sweep_overrides(tiny_root),
        "seed=1,2",
        "logger.offline=true",
        f"logger.tracking_uri={server.url}",
        cwd=tmp_path,
    )
    (sweep,) = sweep_folders(tmp_path)
    with server() as url:
        assert (done := sync(sweep)).returncode == 0, done.stderr
        client = MlflowClient(url)
        experiment = client.get_experiment_by_name(DATA_NAME).experiment_id
        runs = client.search_runs([experiment])
        (parent,) = [run for run in runs if run.data.tags.get("sweep.parent") == sweep.name]
        children = {int(r.data.tags["sweep.job"]): r for r in runs if "sweep.job" in r.data.tags}
        assert sorted(children) == [0, 1] and len(runs) == 3
        assert {r.data.tags["mlflow.parentRunId"] for r in children.values()} == {
            parent.info.run_id
        }
        assert {run.info.status for run in runs} == {"FINISHED"}
        tags, got = parent.data.tags, parent.data.metrics
        assert parent.info.run_name.startswith("sweep ")
        assert "-m" in tags["command"]
        assert (tags["sweep.jobs"], tags["sweep.finished"]) == ("2", "2")
        metrics = [read_metrics(sweep / str(job)) for job in range(2)]
        best = min(range(2), key=lambda job: metrics[job]["val/loss"])  # the task's: lowest
        assert tags["best.job"] == str(best) and tags["best.run_id"] == children[best].info.run_id
        values = [m["test/mae"] for m in metrics]
        assert got["test/mae_mean"] == pytest.approx(statistics.mean(values))
        assert got["test/mae_std"] == pytest.approx(statistics.stdev(values))
        assert got["test/mae_ci95_low"] <= got["test/mae_mean"] <= got["test/mae_ci95_high"]
        parent_id = parent.info.run_id
        assert {a.path for a in client.list_artifacts(parent_id)} == {"jobs.csv", "seeds.csv"}
        with open(client.download_artifacts(parent_id, "jobs.csv", str(tmp_path))) as file:
            rows = list(csv.DictReader(file))
        assert [row["run_id"] for row in rows] == [children[job].info.run_id for job in range(2)]
        history = {key: client.get_metric_history(parent_id, key) for key in got}
        again = src_sync.sync(sweep).splitlines()  # in this process: no second start-up
        assert len(again) == 3 and all(line.startswith("sent 0 record(s)") for line in again)
        assert len(client.search_runs([experiment])) == 3
        assert {key: client.get_metric_history(parent_id, key) for key in got} == history


def md5(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as f:
        while chunk := f.read(2**24):
            digest.update(chunk)
    return digest.hexdigest()


def kill_listener(url: str) -> None:
    """SIGKILL the process group of whatever listens on ``url``'s port: a server that dies."""
    port = int(url.rsplit(":", 1)[1])
    (pid,) = {
        c.pid
        for c in psutil.net_connections("tcp")
        if c.laddr.port == port and c.status == "LISTEN"
    }
    os.killpg(os.getpgid(pid), signal.SIGKILL)


@pytest.mark.slow
def test_a_large_upload_cut_by_an_outage_leaves_no_half_artifact(
    server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint of hundreds of MB, the server killed while it arrives: nothing half-stored
    is listed, the upload stays pending, and src.sync sends it whole."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the sender notices at once
    job = tmp_path / "job"
    job.mkdir()
    checkpoint, block = job / "best.ckpt", os.urandom(2**20)
    with checkpoint.open("wb") as f:
        for i in range(300):  # 300 MiB, no two MiB alike
            f.write(i.to_bytes(4) + block[4:])
    stored = tmp_path / "server-artifacts"
    with server() as url:
        client = MlflowClient(url)
        run_id = client.create_run(client.create_experiment("large")).info.run_id
        outbox = Outbox(job, url)
        sender = Sender(outbox, client)
        sender.start()
        outbox.append(encode("log_artifact", run_id, local_path=checkpoint, artifact_path="ckpt"))
        outbox.append(encode("set_terminated", run_id, status="FINISHED"))
        # The server writes an upload to a hidden staging file, renamed when complete.
        staging = lambda: [p.stat().st_size for p in stored.rglob(".artifact.uploading.*")]  # noqa: E731
        wait_for(lambda: any(staging()), "the upload to begin", timeout=60)
        kill_listener(url)
        assert 0 < max(staging()) < checkpoint.stat().st_size, "killed mid-upload"
        wait_for(lambda: sender.last_error is not None, "the sender to see the outage")
        sender.stopping.set()
        sender.join()
        assert outbox.pending == 2, "the cut upload is pending like any other record"
        outbox.close()
    with server() as url:
        client = MlflowClient(url)
        assert client.list_artifacts(run_id, "ckpt") == [], "no half artifact is listed"
        done = sync(job)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().endswith(f"run {run_id} is FINISHED")
        (artifact,) = client.list_artifacts(run_id, "ckpt")
        assert artifact.file_size == checkpoint.stat().st_size
        (copy,) = stored.rglob("best.ckpt")
        assert md5(copy) == md5(checkpoint), "the whole file, as sent"
