"""Optuna search as a Hydra sweeper: ``python -m src.train -m hparams_search=convnet_optuna``.

Why not ``hydra-optuna-sweeper``: it pins optuna < 3, whose SQLite storage fails with the
SQLAlchemy 2 that MLflow needs, so a search could not be stored or resumed. This sweeper uses
current Optuna with a persistent study: running the same command again continues the study
until it holds ``n_trials`` finished trials.

Each trial is one Hydra job (its own folder, MLflow run and, with ``strategy=ddp``, its own
DDP world). The trial's hyperparameters are ordinary overrides, so every DDP rank trains them.

Resuming (the same command again, the same ``storage``):

- Optuna keeps no sampler state in its storage, and a sampler built again with the same seed
  restarts its random stream: the new trials would repeat the first ones. So the sampler's seed
  is ``seed`` plus the number of trials the study already holds: each run of the command draws
  new points, and the same sequence of commands still draws the same trials. A proposal that
  still equals a finished trial's parameters (a small discrete space) is not trained again: it
  gets that trial's value (Optuna's FAQ, "How can I ignore duplicated samples?").
- A study remembers the fixed settings its trials ran with (the job config without the searched
  keys, ``hydra`` and the ``neutral`` keys, plus the world size). A search with other settings
  (another ``devices`` or ``num_nodes``, epochs, data, ...) would mix incomparable trials in
  one study: it is refused in one line, before anything is written, naming what differs and how
  to start a separate study (``hydra.sweeper.study_name=...``).
- A study that already holds ``n_trials`` finished trials: one line says so; no sweep folder.
- Run again in the same sweep folder (``hydra.sweep.dir=...``) after the sweep was killed, a
  trial it left unfinished runs again as the same job, in its folder: it resumes from its
  checkpoint (a sweep job's ``ckpt_path=auto``), or reads back its result if it had finished.
"""

import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from hydra.core.plugins import Plugins
from hydra.errors import HydraException
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from lightning_exact.sweeps.jobs import JOB_FILE
from omegaconf import DictConfig, ListConfig, OmegaConf
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState

log = logging.getLogger(__name__)


def distribution(spec: Mapping[str, Any]) -> BaseDistribution:
    """``{type: float|int|categorical, low, high, log, step, choices}`` → an Optuna distribution."""
    kind = spec["type"]
    if kind == "float":
        return FloatDistribution(spec["low"], spec["high"], log=spec.get("log", False))
    if kind == "int":
        return IntDistribution(spec["low"], spec["high"], step=spec.get("step", 1))
    if kind == "categorical":
        return CategoricalDistribution(list(spec["choices"]))
    raise ValueError(f"search space type {kind!r} is not one of float, int, categorical")


SETTINGS_ATTR = "fixed_settings"  # the study's user attribute that holds them
FINISHED = (TrialState.COMPLETE, TrialState.FAIL)


class StudySettingsDiffer(HydraException):
    """A resumed search whose fixed settings are not those of the study's trials."""


def skipped(path: str, skip: Sequence[str]) -> bool:
    """Whether the dotted key ``path`` is one of ``skip`` or inside one of its sections."""
    return any(path == s or path.startswith(f"{s}.") for s in skip)


def flat_settings(node: DictConfig, skip: Sequence[str], prefix: str = "") -> Iterator[tuple]:
    """``(dotted key, value as text)`` for every leaf of ``node`` outside ``skip`` (keys or
    sections), interpolations resolved where they can be."""
    raw = OmegaConf.to_container(node, resolve=False)
    for key in node:
        path = f"{prefix}{key}"
        if skipped(path, skip):
            continue
        try:
            value = node[key]
        except Exception:  # an interpolation only a job can resolve (${hydra:runtime...})
            yield path, str(raw[key])
            continue
        if isinstance(value, DictConfig):
            yield from flat_settings(value, skip, f"{path}.")
        elif isinstance(value, ListConfig):
            yield path, str(OmegaConf.to_container(value, resolve=True))
        else:
            yield path, str(value)


