"""``python -m src.predict`` for any task: new files go through the task's contract
(tests/task/test_predict.py runs it end to end on the shipped task)."""

from pathlib import Path

import pytest


def test_new_files_are_the_tasks_to_read_or_refused_in_one_line(tmp_path: Path) -> None:
    """``images=`` goes to the task's ``predict_files``; a task without one (a regression on
    vectors, say) refuses it by name instead of failing on a module it does not have."""
    from dataclasses import replace

    from src.predict import predict
    from src.task import TASK
    from src.template.config import ConfigError
    from tests.test_config import compose_config

    cfg = compose_config("predict", ["ckpt_path=x.ckpt", "images=new/"], tmp_path)
    with pytest.raises(ConfigError, match="images=new/: this task predicts its data splits only"):
        predict(cfg, replace(TASK, predict_files=None))
