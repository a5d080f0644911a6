"""Checkpoint files: written atomically, best and last kept across a resume into another folder,
checked before use (naming what differs), loaded with their data settings for eval and predict.
Each carries its job (settings and overrides): a resume must be the same job."""

import inspect
import pickle
import shlex
import textwrap
import warnings
import zipfile
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from omegaconf import DictConfig, OmegaConf
from torchmetrics import Metric

from lightning_exact.checkpoints.resume import epoch_finished
from lightning_exact.files import copy_atomically
from lightning_exact.job.config import flatten
from lightning_exact.task import Task, best_of
from lightning_exact.training import sharded
from lightning_exact.training.steps import logged_step, stepped


class CheckpointError(ValueError):
    """A checkpoint that is missing or does not fit the requested job."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Local ``.ckpt`` files written atomically
    (:func:`~lightning_exact.training.sharded.write_file_over`).
    (Lightning's default stages them in the system temp folder: a plain copy where that is
    another filesystem.)"""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None
    ) -> None:
        # Over a sharded folder too: a job resumed, in its folder, from its consolidated file.
        sharded.write_file_over(Path(path), lambda file: torch.save(checkpoint, file))


class EpochEndCheckpoint(ModelCheckpoint):
    """Saves at the end of whole epochs only (not of one cut short by ``max_steps``)."""

    # Built once: Lightning reads it at every hook call; ModelCheckpoint rebuilds it each time.
    state_key = cached_property(ModelCheckpoint.state_key.fget)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if epoch_finished(trainer):
            super().on_train_epoch_end(trainer, pl_module)

    def on_train_batch_end(self, *args: Any) -> None:
        pass  # ModelCheckpoint's checks, at every step, of step and time intervals never set


