"""Checkpoint writing, checking and loading; per-step seeding. Models and data are those of the
machinery's own test task (tests/machinery_task.py)."""

import shutil
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_exact.checkpoints.checkpoint import (
    AtomicCheckpointIO,
    BestCheckpoint,
    CheckpointError,
    JobRecord,
    LastCheckpoint,
    check_fits,
    check_same_job,
    job_settings,
    limit_reached,
    load_for_inference,
    read_checkpoint,
    read_weights,
    settings_to_record,
    shorten,
)
from lightning_exact.checkpoints.resume import SeedEachBatch, step_seed
from omegaconf import OmegaConf

from tests.conftest import PROJECT
from tests.machinery_task import SIZES, TASK, Regressor, synthetic_data
from tests.test_config import compose_config


def training_checkpoint(model: Regressor, **extra: object) -> dict:
    """What Lightning saves for a model, reduced to the parts these checks read."""
    return {
        "state_dict": model.state_dict(),
        "hyper_parameters": dict(model.hparams),
        "datamodule_hyper_parameters": {"name": "synthetic"},
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
    readme = str(PROJECT / "conf" / "task.yaml")  # a file, not a checkpoint
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


def test_a_checkpoint_of_another_shape_names_the_layer_and_the_keys() -> None:
    saved = training_checkpoint(Regressor(features=8, hidden=32))
    other = Regressor(features=8, hidden=16)
    with pytest.raises(CheckpointError) as error:
        check_fits(saved, other, synthetic_data(), "last.ckpt")
    assert str(error.value) == (
        "last.ckpt does not fit this model: layer net.0.weight is (32, 8) in the checkpoint but "
        "(16, 8) in this model; the checkpoint was trained with model.hidden=32 (here 16)"
    )


def test_resuming_needs_a_full_checkpoint_of_the_same_data() -> None:
    model = Regressor(features=8, hidden=32)
    with pytest.raises(CheckpointError, match="trained on synthetic but data=other"):
        check_fits(training_checkpoint(model), model, synthetic_data(name="other"), "x")
    other_split = training_checkpoint(model)
    other_split["datamodule_hyper_parameters"] = {**synthetic_data().hparams, "val_size": 3}
    with pytest.raises(CheckpointError, match=r"trained with data.val_size=3 \(here 10\); resume"):
        check_fits(other_split, model, synthetic_data(), "last.ckpt")
    weights_only = training_checkpoint(model)
    del weights_only["optimizer_states"]
    with pytest.raises(CheckpointError, match="holds weights only and cannot resume"):
        check_fits(weights_only, model, synthetic_data(), "last.ckpt")


def test_checkpoint_of_an_older_config_loads_with_todays_defaults(tmp_path: Path) -> None:
    trained = Regressor(features=8, hidden=32)
    saved = training_checkpoint(trained)
    del saved["hyper_parameters"]["lr"]  # a key added after it was written
    saved["state_dict"]["val_metrics.loss.old_state"] = torch.zeros(1)  # a metric state since gone
    torch.save(saved, tmp_path / "old.ckpt")
    data = OmegaConf.create({"name": "synthetic", **SIZES})
    with pytest.warns(UserWarning, match=r"old.ckpt predates config keys lr=0.01: they take"):
        model, _, _ = load_for_inference(str(tmp_path / "old.ckpt"), data, set(), TASK)
    for name, tensor in trained.net.state_dict().items():
        assert torch.equal(model.net.state_dict()[name], tensor)


def test_checkpoint_with_keys_this_code_does_not_know_names_them(tmp_path: Path) -> None:
    saved = training_checkpoint(Regressor(features=8, hidden=32))
    saved["hyper_parameters"]["activation"] = "gelu"  # from a newer or forked version
    del saved["hyper_parameters"]["hidden"]
    torch.save(saved, tmp_path / "new.ckpt")
    data = OmegaConf.create({"name": "synthetic"})
    with pytest.raises(CheckpointError) as error:
        load_for_inference(str(tmp_path / "new.ckpt"), data, set(), TASK)
    assert "keys this code does not know: activation; keys it lacks: hidden" in str(error.value)


def dropout_draws(seeding: SeedEachBatch, epoch: int, batch: int, rank: int) -> torch.Tensor:
    trainer = SimpleNamespace(current_epoch=epoch, global_rank=rank)
    seeding.on_train_batch_start(trainer, None, None, batch)
    return torch.nn.functional.dropout(torch.ones(64), p=0.5)


def test_each_step_draws_from_its_own_seed() -> None:
    seeding = SeedEachBatch(seed=7)
    first = dropout_draws(seeding, epoch=1, batch=3, rank=0)
    torch.rand(1000)  # whatever ran in between (validation, another epoch) does not matter
    assert torch.equal(dropout_draws(seeding, epoch=1, batch=3, rank=0), first)
    # Every rank draws alike: a mask drawn for the global batch is the same on every rank.
    assert torch.equal(dropout_draws(seeding, epoch=1, batch=3, rank=1), first)
    assert not torch.equal(dropout_draws(seeding, epoch=1, batch=4, rank=0), first)
    per_rank = SeedEachBatch(seed=7, per_rank=True)  # strategy.exact=false: masks per rank
    assert torch.equal(dropout_draws(per_rank, epoch=1, batch=3, rank=0), first)
    assert not torch.equal(dropout_draws(per_rank, epoch=1, batch=3, rank=1), first)
    restored = SeedEachBatch(seed=0)
    restored.load_state_dict(seeding.state_dict())  # the seed travels in the checkpoint
    assert torch.equal(dropout_draws(restored, epoch=1, batch=3, rank=0), first)


def test_each_step_seeds_torch_as_manual_seed_does() -> None:
    """The cheaper per-step seeding leaves the CPU generator where ``torch.manual_seed`` does."""
    seeding = SeedEachBatch(seed=7, per_rank=True)
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
        "dirpath": str(old),
        "best_k_models": {str(source): torch.tensor(1.0)},
        "best_model_path": str(source),
        "kth_best_model_path": str(source),
        "best_model_score": torch.tensor(1.0),
        "kth_value": torch.tensor(1.0),
    }
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


