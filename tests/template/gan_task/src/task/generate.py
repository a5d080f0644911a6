"""``python -m src.predict ckpt_path=PATH inputs=16``: new images from a checkpoint's generator,
one PNG each (noise fixed by the image's number), listed in the CSV: index, file."""

import csv
from pathlib import Path

import numpy as np
import torch
from lightning_exact import Task, model_from_checkpoint, read_checkpoint, sample_randn
from PIL import Image

from .model import image_grid


class BadCount(ValueError):
    """inputs= is not a number of images."""


def generate_images(ckpt_path: str, inputs: str, out: Path, task: Task) -> Path:
    if not inputs.isdigit() or int(inputs) < 1:
        raise BadCount(f"inputs={inputs}: give the number of images to generate, e.g. inputs=16")
    saved = read_checkpoint(ckpt_path)
    model = model_from_checkpoint(saved, Path(ckpt_path).name, task).eval()
    indices = torch.arange(int(inputs))
    with torch.no_grad():
        images = model(sample_randn(indices, model.hparams.latent_dim, like=model.weight))
    folder = out.parent / "generated"
    folder.mkdir(parents=True, exist_ok=True)
    rows = [["index", "file"]]
    for index, image in zip(indices.tolist(), images, strict=True):
        path = folder / f"{index:05d}.png"
        Image.fromarray(np.ascontiguousarray(image_grid(image[None], columns=1))).save(path)
        rows.append([index, str(path)])
    with out.open("w", newline="") as file:
        csv.writer(file).writerows(rows)
    print(f"{len(indices)} images in {folder}: {out}")
    return out
