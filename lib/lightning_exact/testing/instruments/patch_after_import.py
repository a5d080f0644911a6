"""For the test instruments (each a ``sitecustomize.py``: ``signal_at_step/`` here, the library
tests' ``count_collectives/``): patch a module of the project in the processes a test starts,
right after that module is first imported."""

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` once the module ``name`` has been imported."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def patch_after_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    sys.meta_path.insert(0, PatchAfterImport(name, patch))
