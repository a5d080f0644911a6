"""The shipped task's configs (conf/data/, conf/model/, conf/experiment/, conf/hparams_search/,
conf/prepare.yaml): what lib/tests/test_config.py checks for any task, here with the image task's
own names."""

import shutil
from pathlib import Path

import pytest
import torch
from hydra.core.hydra_config import HydraConfig
from lightning_exact.checkpoints.checkpoint import (
    CheckpointError,
    check_same_job,
    settings_to_record,
)
from lightning_exact.testing import configs
from lightning_exact.testing.configs import LOCAL_SETTINGS
from omegaconf import DictConfig, OmegaConf

from src.task import TASK
from tests.conftest import HARNESS, PROJECT
from tests.image_data import make_image_folder
from tests.shard_data import write_manifest
from tests.template.test_readme import TASK_GROUPS, config_keys

run_entry = HARNESS.run_entry
CONF = PROJECT / "conf"
ENTRY_CONFIGS = ("train", "eval", "predict", "prepare")  # prepare: the image task's


def compose_config(name: str, overrides: list[str], workdir: Path, conf: Path = CONF) -> DictConfig:
    """Compose like ``@hydra.main`` does, with the runtime folders a real launch would set."""
    return configs.compose_config(name, overrides, workdir, conf=conf, task=TASK)


def conf_copy(folder: Path, local: str | None) -> Path:
    """A copy of conf/ with ``local`` as its conf/local/default.yaml (None: without one)."""
    return configs.conf_copy(folder, CONF, local)


def refusal(override: str) -> str:
    """The line an entry point shows for a command-line ``override`` Hydra refuses."""
    return configs.refusal(override, conf=CONF, task=TASK)


def saved_job(cfg_overrides: list[str], workdir: Path) -> dict:
    """A checkpoint's ``job`` entry as ``src.train`` writes it for these overrides."""
    cfg = compose_config("train", cfg_overrides, workdir)
    return {
        "job": {"settings": settings_to_record(cfg, cfg.seed, None), "overrides": cfg_overrides}
    }


DATA = sorted(path.stem for path in (PROJECT / "conf" / "data").glob("*.yaml"))
MODELS = sorted(path.stem for path in (PROJECT / "conf" / "model").glob("*.yaml"))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("data", DATA)
def test_every_network_gives_one_logit_per_class_of_every_dataset(
    data: str, model: str, tmp_path: Path
) -> None:
    cfg = compose_config("train", [f"data={data}", f"model={model}"], tmp_path)
    if data == "image_folder":
        make_image_folder(Path(cfg.data.root), n_train=2, n_test=1)
    if data == "shards":
        write_manifest(Path(cfg.data.root))
    datamodule = TASK.datamodule_class(data)(**OmegaConf.to_container(cfg.data, resolve=True))
    network = TASK.build_model(OmegaConf.to_container(cfg.model), datamodule)
    logits = network(torch.zeros(2, *datamodule.image_shape))
    assert logits.shape == (2, datamodule.num_classes)


@pytest.mark.parametrize("name", ENTRY_CONFIGS)
def test_the_defaults_read_mnist_downloaded_beside_the_launch(name: str, tmp_path: Path) -> None:
    cfg = compose_config(name, [], tmp_path, conf_copy(tmp_path, None))
    assert cfg.data.name == "mnist" and cfg.data.root == f"{tmp_path}/data"
    assert cfg.data.download is True
    if name == "train":
        assert cfg.model.lr > 0


def test_fashion_mnist_experiment_overrides_data(tmp_path: Path) -> None:
    cfg = compose_config("train", ["experiment=fashion_mnist"], tmp_path)
    assert cfg.data.name == "fashion_mnist"
    assert cfg.data.batch_size == 128  # inherited from data/mnist.yaml


@pytest.mark.parametrize("name", ENTRY_CONFIGS)
def test_one_local_data_folder_serves_every_dataset(name: str, tmp_path: Path) -> None:
    conf = conf_copy(tmp_path, LOCAL_SETTINGS)
    for data, folder in (("mnist", ""), ("image_folder", "/image_folder"), ("shards", "/shards")):
        cfg = compose_config(name, [f"data={data}"], tmp_path, conf)
        assert cfg.data.root == f"/datasets/here{folder}"
    cfg = compose_config(name, ["paths.data_dir=/typed"], tmp_path, conf)
    assert cfg.data.root == "/typed"
    cfg = compose_config(name, ["data.root=/typed/root"], tmp_path, conf)
    assert cfg.data.root == "/typed/root"  # the command line wins


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("mdoel.lr=0.1", "mdoel.lr is not a config key (did you mean model.lr?); top-level keys"),
        ("dat.root=/x", "dat.root is not a config key (did you mean data.root?); top-level keys"),
        ("model.lrr=1", "model.lrr is not a config key (did you mean model.lr?); model has: "),
        ("modle.net.hidden=8", "(did you mean model.net.hidden?)"),
    ],
)
def test_a_mistyped_model_or_data_key_names_the_nearest(override: str, line: str) -> None:
    shown = refusal(override)
    assert "\n" not in shown and line in shown, shown


