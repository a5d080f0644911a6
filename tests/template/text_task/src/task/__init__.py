"""Next-token prediction on a generated text with a small GPT (nanoGPT's model): a task that is not
images, counted in steps, put in place of the image classifier by
``tests/template/test_text_task.py`` in a copy of the project. Copied over ``src/task/`` and
``conf/`` as they are here."""

from lightning_exact import Task

from . import export, generate, model
from .data import CharDataModule

TASK = Task(
    datamodules={"chars": CharDataModule},
    model_class=model.CharGPT,
    build_model=model.build,
    config_targets=model.config_targets,
    monitor="val/loss",
    mode="min",
    sharded_blocks=model.SHARDED_BLOCKS,
    export=export.export,
    predict_inputs=generate.continue_text,
)
