"""The task's test figures for any channel count: RGB images in colour, grayscale in gray."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

from src.task.data.images import Normalize
from src.task.model import ImageClassifier
from src.task.report import figures
from src.template.data import TensorSplit


def test_misclassified_rgb_images_are_drawn_in_colour(tmp_path: Path) -> None:
    images = torch.zeros(6, 3, 16, 16, dtype=torch.uint8)
    images[:, 0] = 255  # pure red images
    labels = torch.tensor([1, 2, 3, 1, 2, 3])
    model = ImageClassifier(net={"name": "convnet"}, lr=0.1, num_classes=4, image_shape=(3, 16, 16))
    torch.nn.init.zeros_(model.net.classifier[-1].weight)  # equal logits: every image is class 0
    with torch.no_grad():
        model.net.classifier[-1].bias.copy_(torch.tensor([1.0, 0, 0, 0]))
    split = TensorSplit(images, labels, transform=Normalize([0.5] * 3, [0.25] * 3))
    data = SimpleNamespace(test_set=split, classes=["a", "b", "c", "d"])
    matrix, grid = figures(model, data, tmp_path)
    pixels = np.asarray(Image.open(grid).convert("RGB")).astype(int)
    red = (pixels[..., 0] > 200) & (pixels[..., 1] < 60) & (pixels[..., 2] < 60)
    assert red.sum() > 1000, "the six misclassified images are drawn red, as read"
    assert Image.open(matrix).size[0] > 500
