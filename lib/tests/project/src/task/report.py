"""What the regression reports: the predictions CSV (index, target, predicted), its MSE, and a
predicted-against-target figure of the test split."""

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning_exact import trainer_precision
from torch import Tensor


def predictions(
    columns: Mapping[str, Tensor], data: Any
) -> tuple[dict[str, Sequence], dict[str, float]]:
    target = columns["target"]
    predicted = columns["predicted"]
    table = {
        "index": columns["index"].tolist(),
        "target": target.tolist(),
        "predicted": predicted.tolist(),
    }
    metrics = {
        "predict/samples": float(len(target)),
        "predict/mse": (predicted.double() - target.double()).square().mean().item(),
    }
    return table, metrics


def figures(model: Any, data: Any, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    test = data.test_set
    was_training = model.training
    # run as the Trainer's loops run it (trainer.precision: 64-true is float64 end to end)
    with torch.no_grad(), trainer_precision(model) as convert:
        predicted = model.eval()(convert(test.inputs.to(model.device))).float().cpu()
    model.train(was_training)
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(test.targets, predicted, s=8)
    ax.set(xlabel="target", ylabel="predicted", title=f"Test ({len(test)} samples)")
    path = out_dir / "predicted_vs_target_test.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path]