def fit_with_best(folder: Path, epochs: int, ckpt_path: Path | None = None) -> BestCheckpoint:
    """The machinery's test task fitted with the template's best and last checkpoints in
    ``folder`` (from ``ckpt_path``: a resume)."""
    best = BestCheckpoint(dirpath=folder, monitor="val/loss", mode="min", save_top_k=2)
    trainer = L.Trainer(
        max_epochs=epochs,
        callbacks=[best, LastCheckpoint(folder), JobRecord({}, [])],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(features=8, hidden=8), datamodule=synthetic_data(), ckpt_path=ckpt_path)
    return best


def test_a_copied_jobs_best_checkpoints_are_found_beside_its_last(tmp_path: Path) -> None:
    """A job's folder copied or moved (another disk, another machine), its first folder gone:
    a resume from the copy's last.ckpt finds the best checkpoints the checkpoint recorded at
    their old paths beside it, and keeps ranking them (issue 60)."""
    first, copy = tmp_path / "first", tmp_path / "copy"
    fit_with_best(first, epochs=2)
    recorded = sorted(path.name for path in first.glob("epoch*.ckpt"))
    assert len(recorded) == 2
    shutil.copytree(first, copy)
    shutil.rmtree(first)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "best checkpoints of")
        best = fit_with_best(copy, epochs=3, ckpt_path=copy / "last.ckpt")
    kept = {Path(path).name for path in best.best_k_models}
    # Forgotten, the best would start afresh: the third epoch's file alone.
    assert len(best.best_k_models) == 2 and set(recorded) & kept, kept
    assert all(Path(path).parent == copy and Path(path).is_file() for path in best.best_k_models)


def test_a_checkpoint_records_the_world_its_job_ran_on(tmp_path: Path) -> None:
    """What a resume on another number of ranks or nodes is told from (start.say_world_change)."""
    fit_with_best(tmp_path, epochs=1)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["job"] == {
        "settings": {},
        "overrides": [],
        "world": {"world_size": 1, "num_nodes": 1},
    }


