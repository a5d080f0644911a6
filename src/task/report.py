"""What this task reports: prediction columns with class names and accuracy, and figures of
the test split (a confusion matrix and misclassified images). The machinery calls these on
rank 0 and logs what they return (see ``TASK`` in :mod:`src.task`)."""

from collections.abc import Mapping, Sequence
from pathlib import Path

import lightning.pytorch as L
import torch
from torch import Tensor

from src.task.data.images import ImageDataModule

COLUMNS = ("predicted", "confidence")


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
    dataset = data.test_set
    classes = data.classes
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    was_training = model.training
    model.eval()
    outputs = []
    with torch.no_grad():
        for start in range(0, len(dataset), 1000):
            batch = dataset.__getitems__(list(range(start, min(start + 1000, len(dataset)))))
            batch = type(batch)(*(tensor.to(model.device) for tensor in batch))
            outputs.append(model.predict_step(batch, start // 1000))
    model.train(was_training)
    predicted, confidence = (torch.cat([o[key] for o in outputs]).cpu() for key in COLUMNS)
    labels = dataset.targets
    n = len(classes)
    matrix = torch.bincount(labels * n + predicted, minlength=n * n).reshape(n, n)
    out_dir.mkdir(parents=True, exist_ok=True)

    fig, ax = plt.subplots(figsize=(7, 6))
    ax.imshow(matrix, cmap="Blues")
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
    matrix_path = out_dir / "confusion_matrix_test.png"
    fig.savefig(matrix_path, dpi=110)
    plt.close(fig)

    wrong = (predicted != labels).nonzero().flatten()[:32].tolist()
    fig, axes = plt.subplots(4, 8, figsize=(12, 7))
    for ax, i in zip(axes.flatten(), wrong + [None] * (32 - len(wrong)), strict=True):
        ax.axis("off")
        if i is not None:
            image = dataset.inputs[i]  # uint8 [C, H, W] as read: no normalisation to undo
            if image.shape[0] == 1:
                ax.imshow(image[0], cmap="gray", vmin=0, vmax=255)
            else:
                ax.imshow(image.permute(1, 2, 0).numpy())
            ax.set_title(
                f"true {classes[labels[i]]}\npred {classes[predicted[i]]} {confidence[i]:.2f}",
                fontsize=7,
            )
    fig.suptitle(
        f"First {len(wrong)} misclassified test images of {int((predicted != labels).sum())}"
    )
    fig.tight_layout()
    grid_path = out_dir / "misclassified_test.png"
    fig.savefig(grid_path, dpi=110)
    plt.close(fig)
    return [matrix_path, grid_path]
