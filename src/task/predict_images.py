"""``python -m src.predict ckpt_path=X images=DIR_OR_GLOB`` (or ``inputs=``): classify new,
unlabelled images.

Needs only the checkpoint: it holds the network, the class names, the normalisation and the
image shape, so the training data need not be reachable. Images are decoded as training did
(``channels``, resized to the trained size) and the CSV has one row per file, sorted by path:
``path, predicted, class_name, confidence``.
"""

import csv
import glob
from pathlib import Path
from typing import Any

import numpy as np
import torch

from src.task.data.image_folder import EXTENSIONS, decode
from src.task.data.images import Normalize
from src.template.checkpoint import model_from_checkpoint, read_checkpoint
from src.template.data import DataError
from src.template.task import Task


def image_paths(pattern: str) -> list[Path]:
    """A folder's images (recursively) or a glob's files, sorted; refuse none."""
    root = Path(pattern).expanduser()
    if root.is_dir():
        found = [p for p in root.rglob("*") if p.suffix.lower() in EXTENSIONS]
    else:
        found = [Path(p) for p in glob.glob(str(root), recursive=True) if Path(p).is_file()]
    kinds = ", ".join(sorted(EXTENSIONS))
    if not found and not (root.exists() or any(mark in pattern for mark in "*?[")):
        raise DataError(
            f"{pattern}: no such file or folder; give image files ({kinds}): a folder, a file "
            "or a glob"
        )
    if not found:
        raise DataError(f"{pattern}: no images here ({kinds})")
    return sorted(found)


def data_state(saved: dict[str, Any], task: Task) -> dict[str, Any]:
    """Classes, mean and std the data module stored in the checkpoint."""
    name = saved.get("datamodule_hyper_parameters", {}).get("name")
    state = saved.get(task.datamodule_class(name).__qualname__, {}) if name else {}
    if not {"classes", "mean", "std"} <= set(state):
        raise DataError("the checkpoint has no class names or normalisation; retrain with it")
    return state


def predict_images(
    ckpt_path: str, pattern: str, out: Path, task: Task, batch_size: int = 256
) -> Path:
    saved = read_checkpoint(ckpt_path)
    model = model_from_checkpoint(saved, Path(ckpt_path).name, task).eval()
    state = data_state(saved, task)
    channels, height, width = model.hparams.image_shape
    normalize = Normalize(state["mean"], state["std"])
    classes = state["classes"]
    paths = image_paths(pattern)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f, torch.no_grad():
        writer = csv.writer(f)
        writer.writerow(["path", "predicted", "class_name", "confidence"])
        for start in range(0, len(paths), batch_size):
            chunk = paths[start : start + batch_size]
            pixels = [decode(p, channels, (height, width)) for p in chunk]
            images = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2)
            confidence, predicted = model(normalize(images)).softmax(dim=1).max(dim=1)
            for path, label, p in zip(chunk, predicted.tolist(), confidence.tolist(), strict=True):
                writer.writerow([str(path), label, classes[label], f"{p:.6f}"])
    print(f"{len(paths)} image(s) classified: {out}")
    return out
