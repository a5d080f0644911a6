"""Test instrument: rank 0 sends itself a real signal during a chosen training step.

Put this folder on ``PYTHONPATH`` and set ``SIGNAL_AT_STEP=<global step>:<signal name>``: when
``ImageClassifier.training_step`` runs with ``global_step == <global step>`` on rank 0 (the
launching process), that process gets the signal, as from ``kill -<signal> <pid>``. Stops then
land at a known step instead of wherever a timer would put them.
"""

import importlib.abc
import os
import signal
import sys

TARGET = "src.task.model"


def patch(module) -> None:
    step, name = os.environ["SIGNAL_AT_STEP"].split(":")
    original = module.ImageClassifier.training_step

    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 0 and self.global_step == int(step):
            os.kill(os.getpid(), signal.Signals[name])
        return original(self, batch, batch_idx)

    module.ImageClassifier.training_step = training_step


class PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("SIGNAL_AT_STEP"):
    import importlib.util

    sys.meta_path.insert(0, PatchAfterImport())
