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
from lightning_exact import DataError, Task, model_from_checkpoint, read_checkpoint

from src.task.data.image_folder import EXTENSIONS, FileImages
from src.task.data.images import Normalize
from src.task.data.survey import Findings, said


def image_paths(pattern: str) -> tuple[list[Path], list[Path]]:
    """A folder's images (recursively) or a glob's files, sorted; refuse none. And the other
    files of the folder (skipped, to be named; hidden files and folders are not looked at)."""
    root = Path(pattern).expanduser()
    skipped = []
    if root.is_dir():
        found = []
        for path in root.rglob("*"):
            if any(part.startswith(".") for part in path.relative_to(root).parts):
                continue
            if path.suffix.lower() in EXTENSIONS:
                found.append(path)
            elif path.is_file():
                skipped.append(path)
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
    return sorted(found), sorted(skipped)


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
    paths, skipped = image_paths(pattern)
    findings = Findings([str(path) for path in paths], [str(path) for path in skipped])
    images_at = FileImages(findings.files, channels, (height, width), findings)
    out.parent.mkdir(parents=True, exist_ok=True)
    classified = 0
    with out.open("w", newline="") as f, torch.no_grad():
        writer = csv.writer(f)
        writer.writerow(["path", "predicted", "class_name", "confidence"])
        for start in range(0, len(paths), batch_size):
            rows = range(start, min(start + batch_size, len(paths)))
            pixels = [images_at(i) for i in rows]
            rows = [i for i in rows if i not in findings.errors]  # each unreadable one listed
            if not rows:
                continue
            pixels = [pixels[i - start] for i in rows]
            images = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2)
            confidence, predicted = model(normalize(images)).softmax(dim=1).max(dim=1)
            for i, label, p in zip(rows, predicted.tolist(), confidence.tolist(), strict=True):
                writer.writerow([str(paths[i]), label, classes[label], f"{p:.6f}"])
            classified += len(rows)
    # Sizes, skipped files, converted modes; unreadable files left out of the CSV and listed
    # beside it (a prediction leaves out only their rows, each named; nothing is trained on).
    said({"to classify": findings}, (height, width), channels, None, None, out.parent)
    print(f"{classified} image(s) classified: {out}")
    return out
