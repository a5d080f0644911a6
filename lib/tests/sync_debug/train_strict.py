"""``python tests/sync_debug/train_strict.py [src.train overrides]``: src.train on a GPU, with the
template's per-step code under ``torch.cuda.set_sync_debug_mode("error")``.

Wrapped: the model's ``training_step`` and the batch hooks of every template callback. The first
steps (warm-up: cuDNN autotuning, lazy initialisation) and the sanity check are left out. A
device-to-host read or a blocking copy inside them raises; the job then fails.
"""

import functools
import importlib
import pkgutil

import lightning_exact
import torch
from lightning.pytorch.callbacks import Callback
from lightning_exact.job import entry, stories

from src.task import TASK

HOOKS = ("on_train_batch_start", "on_train_batch_end")
WARM_UP_STEPS = 3
checked: list[str] = []


def strict(hook):
    @functools.wraps(hook)
    def wrapped(self, *args, **kwargs):
        trainer = self.trainer if isinstance(self, TASK.model_class) else args[0]
        if trainer.global_step < WARM_UP_STEPS or trainer.sanity_checking:
            return hook(self, *args, **kwargs)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return hook(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            checked.append(hook.__qualname__)

    return wrapped


def template_callbacks() -> list[type[Callback]]:
    """Every Lightning callback class the machinery defines, in any of its modules."""
    machinery = pkgutil.walk_packages(lightning_exact.__path__, "lightning_exact.")
    outside = ("lightning_exact.server", "lightning_exact.testing")  # no training code
    modules = [
        importlib.import_module(info.name)
        for info in machinery
        if not info.name.startswith(outside)
    ]
    return [
        value
        for module in modules
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, Callback)
        and value.__module__ == module.__name__
    ]


if __name__ == "__main__":
    TASK.model_class.training_step = strict(TASK.model_class.training_step)
    for callback in template_callbacks():
        for name in HOOKS:
            if name in vars(callback):
                setattr(callback, name, strict(vars(callback)[name]))
    try:
        entry.main("train", TASK, stories.train)
    finally:
        print("steps checked:", len(checked), sorted(set(checked)), flush=True)
