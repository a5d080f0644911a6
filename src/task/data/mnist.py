"""MNIST / Fashion-MNIST: IDX reading, validated download, and their DataModule."""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import tempfile
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from lightning_exact import DataError, folder_kept_if_used
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from torch import Tensor

from src.task.data.augment import check_augment
from src.task.data.images import ImageDataModule

FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


@dataclass(frozen=True)
class DatasetSpec:
    folder: str  # torchvision raw layout: <root>/<folder>/raw/<file>
    mirrors: tuple[str, ...]  # base URLs tried in order, each ending with "/"
    md5: dict[str, str]  # .gz file name -> md5 of the published .gz
    classes: tuple[str, ...]
    mean: float  # normalisation constants on [0,1]-scaled pixels
    std: float


DATASETS: dict[str, DatasetSpec] = {
    "mnist": DatasetSpec(
        folder="MNIST",
        mirrors=(
            "https://ossci-datasets.s3.amazonaws.com/mnist/",
            "http://yann.lecun.com/exdb/mnist/",
        ),
        md5={
            "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
        },
        classes=tuple(str(i) for i in range(10)),
        mean=0.1307,
        std=0.3081,
    ),
    "fashion_mnist": DatasetSpec(
        folder="FashionMNIST",
        mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        md5={
            "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
        },
        classes=("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat")
        + ("Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"),
        mean=0.2860,
        std=0.3530,
    ),
}


# --- reading


