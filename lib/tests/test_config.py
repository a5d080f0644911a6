"""Every config group option composes, resolves and builds the objects it describes.

The library's groups (trainer, strategy, callbacks, logger, ...: lightning_exact/conf/) with the
test project's own (project/conf/: its task.yaml, data and model): these tests name no dataset,
network or metric of any task but the test task's."""

import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from lightning.fabric.utilities.exceptions import MisconfigurationException as ConfigError
from lightning_exact.job.config import check_keys, check_sections
from lightning_exact.job.entry import LIBRARY_CONF
from lightning_exact.job.settings import JobSettings
from lightning_exact.testing import configs
from lightning_exact.testing.configs import LOCAL_SETTINGS
from lightning_exact.tracking.run import build_loggers
from lightning_exact.training.distributed import check_devices
from lightning_exact.training.trainer import build_callbacks, build_trainer, check_settings
from omegaconf import DictConfig, OmegaConf

from tests.conftest import PROJECT, run_entry
from tests.machinery_task import TASK

CONF = PROJECT / "conf"  # the test project's: task.yaml, data/, model/
GROUPS = ("data", "strategy", "trainer", "callbacks", "logger", "debug", "experiment")


def options(group: str) -> list[str]:
    """A group's options, the project's and the library's (found through Hydra's search path)."""
    paths = [*(CONF / group).glob("*.yaml"), *(LIBRARY_CONF / group).glob("*.yaml")]
    return sorted({path.stem for path in paths})


GROUP_OPTIONS = [f"{group}={option}" for group in GROUPS for option in options(group)]


def compose_config(name: str, overrides: list[str], workdir: Path, conf: Path = CONF) -> DictConfig:
    """Compose like ``@hydra.main`` does, with the runtime folders a real launch would set."""
    return configs.compose_config(name, overrides, workdir, conf=conf, task=TASK)


def test_every_group_has_options() -> None:
    for group in ("data", "model", "strategy", "trainer", "callbacks", "logger", "debug", "paths"):
        assert options(group), f"no {group} option in conf/{group}/ or the library's"


@pytest.mark.parametrize(
    ("name", "override"),
    # eval and predict take the model from the checkpoint, so they have no model group.
    [(name, o) for name in ("train", "eval", "predict") for o in GROUP_OPTIONS]
    + [("train", f"model={option}") for option in options("model")],
)
def test_group_option_composes_and_builds(name: str, override: str, tmp_path: Path) -> None:
    cfg = compose_config(name, [override], tmp_path)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    if cfg.accelerator == "gpu" and not torch.cuda.is_available():  # trainer=gpu
        with pytest.raises(ConfigError, match="accelerator=gpu but no GPU is visible here"):
            check_settings(cfg, fitting=name == "train")
        pytest.skip(f"{override} needs a GPU to build; here it composes and is refused")
    check_settings(cfg, fitting=name == "train")  # every shipped option passes the checks
    check_keys("data", cfg.data, TASK.datamodule_class(cfg.data.name))
    model_cfg = OmegaConf.to_container(
        cfg.get("model") or compose_config("train", [], tmp_path).model
    )
    check_sections(cfg, TASK.config_targets(model_cfg))
    data = OmegaConf.to_container(cfg.data, resolve=True)
    datamodule = TASK.datamodule_class(cfg.data.name)(**data)
    TASK.build_model(model_cfg, datamodule)
    fitting = name == "train"
    monitor = (TASK.monitor, TASK.mode) if fitting else None
    callbacks = build_callbacks(cfg.callbacks, Path(cfg.paths.output_dir), monitor)
    settings = JobSettings.from_config(cfg)
    trainer = build_trainer(cfg, settings, build_loggers(cfg, settings), callbacks, fitting=fitting)
    assert trainer.world_size == cfg.devices * cfg.num_nodes
    assert datamodule.hparams.batch_size == cfg.data.batch_size


