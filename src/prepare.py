"""``python -m src.prepare [data=...] out=DIR``: a dataset as shards for ``data=shards``.

Any dataset of the data contract (IDX files, image folders) is read as the training job reads it
and written with LitData's ``optimize()`` into ``DIR/train`` and ``DIR/test``: one sample per
image, ``{"index": position in the official split, "label": int, "image": PNG or JPEG bytes}``
(an image file's own bytes: training decodes it at its own size and crops or resizes it),
in index order, on every core, with LitData's progress bar. ``DIR/manifest.json`` says what
the shards hold: dataset, classes, image shape, mean/std, counts and a content digest per split;
``DIR/<split>_labels.npy`` their labels.

Rerunning an interrupted conversion continues it (LitData's checkpoints); a finished split is
kept. A folder that holds shards of other data is refused.
"""

import contextlib
import hashlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning_exact import DataError, Task, check_choice, check_keys
from lightning_exact.job.entry import main
from omegaconf import DictConfig, OmegaConf
from PIL import Image
from torch import Tensor

from src.task import TASK
from src.task.data.images import PixelSums, read_images
from src.task.data.shards import litdata
from src.task.data.survey import own_sizes, said

MANIFEST = "manifest.json"
SPLITS = ("train", "test")
SCAN_CHUNK = 4096  # images decoded at once to check, digest and count a split


class Encoder:
    """Sample ``i`` of one split as ``{"index", "label", "image"}`` (runs in LitData's workers,
    forked: what ``image_at`` reads from is shared, not copied). An image file is stored as it
    is (``image_at.original``): training decodes it at its own size and crops or resizes it."""

    def __init__(self, image_at: Callable, labels: np.ndarray, fmt: str, quality: int) -> None:
        self.image_at = image_at
        self.labels = labels
        self.fmt = fmt
        self.quality = quality

    def __call__(self, i: int) -> dict[str, Any]:
        if original := getattr(self.image_at, "original", None):
            return {"index": int(i), "label": int(self.labels[i]), "image": original(i)}
        pixels = self.image_at(i)
        image = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
        buffer = io.BytesIO()
        if self.fmt == "png":
            image.save(buffer, format="PNG", compress_level=6)
        else:
            image.save(buffer, format="JPEG", quality=self.quality)
        return {"index": int(i), "label": int(self.labels[i]), "image": buffer.getvalue()}


def scan(
    datamodule: Any, split: str, labels: Tensor, image_at: Callable, chunk: int = SCAN_CHUNK
) -> tuple[str, PixelSums]:
    """One pass over a split, a chunk of images at a time: each chunk checked as training checks
    the split, the split's content digest (the one the in-memory dataset logs) and its pixel
    sums (for mean/std, counted as each image is decoded). Files (``image_at.findings``) that
    do not decode are recorded there and left out of both, so the digest is that of the split
    without them (which the shards hold with ``data.skip_unreadable=true``; without, the job is
    refused after the scan)."""
    md5 = hashlib.md5()
    sums = PixelSums(datamodule.image_shape[0])
    findings = getattr(image_at, "findings", None)
    for start in range(0, len(labels), chunk):
        indices = range(start, min(start + chunk, len(labels)))
        images = read_images(image_at, indices, datamodule.image_shape, sums)
        if findings is not None and findings.errors:
            images = images[torch.tensor([i not in findings.errors for i in indices])]
            if not len(images):
                continue
        datamodule.check(split, images, labels[start : indices.stop])
        md5.update(images.numpy())
    if findings is not None and findings.errors:
        labels = labels[findings.readable()]
    md5.update(labels.numpy())
    return md5.hexdigest(), sums


def identity(datamodule: Any, digests: dict[str, str]) -> dict[str, Any]:
    """What the shards are of: two conversions with the same identity may share a folder."""
    return {"dataset": datamodule.name, "digests": digests}