def read_idx(path: Path, expected_ndim: int) -> np.ndarray:
    """Read an unsigned-byte IDX file (.gz or extracted), refusing anything malformed."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            data = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise DataError(
            f"{path}: corrupt or truncated gzip stream ({e}); delete it and re-download"
        ) from e
    expected_magic = 0x0800 | expected_ndim
    header = 4 + 4 * expected_ndim
    magic = int.from_bytes(data[:4], "big") if len(data) >= 4 else None
    if magic != expected_magic:
        found = "none (file shorter than 4 bytes)" if magic is None else f"0x{magic:08x}"
        raise DataError(
            f"{path}: not an IDX file with {expected_ndim} dims of unsigned bytes: "
            f"magic {found}, expected 0x{expected_magic:08x}"
        )
    if len(data) < header:
        raise DataError(f"{path}: truncated IDX header ({len(data)} bytes, need {header})")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=expected_ndim, offset=4))
    expected = int(np.prod(dims))
    actual = len(data) - header
    if actual != expected:
        raise DataError(
            f"{path}: payload for dims {dims} should be {expected} bytes, found {actual} "
            "(truncated or corrupt file; delete it and re-download)"
        )
    # Copy: frombuffer over bytes is read-only and torch.from_numpy would warn.
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims).copy()


def _find(raw: Path, name: str) -> Path | None:
    """The downloaded .gz wins over an extracted copy."""
    for candidate in (raw / f"{name}.gz", raw / name):
        if candidate.is_file():
            return candidate
    return None


def _missing(raw: Path) -> list[str]:
    return [name for name in FILES if _find(raw, name) is None]


def _offline_message(raw: Path, download: bool, detail: str = "") -> str:
    """Names only the files that are missing (all four when the folder is empty)."""
    missing = _missing(raw) or list(FILES)
    names = ", ".join(f"{n}.gz" for n in missing)
    way_out = (
        "or check this machine's internet access (the download was tried)"
        if download
        else "or set data.download=true to fetch them from the public mirrors"
    )
    return (
        f"MNIST-format data not found in {raw} (missing {names}; extracted files work too). "
        f"Fix: set data.root=... to a folder containing {raw.parent.name}/raw/ with all four "
        f"files, {way_out}." + (f" {detail}" if detail else "")
    )


def load_split(root: Path, spec: DatasetSpec, train: bool) -> tuple[Tensor, Tensor]:
    """Official train or test split as (uint8 [N, 1, 28, 28], int64 [N])."""
    raw = Path(root) / spec.folder / "raw"
    prefix = "train" if train else "t10k"
    image_file = _find(raw, f"{prefix}-images-idx3-ubyte")
    label_file = _find(raw, f"{prefix}-labels-idx1-ubyte")
    if image_file is None or label_file is None:
        raise DataError(_offline_message(raw, download=False))
    images = read_idx(image_file, 3)
    labels = read_idx(label_file, 1)
    if images.shape[1:] != (28, 28):
        raise DataError(f"{image_file}: images are {images.shape[1:]}, expected 28x28")
    if len(images) != len(labels):
        raise DataError(
            f"{image_file} has {len(images)} images but {label_file} has "
            f"{len(labels)} labels; one of them is from a different or broken download"
        )
    if len(labels) and labels.max() >= len(spec.classes):
        raise DataError(
            f"{label_file}: label {labels.max()} outside [0, {len(spec.classes)}) "
            f"for {spec.folder}; wrong dataset in this folder?"
        )
    return torch.from_numpy(images).unsqueeze(1), torch.from_numpy(labels).long()


# --- downloading


def _fetch(url: str, dest: Path, md5: str, progress: Progress) -> None:
    """Stream url to a temp file beside dest, check md5, then atomically rename."""
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f"{dest.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.md5()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=30) as response:
            total = response.headers.get("Content-Length")
            task = progress.add_task(dest.name, total=int(total) if total else None)
            while chunk := response.read(1 << 16):
                out.write(chunk)
                digest.update(chunk)
                progress.advance(task, len(chunk))
        if digest.hexdigest() != md5:
            raise ValueError(f"md5 {digest.hexdigest()} != expected {md5}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def download(root: Path, spec: DatasetSpec) -> None:
    """Fetch only the missing files, trying each mirror in order; never leaves partial files,
    nor folders it created (``data.root`` and all above it) when nothing could be fetched."""
    raw = Path(root) / spec.folder / "raw"
    missing = _missing(raw)
    if not missing:
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
    )
    with folder_kept_if_used(raw), Progress(*columns) as progress:
        for name in missing:
            _fetch_from_mirrors(f"{name}.gz", raw, spec, progress)


def _fetch_from_mirrors(gz: str, raw: Path, spec: DatasetSpec, progress: Progress) -> None:
    last_error = "no mirrors configured"
    for mirror in spec.mirrors:
        try:
            _fetch(mirror + gz, raw / gz, spec.md5[gz], progress)
            return
        except (OSError, ValueError, http.client.HTTPException) as e:
            last_error = f"{mirror + gz}: {type(e).__name__}: {e}"
    detail = f"Download failed from {', '.join(spec.mirrors)}; last error: {last_error}"
    raise DataError(_offline_message(raw, download=True, detail=detail))


# --- data module


class MNISTDataModule(ImageDataModule):
    """MNIST or Fashion-MNIST (``name``) from IDX files in torchvision's raw layout."""

    def __init__(
        self,
        name: str,
        root: str,
        download: bool,
        batch_size: int,
        val_size: int,
        num_workers: int = 0,
        split_seed: int = 12345,
        shuffle_seed: int = 0,
        pin_memory: bool = False,
        device_resident: bool = False,
        augment: dict | None = None,
        folds: int | None = None,
        fold: int = 0,
    ) -> None:
        if name not in DATASETS:
            raise DataError(f"data.name={name!r} is unknown; valid names: {', '.join(DATASETS)}")
        super().__init__()
        check_augment(augment)
        self.save_hyperparameters(logger=False)  # stored in checkpoints; tracking logs the config
        self.spec = DATASETS[name]
        self.root = Path(root).expanduser()
        self.image_shape = (1, 28, 28)
        self.classes = self.spec.classes
        self.mean = (self.spec.mean,)
        self.std = (self.spec.std,)
        self.source = str(self.raw_folder.resolve())

    @property
    def raw_folder(self) -> Path:
        return self.root / self.spec.folder / "raw"

    def prepare_data(self) -> None:
        raw = self.raw_folder
        if _missing(raw):
            if not self.hparams.download:
                raise DataError(_offline_message(raw, download=False))
            download(self.root, self.spec)

    def read(self, split: str) -> tuple[Tensor, Tensor]:
        return load_split(self.root, self.spec, train=split == "train")