def test_contract_keys_and_defaults(tmp_path: Path) -> None:
    cfg = compose_config("train", [], tmp_path)
    assert (cfg.devices, cfg.num_nodes, cfg.accelerator, cfg.ckpt_path) == (1, 1, "auto", None)
    assert isinstance(cfg.seed, int)
    assert cfg.data.name in TASK.datamodules and cfg.logger.kind == "mlflow"
    assert cfg.paths.data_dir == f"{tmp_path}/data"
    assert cfg.logger.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    for key in ("batch_size", "val_size", "num_workers"):
        assert key in cfg.data
    for key in ("max_epochs", "limit_train_batches", "limit_val_batches", "limit_test_batches"):
        assert key in cfg.trainer
    # Sub-second run folders: two jobs started in the same second do not collide.
    run_dir = HydraConfig.get().run.dir
    assert re.search(r"/train/runs/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d{6}$", run_dir)


class Net:
    def __init__(self, in_channels: int, channels: tuple[int, ...] = (8,), dropout: float = 0.0):
        pass


class Model:
    def __init__(self, net: dict, num_classes: int, lr: float = 0.01) -> None:
        pass


def test_check_keys_names_the_valid_keys_and_a_near_miss() -> None:
    check_keys("model.net", {"channels": [8], "dropout": 0.1}, Net)
    with pytest.raises(ConfigError) as info:
        check_keys("model.net", {"chanels": [8]}, Net)
    assert str(info.value) == (
        "model.net.chanels is not a setting of model.net (Net) (did you mean "
        "model.net.channels?); valid keys: model.net.in_channels, model.net.channels, "
        "model.net.dropout"
    )
    with pytest.raises(ConfigError, match="model.num_classes is set from the data; remove"):
        check_keys("model", {"num_classes": 3}, Model, set_by={"num_classes": "the data"})


def test_the_sweep_metric_and_its_direction_are_the_tasks(tmp_path: Path) -> None:
    """conf/ names no metric: ``optimized_metric`` and Optuna's ``direction`` come from TASK
    (``${task:...}``), and a task whose metric is lower-is-better turns the direction around."""
    cfg = compose_config("train", [], tmp_path)
    values = TASK.config_values()
    assert cfg.optimized_metric == values["optimized_metric"]
    for search in options("hparams_search"):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            overrides = [f"hparams_search={search}"]
            composed = compose("train", overrides, return_hydra_config=True)
        assert composed.hydra.sweeper.direction == values["direction"], search
        assert composed.optimized_metric == values["optimized_metric"], search
    loss = replace(TASK, monitor="val/loss", mode="min", optimized_metric=None).config_values()
    assert (loss["optimized_metric"], loss["direction"]) == ("val/loss_best", "minimize")
    named = replace(TASK, monitor="val/acc", mode="max", optimized_metric="test/acc")
    values = named.config_values()
    assert (values["optimized_metric"], values["direction"]) == ("test/acc", "maximize")
    none = replace(TASK, monitor=None, mode="min", optimized_metric=None).config_values()
    assert none["optimized_metric"] is None, "a task without a metric: no sweep ranks by it"


def refusal(override: str) -> str:
    """The line an entry point shows for a command-line ``override`` Hydra refuses."""
    return configs.refusal(override, conf=CONF, task=TASK)


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "dat.batch_size=8",
            "dat.batch_size is not a config key (did you mean data.batch_size?); top-level keys",
        ),
        (
            "data.batch_sise=8",
            "data.batch_sise is not a config key (did you mean data.batch_size?); data has: ",
        ),
        ("tarinmer.max_epochs=1", "(did you mean trainer.max_epochs?)"),
        (
            "trainer.acumulate_grad_batches=2",
            "trainer.acumulate_grad_batches is not a config key (did you mean "
            "trainer.accumulate_grad_batches?); trainer has: accumulate_grad_batches, barebones,",
        ),
        ("trainer.devices=2", "trainer.devices is set from the top-level key devices; remove"),
        ("trainer.logger=false", "trainer.logger is set from the logger group (logger=mlflow|"),
        (  # the retired key: BatchNorm is global on any device unless strategy.exact=false
            "strategy.sync_batchnorm=true",
            "strategy.sync_batchnorm is set from strategy.exact (BatchNorm over the global batch "
            "on any device, on by default); remove strategy.sync_batchnorm",
        ),
        ("trainer.sync_batchnorm=true", "trainer.sync_batchnorm is set from strategy.exact ("),
        (
            "+trainer.max_steps=14",  # a Trainer argument that needed + before every one was a key
            "+trainer.max_steps=14: trainer.max_steps already has a value; set it without +: "
            "trainer.max_steps=14 (Hydra's + only adds a key that is absent or null)",
        ),
    ],
)
def test_an_unknown_key_is_one_line_with_the_nearest_key(override: str, line: str) -> None:
    shown = refusal(override)
    assert "\n" not in shown and line in shown, shown


