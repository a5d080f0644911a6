"""Optuna search as a Hydra sweeper: ``python -m src.train -m hparams_search=convnet_optuna``.

Why not ``hydra-optuna-sweeper``: it pins optuna < 3, whose SQLite storage fails with the
SQLAlchemy 2 that MLflow needs, so a search could not be stored or resumed. This sweeper uses
current Optuna with a persistent study: running the same command again continues the study
until it holds ``n_trials`` finished trials.

Each trial is one Hydra job (its own folder, MLflow run and, with ``strategy=ddp``, its own
DDP world). The trial's hyperparameters are ordinary overrides, so every DDP rank trains them.
"""

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf
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


class OptunaSearch(Sweeper):
    def __init__(
        self,
        study_name: str,
        storage: str | None,
        direction: str,
        n_trials: int,
        seed: int | None,
        params: DictConfig,
    ) -> None:
        self.study_name, self.storage, self.direction = study_name, storage, direction
        self.n_trials, self.seed = n_trials, seed
        self.space = {name: distribution(spec) for name, spec in params.items()}

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> optuna.trial.FrozenTrial:
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        if self.storage and self.storage.startswith("sqlite:///"):
            Path(self.storage.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        study = optuna.create_study(
            study_name=self.study_name,
            storage=self.storage,
            direction=self.direction,
            sampler=optuna.samplers.TPESampler(seed=self.seed),
            load_if_exists=True,
        )
        done = len(study.get_trials(states=(TrialState.COMPLETE, TrialState.FAIL)))
        if done:
            log.info("study %s resumed with %d finished trials", self.study_name, done)
        for _ in range(done, self.n_trials):
            trial = study.ask(self.space)
            overrides = [*arguments, *(f"{name}={value}" for name, value in trial.params.items())]
            self.validate_batch_is_legal([overrides])
            (result,) = self.launcher.launch([overrides], initial_job_idx=trial.number)
            try:
                value = float(result.return_value)  # re-raises the job's error, if any
            except Exception as error:
                log.error("trial %d failed: %s", trial.number, error)
                study.tell(trial, state=TrialState.FAIL)
                continue
            study.tell(trial, value)
            log.info(
                "trial %d: %s = %.6f with %s", trial.number, self.direction, value, trial.params
            )
        return self._report(study, sweep_dir)

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
