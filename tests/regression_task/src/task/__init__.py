"""A regression on synthetic vectors: the task ``tests/test_task_contract.py`` puts in place of
the image classifier, in a copy of the project, to prove the machinery needs nothing of it.

Copied over ``src/task/`` (and ``conf/``) as they are here; ``TASK`` is the whole contract. Its
imports are relative so that the machinery's tests can also import it in place
(``tests/machinery_task.py``).
"""

from src.template.task import Task

from . import export, model, report
from .data import SyntheticDataModule

TASK = Task(
    datamodules={"synthetic": SyntheticDataModule},
    model_class=model.Regressor,
    build_model=model.build,
    config_targets=model.config_targets,
    monitor="val/loss",
    mode="min",
    export=export.export,
    figures=report.figures,
    predictions=report.predictions,
)
