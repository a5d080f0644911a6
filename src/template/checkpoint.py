"""Checkpoint files: written atomically, kept (best and last), checked before a job relies on one.

* :class:`AtomicCheckpointIO` writes every ``.ckpt`` to a temporary file beside its target,
  syncs it and renames it over the target: a crash, SIGKILL or full disk leaves the previous
  file whole. (Lightning's default stages the file in the system temp folder and moves it,
  which is a plain copy when that folder is on another filesystem.)
* :class:`BestCheckpoint` keeps the best checkpoint so far when a run resumes into a new output
  folder (Lightning forgets it there, and would call the first resumed epoch the best).
* :class:`LastCheckpoint` writes ``last.ckpt`` at epoch ends and mid-epoch, at a training step's
  end (the point Lightning resumes from).
* :func:`resume_path` turns ``ckpt_path=auto`` into the output folder's ``last.ckpt``, if any.
* :func:`read_checkpoint` and :func:`check_fits` refuse a missing file, a file that is not a
  training checkpoint, or one of other data or another model shape before any work starts,
  naming the layer or the config keys that differ.
"""

import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

from src.template.config import flatten
from src.template.resume import epoch_finished


class CheckpointError(ValueError):
    """A checkpoint that is missing or does not fit the requested job."""


def write_atomically(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """``write`` to ``.<name>.<random>.tmp`` beside ``path``, fsync, then rename over ``path``:
    a reader (another rank) sees the old file or the new one, never a half-written one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    # os.open applies the umask to 0o666, as open() does for the final file.
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a power loss
    finally:
        os.close(folder)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Every local ``.ckpt`` written by :func:`write_atomically`."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None
    ) -> None:
        if "://" in str(path):  # remote storage: Lightning's fsspec writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        write_atomically(Path(path), lambda file: torch.save(checkpoint, file))


def copy_atomically(source: Path, target: Path) -> None:
    """``source`` to ``target`` unless already copied (same size and time, as copy2 keeps)."""
    if target.is_file():
        old, new = source.stat(), target.stat()
        if (old.st_size, old.st_mtime_ns) == (new.st_size, new.st_mtime_ns):
            return
    with source.open("rb") as file:
        write_atomically(target, lambda out: shutil.copyfileobj(file, out))
    shutil.copystat(source, target)


class FixedStateKey:
    """For a ModelCheckpoint: its ``state_key`` built once. Lightning reads every callback's key
    at every hook call of every step (to name a profiler action), and a ModelCheckpoint builds
    its key anew each time from settings fixed once it is built."""

    @property
    def state_key(self) -> str:
        if "_state_key" not in self.__dict__:
            self.__dict__["_state_key"] = super().state_key
        return self.__dict__["_state_key"]


class BestCheckpoint(FixedStateKey, ModelCheckpoint):
    """Lightning's top-k checkpointing that survives a resume into another folder: the best
    files so far are copied into this job's folder and tracked as if written there, so the
    best score, the best file and the test of the best model match an uninterrupted run."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        old, new = state_dict.get("dirpath"), self.dirpath
        best = state_dict.get("best_k_models", {})
        if old and new and old != new and all(Path(path).is_file() for path in best):
            moved = {path: str(Path(new) / Path(path).name) for path in best}
            # Lightning restores callbacks again from the best file at test time, while other
            # ranks read that file: never rewrite it in place.
            if rank_zero_only.rank == 0:
                for source, target in moved.items():
                    copy_atomically(Path(source), Path(target))
            state_dict = {
                **state_dict,
                "dirpath": new,
                "best_k_models": {moved[path]: score for path, score in best.items()},
                "best_model_path": moved.get(state_dict["best_model_path"], ""),
                "kth_best_model_path": moved.get(state_dict["kth_best_model_path"], ""),
                "last_model_path": "",
            }
        elif old and old != new:
            rank_zero_warn(f"best checkpoints of {old} are gone; the best starts afresh")
        super().load_state_dict(state_dict)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if epoch_finished(trainer):  # not an epoch cut short by max_steps
            super().on_train_epoch_end(trainer, pl_module)


class LastCheckpoint(FixedStateKey, ModelCheckpoint):
    """Writes ``last.ckpt`` at every epoch end (Lightning's ``save_last`` only writes when a
    new best was saved) and, mid-epoch, every ``every_n_train_steps`` steps and at the step
    ``max_steps`` ends on. A step that ends an epoch is left to the epoch-end checkpoint, so
    its validation is never skipped. It has no state worth restoring: the file is rewritten."""

    def __init__(self, dirpath: Path, every_n_train_steps: int | None = None) -> None:
        super().__init__(
            dirpath=dirpath, filename="last", enable_version_counter=False,
            save_on_train_epoch_end=True,
        )  # fmt: skip
        self.every_n_steps = every_n_train_steps or 0

    @property
    def path(self) -> Path:
        return Path(self.dirpath) / "last.ckpt"

    def save_now(self, trainer: L.Trainer) -> None:
        """Write ``last.ckpt`` now; every rank calls it at the same step."""
        trainer.save_checkpoint(self.path, weights_only=False)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if epoch_finished(trainer):
            return
        step = trainer.global_step
        periodic = self.every_n_steps > 0 and step % self.every_n_steps == 0
        if periodic or step == trainer.max_steps:
            self.save_now(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if epoch_finished(trainer):
            super().on_train_epoch_end(trainer, pl_module)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def save_last(trainer: L.Trainer) -> None:
    """Write the job's ``last.ckpt`` now (all ranks, at the same step), if it keeps one."""
    for callback in trainer.callbacks:
        if isinstance(callback, LastCheckpoint):
            callback.save_now(trainer)


def resume_path(ckpt_path: str | None, output_dir: Path) -> str | None:
    """``ckpt_path=auto``: the output folder's ``last.ckpt`` if a job there wrote one, else None
    (start fresh). With a fixed folder, the same command run again continues where it stopped."""
    if ckpt_path != "auto":
        return ckpt_path
    last = output_dir / "checkpoints" / "last.ckpt"
    return str(last) if last.is_file() else None


def read_checkpoint(ckpt_path: str | None) -> dict[str, Any]:
    """The contents of a checkpoint written by ``src.train``, or a one-line reason it is not."""
    if not ckpt_path:
        raise CheckpointError(
            "ckpt_path is required, e.g. ckpt_path=outputs/train/runs/<time>/checkpoints/last.ckpt"
        )
    path = Path(ckpt_path)
    if not path.is_file():
        raise CheckpointError(f"ckpt_path={ckpt_path}: no such file")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        reason = str(error).strip().splitlines()[0][:160]
        raise CheckpointError(
            f"ckpt_path={ckpt_path} is not a readable checkpoint ({reason}); "
            "pass a .ckpt written by src.train"
        ) from error
    if not isinstance(saved, dict) or "state_dict" not in saved:
        raise CheckpointError(
            f"ckpt_path={ckpt_path} is not a Lightning checkpoint (no state_dict); "
            "pass a .ckpt written by src.train"
        )
    return saved


def check_fits(
    saved: Mapping[str, Any], model: L.LightningModule, datamodule: Any, path: str
) -> None:
    """Refuse to resume from a checkpoint of another dataset, data settings (image size,
    channels, validation split, ...), network or kind (weights only)."""
    name = Path(path).name
    check_dataset(saved, datamodule.hparams.name, name)
    trained = saved.get("datamodule_hyper_parameters", {})
    differing = data_differences(trained, datamodule.hparams, type(datamodule).CONTENT_KEYS)
    if differing:
        raise CheckpointError(
            f"{name} was trained with {', '.join(differing)}; resume with the same data settings"
        )
    datamodule.load_state_dict(saved.get(type(datamodule).__qualname__, {}))  # same classes
    check_weights_fit(saved, model.state_dict(), name, model.hparams)
    if "optimizer_states" not in saved or "loops" not in saved:
        raise CheckpointError(
            f"{name} holds weights only and cannot resume training; evaluate it with src.eval "
            "or resume from a last.ckpt"
        )


def check_dataset(saved: Mapping[str, Any], data_name: str, name: str) -> None:
    trained_on = saved.get("datamodule_hyper_parameters", {}).get("name")
    if trained_on and trained_on != data_name:
        raise CheckpointError(
            f"{name} was trained on {trained_on} but data={data_name}; add data={trained_on}"
        )


def check_weights_fit(
    saved: Mapping[str, Any],
    expected: Mapping[str, torch.Tensor],
    name: str,
    hparams: Mapping[str, Any],
) -> None:
    """Name the first tensor that is missing, unexpected or of another shape, and the config
    keys of the model that explain it."""
    found = saved["state_dict"]
    problem = next(
        (
            f"layer {key} is {tuple(found[key].shape)} in the checkpoint but "
            f"{tuple(tensor.shape)} in this model"
            for key, tensor in expected.items()
            if key in found and found[key].shape != tensor.shape
        ),
        None,
    )
    missing = [key for key in expected if key not in found]
    unexpected = [key for key in found if key not in expected]
    if problem is None and (missing or unexpected):
        problem = f"tensors missing: {missing[:3]}, not in this model: {unexpected[:3]}"
    if problem is None:
        return
    theirs, ours = flatten(saved.get("hyper_parameters", {})), flatten(hparams)
    differing = [
        f"model.{key}={theirs[key]} (here {ours[key]})"
        for key in theirs
        if key in ours and plain(theirs[key]) != plain(ours[key])
    ]
    hint = f"; the checkpoint was trained with {', '.join(differing)}" if differing else ""
    raise CheckpointError(f"{name} does not fit this model: {problem}{hint}")


def plain(value: Any) -> Any:
    """Lists and tuples compare equal when their items do (a config list, a saved tuple)."""
    return [plain(item) for item in value] if isinstance(value, list | tuple) else value


def data_differences(
    trained: Mapping[str, Any], current: Mapping[str, Any], keys: Iterable[str]
) -> list[str]:
    """``data.<key>=<trained> (here <current>)`` for each of ``keys`` whose values differ."""
    return [
        f"data.{key}={trained[key]} (here {current[key]})"
        for key in keys
        if key in trained and plain(trained[key]) != plain(current[key])
    ]
