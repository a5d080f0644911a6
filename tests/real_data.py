"""Where the real Fashion-MNIST/MNIST files are, for the benchmark and the real-data tests.

One setting: the environment variable ``TEMPLATE_DATA_DIR`` (a folder in torchvision's raw
layout: ``FashionMNIST/raw/``, ``MNIST/raw/``); unset or empty, ``../shared/data`` beside the
project folder. What needs the files and does not find them there skips, naming the folder.
"""

import os
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
DATA_DIR_ENV = "TEMPLATE_DATA_DIR"
DEFAULT = PROJECT.parent / "shared" / "data"


def real_data_dir() -> Path:
    """``$TEMPLATE_DATA_DIR`` (``~`` expanded, relative to the current folder), else the default."""
    value = os.environ.get(DATA_DIR_ENV, "").strip()
    return Path(value).expanduser().absolute() if value else DEFAULT
