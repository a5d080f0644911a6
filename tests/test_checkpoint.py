"""Checkpoint writing, checking and loading; per-step seeding."""

import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

from src.task import TASK
from src.task.data.mnist import MNISTDataModule
from src.task.model import ImageClassifier
from src.template.checkpoint import (
    AtomicCheckpointIO,
    BestCheckpoint,
    CheckpointError,
    LastCheckpoint,
    check_fits,
    load_for_inference,
    read_checkpoint,
    shorten,
)
from src.template.resume import SeedEachBatch, step_seed
from tests.conftest import PROJECT

NET = {"channels": [8, 16], "hidden": 32, "dropout": 0.25, "batch_norm": True}


def training_checkpoint(model: ImageClassifier, **extra: object) -> dict:
    """What Lightning saves for a model, reduced to the parts these checks read."""
    return {
        "state_dict": model.state_dict(),
        "hyper_parameters": dict(model.hparams),
        "datamodule_hyper_parameters": {"name": "mnist"},
        "optimizer_states": [],
        "loops": {},
        **extra,
    }


def test_atomic_write_keeps_the_previous_file_when_saving_fails(tmp_path: Path) -> None:
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"epoch": 1}, path)
    with pytest.raises(Exception, match="pickle"):
        io.save_checkpoint({"epoch": 2, "broken": lambda: None}, path)  # fails mid-write
    assert torch.load(path, weights_only=True) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"], "no temporary file left"


def test_atomic_write_stays_in_the_checkpoint_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning's default stages the file in the temp folder and moves it: a copy, not an
    # atomic rename, when that folder is on another filesystem. Ours never touches it.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-temp-folder"))
    AtomicCheckpointIO().save_checkpoint({"epoch": 3}, tmp_path / "ckpts" / "last.ckpt")
    assert torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True) == {"epoch": 3}