class BestCheckpoint(EpochEndCheckpoint):
    """Top-k checkpointing that survives a resume into another folder: the best files so far
    are copied there and tracked as if written there (Lightning would forget them). Sharded
    folders become files for a job that writes files (its strategy could not read them)."""

    writes_folders = False  # strategy=fsdp with sharded_checkpoints: the best are folders
    loading_from: Path | None = None  # the folder of the checkpoint being restored

    def keep(self, source: Path, target: Path) -> None:
        """A best checkpoint of the job resumed, at ``target`` (``source`` itself, or a copy)
        in the form this job writes and reads: a sharded folder made one file where needed."""
        if sharded.is_sharded_checkpoint(source) and not self.writes_folders:
            sharded.consolidate(source, target)
        elif sharded.is_sharded_checkpoint(source):
            sharded.copy_sharded(source, target)
        elif source != target:
            copy_atomically(source, target)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)  # before Lightning restores the callbacks
        self.writes_folders = getattr(trainer.strategy, "sharded_checkpoints", False)

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Called just before load_state_dict, with the path of the checkpoint being read.
        self.loading_from = Path(trainer.ckpt_path).parent if trainer.ckpt_path else None

    def located(self, recorded: str) -> Path | None:
        """Where a best checkpoint recorded at ``recorded`` is now: there, or (its folder copied
        or moved, e.g. to another machine) the file of that name beside the checkpoint being
        restored; None if neither exists."""
        candidates = [Path(recorded)]
        if self.loading_from is not None:
            candidates.append(self.loading_from / Path(recorded).name)
        return next((path for path in candidates if path.exists()), None)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The best checkpoint is chosen, then its score, the best value of the metric so far
        (``<monitor>_best``), sent to the loggers at this validation's step."""
        super().on_validation_end(trainer, pl_module)
        fitting = trainer.state.fn == "fit" and not trainer.sanity_checking
        if fitting and (best := self.best_so_far()):
            for logger in trainer.loggers:
                logger.log_metrics(best, step=logged_step(trainer))

    def best_so_far(self) -> dict[str, float]:
        """``{<monitor>_best: the best checkpoint's score}``; empty before any validation."""
        if self.best_model_score is None or self.monitor is None:
            return {}
        return {best_of(self.monitor): float(self.best_model_score)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        old = state_dict.get("dirpath")
        new = self.dirpath
        best = state_dict.get("best_k_models", {})
        found = {path: self.located(path) for path in best}
        moving = bool(old and new and old != new and all(found.values()))
        moved = {path: str(Path(new) / Path(path).name) if moving else path for path in best}
        # Lightning restores callbacks again from the best file at test time, while other
        # ranks read that file: never rewrite it in place (it is a file by then).
        if rank_zero_only.rank == 0:
            for recorded, target in moved.items():
                source = found[recorded]
                if source is not None and (moving or source == Path(target)):
                    self.keep(source, Path(target))
        if moving:
            state_dict = {
                **state_dict,
                "dirpath": new,
                "best_k_models": {moved[path]: score for path, score in best.items()},
                "best_model_path": moved.get(state_dict["best_model_path"], ""),
                "kth_best_model_path": moved.get(state_dict["kth_best_model_path"], ""),
                "last_model_path": "",
            }
        elif old and old != new:
            beside = f" nor beside {self.loading_from}" if self.loading_from else ""
            rank_zero_warn(f"best checkpoints of {old} are gone{beside}; the best starts afresh")
        super().load_state_dict(state_dict)


class LastCheckpoint(EpochEndCheckpoint):
    """``last.ckpt`` at every epoch end (``save_last`` writes only with a new best) and, mid-epoch,
    after every validation (``trainer.val_check_interval``), every ``every_n_train_steps`` steps
    and at ``max_steps`` (an epoch's last step: at its end)."""

    def __init__(self, dirpath: Path, every_n_train_steps: int | None = None) -> None:
        super().__init__(
            dirpath=dirpath,
            filename="last",
            enable_version_counter=False,
            save_on_train_epoch_end=True,
        )
        self.every_n_steps = every_n_train_steps or 0

    def save_now(self, trainer: L.Trainer) -> None:
        trainer.save_checkpoint(Path(self.dirpath) / "last.ckpt", weights_only=False)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not stepped(trainer):  # inside a step: its accumulated gradients are in no file
            return
        step = logged_step(trainer)  # the job's steps, as the x-axis counts them
        every = self.every_n_steps
        ends = trainer.max_steps not in (-1, None) and trainer.global_step >= trainer.max_steps
        if ((every > 0 and step % every == 0) or ends) and not epoch_finished(trainer):
            self.save_now(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        fitting = trainer.state.fn == "fit" and not trainer.sanity_checking
        if fitting and stepped(trainer) and not epoch_finished(trainer):
            self.save_now(trainer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def save_last(trainer: L.Trainer) -> None:
    """Write the job's ``last.ckpt`` now (all ranks, at the same step), if it keeps one."""
    for callback in trainer.callbacks:
        if isinstance(callback, LastCheckpoint):
            callback.save_now(trainer)


def resume_path(ckpt_path: str | None, output_dir: Path) -> str | None:
    """``ckpt_path=auto``: the folder's ``last.ckpt`` (a file, or a sharded folder) if a job
    there wrote one, else None."""
    if ckpt_path != "auto":
        return ckpt_path
    last = output_dir / "checkpoints" / "last.ckpt"
    # The second: a sharded last.ckpt moved aside by a job killed while swapping in its next.
    for found in (last, sharded.replaced_folder(last)):
        if found.is_file() or sharded.is_sharded_checkpoint(found):
            return str(found)
    return None


def read_checkpoint(ckpt_path: str | None, weights: bool = True) -> dict[str, Any]:
    """The contents of a checkpoint written by ``src.train``, or a one-line reason it is not. A
    sharded folder is read whole (``weights=False``: shapes only, to check it fits a job)."""
    if not ckpt_path:
        raise CheckpointError(
            "ckpt_path is required, e.g. ckpt_path=outputs/train/runs/<time>/checkpoints/last.ckpt"
        )
    if sharded.is_sharded_checkpoint(ckpt_path):
        try:
            return sharded.read_sharded(Path(ckpt_path), weights)
        except Exception as error:
            raise CheckpointError(
                f"ckpt_path={ckpt_path} is not a readable sharded checkpoint "
                f"({one_line(error)}); pass a checkpoint written by src.train"
            ) from None
    if Path(ckpt_path).is_dir():
        raise CheckpointError(
            f"ckpt_path={ckpt_path} is a folder but not a sharded checkpoint (no "
            f"{sharded.META_FILE}); pass a .ckpt written by src.train"
        )
    if not Path(ckpt_path).is_file():
        raise CheckpointError(f"ckpt_path={ckpt_path}: no such file")
    try:
        saved = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        fits = isinstance(saved, dict) and "state_dict" in saved
        problem = "" if fits else "is not a Lightning checkpoint (no state_dict)"
    except Exception as error:
        problem = f"is not a readable checkpoint ({why_unreadable(ckpt_path, error)})"
    if problem:
        raise CheckpointError(f"ckpt_path={ckpt_path} {problem}; pass a .ckpt written by src.train")
    return saved


def why_unreadable(path: str, error: Exception) -> str:
    """torch.load's refusal in a few words: its messages run to paragraphs (and may advise
    ``weights_only=False``, which would run any code a file holds)."""
    if not zipfile.is_zipfile(path):
        return "not the zip archive torch.save writes"
    text = str(error)
    if isinstance(error, pickle.UnpicklingError) and "WeightsUnpickler error:" in text:
        detail = text.partition("WeightsUnpickler error:")[2].strip().split(". ")[0]
        return f"it holds more than tensors and plain values: {shorten(detail)}"
    return one_line(error)


def one_line(error: Exception) -> str:
    """An error's first line, shortened; its type's name if it says nothing."""
    text = str(error).strip()
    return shorten(text.splitlines()[0] if text else type(error).__name__)


def shorten(reason: str) -> str:
    """At most 160 characters, cut between words."""
    return textwrap.shorten(reason, 160, placeholder=" ...")


def migrated(model: L.LightningModule, saved: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the checkpoint ``saved`` as the model's ``on_load_checkpoint`` (Lightning's hook,
    called before it loads a checkpoint) changes it: what an older version of the task saved
    (a metric state it dropped), checked and loaded as the task reads it now."""
    copy = {**saved, "state_dict": dict(saved["state_dict"])}
    model.on_load_checkpoint(copy)
    return copy


def check_fits(
    saved: Mapping[str, Any], model: L.LightningModule, datamodule: Any, path: str
) -> None:
    """Refuse to resume from a checkpoint of other data, another network or weights only."""
    name = Path(path).name
    keys = ("name", *type(datamodule).CONTENT_KEYS)
    check_same_data(saved, datamodule.hparams, keys, name, "resume with the same data settings")
    datamodule.load_state_dict(saved.get(type(datamodule).__qualname__, {}))  # same classes
    check_weights_fit(migrated(model, saved), model.state_dict(), name, model.hparams)
    if "optimizer_states" not in saved or "loops" not in saved:
        raise CheckpointError(
            f"{name} holds weights only and cannot resume training; evaluate it with src.eval "
            "or resume from a last.ckpt"
        )


def check_same_data(
    saved: Mapping[str, Any], data: Mapping[str, Any], keys: Iterable[str], name: str, fix: str
) -> None:
    """Refuse a checkpoint trained on another dataset or with other values of ``keys``."""
    trained = saved.get("datamodule_hyper_parameters", {})
    if "name" in keys and trained.get("name") and trained["name"] != data["name"]:
        raise CheckpointError(
            f"{name} was trained on {trained['name']} but data={data['name']}; "
            f"add data={trained['name']}"
        )
    differing = differences(trained, data, keys, "data")
    if differing:
        raise CheckpointError(f"{name} was trained with {', '.join(differing)}; {fix}")


def check_weights_fit(
    saved: Mapping[str, Any], expected: Mapping[str, torch.Tensor], name: str, hparams: Any
) -> None:
    """Name the first tensor that does not fit, and the model's config keys that explain it."""
    found = saved["state_dict"]
    shapes = [
        f"layer {key} is {tuple(found[key].shape)} in the checkpoint but "
        f"{tuple(tensor.shape)} in this model"
        for key, tensor in expected.items()
        if key in found and found[key].shape != tensor.shape
    ]
    missing = [key for key in expected if key not in found]
    unexpected = [key for key in found if key not in expected]
    if not (shapes or missing or unexpected):
        return
    problem = (
        shapes[0]
        if shapes
        else (f"tensors missing: {missing[:3]}, not in this model: {unexpected[:3]}")
    )
    theirs = flatten(saved.get("hyper_parameters", {}))
    ours = flatten(hparams)
    differing = differences(theirs, ours, theirs, "model")
    hint = f"; the checkpoint was trained with {', '.join(differing)}" if differing else ""
    raise CheckpointError(f"{name} does not fit this model: {problem}{hint}")


def differences(
    trained: Mapping[str, Any], current: Mapping[str, Any], keys: Iterable[str], section: str = ""
) -> list[str]:
    """``<section>.<key>=<trained> (here <current>)`` for each of ``keys`` set on both sides that
    differs (keys already dotted, as a job's settings are, need no ``section``)."""
    prefix = f"{section}." if section else ""
    return [
        f"{prefix}{key}={trained[key]} (here {current[key]})"
        for key in keys
        if key in trained and key in current and as_lists(trained[key]) != as_lists(current[key])
    ]


def as_lists(value: Any) -> Any:
    """Lists and tuples compare equal when their items do (a config list, a saved tuple)."""
    return [as_lists(item) for item in value] if isinstance(value, list | tuple) else value


RESULT_SECTIONS = ("seed", "data", "model", "trainer")  # what decides a job's result
RESULT_KEYS = ("strategy.exact",)  # and single keys of other sections (per-rank masks or not)
NOT_THE_JOB = ("ckpt_path=", "weights_from=")  # overrides that say where a job starts, not what


def job_settings(cfg: DictConfig) -> dict[str, Any]:
    """The resolved values that decide a job's result (``data.batch_size``: 32): every key of
    :data:`RESULT_SECTIONS` but those in ``resume_may_differ`` (how long, where and how fast),
    and the :data:`RESULT_KEYS` the config has."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    values = flatten({key: resolved[key] for key in RESULT_SECTIONS if key in resolved})
    for key in RESULT_KEYS:
        if (value := OmegaConf.select(cfg, key)) is not None:
            values[key] = value
    free = tuple(cfg.get("resume_may_differ") or ())
    return {
        key: value
        for key, value in values.items()
        if not any(key == other or key.startswith(f"{other}.") for other in free)
    }


def follows_seed(cfg: DictConfig) -> set[str]:
    """``seed`` and the keys set to ``${seed}`` (``data.shuffle_seed``): with ``seed=null`` a
    resume takes the checkpoint's seed, so they are not compared."""
    raw = flatten({key: OmegaConf.to_container(cfg[key]) for key in ("data", "model")})
    return {"seed", *(key for key, value in raw.items() if value == "${seed}")}


def job_overrides() -> list[str]:
    """The command's overrides that make the job (Hydra's), without where it starts from."""
    return [o for o in HydraConfig.get().overrides.task if not o.startswith(NOT_THE_JOB)]


def resume_command(overrides: Iterable[str], ckpt_path: str | Path) -> str:
    """The command that continues the job of ``overrides`` from ``ckpt_path``, quoted for a
    POSIX shell: the job's own overrides, ``ckpt_path`` last."""
    return shlex.join(["python", "-m", "src.train", *overrides, f"ckpt_path={ckpt_path}"])


def settings_to_record(
    cfg: DictConfig, seed: int, saved: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The job's settings with the seed it trains with: under ``seed=null`` the one drawn, or on
    resume the checkpoint's (it travels in the checkpoint)."""
    settings = {**job_settings(cfg), "seed": seed}
    earlier = ((saved or {}).get("job") or {}).get("settings", {})
    if cfg.seed is None:
        settings.update({key: earlier[key] for key in follows_seed(cfg) if key in earlier})
    return settings


class JobRecord(Callback):
    """Stores the job in every checkpoint (rank 0's is saved): the settings that decide its result
    (a resume must match them), its overrides (the command that continues it) and the world it
    ran on (a resume on another says so: ``start.say_world_change``)."""

    def __init__(self, settings: Mapping[str, Any], overrides: list[str]) -> None:
        self.job = {"settings": dict(settings), "overrides": list(overrides)}

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        world = {"world_size": trainer.world_size, "num_nodes": trainer.num_nodes}
        checkpoint["job"] = {**self.job, "world": world}


def check_strategy(ckpt_path: str, strategy: str) -> None:
    """Only FSDP loads a sharded folder shard by shard; any strategy takes its one file."""
    if strategy != "fsdp" and sharded.is_sharded_checkpoint(ckpt_path):
        raise CheckpointError(
            f"{Path(ckpt_path).name} is a sharded checkpoint folder (written under strategy=fsdp); "
            f"resume it with strategy=fsdp, or make it one file first: "
            f"python -m src.consolidate {ckpt_path}"
        )


def check_same_job(saved: Mapping[str, Any], cfg: DictConfig, ckpt_path: str) -> None:
    """Refuse a resume whose settings differ from its checkpoint's job in anything that decides
    the result: it would record another job's numbers in that job's run and folder. (A
    checkpoint older than this check carries no job: nothing to compare.)"""
    job = saved.get("job")
    if not job:
        return
    skip = follows_seed(cfg) if cfg.seed is None else set()
    keys = [key for key in job["settings"] if key not in skip]
    differing = differences(job["settings"], job_settings(cfg), keys)
    if differing:
        raise CheckpointError(
            f"{Path(ckpt_path).name} was trained with {', '.join(differing)}; a resume continues "
            f"that job. Continue it with its own settings: "
            f"{resume_command(job['overrides'], ckpt_path)}; or start a new job from its "
            f"weights: weights_from={ckpt_path} instead of ckpt_path"
        )


def epochs_done(saved: Mapping[str, Any]) -> int:
    """The whole epochs a checkpoint's job trained (Lightning counts an epoch processed before
    its end-of-epoch checkpoint is written)."""
    return saved["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"]


def limit_reached(saved: Mapping[str, Any], trainer: Mapping[str, Any]) -> str | None:
    """The key whose end the checkpoint's job already reached (``trainer.max_steps`` or
    ``trainer.max_epochs``: the one to raise to train it longer), or None: it trains on."""
    max_steps = trainer.get("max_steps", -1)
    if max_steps is not None and max_steps != -1 and saved["global_step"] >= max_steps:
        return "trainer.max_steps"
    max_epochs = trainer.get("max_epochs")
    if max_epochs is not None and max_epochs != -1 and epochs_done(saved) >= max_epochs:
        return "trainer.max_epochs"
    return None


def read_weights(cfg: DictConfig) -> dict[str, Any] | None:
    """``weights_from=<ckpt>``'s contents (a new job starts from its weights); refused with
    ``ckpt_path``, which continues a job instead."""
    source = cfg.get("weights_from")
    if source and cfg.ckpt_path:
        raise CheckpointError(
            f"ckpt_path={cfg.ckpt_path} and weights_from={source} together: ckpt_path continues "
            "a job, weights_from starts a new one from a checkpoint's weights; keep one"
        )
    return read_checkpoint(source) if source else None


def learned_weights(model: L.LightningModule, state: Mapping[str, Any]) -> dict[str, Any]:
    """The learned tensors only: metric states (torchmetrics) may be newer or older."""
    metrics = tuple(
        f"{key}." for key, module in model.named_modules() if isinstance(module, Metric)
    )
    return {k: v for k, v in state.items() if not k.startswith(metrics)}


def load_weights(model: L.LightningModule, saved: Mapping[str, Any], name: str) -> None:
    """Load a checkpoint's learned weights into ``model``, once they are checked to fit."""
    weights = learned_weights(model, migrated(model, saved)["state_dict"])
    expected = learned_weights(model, model.state_dict())
    check_weights_fit({**saved, "state_dict": weights}, expected, name, model.hparams)
    model.load_state_dict(weights, strict=False)


def model_from_checkpoint(saved: Mapping[str, Any], name: str, task: Task) -> L.LightningModule:
    """The model rebuilt from the checkpoint's hyperparameters, new keys at today's defaults; keys
    unknown or lacking are refused by name (``load_from_checkpoint`` would name tensors)."""
    hparams = dict(saved.get("hyper_parameters", {}))
    unknown = []
    missing = []
    defaulted = []
    empty = inspect.Parameter.empty
    for section, (target, set_by_data) in task.config_targets(hparams).items():
        values = OmegaConf.select(OmegaConf.create({"model": hparams}), section) or {}
        prefix = f"{section}.".removeprefix("model.")  # model.net -> net.
        params = inspect.signature(target).parameters.items()
        defaults = {k: p.default for k, p in params if k not in ("self", *set_by_data)}
        unknown += [prefix + k for k in values if k not in (*defaults, "name", *set_by_data)]
        absent = [key for key in defaults if key not in values]
        missing += [prefix + k for k in absent if defaults[k] is empty]
        defaulted += [f"{prefix}{k}={defaults[k]}" for k in absent if defaults[k] is not empty]
    problems = [f"keys this code does not know: {', '.join(unknown)}"] if unknown else []
    problems += [f"keys it lacks: {', '.join(missing)}"] if missing else []
    if problems:
        raise CheckpointError(
            f"{name} was saved by a different version of the model: {'; '.join(problems)}. "
            "Load it with the code version that wrote it (its mlflow.source.git.commit tag)"
        )
    if defaulted:
        warnings.warn(
            f"{name} predates config keys {', '.join(defaulted)}: they take today's defaults",
            stacklevel=2,
        )
    model = task.model_class(**hparams)
    load_weights(model, saved, name)
    return model


def is_sharded(module: Any) -> bool:
    """Whether ``module`` holds FSDP2-sharded parameters (``distributed.shard`` went through it
    or a submodule)."""
    from torch.distributed.fsdp import FSDPModule

    modules = module.modules() if isinstance(module, torch.nn.Module) else ()
    return any(isinstance(sub, FSDPModule) for sub in modules)


@rank_zero_only
def whole_model(model: L.LightningModule, ckpt_path: str, task: Task) -> L.LightningModule:
    """The model rank 0 runs alone after training (figures, the MLflow model): ``model``, or,
    where it is sharded (strategy=fsdp: each rank holds 1/N of every weight and a forward needs
    every rank), the same model rebuilt whole on the CPU from ``ckpt_path``, the gathered
    checkpoint."""
    if not is_sharded(model):
        return model
    return model_from_checkpoint(read_checkpoint(ckpt_path), Path(ckpt_path).name, task)


def load_for_inference(
    ckpt_path: str | None, data: Mapping[str, Any], typed: set[str], task: Task
) -> tuple[L.LightningModule, L.LightningDataModule, dict[str, str] | None]:
    """The checkpoint's model, its data module and MLflow run (if tracked). The data settings are
    the checkpoint's but for keys typed (``data.root=...``); typing what the data is fails."""
    saved = read_checkpoint(ckpt_path)
    name = Path(ckpt_path).name
    values = dict(data)
    if trained := saved.get("datamodule_hyper_parameters"):  # none: an older checkpoint
        content = task.datamodule_class(trained["name"]).CONTENT_KEYS
        chosen = typed | ({"name"} if "" in typed else set())  # "": the command chose data=
        keys = [key for key in ("name", *content) if key in chosen]
        fix = "eval and predict use the checkpoint's data settings: leave these out"
        check_same_data(saved, data, keys, name, fix)
        # Keys newer than the checkpoint come from the command's config of the same dataset.
        base = values if data.get("name") == trained["name"] else {}
        values = {**base, **trained, **{key: data[key] for key in typed if key in data}}
    model = model_from_checkpoint(saved, name, task)
    datamodule = task.datamodule_class(values["name"])(**values)
    # Lightning saves the DataModule's state under its class name.
    datamodule.load_state_dict(saved.get(type(datamodule).__qualname__, {}))
    return model, datamodule, saved.get("mlflow")