def test_the_optuna_search_maximises_the_best_accuracy(tmp_path: Path) -> None:
    cfg = compose_config("train", ["hparams_search=convnet_optuna"], tmp_path)
    assert cfg.optimized_metric == TASK.config_values()["optimized_metric"] == "val/acc_best"
    assert TASK.config_values()["direction"] == "maximize"


def test_configuration_page_names_every_key_of_the_task() -> None:
    page = (PROJECT / "docs" / "configuration.md").read_text()
    keys = [key for key in sorted(config_keys()) if key.split(".")[0] in TASK_GROUPS]
    assert "model.net.channels" in keys and "data.root" in keys
    assert [key for key in keys if f"`{key}`" not in page] == []


def test_the_data_and_model_keys_a_resume_may_change_exist(tmp_path: Path) -> None:
    cfg = compose_config("train", [], tmp_path)
    task_keys = [key for key in cfg.resume_may_differ if key.split(".")[0] in ("data", "model")]
    assert "data.root" in task_keys and "model.compile" in task_keys
    for key in task_keys:
        assert OmegaConf.select(cfg, key, default="missing") != "missing", key


def test_a_resume_may_move_the_data_and_compile_the_model_but_not_change_the_lr(
    tmp_path: Path,
) -> None:
    job = ["data=fashion_mnist"]
    saved = saved_job(job, tmp_path)
    moved = [*job, "data.root=/elsewhere", "model.compile=true", "model.channels_last=true"]
    check_same_job(saved, compose_config("train", moved, tmp_path), "last.ckpt")
    with pytest.raises(CheckpointError, match=r"model.lr=0.002 \(here 0.1\)"):
        check_same_job(saved, compose_config("train", [*job, "model.lr=0.1"], tmp_path), "x")


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ([], "convnet"),
        (["data=shards", "model=resnet", "devices=2", "accelerator=cpu"], "2 ranks resnet"),
        (["experiment=fashion_mnist", "model=resnet", "debug=fast"], "debug=fast resnet"),
    ],
)
def test_the_runs_are_named_by_the_ranks_and_the_network(
    overrides: list[str], name: str, tmp_path: Path
) -> None:
    """Issue 60's runs list, as the image task's jobs name their runs (what
    tests/test_tracking.py checks for any task)."""
    run_name = compose_config("train", overrides, tmp_path).logger.run_name
    assert " ".join(run_name.split()) == name


# --- src.prepare (the image task's) reads this machine's settings as the library's entry points
# do (lib/tests/test_config.py)


def test_prepare_takes_local_settings_and_the_command_line_wins(tmp_path: Path) -> None:
    conf = conf_copy(tmp_path, LOCAL_SETTINGS)
    cfg = compose_config("prepare", [], tmp_path, conf)
    assert cfg.paths.data_dir == "/datasets/here"
    assert HydraConfig.get().run.dir.startswith("/scratch/outputs/prepare/runs/")
    cfg = compose_config(
        "prepare", ["paths.data_dir=/typed", "paths.log_dir=typed"], tmp_path, conf
    )
    assert cfg.paths.data_dir == "/typed"
    assert HydraConfig.get().run.dir.startswith("typed/prepare/runs/")


def test_without_local_settings_prepare_keeps_the_defaults(tmp_path: Path) -> None:
    cfg = compose_config("prepare", [], tmp_path, conf_copy(tmp_path, None))
    assert cfg.paths.data_dir == f"{tmp_path}/data"
    assert HydraConfig.get().run.dir.startswith("outputs/prepare/runs/")
    assert cfg == compose_config("prepare", ["~local"], tmp_path, tmp_path / "conf")


@pytest.mark.slow
def test_prepare_reads_local_settings(tmp_path: Path) -> None:
    """``python -m src.prepare --cfg job`` in a copy of the project with conf/local/default.yaml."""
    copy = tmp_path / "project"
    for folder in ("src", "conf"):
        shutil.copytree(PROJECT / folder, copy / folder, ignore=shutil.ignore_patterns("__py*"))
    (copy / "conf" / "local" / "default.yaml").write_text(LOCAL_SETTINGS)
    proc = run_entry("prepare", "--cfg", "job", cwd=copy, env={"PYTHONPATH": str(copy)})
    assert "data_dir: /datasets/here" in proc.stdout, proc.stdout
    assert "log_dir: /scratch/outputs" in proc.stdout
