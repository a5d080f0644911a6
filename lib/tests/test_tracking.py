"""Tracking set-up against a real SQLite MLflow store."""

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger
from lightning_exact.environment import environment
from lightning_exact.job.config import flatten
from lightning_exact.job.settings import JobSettings
from lightning_exact.tracking.outcome import log_model
from lightning_exact.tracking.run import (
    RESUMED_TAG,
    build_loggers,
    log_params,
    run_to_continue,
    user_tags,
)
from lightning_exact.tracking.store import (
    TrackingError,
    artifact_location,
    mask_override,
    mask_secrets,
    prepare_store,
    without_password,
)
from mlflow import MlflowClient
from omegaconf import OmegaConf

from src.task import TASK as PROJECT_TASK
from tests.browser import Page, browser_page, chromium
from tests.conftest import (
    DATA_NAME,
    PROJECT,
    TRAIN_RUN_NAME,
    free_port,
    mlflow_server,
    one_error_line,
    only_run,
    read_metrics,
    run_entry,
    tiny_overrides,
)
from tests.machinery_task import TASK, synthetic_data
from tests.test_config import compose_config


def test_flatten_uses_override_style_keys() -> None:
    tree = {"model": {"lr": 0.1, "net": {"channels": [8, 16]}}, "seed": 0}
    assert flatten(tree) == {"model.lr": 0.1, "model.net.channels": [8, 16], "seed": 0}


def test_artifacts_go_beside_a_sqlite_store(tmp_path: Path) -> None:
    assert artifact_location(f"sqlite:///{tmp_path}/mlflow.db") == str(tmp_path / "mlartifacts")
    assert artifact_location("http://127.0.0.1:5000") is None