def saved_job(cfg_overrides: list[str], workdir: Path) -> dict:
    """A checkpoint's ``job`` entry as ``src.train`` writes it for these overrides."""
    cfg = compose_config("train", cfg_overrides, workdir)
    return {
        "job": {"settings": settings_to_record(cfg, cfg.seed, None), "overrides": cfg_overrides}
    }


def test_a_resume_with_settings_that_decide_the_result_is_refused_naming_each(
    tmp_path: Path,
) -> None:
    job = ["data.val_size=7", "trainer.limit_train_batches=150"]
    saved = saved_job(job, tmp_path)
    path = "/runs/a/checkpoints/last.ckpt"
    # How long it trains, where and how fast: the same job.
    same = [
        *job,
        "trainer.max_epochs=9",
        "data.num_workers=2",
        "trainer.num_sanity_val_steps=0",
    ]
    check_same_job(saved, compose_config("train", same, tmp_path), path)
    other = ["seed=7"]  # limit_train_batches: 1.0, val_size: the task's default
    cfg = compose_config("train", other, tmp_path)
    with pytest.raises(CheckpointError) as refused:
        check_same_job(saved, cfg, path)
    message = str(refused.value)
    assert "\n" not in message
    named = (
        "trainer.limit_train_batches=150 (here 1.0)",
        f"data.val_size=7 (here {cfg.data.val_size})",
        "seed=1234 (here 7)",
        "data.shuffle_seed=1234 (here 7)",
    )
    for differing in named:
        assert differing in message, message
    assert "num_workers" not in message and "max_epochs" not in message
    # The two ways on: the job's own command, and a new job from its weights.
    own = f"python -m src.train data.val_size=7 trainer.limit_train_batches=150 ckpt_path={path}"
    assert own in message and f"weights_from={path}" in message


def test_seed_null_on_resume_takes_the_checkpoints_seed_and_old_checkpoints_are_not_checked(
    tmp_path: Path,
) -> None:
    saved = saved_job([], tmp_path)
    cfg = compose_config("train", ["seed=null"], tmp_path)
    check_same_job(saved, cfg, "last.ckpt")  # neither seed nor data.shuffle_seed compared
    assert settings_to_record(cfg, 99, saved)["seed"] == 1234  # the checkpoint's, not drawn
    check_same_job({}, compose_config("train", ["data.val_size=7"], tmp_path), "last.ckpt")


def test_resume_may_differ_lists_keys_the_config_has(tmp_path: Path) -> None:
    """Of the machinery's keys; those of the task's data and model are checked with the task."""
    cfg = compose_config("train", [], tmp_path)
    settings = job_settings(cfg)
    for key in cfg.resume_may_differ:
        assert key not in settings
        if key.split(".")[0] not in ("data", "model"):
            assert OmegaConf.select(cfg, key, default="missing") != "missing", key
    assert {"trainer.limit_train_batches", "trainer.precision", "data.batch_size"} <= set(settings)


def test_the_limit_a_finished_job_reached_is_the_key_to_raise() -> None:
    def saved(epochs: int, step: int) -> dict:
        progress = {"epoch_progress": {"current": {"processed": epochs}}}
        return {"global_step": step, "loops": {"fit_loop": progress}}

    assert limit_reached(saved(3, 30), {"max_epochs": 3, "max_steps": -1}) == "trainer.max_epochs"
    assert limit_reached(saved(3, 30), {"max_epochs": 4, "max_steps": -1}) is None
    assert limit_reached(saved(1, 14), {"max_epochs": 3, "max_steps": 14}) == "trainer.max_steps"
    assert limit_reached(saved(1, 14), {"max_epochs": -1, "max_steps": 14}) == "trainer.max_steps"
    assert limit_reached(saved(1, 14), {"max_epochs": 3, "max_steps": -1}) is None


def test_ckpt_path_and_weights_from_together_are_refused(tmp_path: Path) -> None:
    cfg = compose_config("train", ["ckpt_path=a.ckpt", "weights_from=b.ckpt"], tmp_path)
    with pytest.raises(CheckpointError, match="keep one"):
        read_weights(cfg)
