"""The task contract (``lightning_exact.task``): a task written for an older version is answered
with the name it must use now."""

import pytest
from lightning_exact.task import Task

from tests.machinery_task import TASK as MACHINERY_TASK


def test_a_renamed_field_answers_with_its_new_name() -> None:
    """A task written for an older template: one line naming the field's name now."""
    required = ("datamodules", "model_class", "build_model", "config_targets", "monitor", "mode")
    fields = {key: getattr(MACHINERY_TASK, key) for key in required}
    with pytest.raises(TypeError) as refused:
        Task(**fields, predict_files=lambda *args: None)
    assert str(refused.value) == (
        "Task(predict_files=...) is now Task(predict_inputs=...): rename it in src/task/"
    )
