"""Checkpoints: written atomically, checked before a job relies on one, resumed exactly.

* :class:`AtomicCheckpointIO` writes every ``.ckpt`` to a temporary file beside its target,
  syncs it and renames it over the target: a crash, SIGKILL or full disk leaves the previous
  file whole. (Lightning's default stages the file in the system temp folder and moves it,
  which is a plain copy when that folder is on another filesystem.)
* :func:`read_checkpoint` and :func:`check_fits` refuse a missing file, a file that is not a
  training checkpoint, or one of another dataset or network shape before any work starts,
  naming the layer or the config keys that differ.
* :class:`BestCheckpoint` keeps the best checkpoint so far when a run resumes into a new output
  folder (Lightning forgets it there, and would call the first resumed epoch the best).
* :class:`SeedEachBatch` makes the randomness of every training step (dropout) a function of
  (seed, epoch, batch, rank), so a run resumed from a checkpoint draws exactly what an
  uninterrupted run draws, with no per-rank generator state to gather and store.
* Mid-epoch checkpoints (a stop signal, ``max_steps``, ``every_n_train_steps``) are written at
  a training step's end, the point Lightning resumes from; :class:`MidEpochState` adds the
  epoch's metric sums so far, and :func:`resume_position` tells the sampler where to go on.
"""

import inspect
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torchmetrics import Metric

_UMASK = os.umask(0o022)
os.umask(_UMASK)


class CheckpointError(ValueError):
    """A checkpoint that is missing or does not fit the requested job."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to ``.<name>.<random>.tmp`` in the target folder, fsync, then rename."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None
    ) -> None:
        if "://" in str(path):  # remote storage: Lightning's fsspec writer
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as file:
                torch.save(checkpoint, file)
                file.flush()
                os.fsync(file.fileno())
            os.chmod(temp, 0o666 & ~_UMASK)  # mkstemp creates 0600
            os.replace(temp, path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)  # the rename itself survives a power loss
        finally:
            os.close(folder)


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
            if rank_zero_only.rank == 0:
                Path(new).mkdir(parents=True, exist_ok=True)
                for source, target in moved.items():
                    shutil.copy2(source, target)
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


def epoch_finished(trainer: L.Trainer) -> bool:
    """Whether every training batch of the current epoch has been trained."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return done >= trainer.num_training_batches


def resume_position(trainer: L.Trainer | None) -> tuple[int, int]:
    """(epoch, training batches of it already done) where fitting starts, read from Lightning's
    loop state (restored from the checkpoint before the train loader is built)."""
    if trainer is None:
        return 0, 0
    epochs = trainer.fit_loop.epoch_progress.current
    if epochs.started > epochs.processed:  # the checkpoint was written mid-epoch
        return epochs.processed, trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return epochs.processed, 0


# Lightning asks for a loader with state_dict() to resume mid-epoch; the sampler resumes from
# Lightning's own loop state instead (resume_position), which makes the warning wrong here.
warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before")


class MidEpochState(Callback):
    """The epoch's metric sums so far, in checkpoints written mid-epoch.

    Lightning restores weights and loops but not torchmetrics states, which are per rank and
    not persistent: a job resumed mid-epoch would report that epoch over its remaining batches
    only. At a mid-epoch save the states are reduced over ranks (one collective, at the save);
    on resume rank 0 holds the reduced states and the other ranks start empty, so the epoch-end
    ``compute()`` gives the uninterrupted value (up to float summation order). Exact for states
    reduced by sum, max, min or concatenation (torchmetrics' built-in metrics).
    """

    def __init__(self) -> None:
        self.loaded: dict[str, dict[str, Any]] = {}

    @staticmethod
    def _metrics(pl_module: L.LightningModule) -> dict[str, Metric]:
        return {
            name: module
            for name, module in pl_module.named_modules()
            if isinstance(module, Metric) and set(module.metric_state) - set(module.state_dict())
        }

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        epochs = trainer.fit_loop.epoch_progress.current
        if trainer.state.fn != "fit" or epochs.started <= epochs.processed:
            return  # only a mid-epoch checkpoint needs them
        states = {}
        for name, metric in self._metrics(pl_module).items():
            with metric.sync_context():
                states[name] = {key: detach_to_cpu(v) for key, v in metric.metric_state.items()}
        checkpoint["mid_epoch_metric_states"] = states

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self.loaded = checkpoint.get("mid_epoch_metric_states", {})

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        metrics = self._metrics(pl_module)
        for name, states in self.loaded.items():
            if name not in metrics:
                continue
            metric = metrics[name]
            metric.reset()
            if trainer.global_rank == 0:  # the reduced sums count once
                for key, value in states.items():
                    setattr(metric, key, to_device(value, metric.device))
        self.loaded = {}


