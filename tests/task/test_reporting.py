"""The task's test figures for any channel count: RGB images in colour, grayscale in gray."""

import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning_exact.data import TensorSplit
from PIL import Image

from src.task.data.images import Normalize
from src.task.model import ImageClassifier
from src.task.report import figures
from tests.conftest import HARNESS

run_entry = HARNESS.run_entry
tiny_overrides = HARNESS.tiny_overrides


def test_misclassified_rgb_images_are_drawn_in_colour(tmp_path: Path) -> None:
    images = torch.zeros(6, 3, 16, 16, dtype=torch.uint8)
    images[:, 0] = 255  # pure red images
    labels = torch.tensor([1, 2, 3, 1, 2, 3])
    model = ImageClassifier(net={"name": "convnet"}, lr=0.1, num_classes=4, image_shape=(3, 16, 16))
    torch.nn.init.zeros_(model.net.classifier[-1].weight)  # equal logits: every image is class 0
    with torch.no_grad():
        model.net.classifier[-1].bias.copy_(torch.tensor([1.0, 0, 0, 0]))
    split = TensorSplit(images, labels, transform=Normalize([0.5] * 3, [0.25] * 3))
    data = SimpleNamespace(test_set=split, classes=["a", "b", "c", "d"], image_shape=(3, 16, 16))
    matrix, grid = figures(model, data, tmp_path)
    pixels = np.asarray(Image.open(grid).convert("RGB")).astype(int)
    red = (pixels[..., 0] > 200) & (pixels[..., 1] < 60) & (pixels[..., 2] < 60)
    assert red.sum() > 1000, "the six misclassified images are drawn red, as read"
    assert Image.open(matrix).size[0] > 500
    # data=shards: inputs decoded one at a time (no .shape), image files at their own size.
    files = [torch.zeros(3, 20, 12, dtype=torch.uint8) for _ in range(6)]
    for image in files:
        image[0] = 255  # red
    data.test_set = ShardLike(split, files)
    (_, grid) = figures(model, data, tmp_path / "files")
    pixels = np.asarray(Image.open(grid).convert("RGB")).astype(int)
    red = (pixels[..., 0] > 200) & (pixels[..., 1] < 60) & (pixels[..., 2] < 60)
    assert red.sum() > 1000, "images of another size are drawn at the model's input size"


class ShardLike:
    """A test split as data=shards gives it: batches as the in-memory split's, ``inputs``
    indexed one at a time (no ``.shape``), each image at its file's own size."""

    def __init__(self, split: TensorSplit, files: list[torch.Tensor]) -> None:
        self.split = split
        self.inputs = files
        self.targets = split.targets

    def __len__(self) -> int:
        return len(self.split)

    def __getitems__(self, indices: list[int]) -> object:
        return self.split.__getitems__(indices)


def printed_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


@pytest.mark.slow
def test_a_run_and_a_sweep_job_print_a_screenful_and_keep_the_rest(
    tiny_root: Path, tmp_path: Path
) -> None:
    """A default run prints about 40 lines at most (no config tree, model summary, duplicate
    results or library notices); the config and the model summary are in the output folder."""
    run = run_entry(
        "train", *tiny_overrides(tiny_root, model=True), "callbacks.progress_bar=rich", cwd=tmp_path
    )
    single = printed_lines(run)
    assert len(single) <= 40, "\n".join(single)
    assert not [line for line in single if "srun" in line or "Tip:" in line or "LeafSpec" in line]
    (out,) = (tmp_path / "outputs" / "train" / "runs").iterdir()
    best = [line for line in single if line.startswith("best checkpoint: ")]
    assert len(best) == 1 and Path(best[0].split(": ", 1)[1]).parent == out / "checkpoints", best
    assert "model:" in (out / "config.yaml").read_text()
    assert "Total params" in (out / "model_summary.txt").read_text()
    default = tiny_overrides(tiny_root, model=True)
    sweep = run_entry("train", "-m", *default, "model.lr=0.01,0.02", cwd=tmp_path)
    hydra_lines = 3  # "Launching 2 jobs locally", and "#0 : ...", "#1 : ..."
    assert len(printed_lines(sweep)) <= 2 * len(single) + hydra_lines


@pytest.mark.slow
def test_the_predictions_line_starts_its_own_line_after_the_progress_bar(
    trained: dict[str, Path], tmp_path: Path
) -> None:
    """The tqdm bar ends its line when it closes, after the prediction loop: a line printed
    from inside the loop (the writer's epoch end) was glued to the bar's last line."""
    run_dir = tmp_path / "predict"
    ckpt = trained["run_dir"] / "checkpoints" / "last.ckpt"
    proc = run_entry(
        "predict",
        f"ckpt_path={ckpt}",
        f"data.root={trained['tiny_root']}",
        "callbacks.progress_bar=tqdm",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert "Predicting DataLoader 0: 100%" in proc.stdout  # the bar was drawn
    lines = proc.stdout.splitlines()
    assert f"predictions written to {run_dir / 'predictions_test.csv'}" == lines[-1], lines[-3:]
    assert [line for line in lines if "predictions written" in line] == lines[-1:]
