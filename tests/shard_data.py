"""Shard folders for the tests: written by the real ``src.prepare``, or just a manifest."""

import json
from pathlib import Path


def write_manifest(root: Path, classes: tuple[str, ...] = tuple("0123456789")) -> Path:
    """Only ``manifest.json``: enough to build ``data=shards`` (no sample is read)."""
    root.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": "png",
        "identity": {"dataset": "mnist", "digests": {"train": "", "test": ""}},
        "classes": list(classes),
        "image_shape": [1, 28, 28],
        "mean": [0.1307],
        "std": [0.3081],
        "counts": {"train": 0, "test": 0},
        "val_size": 5,
        "complete": ["train", "test"],
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root