def test_plus_sets_a_key_whose_default_is_null_as_hydra_does(tmp_path: Path) -> None:
    """Hydra's rule, as docs/troubleshooting.md says it: + on a null key sets it."""
    cfg = compose_config("train", ["+trainer.gradient_clip_val=0.5"], tmp_path)
    assert cfg.trainer.gradient_clip_val == 0.5


@pytest.mark.parametrize("devices", [1, 3, "auto"])
def test_valid_device_counts(devices: object) -> None:
    check_devices("cpu", devices, 1)


@pytest.mark.parametrize("devices", [0, -2, "two", 1.5, True, []])
def test_invalid_device_counts_say_what_is_valid(devices: object) -> None:
    with pytest.raises(ConfigError, match=rf"^devices={re.escape(str(devices))} is not valid: "):
        check_devices("cpu", devices, 1)


def test_cpu_processes_are_checked_against_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    for name in ("RANK", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    check_devices("cpu", 4, 1)  # twice the cores: slower, still runs (the tests do it)
    with pytest.raises(
        ConfigError,
        match=r"^devices=5 would start 5 processes on this machine's "
        r"2 CPU core\(s\); use devices=2 ",
    ):
        check_devices("cpu", 5, 3)  # per node: num_nodes does not change what one node runs
    # Each rank started by srun (or torchrun) may be bound to a few cores: the node's count.
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_PROCID", "3")
    check_devices("cpu", 8, 1)
    with pytest.raises(
        ConfigError,
        match=r"^devices=1000 would start 1000 processes on this "
        r"machine's 64 CPU core\(s\); use devices=64 ",
    ):
        check_devices("cpu", 1000, 1)


@pytest.mark.parametrize("num_nodes", [0, -1, "two", 1.0])
def test_invalid_node_counts(num_nodes: object) -> None:
    with pytest.raises(ConfigError, match=r"is not valid: it is the number of machines"):
        check_devices("cpu", 1, num_nodes)


@pytest.mark.parametrize(
    ("launcher", "rank", "copies"),
    [("lightning", 0, 4), ("lightning", 1, 3), ("lightning", 7, 3), ("torchrun", 5, 4)],
)
def test_copies_of_in_memory_data_still_to_read_on_a_machine(
    launcher: str, rank: int, copies: int
) -> None:
    """4 ranks a machine: Lightning's launcher starts a machine's other ranks once its first
    has read its copy; torchrun and srun start them together."""
    settings = JobSettings(Path("out"), 4, 2, launcher, rank)
    assert settings.copies_to_read == copies


def test_evaluation_takes_a_batch_the_world_does_not_divide(tmp_path: Path) -> None:
    cfg = compose_config("eval", ["strategy=ddp", "devices=3"], tmp_path)
    settings = check_settings(cfg, fitting=False)  # 128 samples split by samples, not refused
    assert settings.world_size == 3
    with pytest.raises(Exception, match="must be divisible by the world size 3"):
        check_settings(cfg, fitting=True)


def test_a_resume_on_a_world_that_does_not_divide_its_batch_names_the_ones_that_do(
    tmp_path: Path,
) -> None:
    """A resume keeps its job's global batch (another is refused as another job): the refusal
    names the nearest world sizes that divide it, not only another batch size (issue 60)."""
    args = ["strategy=ddp", "devices=3", "data.batch_size=128"]
    cfg = compose_config("train", [*args, "ckpt_path=x/last.ckpt"], tmp_path)
    with pytest.raises(
        Exception, match=r"\(a resume keeps its job's: resume it on 2 or 4 ranks\)$"
    ):
        check_settings(cfg, fitting=True)


@pytest.mark.parametrize(
    "length",
    [
        ["trainer.max_epochs=-1", "trainer.max_steps=500"],  # counted in steps
        ["trainer.max_epochs=2", "trainer.max_steps=500"],  # whichever ends it first
        ["trainer.max_epochs=-1", "trainer.max_time=00:01:00:00"],  # by time
    ],
)
def test_a_job_may_be_counted_in_epochs_steps_or_time(length: list[str], tmp_path: Path) -> None:
    check_settings(compose_config("train", length, tmp_path), fitting=True)


@pytest.mark.parametrize(
    ("length", "line"),
    [
        (
            ["trainer.max_epochs=-1"],
            "trainer.max_epochs=-1 with trainer.max_steps=-1 trains without end",
        ),
        (["trainer.max_epochs=0"], "trainer.max_epochs=0 is not valid"),
        (["trainer.max_steps=0"], "trainer.max_steps=0 is not valid"),
    ],
)
def test_a_job_without_an_end_is_refused(length: list[str], line: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=line):
        check_settings(compose_config("train", length, tmp_path), fitting=True)


# --- this machine's settings: conf/local/default.yaml (git-ignored), never written to conf/ here
# (the template's conf/local/example.yaml and its .gitignore: tests/template/test_conf.py)

ENTRY_CONFIGS = ("train", "eval", "predict")  # the library's entry points


def conf_copy(folder: Path, local: str | None) -> Path:
    """A copy of conf/ with ``local`` as its conf/local/default.yaml (None: without one)."""
    return configs.conf_copy(folder, CONF, local)


@pytest.mark.parametrize("name", ENTRY_CONFIGS)
def test_local_settings_win_over_the_defaults(name: str, tmp_path: Path) -> None:
    conf = conf_copy(tmp_path, LOCAL_SETTINGS)
    cfg = compose_config(name, [], tmp_path, conf)
    assert cfg.paths.data_dir == "/datasets/here"  # every dataset's root (tests/task/test_conf.py)
    assert HydraConfig.get().run.dir.startswith(f"/scratch/outputs/{name}/runs/")
    assert cfg.logger.tracking_uri == "http://mlflow.example:5000"


@pytest.mark.parametrize("name", ENTRY_CONFIGS)
def test_the_command_line_wins_over_local_settings(name: str, tmp_path: Path) -> None:
    conf = conf_copy(tmp_path, LOCAL_SETTINGS)
    cfg = compose_config(name, ["paths.data_dir=/typed", "paths.log_dir=typed"], tmp_path, conf)
    assert cfg.paths.data_dir == "/typed"
    assert HydraConfig.get().run.dir.startswith(f"typed/{name}/runs/")


@pytest.mark.parametrize("name", ENTRY_CONFIGS)
def test_without_local_settings_the_defaults_hold(name: str, tmp_path: Path) -> None:
    cfg = compose_config(name, [], tmp_path, conf_copy(tmp_path, None))
    assert cfg.paths.data_dir == f"{tmp_path}/data"
    assert HydraConfig.get().run.dir.startswith(f"outputs/{name}/runs/")
    if name in ("train", "eval"):  # predict logs to none by default
        assert cfg.logger.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    conf = tmp_path / "conf"
    assert cfg == compose_config(name, ["~local"], tmp_path, conf)  # as without the default


@pytest.mark.slow
def test_every_entry_point_reads_local_settings(tmp_path: Path) -> None:
    """``python -m src.<entry> --cfg job`` in a copy of the project with conf/local/default.yaml."""
    copy = tmp_path / "project"
    for folder in ("src", "conf"):
        shutil.copytree(PROJECT / folder, copy / folder, ignore=shutil.ignore_patterns("__py*"))
    (copy / "conf" / "local").mkdir(exist_ok=True)
    (copy / "conf" / "local" / "default.yaml").write_text(LOCAL_SETTINGS)
    for name in ENTRY_CONFIGS:
        proc = run_entry(name, "--cfg", "job", cwd=copy, env={"PYTHONPATH": str(copy)})
        assert "data_dir: /datasets/here" in proc.stdout, proc.stdout
        assert "log_dir: /scratch/outputs" in proc.stdout
        assert "tracking_uri: http://mlflow.example:5000" in proc.stdout