def detach_to_cpu(value: Any) -> Any:
    if isinstance(value, list):
        return [item.detach().cpu() for item in value]
    return value.detach().cpu()


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, list):
        return [item.to(device) for item in value]
    return value.to(device)


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
    keys of the network that explain it."""
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
    theirs = saved.get("hyper_parameters", {}).get("net", {})
    ours = hparams.get("net", {})
    differing = [
        f"model.net.{key}={theirs[key]} (here {ours.get(key)})"
        for key in theirs
        if key in ours and theirs[key] != ours[key]
    ]
    hint = f"; the checkpoint was trained with {', '.join(differing)}" if differing else ""
    raise CheckpointError(f"{name} does not fit this model: {problem}{hint}")


def model_from_checkpoint(
    saved: Mapping[str, Any], name: str, model_class: type[L.LightningModule]
) -> L.LightningModule:
    """Rebuild the trained model from a checkpoint's own hyperparameters (the network included:
    its name is one of them).

    A checkpoint from an older config may lack keys added since: they take today's defaults
    (with a warning naming them). Keys this code no longer knows, or a missing key that has no
    default, are refused by name. ``model_class.config_targets`` says what to compare against.
    """
    hparams = dict(saved.get("hyper_parameters", {}))
    unknown, missing, defaulted = [], [], []
    for section, (target, set_by) in model_class.config_targets(hparams.get("net", {})).items():
        values = hparams if section == "model" else hparams.get(section.split(".", 1)[1], {})
        prefix = section.removeprefix("model").lstrip(".")
        found = compare_keys(values, target, f"{prefix}." if prefix else "", set_by)
        unknown, missing, defaulted = unknown + found[0], missing + found[1], defaulted + found[2]
    problems = [f"keys this code does not know: {', '.join(unknown)}"] if unknown else []
    problems += [f"keys it lacks: {', '.join(missing)}"] if missing else []
    if problems:
        raise CheckpointError(
            f"{name} was saved by a different version of the model: {'; '.join(problems)}. "
            "Load it with the code version that wrote it (its git.commit tag in MLflow)"
        )
    if defaulted:
        warnings.warn(
            f"{name} predates config keys {', '.join(defaulted)}: they take today's defaults",
            stacklevel=2,
        )
    model = model_class(**hparams)
    # Only the network's tensors matter for inference (metric states may be newer or older).
    network = {key: value for key, value in model.state_dict().items() if key.startswith("net.")}
    weights = {key: value for key, value in saved["state_dict"].items() if key.startswith("net.")}
    check_weights_fit({**saved, "state_dict": weights}, network, name, model.hparams)
    model.load_state_dict(weights, strict=False)
    return model


def compare_keys(
    values: Mapping[str, Any], target: Callable, prefix: str, set_by_data: tuple[str, ...]
) -> tuple[list[str], list[str], list[str]]:
    """(unknown, missing without default, missing with default) keys of ``target``'s init;
    ``name`` (which network) and keys set from the data are not config keys of ``target``."""
    parameters = dict(inspect.signature(target).parameters)
    parameters.pop("self", None)
    for key in set_by_data:
        parameters.pop(key, None)
    unknown = [prefix + key for key in values if key not in parameters and key != "name"]
    unknown = [key for key in unknown if key.removeprefix(prefix) not in set_by_data]
    absent = [key for key in parameters if key not in values]
    missing = [prefix + key for key in absent if parameters[key].default is inspect.Parameter.empty]
    defaulted = [
        f"{prefix}{key}={parameters[key].default}"
        for key in absent
        if parameters[key].default is not inspect.Parameter.empty
    ]
    return unknown, missing, defaulted


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


def data_for_inference(
    saved: Mapping[str, Any],
    data: Mapping[str, Any],
    typed: set[str],
    data_class: Callable[[str], type],
    name: str,
) -> dict[str, Any]:
    """The data settings eval and predict use: the checkpoint's (what the data is and where it
    was), except the keys the command typed (``data.root=...``, ``data.batch_size=...``). A
    typed key that changes what the data is (``CONTENT_KEYS``: image size, channels, the
    validation split, ...) is refused: the model was trained on the checkpoint's."""
    trained = saved.get("datamodule_hyper_parameters")
    if not trained:  # written before checkpoints held their data settings
        return dict(data)
    if typed & {"", "name"}:  # the command chose a dataset: it must be the checkpoint's
        check_dataset(saved, data["name"], name)
    typed_content = [k for k in data_class(trained["name"]).CONTENT_KEYS if k in typed]
    differing = data_differences(trained, data, typed_content)
    if differing:
        raise CheckpointError(
            f"{name} was trained with {', '.join(differing)}; eval and predict use the "
            "checkpoint's data settings: leave these out"
        )
    # Keys newer than the checkpoint come from the command's config of the same dataset.
    base = dict(data) if data.get("name") == trained["name"] else {}
    return {**base, **trained, **{key: data[key] for key in typed if key in data}}


