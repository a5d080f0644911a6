"""Every config group option composes, resolves and builds the objects it describes."""

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from src.data import MNISTDataModule
from src.model import ImageClassifier
from src.tracking import build_loggers
from src.trainer import build_trainer
from tests.conftest import PROJECT

CONF = PROJECT / "conf"
GROUPS = ("data", "strategy", "trainer", "callbacks", "logger", "debug", "experiment")
GROUP_OPTIONS = [
    f"{group}={path.stem}" for group in GROUPS for path in sorted((CONF / group).glob("*.yaml"))
]


def compose_config(name: str, overrides: list[str], workdir: Path) -> DictConfig:
    """Compose like ``@hydra.main`` does, with the runtime folders a real launch would set."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(name, overrides=overrides, return_hydra_config=True)
    OmegaConf.set_readonly(cfg.hydra, False)
    with open_dict(cfg):
        cfg.hydra.runtime.cwd = str(workdir)
        cfg.hydra.runtime.output_dir = str(workdir / "out")
    HydraConfig.instance().set_config(cfg)  # keeps its own copy of cfg.hydra
    OmegaConf.set_readonly(cfg, False)
    with open_dict(cfg):
        del cfg["hydra"]  # the task function never sees it either
    return cfg


def test_every_group_has_options() -> None:
    for group in (*GROUPS, "model", "paths", "hydra"):
        assert list((CONF / group).glob("*.yaml")), f"conf/{group}/ is empty"


@pytest.mark.parametrize(
    ("name", "override"),
    # eval and predict take the model from the checkpoint, so they have no model group.
    [(name, o) for name in ("train", "eval", "predict") for o in GROUP_OPTIONS]
    + [("train", "model=convnet")],
)
def test_group_option_composes_and_builds(name: str, override: str, tmp_path: Path) -> None:
    cfg = compose_config(name, [override], tmp_path)
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    datamodule = MNISTDataModule(**cfg.data)
    model_cfg = cfg.get("model") or compose_config("train", [], tmp_path).model
    ImageClassifier(num_classes=10, **OmegaConf.to_container(model_cfg))
    trainer = build_trainer(cfg, build_loggers(cfg), fitting=name == "train")
    assert trainer.world_size == cfg.devices * cfg.num_nodes
    assert datamodule.hparams.batch_size == cfg.data.batch_size


def test_contract_keys_and_defaults(tmp_path: Path) -> None:
    cfg = compose_config("train", [], tmp_path)
    assert (cfg.devices, cfg.num_nodes, cfg.accelerator, cfg.ckpt_path) == (1, 1, "auto", None)
    assert isinstance(cfg.seed, int)
    assert cfg.data.name == "mnist" and cfg.model.lr > 0 and cfg.logger.kind == "mlflow"
    assert cfg.data.root == f"{tmp_path}/data" and cfg.data.download is True
    assert cfg.logger.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    for key in ("batch_size", "val_size", "num_workers"):
        assert key in cfg.data
    for key in ("max_epochs", "limit_train_batches", "limit_val_batches", "limit_test_batches"):
        assert key in cfg.trainer
    # Sub-second run folders: two jobs started in the same second do not collide.
    run_dir = HydraConfig.get().run.dir
    assert re.search(r"/train/runs/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d{6}$", run_dir)


def test_fashion_mnist_experiment_overrides_data(tmp_path: Path) -> None:
    cfg = compose_config("train", ["experiment=fashion_mnist"], tmp_path)
    assert cfg.data.name == "fashion_mnist"
    assert cfg.data.batch_size == 128  # inherited from data/mnist.yaml
