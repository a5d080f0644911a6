"""What this task reports: prediction columns with class names and accuracy, and figures of
the test split (a confusion matrix and misclassified images). The machinery calls these on
rank 0 and logs what they return (see ``TASK`` in :mod:`src.task`)."""

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning_exact import trainer_precision
from torch import Tensor
from torch.nn import functional as F

from src.task.data.images import ImageDataModule

COLUMNS = ("predicted", "confidence")
GRID = (4, 8)  # rows and columns of misclassified images


def predictions(
    columns: Mapping[str, Tensor], data: ImageDataModule
) -> tuple[dict[str, Sequence], dict[str, float]]:
    """The CSV's columns (index, label, predicted, class_name, confidence) and predict metrics."""
    predicted = columns["predicted"]
    label = columns["label"]
    table = {
        "index": columns["index"].tolist(),
        "label": label.tolist(),
        "predicted": predicted.tolist(),
        "class_name": [data.classes[i] for i in predicted.tolist()],
        "confidence": [f"{c:.6f}" for c in columns["confidence"].tolist()],
    }
    metrics = {
        "predict/samples": float(len(predicted)),
        "predict/acc": (predicted == label).double().mean().item(),
    }
    return table, metrics


def figures(model: L.LightningModule, data: ImageDataModule, out_dir: Path) -> list[Path]:
    """A confusion matrix and a grid of misclassified images for the test split, as PNGs.

    Rank 0 runs the (best) model over the test split once more, outside the DDP wrapper:
    seconds on a CPU, and it keeps figure-making out of the training loop.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    predicted, confidence = test_predictions(model, data.test_set)
    out_dir.mkdir(parents=True, exist_ok=True)
    matrix = confusion_matrix_figure(
        data.test_set.targets, predicted, data.classes, out_dir / "confusion_matrix_test.png"
    )
    grid = misclassified_figure(data, predicted, confidence, out_dir / "misclassified_test.png")
    return [matrix, grid]


def test_predictions(model: L.LightningModule, dataset: Any) -> tuple[Tensor, Tensor]:
    """The model's predicted class and confidence for every sample of ``dataset`` (a split of
    the data contract: ``__getitems__`` gives a batch), in order, each batch converted and run
    as the Trainer runs one (``trainer.precision``)."""
    was_training = model.training
    model.eval()
    outputs = []
    with torch.no_grad(), trainer_precision(model) as convert:
        for start in range(0, len(dataset), 1000):
            batch = dataset.__getitems__(list(range(start, min(start + 1000, len(dataset)))))
            batch = convert(type(batch)(*(tensor.to(model.device) for tensor in batch)))
            outputs.append(model.predict_step(batch, start // 1000))
    model.train(was_training)
    predicted, confidence = (torch.cat([o[key] for o in outputs]).cpu() for key in COLUMNS)
    return predicted, confidence


def confusion_matrix_figure(
    labels: Tensor, predicted: Tensor, classes: Sequence[str], path: Path
) -> Path:
    """Counts of (true, predicted) class pairs, each written in its cell."""
    import matplotlib.pyplot as plt

    n = len(classes)
    matrix = torch.bincount(labels * n + predicted, minlength=n * n).reshape(n, n)
    fig, ax = plt.subplots(figsize=(7, 6))
    ax.imshow(matrix.numpy(), cmap="Blues")
    for (row, col), count in zip(
        torch.cartesian_prod(torch.arange(n), torch.arange(n)).tolist(),
        matrix.flatten().tolist(),
        strict=True,
    ):
        color = "white" if count > matrix.max() / 2 else "black"
        ax.text(col, row, str(count), ha="center", va="center", fontsize=7, color=color)
    ax.set(
        xticks=range(n),
        yticks=range(n),
        xlabel="predicted",
        ylabel="true",
        title=f"Test confusion matrix ({len(labels)} samples)",
    )
    ax.set_xticklabels(classes, rotation=45, ha="right", fontsize=8)
    ax.set_yticklabels(classes, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def misclassified_figure(
    data: ImageDataModule, predicted: Tensor, confidence: Tensor, path: Path
) -> Path:
    """The first misclassified test images (:data:`GRID`) as read (uint8: no normalisation to
    undo; grayscale in gray, RGB in colour), each at the model's input size under its true and
    predicted class. One mosaic in one axes: 32 axes took most of a job's figure time."""
    import matplotlib.pyplot as plt

    rows, cols = GRID
    images = data.test_set.inputs  # a tensor, or decoded one at a time (data=shards)
    labels = data.test_set.targets
    wrong = (predicted != labels).nonzero().flatten()
    _, height, width = data.image_shape
    band = height // 2  # above each image, white: its two lines of text
    cell_height = band + height + height // 8
    cell_width = width + width // 8
    mosaic = torch.full((rows * cell_height, cols * cell_width, 3), 255, dtype=torch.uint8)
    fig, ax = plt.subplots(figsize=(12, 7))
    for place, i in enumerate(wrong[: rows * cols].tolist()):
        top = (place // cols) * cell_height + band
        left = (place % cols) * cell_width
        mosaic[top : top + height, left : left + width] = as_rgb(images[i], height, width)
        classes = f"true {data.classes[labels[i]]}\npred {data.classes[predicted[i]]}"
        caption = f"{classes} {confidence[i]:.2f}"
        ax.text(left + width / 2, top - 1, caption, ha="center", va="bottom", fontsize=7)
    ax.imshow(mosaic.numpy(), extent=(0, cols * cell_width, rows * cell_height, 0))
    ax.axis("off")
    shown = min(len(wrong), rows * cols)
    ax.set_title(f"First {shown} misclassified test images of {len(wrong)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def as_rgb(image: Tensor, height: int, width: int) -> Tensor:
    """A uint8 ``[C, h, w]`` image as ``[height, width, 3]``: an image file of another size
    (shards keep the files' own) is resized, a grayscale one repeated over three channels."""
    if tuple(image.shape[1:]) != (height, width):
        resized = F.interpolate(
            image[None].float(), size=(height, width), antialias=True, mode="bilinear"
        )
        image = resized[0].round().clamp(0, 255).to(torch.uint8)
    return image.expand(3, height, width).permute(1, 2, 0)
