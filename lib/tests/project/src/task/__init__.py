"""A regression on synthetic vectors: the library's test task (``lib/tests/`` run their jobs on
this project), and the task ``tests/template/test_task_contract.py`` puts in place of the image
classifier, in a copy of the template, to prove the machinery needs nothing of it.

Copied over ``src/task/`` (and ``conf/``) as they are here; ``TASK`` is the whole contract. Its
imports are relative so that it works wherever it is copied.
"""

from lightning_exact import Task

from . import export, model, report
from .data import SyntheticDataModule

TASK = Task(
    datamodules={"synthetic": SyntheticDataModule, "noisy": SyntheticDataModule},
    model_class=model.Regressor,
    build_model=model.build,
    config_targets=model.config_targets,
    monitor="val/loss",
    mode="min",
    sharded_blocks=model.SHARDED_BLOCKS,
    export=export.export,
    figures=report.figures,
    predictions=report.predictions,
)
