"""``python -m src.predict`` for any task: new inputs go through the task's contract
(tests/task/test_predict.py runs it end to end on the shipped task)."""

from dataclasses import replace
from pathlib import Path

import pytest
from lightning_exact.job.config import ConfigError
from lightning_exact.job.stories import predict

from tests.machinery_task import TASK
from tests.test_config import compose_config

# ``images=``, inputs= by its name before 1.0 (the library's conf/predict.yaml still reads it,
# deprecated), given as a project's config once wrote it (``inputs: ${images}``).
IMAGES = ["inputs=${images}", "++images=new/"]


@pytest.mark.parametrize("typed", [["inputs=new/"], IMAGES], ids=["inputs", "images"])
def test_new_inputs_are_the_tasks_to_read_or_refused_in_one_line(typed: list[str], tmp_path: Path):
    """``inputs=`` (or the image task's ``images=``) goes to the task's ``predict_inputs``; a
    task without one refuses it by name instead of failing on a reader it does not have."""
    cfg = compose_config("predict", ["ckpt_path=x.ckpt", *typed], tmp_path)
    with pytest.raises(ConfigError, match="inputs=new/: this task predicts its data splits only"):
        predict(cfg, replace(TASK, predict_inputs=None))


def test_new_inputs_reach_the_tasks_reader_as_typed(tmp_path: Path) -> None:
    """Whatever was typed, a string with spaces included, reaches the reader unchanged."""
    seen = []

    def reader(ckpt_path: str, inputs: str, out: Path, task: object) -> Path:
        seen.append((ckpt_path, inputs, out.name))
        return out

    cfg = compose_config("predict", ["ckpt_path=x.ckpt", "inputs='Return the '"], tmp_path)
    predict(cfg, replace(TASK, predict_inputs=reader))
    assert seen == [("x.ckpt", "Return the ", "predictions_inputs.csv")]


def test_a_list_of_inputs_is_refused_in_one_line(tmp_path: Path) -> None:
    cfg = compose_config("predict", ["ckpt_path=x.ckpt", "inputs=[a.png,b.png]"], tmp_path)
    reader = replace(TASK, predict_inputs=lambda *args: Path())
    with pytest.raises(ConfigError, match=r"inputs=\['a.png', 'b.png'\] is a list; give one value"):
        predict(cfg, reader)


def test_images_and_inputs_together_are_refused_in_one_line(tmp_path: Path) -> None:
    """images= is inputs= by another name: given both, neither is dropped quietly."""
    cfg = compose_config("predict", ["ckpt_path=x.ckpt", "++images=a", "inputs=b"], tmp_path)
    with pytest.raises(ConfigError, match="images=a and inputs=b together: give inputs= only$"):
        predict(cfg, TASK)


def test_a_split_of_a_task_without_predictions_is_refused_in_one_line(tmp_path: Path) -> None:
    """Before any folder or rank: a task without Task.predictions writes no split's CSV."""
    cfg = compose_config("predict", ["ckpt_path=x.ckpt"], tmp_path)
    with pytest.raises(ConfigError, match="this task writes no predictions of a data split"):
        predict(cfg, replace(TASK, predictions=None))