def load_for_inference(
    ckpt_path: str | None,
    data: Mapping[str, Any],
    typed: set[str],
    data_class: Callable[[str], type],
    model_class: type[L.LightningModule],
) -> tuple[L.LightningModule, L.LightningDataModule, dict[str, str] | None]:
    """The checkpoint's model, a data module with the checkpoint's data settings (see
    :func:`data_for_inference`; ``typed``: the ``data`` keys the command set) and the MLflow
    run the checkpoint came from, if it was tracked.

    Checkpoints hold plain values only, so they load with ``weights_only=True``.
    """
    saved = read_checkpoint(ckpt_path)
    name = Path(ckpt_path).name
    values = data_for_inference(saved, data, typed, data_class, name)
    model = model_from_checkpoint(saved, name, model_class)
    datamodule = data_class(values["name"])(**values)
    # Lightning saves the DataModule's state under its class name (here: its normalisation).
    datamodule.load_state_dict(saved.get(type(datamodule).__qualname__, {}))
    return model, datamodule, saved.get("mlflow")


def seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)`` for the generators a training step can draw from: the CPU's
    and those of the accelerators this process has initialised. ``torch.manual_seed`` also queues
    a seed for every accelerator not initialised (CUDA and XPU in a CPU job), saving the Python
    stack with each: about 0.5 ms inside a training step, at every step."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)  # each GPU's generator, at once
    if torch.xpu.is_initialized():
        torch.xpu.manual_seed_all(seed)
    torch.mps.manual_seed(seed)  # a no-op where there is no MPS


class SeedEachBatch(Callback):
    """Seeds python, numpy and torch before every training step from (seed, epoch, batch, rank).

    The seed travels in the checkpoint, so a resumed run continues the same streams even when
    the first run drew its seed at random (``seed=null``). Ranks draw different dropout masks.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        entropy = [self.seed, trainer.current_epoch, batch_idx, trainer.global_rank]
        step_seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
        random.seed(step_seed)
        np.random.seed(step_seed)
        seed_torch(step_seed)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seed = state_dict["seed"]