def test_read_checkpoint_refuses_what_is_not_one(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such file"):
        read_checkpoint(str(tmp_path / "missing.ckpt"))
    (tmp_path / "notes.ckpt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="is not a readable checkpoint"):
        read_checkpoint(str(tmp_path / "notes.ckpt"))
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="not a Lightning checkpoint"):
        read_checkpoint(str(tmp_path / "plain.pt"))


class Unsafe:
    """What weights_only loading refuses: a class of someone's own, pickled."""


def test_an_unreadable_file_gets_a_short_whole_reason(tmp_path: Path) -> None:
    """Not torch's paragraph cut mid-word (it also advises weights_only=False: running the
    file's code)."""
    readme = str(PROJECT / "README.md")
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(readme)
    assert str(info.value) == (
        f"ckpt_path={readme} is not a readable checkpoint (not the zip archive torch.save "
        "writes); pass a .ckpt written by src.train"
    )
    torch.save({"state_dict": {}, "object": Unsafe()}, tmp_path / "objects.ckpt")
    with pytest.raises(CheckpointError) as info:
        read_checkpoint(str(tmp_path / "objects.ckpt"))
    assert "(it holds more than tensors and plain values: Unsupported global: GLOBAL " in str(
        info.value
    )
    assert "weights_only" not in str(info.value) and "by default); pass a .ckpt" in str(info.value)


def test_a_long_reason_is_cut_between_words() -> None:
    reason = "the archive " + "is damaged beyond repair " * 10
    cut = shorten(reason)
    assert len(cut) <= 160 and cut.endswith(" ...")
    assert reason.startswith(cut.removesuffix(" ...") + " ")  # whole words only


def tiny_mnist(root: Path, name: str = "mnist") -> MNISTDataModule:
    return MNISTDataModule(name=name, root=str(root), download=False, batch_size=8, val_size=2)


def test_a_checkpoint_of_another_shape_names_the_layer_and_the_keys(tmp_path: Path) -> None:
    saved = training_checkpoint(ImageClassifier(net=NET, lr=0.1))
    other = ImageClassifier(net={**NET, "channels": [4, 16]}, lr=0.1)
    with pytest.raises(CheckpointError) as error:
        check_fits(saved, other, tiny_mnist(tmp_path), "last.ckpt")
    assert str(error.value) == (
        "last.ckpt does not fit this model: layer net.features.0.weight is (8, 1, 3, 3) in the "
        "checkpoint but (4, 1, 3, 3) in this model; the checkpoint was trained with "
        "model.net.channels=[8, 16] (here [4, 16])"
    )


def test_resuming_needs_a_full_checkpoint_of_the_same_data(tmp_path: Path) -> None:
    model = ImageClassifier(net=NET, lr=0.1)
    with pytest.raises(CheckpointError, match="trained on mnist but data=fashion_mnist"):
        check_fits(training_checkpoint(model), model, tiny_mnist(tmp_path, "fashion_mnist"), "x")
    other_split = training_checkpoint(model)
    other_split["datamodule_hyper_parameters"] = {**tiny_mnist(tmp_path).hparams, "val_size": 3}
    with pytest.raises(CheckpointError, match=r"trained with data.val_size=3 \(here 2\); resume"):
        check_fits(other_split, model, tiny_mnist(tmp_path), "last.ckpt")
    weights_only = training_checkpoint(model)
    del weights_only["optimizer_states"]
    with pytest.raises(CheckpointError, match="holds weights only and cannot resume"):
        check_fits(weights_only, model, tiny_mnist(tmp_path), "last.ckpt")


def test_checkpoint_of_an_older_config_loads_with_todays_defaults(tmp_path: Path) -> None:
    trained = ImageClassifier(net=NET, lr=0.1)
    saved = training_checkpoint(trained)
    del saved["hyper_parameters"]["channels_last"]  # keys added after it was written
    del saved["hyper_parameters"]["net"]["dropout"]
    del saved["state_dict"]["val_acc_best.max_value"]  # a metric state it predates
    torch.save(saved, tmp_path / "old.ckpt")
    data = OmegaConf.create({"name": "mnist", "root": str(tmp_path), "download": False})
    data.update(batch_size=8, val_size=2)
    with pytest.warns(UserWarning, match=r"predates config keys channels_last=False, net.dropou"):
        model, _, _ = load_for_inference(str(tmp_path / "old.ckpt"), data, set(), TASK)
    for name, tensor in trained.net.state_dict().items():
        assert torch.equal(model.net.state_dict()[name], tensor)


def test_checkpoint_with_keys_this_code_does_not_know_names_them(tmp_path: Path) -> None:
    saved = training_checkpoint(ImageClassifier(net=NET, lr=0.1))
    saved["hyper_parameters"]["net"]["activation"] = "gelu"  # from a newer or forked version
    del saved["hyper_parameters"]["lr"]
    torch.save(saved, tmp_path / "new.ckpt")
    data = OmegaConf.create({"name": "mnist"})
    with pytest.raises(CheckpointError) as error:
        load_for_inference(str(tmp_path / "new.ckpt"), data, set(), TASK)
    assert "keys this code does not know: net.activation; keys it lacks: lr" in str(error.value)


def dropout_draws(seeding: SeedEachBatch, epoch: int, batch: int, rank: int) -> torch.Tensor:
    trainer = SimpleNamespace(current_epoch=epoch, global_rank=rank)
    seeding.on_train_batch_start(trainer, None, None, batch)
    return torch.nn.functional.dropout(torch.ones(64), p=0.5)


def test_each_step_draws_from_its_own_seed() -> None:
    seeding = SeedEachBatch(seed=7)
    first = dropout_draws(seeding, epoch=1, batch=3, rank=0)
    torch.rand(1000)  # whatever ran in between (validation, another epoch) does not matter
    assert torch.equal(dropout_draws(seeding, epoch=1, batch=3, rank=0), first)
    assert not torch.equal(dropout_draws(seeding, epoch=1, batch=3, rank=1), first)
    assert not torch.equal(dropout_draws(seeding, epoch=1, batch=4, rank=0), first)
    restored = SeedEachBatch(seed=0)
    restored.load_state_dict(seeding.state_dict())  # the seed travels in the checkpoint
    assert torch.equal(dropout_draws(restored, epoch=1, batch=3, rank=0), first)


def test_each_step_seeds_torch_as_manual_seed_does() -> None:
    """The cheaper per-step seeding leaves the CPU generator where ``torch.manual_seed`` does."""
    seeding = SeedEachBatch(seed=7)
    ours = dropout_draws(seeding, epoch=2, batch=5, rank=1)
    assert step_seed(7, 2, 5, 1) == 38591399, "the seeds of a step never change: resumes match"
    torch.manual_seed(step_seed(7, 2, 5, 1))
    assert torch.equal(torch.nn.functional.dropout(torch.ones(64), p=0.5), ours)


def test_checkpoint_callbacks_keep_lightnings_state_keys(tmp_path: Path) -> None:
    """Built once, the keys are the ones Lightning builds: checkpoints of either version load."""
    best = BestCheckpoint(dirpath=tmp_path, monitor="val/acc", mode="max", save_top_k=1)
    for callback in (best, LastCheckpoint(tmp_path, every_n_train_steps=5)):
        assert callback.state_key == ModelCheckpoint.state_key.fget(callback)
        assert callback.state_key is callback.state_key


def test_best_file_copied_into_a_resumed_folder_is_never_rewritten_in_place(
    tmp_path: Path,
) -> None:
    """Lightning restores callbacks again from the best file when it tests it, while the other
    ranks read that file: the copy made at resume must not be made again (a rank then read a
    half-rewritten checkpoint), and a copy replaces its target whole."""
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    source = old / "epoch000-acc1.0000.ckpt"
    torch.save({"weights": torch.arange(1000)}, source)
    state = {
        "dirpath": str(old), "best_k_models": {str(source): torch.tensor(1.0)},
        "best_model_path": str(source), "kth_best_model_path": str(source),
        "best_model_score": torch.tensor(1.0), "kth_value": torch.tensor(1.0),
    }  # fmt: skip
    best = BestCheckpoint(dirpath=new, monitor="val/acc", mode="max", save_top_k=1)
    best.load_state_dict(state)  # fit resumes into a new folder: the best file is copied
    copied = new / source.name
    assert best.best_model_path == str(copied)
    before = copied.stat()
    with copied.open("rb") as reader:  # another rank reading it for its test
        best.load_state_dict(state)  # Lightning's restore from the best file at test time
        assert copied.stat().st_ctime_ns == before.st_ctime_ns, "rewritten while being read"
        torch.save({"weights": -torch.arange(1000)}, source)  # a source that really differs
        best.load_state_dict(state)
        assert copied.stat().st_ino != before.st_ino, "copied in place, not renamed over"
        assert torch.equal(torch.load(reader, weights_only=True)["weights"], torch.arange(1000))
    assert torch.equal(torch.load(copied, weights_only=True)["weights"], -torch.arange(1000))
    assert not list(new.glob(".*.tmp"))
