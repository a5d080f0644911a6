"""Where the real Fashion-MNIST/MNIST files are, for the benchmark and the real-data tests.

One setting: the environment variable ``TEMPLATE_DATA_DIR`` (a folder in torchvision's raw
layout: ``FashionMNIST/raw/``, ``MNIST/raw/``). Unset or empty, there are none: what needs them
skips, saying to set the variable (no folder of some machine is guessed).
"""

import os
from pathlib import Path

DATA_DIR_ENV = "TEMPLATE_DATA_DIR"


def real_data_dir() -> Path | None:
    """``$TEMPLATE_DATA_DIR`` (``~`` expanded, relative to the current folder), else None."""
    value = os.environ.get(DATA_DIR_ENV, "").strip()
    return Path(value).expanduser().absolute() if value else None


def has_real(folder: str) -> bool:
    """Whether ``$TEMPLATE_DATA_DIR`` holds ``folder/raw/`` (e.g. ``FashionMNIST``)."""
    root = real_data_dir()
    return root is not None and (root / folder / "raw").is_dir()