def test_prepare_store_creates_the_schema_once(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/nested/mlflow.db"
    prepare_store(uri, "mnist")
    assert (tmp_path / "nested" / "mlflow.db").is_file()
    assert sorted(e.name for e in MlflowClient(uri).search_experiments()) == ["Default", "mnist"]
    prepare_store(uri, "mnist")  # an existing store is left as it is


def test_logger_run_id_names_a_run_of_the_store(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    prepare_store(uri, "mnist")
    client = MlflowClient(uri)
    run = client.create_run(client.get_experiment_by_name("mnist").experiment_id)
    named = [f"logger.tracking_uri={uri}", f"logger.run_id={run.info.run_id}"]
    cfg = compose_config("train", named, tmp_path)
    assert run_to_continue(None, cfg.logger, JobSettings.from_config(cfg)) == run.info.run_id
    unknown = compose_config("train", [f"logger.tracking_uri={uri}", "logger.run_id=0ff"], tmp_path)
    with pytest.raises(TrackingError, match="logger.run_id=0ff is not a run of sqlite:///"):
        run_to_continue(None, unknown.logger, JobSettings.from_config(unknown))


def test_jobs_starting_together_on_a_fresh_store_all_get_it(tmp_path: Path) -> None:
    # A sweep's SLURM jobs start at once: each job's rank 0 prepares the same fresh store.
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    script = (
        f"from lightning_exact.tracking.store import prepare_store; prepare_store({uri!r}, 'mnist')"
    )
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    jobs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    errors = [job.communicate(timeout=120)[1] for job in jobs]
    assert [job.returncode for job in jobs] == [0] * 4, "\n".join(errors)[-3000:]
    assert sorted(e.name for e in MlflowClient(uri).search_experiments()) == ["Default", "mnist"]


def test_credentials_are_masked() -> None:
    values = {"db.password": "pw", "api_token": "t", "aws.secret_access_key": "k", "lr": 0.1}
    assert mask_secrets(values) == {
        "db.password": "***",
        "api_token": "***",
        "aws.secret_access_key": "***",
        "lr": 0.1,
    }
    assert mask_secrets({"uri": "http://me:pw@host:5000"}) == {"uri": "http://me:***@host:5000"}
    assert mask_override("+db.password=pw") == "+db.password=***"
    assert (
        mask_override("logger.tracking_uri=https://me:pw@h")
        == "logger.tracking_uri=https://me:***@h"
    )
    assert mask_override("model.lr=0.1") == "model.lr=0.1"
    assert without_password("https://me:pw@host:5000/x") == "https://me@host:5000/x"


@pytest.mark.parametrize("kind", ["none", "csv", "mlflow"])
def test_logger_kinds(kind: str, tmp_path: Path) -> None:
    cfg = compose_config("train", [f"logger={kind}"], tmp_path)
    loggers = build_loggers(cfg, JobSettings.from_config(cfg))
    expected = {"none": [], "csv": [CSVLogger], "mlflow": [MLFlowLogger]}[kind]
    assert len(loggers) == len(expected)
    assert all(isinstance(logger, cls) for logger, cls in zip(loggers, expected, strict=True))


def test_an_offline_logger_opens_no_connection(tmp_path: Path) -> None:
    """logger.offline rests on Lightning's MLFlowLogger keeping the ``run_id`` it is given and
    asking its ``experiment`` (overridden here) for everything: if an upgrade changes either,
    this fails instead of an offline job hanging on a server it cannot reach."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    url = f"http://127.0.0.1:{port}"
    cfg = compose_config("train", ["logger.offline=true", f"logger.tracking_uri={url}"], tmp_path)
    (logger,) = build_loggers(cfg, JobSettings.from_config(cfg))
    assert logger.run_id.startswith("offline-"), "the placeholder the outbox records carry"
    logger.log_metrics({"train/loss": 0.5, "epoch": 0})
    logger.finalize("success")  # Lightning's, after fit: not the job's end
    logger.finalize("finished")  # the job's (run_lifecycle)
    logger.outbox.close()
    methods = [r["method"] for r in logger.outbox.records[1:]]
    assert methods == ["create_run", "log_batch", "set_terminated"]


def test_run_tags_and_notes_land_on_the_run(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    typed = ["logger.tags={team: vision, data: v2}", "logger.notes='first try, on CPU'"]
    cfg = compose_config("train", [f"logger.tracking_uri={uri}", *typed], tmp_path)
    (logger,) = build_loggers(cfg, JobSettings.from_config(cfg))
    tags = MlflowClient(uri).get_run(logger.run_id).data.tags  # run_id opens the run
    assert tags["team"] == "vision" and tags["data"] == "v2"
    assert tags["mlflow.note.content"] == "first try, on CPU", "the UI's run description"
    assert tags["task"] == "train", "the template's own tags stay"


def test_runs_are_named_for_what_tells_them_apart_and_resumes_are_on_the_run(
    tmp_path: Path,
) -> None:
    """Issues 60 and 69: a name leads with what tells a run apart (the world size), then the
    task's run_label; the experiment (the data) is not repeated. A resume continues the same
    run, renamed for the world it finishes on, and says its history in its tags
    (``resume.count``: a column of the runs list) and description. (The shipped task's own
    names: tests/task/test_conf.py.)"""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = ["strategy=ddp", "accelerator=cpu", f"logger.tracking_uri={uri}"]
    notes = "logger.notes='spot nodes'"
    client = MlflowClient(uri)
    named = TRAIN_RUN_NAME

    def job(devices: int, resumed_from: int | None = None, run_id: str | None = None) -> str:
        cfg = compose_config("train", [*first, notes, f"devices={devices}"], tmp_path)
        resumed = {RESUMED_TAG: str(resumed_from)} if resumed_from else {}
        settings = JobSettings.from_config(cfg)
        (logger,) = build_loggers(cfg, settings, resumed, continue_run=run_id)
        log_params(logger, flatten(OmegaConf.to_container(cfg, resolve=True)))
        return logger.run_id

    run_id = job(devices=2)
    assert client.get_run(run_id).info.run_name == f"2 ranks {named}"
    assert job(devices=2, resumed_from=50, run_id=run_id) == run_id
    assert job(devices=1, resumed_from=80, run_id=run_id) == run_id  # spot capacity: 1 left
    run = client.get_run(run_id)
    assert run.info.run_name == named, "one run, named for the world it finished on"
    assert run.data.tags["resume.count"] == "2" and run.data.tags["resume.2.world_size"] == "1"
    assert run.data.tags["resume.2.resumed_from_step"] == "80"
    assert run.data.tags["mlflow.note.content"] == (
        "spot nodes\n\nResume 1: from step 50 on 2 ranks"
        "\n\nResume 2: from step 80 on 1 rank (was 2)"
    )
    # One rank goes unsaid (tests/test_train.py: the run of a 1-rank job), a sweep's devices too.
    assert client.get_run(job(devices=1)).info.run_name == named


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+logger.tags.task=mine", "logger.tags.task is a tag the template sets; use another name"),
        ("logger.tags=team", "logger.tags=team is not a set of name: value pairs; use e.g."),
    ],
)
def test_tags_that_cannot_be_set(override: str, message: str, tmp_path: Path) -> None:
    cfg = compose_config("train", [override], tmp_path)
    with pytest.raises(TrackingError, match=f"^{re.escape(message)}"):
        build_loggers(cfg, JobSettings.from_config(cfg))
    assert not (tmp_path / "mlflow.db").exists(), "refused before the store is opened"


def test_the_description_is_set_by_logger_notes() -> None:
    logger = OmegaConf.create({"tags": {"mlflow.note.content": "x"}, "notes": None})
    with pytest.raises(TrackingError, match="is a tag the template sets; use logger.notes"):
        user_tags(logger, reserved=["task"])


@pytest.mark.parametrize("kind", ["none", "csv", "mlflow"])
def test_tensorboard_beside_any_logger(kind: str, tmp_path: Path) -> None:
    cfg = compose_config("train", [f"logger={kind}", "logger.tensorboard=true"], tmp_path)
    loggers = build_loggers(cfg, JobSettings.from_config(cfg))
    (tensorboard,) = [x for x in loggers if isinstance(x, TensorBoardLogger)]
    assert Path(tensorboard.log_dir) == Path(cfg.paths.output_dir) / "tensorboard"


class DataDependent(torch.nn.Module):
    """A network torch.export cannot trace: its control flow depends on the inputs."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = inputs.flatten(1)[:, :1]
        return outputs if inputs.sum() > 0 else -outputs


def test_a_network_that_cannot_be_exported_costs_a_warning_not_the_job(tmp_path: Path) -> None:
    cfg = compose_config("train", [f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db"], tmp_path)
    loggers = build_loggers(cfg, JobSettings.from_config(cfg))
    datamodule = synthetic_data()
    datamodule.load("test")
    out = Path(cfg.paths.output_dir)
    with pytest.warns(UserWarning, match="not logged as an MLflow model: exporting it failed"):
        model = SimpleNamespace(net=DataDependent())
        log_model(loggers, cfg.logger, TASK, model, datamodule, out, step=1, metrics=[])
    assert list(out.iterdir()) == [], "no model folder, no staging folder left"


def test_a_task_without_export_says_it_logged_no_model(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from dataclasses import replace

    cfg = compose_config("train", [f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db"], tmp_path)
    task = replace(TASK, export=None)
    loggers = build_loggers(cfg, JobSettings.from_config(cfg))
    log_model(loggers, cfg.logger, task, None, None, tmp_path, step=1, metrics=[])
    assert "No MLflow model logged: the task has no export" in capsys.readouterr().out


def test_unreachable_server_is_a_clear_error_at_once(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(
        TrackingError, match=f"MLflow server http://u:\\*\\*\\*@127.0.0.1:{port} is not"
    ):
        prepare_store(f"http://u:pw@127.0.0.1:{port}", "mnist")


@pytest.mark.slow
def test_a_csv_job_never_imports_mlflow(tiny_root: Path, tmp_path: Path) -> None:
    """``logger=csv`` (and ``none``) pays nothing for MLflow: the job, its rank and loader
    processes included, imports no ``mlflow`` module (Python's own import log says which it
    imports: ``PYTHONPROFILEIMPORTTIME``)."""
    run_dir = tmp_path / "run"
    proc = run_entry(
        "train",
        *tiny_overrides(tiny_root, logger="csv"),
        "trainer.max_epochs=1",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
        env={"PYTHONPROFILEIMPORTTIME": "1"},
    )
    imported = [line.split("|")[-1] for line in proc.stderr.splitlines() if "|" in line]
    assert "lightning_exact.tracking" in {name.strip() for name in imported}, "the job's modules"
    assert mlflow_importers(imported) <= TASKS_OWN, "the machinery imports no mlflow"
    assert (run_dir / "csv" / "metrics.csv").is_file()


def mlflow_importers(imported: list[str]) -> set[str]:
    """The modules that imported ``mlflow`` itself, from Python's import log (a module's line
    comes after those of the modules it imported, each level indented 2 more); the outermost
    ``src.task`` module for the task's own."""
    importers = set()
    for at, name in enumerate(imported):
        if name.strip() != "mlflow":
            continue
        depth = len(name) - len(name.lstrip())
        parents = (n for n in imported[at + 1 :] if len(n) - len(n.lstrip()) < depth)
        importer = next(parents, "?").strip()
        importers.add("src.task" if importer.startswith("src.task") else importer)
    return importers


# A task's own modules may import mlflow at their top (docs/make-it-yours.md): what is checked
# is that the machinery does not.
TASKS_OWN = {"src.task"}


# --- real jobs against a real `mlflow server`


@pytest.mark.slow
def test_training_against_a_real_mlflow_server(
    server_url: str, tiny_root: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    run_entry(
        "train",
        *tiny_overrides(tiny_root),
        "trainer.max_epochs=1",
        f"logger.tracking_uri={server_url}",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert not (tmp_path / "mlflow.db").exists(), "nothing was logged locally"
    client = MlflowClient(server_url)
    (run,) = client.search_runs([client.get_experiment_by_name(DATA_NAME).experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["model.lr"] == "0.01"
    assert run.info.artifact_uri.startswith("mlflow-artifacts:"), "the server serves artifacts"
    config = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path / "dl"))
    assert Path(config).read_text() == (run_dir / "config.yaml").read_text()
    assert read_metrics(run_dir)["test/loss"] == pytest.approx(run.data.metrics["test/loss"])
    tls = server_url.replace("http://", "https://")
    (tmp_path / "asked-in-https").mkdir()
    asked = run_entry(
        "train",
        *tiny_overrides(tiny_root),
        f"logger.tracking_uri={tls}",
        cwd=tmp_path / "asked-in-https",
        check=False,
    )
    assert one_error_line(asked.stderr) == (
        f"Error: MLflow server {tls} answers only plain HTTP: use logger.tracking_uri={server_url}"
    )
    assert list((tmp_path / "asked-in-https").iterdir()) == [], "nothing is left behind"


@pytest.mark.slow
def test_unreachable_server_stops_the_job_before_training(tiny_root: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = run_entry(
        "train",
        *tiny_overrides(tiny_root),
        f"logger.tracking_uri=http://127.0.0.1:{port}",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 1
    assert f"MLflow server http://127.0.0.1:{port} is not reachable" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists(), "no training happened"


# --- system metrics


RUN_NAMES = 'a[href*="/runs/"]'  # each run's name in the runs table: a link to its page
MODEL_NAMES = 'a[href*="/models/m-"]'  # each logged model's in the Models tab
# The button beside a sweep's parent run that shows its jobs under it
EXPAND_SWEEP = """[...document.querySelectorAll('a[href*="/runs/"]')]
  .find(a => a.innerText.startsWith('sweep ')).closest('[role=gridcell]')
  .querySelector('button[data-component-id*="runnamecellrenderer"]').click()"""


def told_apart(page: Page, selector: str, count: int) -> list[str]:
    """The ``count`` names ``selector`` finds, each whole on the screen and none the same."""
    page.wait_for(selector, count)
    names = page.visible_texts(selector)
    print("on the screen:", [name["shown"] for name in names])
    assert [name["shown"] for name in names] == [name["full"] for name in names], "none cut"
    assert len({name["shown"] for name in names}) == len(names) == count, names
    return [name["shown"] for name in names]


@pytest.mark.slow
@pytest.mark.skipif(
    chromium() is None, reason="no Chromium here (.ci/run installs it: apt chromium)"
)
def test_a_reviewer_tells_runs_and_models_apart_in_the_mlflow_ui(
    tiny_root: Path, tmp_path: Path
) -> None:
    """docs/mlflow.md "Reviewing runs", in headless Chromium at MLflow's default layout
    (1600 x 1000) against `mlflow ui` as the README starts it: the part of each run's and
    model's name on the screen (the DOM's layout, not pixels) tells it apart, a smoke run says
    so, the sweep's link shows its metric as a column, and a run lasts as long as its job."""
    sweep = ["trainer.max_epochs=1", "model.lr=0.01,0.02", "logger.registered_model_name=r"]
    swept = run_entry("train", "-m", *tiny_overrides(tiny_root, model=True), *sweep, cwd=tmp_path)
    started = time.time()
    run_entry("train", *tiny_overrides(tiny_root), "debug=fast", cwd=tmp_path)
    took = time.time() - started
    (shown, _) = [line.split()[2] for line in swept.stdout.splitlines() if "MLflow run: " in line]
    (view,) = re.findall(r"a column: (\S+)", swept.stdout)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(DATA_NAME).experiment_id
    (smoke,) = client.search_runs([experiment], "tags.debug = 'fast'")
    start, end = smoke.info.start_time / 1000, smoke.info.end_time / 1000
    print(f"the smoke run: {end - start:.1f} s; its command: {took:.1f} s")
    # From its process's start (imports and config included) to after its outcome is recorded
    assert (
        started - 1 <= start < started + 5
    )  # Linux's boot time, of a process's start, is whole seconds
    assert end > (Path(smoke.data.tags["hydra.output_dir"]) / "metrics.json").stat().st_mtime
    model = client.search_logged_models([experiment], order_by=[{"field_name": "creation_time"}])[0]
    port = free_port()
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # the README's light UI
    argv = ["mlflow", "ui", "--workers", "1", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    with (
        environment(**env),
        mlflow_server(argv, port, tmp_path) as url,
        browser_page(tmp_path / "chromium") as page,
    ):
        page.open(f"{url}/#/experiments/{experiment}/runs?workflowType=machine_learning")
        assert told_apart(page, RUN_NAMES, 2) == [
            f"debug=fast {TRAIN_RUN_NAME}",
            "sweep lr=0.01,0.02",
        ]
        page.evaluate(EXPAND_SWEEP)
        jobs = told_apart(page, RUN_NAMES, 4)
        assert {f"lr=0.01 {TRAIN_RUN_NAME}", f"lr=0.02 {TRAIN_RUN_NAME}"} < set(jobs)
        page.screenshot(tmp_path / "runs.png")
        # The link the sweep printed: its jobs' optimized_metric a column
        page.open(view.replace("http://127.0.0.1:5000", url))
        page.wait_for(RUN_NAMES, 2)
        headers = page.evaluate(
            "[...document.querySelectorAll('[role=columnheader]')].map(e => e.innerText)"
        )
        assert PROJECT_TASK.config_values()["optimized_metric"] in headers, headers
        page.open(f"{url}/#/experiments/{experiment}/models?workflowType=machine_learning")
        models = told_apart(page, MODEL_NAMES, 2)
        assert set(models) == {f"lr=0_01 {TRAIN_RUN_NAME}", f"lr=0_02 {TRAIN_RUN_NAME}"}
        # The page each job prints (for `mlflow ui` on its default port): the run, in training mode.
        run_page = page_text(page, shown.replace("http://127.0.0.1:5000", url))
        assert f"lr=0.01 {TRAIN_RUN_NAME}" in run_page, run_page[:3000]
        assert "Model training" in run_page, run_page[:3000]
        model_page = page_text(page, f"{url}/#/experiments/{experiment}/models/{model.model_id}")
        assert f"Datasets used {DATA_NAME}/test" in model_page, model_page[-2000:]
        assert "Model versions r v1" in model_page, model_page[-2000:]


def page_text(page: Page, url: str, wait_s: float = 60) -> str:
    """What a reader sees at ``url`` once it has rendered, as one line of text."""
    page.open(url)
    deadline = time.monotonic() + wait_s
    while True:
        text = " ".join(page.evaluate("document.body.innerText").split())
        if "Loading" not in text or time.monotonic() > deadline:
            time.sleep(1)  # its last requests
            return " ".join(page.evaluate("document.body.innerText").split())
        time.sleep(0.5)


@pytest.mark.slow
def test_tensorboard_beside_mlflow_on_two_ranks(tiny_root: Path, tmp_path: Path) -> None:
    """logger.tensorboard=true on 2 DDP ranks: one events file (rank 0's), with the epoch and
    test metrics, and the MLflow run as without it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    run_entry(
        "train",
        *tiny_overrides(tiny_root),
        "trainer.max_epochs=1",
        "strategy=ddp",
        "devices=2",
        "logger.tensorboard=true",
        "+logger.tags.team=vision",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    (events,) = run_dir.rglob("events.out.tfevents.*")
    assert events.parent == run_dir / "tensorboard"
    scalars = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert {"train/loss", "val/loss", "test/loss"} <= set(scalars), scalars
    client, run = only_run(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED" and run.data.tags["team"] == "vision"
    assert run.data.metrics["test/loss"] == pytest.approx(read_metrics(run_dir)["test/loss"])


# A job run as `python -m src.train` does, that says which modules imported mlflow: the one
# whose code ran the import (the task's own modules counted as one, `src.task`).
WHICH_MLFLOW_MODULES = """
import runpy, sys
importers = set()

class WhoImportsMlflow:
    def find_spec(self, name, path=None, target=None):
        if name == "mlflow":
            frame = sys._getframe(1)
            while frame.f_globals.get("__name__", "").startswith(("importlib", "_frozen")):
                frame = frame.f_back
            importer = frame.f_globals.get("__name__", "?")
            importers.add("src.task" if importer.startswith("src.task") else importer)
        return None

sys.meta_path.insert(0, WhoImportsMlflow())
sys.argv = ["src.train", *sys.argv[1:]]
try:
    runpy.run_module("src.train", run_name="__main__")
finally:
    print("mlflow imported by:", sorted(importers - {"src.task"}))
"""


@pytest.mark.parametrize("logger", ["csv", "none"])
def test_a_job_without_mlflow_never_imports_it(logger: str, tiny_root: Path, tmp_path: Path):
    """MLflow takes a second to import; a job that logs elsewhere does not pay it, but for what
    the task's own modules import (docs/make-it-yours.md: import it where it is used)."""
    job = [*tiny_overrides(tiny_root, logger=logger), "hydra.run.dir=run"]
    proc = subprocess.run(
        [sys.executable, "-c", WHICH_MLFLOW_MODULES, *job],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(PROJECT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mlflow imported by: []" in proc.stdout, proc.stdout[-2000:]
    assert (tmp_path / "run" / "metrics.json").exists()