def check_folder(out: Path, expected: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest already in ``out`` (None if empty); refuse shards of other data."""
    path = out / MANIFEST
    if path.is_file():
        manifest = json.loads(path.read_text())
        if manifest["identity"] != expected:
            theirs = manifest["identity"]
            raise DataError(
                f"{out} holds shards of other data ({theirs['dataset']}, digests "
                f"{theirs['digests']}: other files or data settings); choose another out= "
                "folder, or delete this one to convert again"
            )
        return manifest
    if out.exists() and any(out.iterdir()):
        raise DataError(f"{out} is not empty and has no {MANIFEST}; choose an empty out= folder")
    return None


def write_split(
    image_at: Callable, labels: Tensor, folder: Path, cfg: DictConfig, num_workers: int
) -> None:
    """One split as LitData shards in ``folder`` (continues an interrupted conversion)."""
    optimize = litdata().optimize
    with open(os.devnull, "w") as chatter, contextlib.redirect_stdout(chatter):  # (workers too)
        optimize(
            fn=Encoder(image_at, labels.numpy(), cfg.format, cfg.jpeg_quality),
            inputs=list(range(len(labels))),
            output_dir=str(folder),
            chunk_bytes=cfg.chunk_bytes,
            num_workers=max(1, min(num_workers, len(labels))),
            use_checkpoint=True,  # rerun = continue; implies keep_data_ordered: index order
            start_method="fork",
            reorder_files=False,
        )


def check_order(folder: Path) -> list[int]:
    """Shard position equals sample index: data=shards relies on it (checked at each chunk's
    ends, cheap). The shards' sample counts, in index order."""
    dataset = litdata().StreamingDataset(str(folder))
    chunks = json.loads((folder / "index.json").read_text())["chunks"]
    start = 0
    for chunk in chunks:
        for position in {start, start + chunk["chunk_size"] - 1}:
            if dataset[position]["index"] != position:
                raise DataError(f"{folder}: shards are not in index order; delete it and rerun")
        start += chunk["chunk_size"]
    return [chunk["chunk_size"] for chunk in chunks]


def said_and_kept(datamodule: Any, sources: dict[str, tuple[Tensor, Any]]) -> dict[str, Any]:
    """What the scan of a dataset of files found, said (sizes, skipped files, converted modes,
    unreadable files: refused, or left out of ``sources`` with ``data.skip_unreadable=true``).
    The findings per split; none for a dataset of pixels."""
    found = {
        name: image_at.findings
        for name, (_, image_at) in sources.items()
        if getattr(image_at, "findings", None) is not None
    }
    if not found:
        return found
    channels, *size = datamodule.image_shape
    skip = bool(datamodule.hparams.get("skip_unreadable"))
    for name, rows in said(found, size, channels, skip).items():
        labels, image_at = sources[name]
        if len(rows) < len(labels):
            sources[name] = (labels[torch.from_numpy(rows)], image_at.subset(rows))
    return found


def manifest_for(
    out: Path, datamodule: Any, sources: dict[str, tuple[Tensor, Any]], image_format: str
) -> dict[str, Any]:
    """The manifest of ``out``: the one there if it holds these data (a rerun continues), else a
    new one. Read a chunk at a time, as training reads the data (and checks it): a folder of
    millions of images converts in flat memory; each image is decoded twice (scan, then write)."""
    scanned = {name: scan(datamodule, name, *source) for name, source in sources.items()}
    found = said_and_kept(datamodule, sources)
    digests = {name: digest for name, (digest, _) in scanned.items()}
    if datamodule.mean is None:  # statistics of the training pixels, as read("train") sets them
        datamodule.mean, datamodule.std = scanned["train"][1].statistics()
    expected = identity(datamodule, digests)
    files = any(hasattr(image_at, "original") for _, image_at in sources.values())
    manifest = check_folder(out, expected) or {
        "format": "original files" if files else image_format,
        "identity": expected,
        "classes": list(datamodule.classes),
        "image_shape": list(datamodule.image_shape),
        "mean": list(datamodule.mean),
        "std": list(datamodule.std),
        "counts": {name: len(labels) for name, (labels, _) in sources.items()},
        "complete": [],
    }
    if found:  # the files' own sizes: training on the shards says where they are resized
        manifest["source_sizes"] = own_sizes(found)
        manifest["left_out"] = {name: len(f.errors) for name, f in found.items()}
    # data=shards' default: the source's carve-out (not what the shards hold: a rerun updates it)
    manifest["val_size"] = datamodule.hparams.val_size
    return manifest


def prepare(cfg: DictConfig, task: Task) -> Path:
    if not cfg.out:
        raise DataError("out=DIR is required: the folder the shards are written to")
    check_choice("format", cfg.format, ("png", "jpeg"))
    out = Path(cfg.out).expanduser().resolve()
    data_class = task.datamodule_class(cfg.data.name)
    check_keys("data", cfg.data, data_class)
    datamodule = data_class(**OmegaConf.to_container(cfg.data, resolve=True))
    datamodule.prepare_data()
    sources = {name: datamodule.sample_source(name) for name in SPLITS}
    manifest = manifest_for(out, datamodule, sources, cfg.format)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    workers = cfg.num_workers or os.cpu_count() or 1
    for name, (labels, image_at) in sources.items():
        if name in manifest["complete"]:
            print(f"{out / name}: already converted")
            continue
        # An interrupted split continues with the worker count it started with (LitData's
        # checkpoints are per worker).
        if name in manifest.setdefault("workers", {}):
            print(f"{out / name}: continuing the conversion that stopped")
        started = manifest["workers"].setdefault(name, workers)
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
        write_split(image_at, labels, out / name, cfg, started)
        np.save(out / f"{name}_labels.npy", labels.numpy())  # for figures, no decoding
        manifest.setdefault("chunks", {})[name] = check_order(out / name)  # data.partitions
        manifest["complete"].append(name)
        (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    counts = ", ".join(f"{n} {name}" for name, n in manifest["counts"].items())
    print(f"Shards of {counts} images are in {out}; train with data=shards data.root={out}")
    return out


if __name__ == "__main__":
    main("prepare", TASK, prepare)
