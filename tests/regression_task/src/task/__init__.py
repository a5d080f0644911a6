"""A regression on synthetic vectors: the task ``tests/test_task_contract.py`` puts in place of
the image classifier, in a copy of the project, to prove the machinery needs nothing of it.

Copied over ``src/task/`` (and ``conf/``) as they are here; ``TASK`` is the whole contract.
"""

from src.task import export, model, report
from src.task.data import SyntheticDataModule
from src.template.task import Task

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
