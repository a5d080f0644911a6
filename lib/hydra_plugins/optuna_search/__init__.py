"""A Hydra sweeper on current Optuna with persistent storage (see ``sweeper.py``)."""

from hydra_plugins.optuna_search.sweeper import OptunaSearch

__all__ = ["OptunaSearch"]
