"""The train, eval and predict entry points: compose the config with Hydra, run the job with
the task, end expected errors (bad input, a failed rank) in one line."""

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import HydraException
from lightning.fabric.utilities.exceptions import MisconfigurationException as ConfigError
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_exact import data
from lightning_exact.checkpoints import checkpoint, shutdown
from lightning_exact.environment import environment
from lightning_exact.job import reporting
from lightning_exact.job.clock import start_job_clock
from lightning_exact.job.config import describe_config_error
from lightning_exact.job.stories import STORIES
from lightning_exact.sweeps import jobs as sweeps
from lightning_exact.sweeps import report as sweep_report
from lightning_exact.task import Task
from lightning_exact.tracking import names, store
from lightning_exact.training.distributed import job_scope
from lightning_exact.training.trainer import SET_BY_TEMPLATE

LIBRARY_CONF = Path(__file__).resolve().parents[1] / "conf"  # found through Hydra's search path


def project_conf() -> Path:
    """The project's ``conf/``, beside its ``src/`` package (which the entry point and the task
    come from), however the job was launched; else in the folder it is launched from."""
    package = sys.modules.get("src")
    init = getattr(package, "__file__", None)
    return Path(init).resolve().parents[1] / "conf" if init else Path.cwd() / "conf"


# Trainer arguments on the command line (trainer.devices=2) and retired keys, set elsewhere.
SET_ELSEWHERE = {
    **{f"trainer.{key}": where for key, where in SET_BY_TEMPLATE.items()},
    "strategy.sync_batchnorm": "strategy.exact (BatchNorm over the global batch on any device, "
    "on by default)",
}
# Errors that mean bad input or a failed rank: shown as one line, no traceback.
EXPECTED = (
    data.DataError,
    checkpoint.CheckpointError,
    store.TrackingError,
    ConfigError,
    shutdown.RankFailed,
    sweeps.SweepError,
)


def main(
    config_name: str, task: Task, job: Callable[[DictConfig, Task], Any] | None = None
) -> None:
    """``job(cfg, task)`` with the config ``<config_name>.yaml`` (the project's ``conf/``, then
    the library's); ``job`` by default the story of that name (:mod:`.stories`: train, eval,
    predict). Hydra's sweepers optimise its result.
    Hydra's errors (raised, not reported, under its documented ``HYDRA_FULL_ERROR=1``) and a
    sweep's first failed job's end here, in one line; a single job ends its own (short_errors).
    A sweep then reports its jobs (lib/lightning_exact/sweeps/report.py)."""
    if not isinstance(task, Task):  # main(name, job, task): its order before 1.0
        raise TypeError("entry.main(config_name, job, task) is now main(config_name, task)")
    job = job or STORIES[config_name]
    expected = (*EXPECTED, *task.errors)

    @hydra.main(version_base="1.3", config_path=str(project_conf()), config_name=config_name)
    def run(cfg: DictConfig) -> Any:
        start_job_clock()  # the job's MLflow run starts here: its duration is the job's
        reporting.quiet_library_notices()  # here: a SLURM sweep job runs this function, not main()
        use_task_in_config(task)
        with reporting.short_errors(*expected), job_scope():
            return job(cfg, task)

    sweeps.register_resolvers()
    names.register_resolver()
    use_task_in_config(task)
    sys.argv[1:] = store.credentials_to_environment(sys.argv[1:])  # before Hydra records them
    folder = sweeps.resume_folder(sys.argv[1:]) if config_name == "train" else None
    if folder:  # a resume continues in the stopped job's folder: one job, one folder
        sys.argv.append(f"hydra.run.dir={folder}")
    with (
        # MLflow's own "View run" lines: the job prints its run's page once, without a password.
        environment(HYDRA_FULL_ERROR="1", MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT="true"),
        sweep_report.reported_at_end(task.mode),
        left_as_it_was_if_refused(folder),
    ):
        run_in_one_line(run, expected)


def run_in_one_line(run: Callable[[], Any], expected: tuple[type[Exception], ...]) -> None:
    """``run()``, its config errors and expected errors shown in one line, exit status 1."""
    try:
        run()
    except (HydraException, OmegaConfBaseException) as error:
        reporting.show_error(describe_config_error(error, SET_ELSEWHERE))
        reporting.remove_refused_sweep()
        raise SystemExit(1) from None
    except expected as error:
        reporting.show_error(str(error))
        raise SystemExit(1) from None


def use_task_in_config(task: Task) -> None:
    """``${task:KEY}`` in conf/ reads the task's :meth:`Task.config_values`: the sweeps' metric
    and Optuna's direction are named once, by the task. Registered before Hydra composes (the
    sweeper's config) and again in the job (a SLURM sweep job runs only the job function)."""
    OmegaConf.register_new_resolver("task", task.config_values().__getitem__, replace=True)


@contextmanager
def left_as_it_was_if_refused(folder: Path | None) -> Iterator[None]:
    """A resume refused in the stopped job's ``folder`` leaves it as it was: Hydra rewrites its
    ``.hydra/`` record and appends to its log before the job's checks run. A job that got as far
    as writing ``config.yaml`` (its checks passed) keeps what it wrote."""
    if folder is None:
        yield
        return
    files = [path for path in (*folder.glob(".hydra/*"), *folder.glob("*.log")) if path.is_file()]
    before = {path: path.read_bytes() for path in files}
    config = folder / "config.yaml"
    stamp = config.stat().st_mtime_ns if config.is_file() else None
    try:
        yield
    except SystemExit as stop:
        written = config.stat().st_mtime_ns if config.is_file() else None
        if stop.code and written == stamp:
            for path, content in before.items():
                path.write_bytes(content)
        raise