class OptunaSearch(Sweeper):
    def __init__(
        self,
        study_name: str,
        storage: str | None,
        direction: str,
        n_trials: int,
        seed: int | None,
        params: DictConfig,
        neutral: Sequence[str] = (),
    ) -> None:
        self.study_name, self.storage, self.direction = study_name, storage, direction
        self.n_trials, self.seed = n_trials, seed
        self.space = {name: distribution(spec) for name, spec in params.items()}
        self.neutral = list(neutral)

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> optuna.trial.FrozenTrial | None:
        study = self._open_study()
        self._check_settings(study)
        done = len(study.get_trials(deepcopy=False, states=FINISHED))
        if done >= self.n_trials:
            log.info(
                "study %s already holds %d finished trials (hydra.sweeper.n_trials=%d): nothing "
                "to run; raise n_trials to add trials",
                self.study_name,
                done,
                self.n_trials,
            )
            return study.best_trial if study.get_trials(states=(TrialState.COMPLETE,)) else None
        if done:
            log.info("study %s resumed with %d finished trials", self.study_name, done)
        if self.seed is not None:
            # A new stream for every run of the command, the same for the same history.
            study.sampler = optuna.samplers.TPESampler(seed=self.seed + len(study.trials))
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        for trial in self._interrupted(study, sweep_dir):
            log.info("trial %d was interrupted: it resumes in its folder", trial.number)
            self._run_trial(study, trial.number, trial.params, arguments)
        done = len(study.get_trials(deepcopy=False, states=FINISHED))
        for _ in range(done, self.n_trials):
            trial = study.ask(self.space)
            if not self._reuse_duplicate(study, trial):
                self._run_trial(study, trial.number, trial.params, arguments)
        return self._report(study, sweep_dir)

    def _run_trial(
        self, study: optuna.Study, number: int, params: Mapping[str, Any], arguments: list[str]
    ) -> None:
        """Trial ``number`` as Hydra job ``number`` (its folder), its result told to the study."""
        overrides = [*arguments, *(f"{name}={value}" for name, value in params.items())]
        self.validate_batch_is_legal([overrides])
        (result,) = self.launcher.launch([overrides], initial_job_idx=number)
        try:
            value = float(result.return_value)  # re-raises the job's error, if any
        except Exception as error:
            log.error("trial %d failed: %s", number, error)
            study.tell(number, state=TrialState.FAIL)
            return
        study.tell(number, value)
        log.info("trial %d: %s = %.6f with %s", number, self.direction, value, dict(params))

    @staticmethod
    def _interrupted(study: optuna.Study, sweep_dir: Path) -> list[optuna.trial.FrozenTrial]:
        """Trials an earlier run of this sweep started in this folder and never finished (the
        sweep was killed): run again as the same job, they resume from its checkpoint."""
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        return [t for t in running if (sweep_dir / str(t.number) / JOB_FILE).is_file()]

    def _open_study(self) -> optuna.Study:
        """The stored study, or a new one (Optuna says so) if there is none yet."""
        if self.storage and self.storage.startswith("sqlite:///"):
            Path(self.storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        if self.storage and self.study_name in optuna.get_all_study_names(self.storage):
            return optuna.load_study(study_name=self.study_name, storage=self.storage)
        return optuna.create_study(
            study_name=self.study_name, storage=self.storage, direction=self.direction
        )

    def fixed_settings(self) -> dict[str, str]:
        """What every trial of a study must share: the job config without ``hydra``, the
        searched keys and the ``neutral`` ones, and the world size it asks for."""
        job = OmegaConf.masked_copy(self.config, [k for k in self.config if k != "hydra"])
        settings = dict(flat_settings(job, [*self.neutral, *self.space]))
        if {"accelerator", "devices", "num_nodes"} <= set(job):
            from lightning_exact.training.distributed import requested_processes

            world = requested_processes(job.accelerator, job.devices, job.num_nodes)
            settings["world_size"] = str(world)
        return settings

    def _check_settings(self, study: optuna.Study) -> None:
        """Refuse a resume whose fixed settings differ from the study's (one line); record the
        settings of a new study (or of one stored before they were recorded)."""
        settings = self.fixed_settings()
        stored = study.user_attrs.get(SETTINGS_ATTR)
        if stored is None:
            study.set_user_attr(SETTINGS_ATTR, settings)
            return
        # Keys neutral or searched now are not compared, whatever they were then.
        skip = [*self.neutral, *self.space]
        differ = sorted(
            k
            for k in stored.keys() | settings.keys()
            if stored.get(k) != settings.get(k) and not skipped(k, skip)
        )
        if not differ:
            return
        shown = "; ".join(
            f"{k}: {stored.get(k, '(unset)')} in the study, {settings.get(k, '(unset)')} here"
            for k in differ[:4]
        ) + (f"; {len(differ) - 4} more" if len(differ) > 4 else "")
        where = f" in {self.storage}" if self.storage else ""
        raise StudySettingsDiffer(
            f"study {self.study_name}{where} holds trials run with other fixed settings ({shown}); "
            "its trials would not compare with this search's. Run with the study's settings, or "
            f"start a separate study: hydra.sweeper.study_name={self.study_name}-2 (any new name)"
        )

    def _reuse_duplicate(self, study: optuna.Study, trial: optuna.Trial) -> bool:
        """A proposal equal to a finished trial's parameters gets that trial's value instead of
        a second training run (Optuna FAQ: "How can I ignore duplicated samples?")."""
        for earlier in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if earlier.params == trial.params:
                trial.set_user_attr("same_params_as_trial", earlier.number)
                study.tell(trial, earlier.value)
                log.info(
                    "trial %d: the parameters of trial %d again; its value %.6f is reused, "
                    "nothing is trained",
                    trial.number,
                    earlier.number,
                    earlier.value,
                )
                return True
        return False

    def _report(self, study: optuna.Study, sweep_dir: Path) -> optuna.trial.FrozenTrial:
        if not study.get_trials(states=(TrialState.COMPLETE,)):
            raise RuntimeError(f"no trial of study {self.study_name} finished; see the logs above")
        best = study.best_trial
        summary = {"study": self.study_name, "best_trial": best.number, "best_value": best.value}
        summary["best_params"] = dict(best.params)
        OmegaConf.save(OmegaConf.create(summary), sweep_dir / "optimization_results.yaml")
        log.info("best trial %d: value %.6f, params %s", best.number, best.value, best.params)
        return best


__all__: Sequence[str] = ["OptunaSearch", "distribution"]
