"""``data=image_folder``: images in class folders, ``<root>/train/<class>/*.png`` and
``<root>/test/<class>/*.jpg``, decoded once into the same in-memory ``uint8`` tensor the IDX
datasets use, so batches are sliced as fast. A split costs its pixels: one tensor allocated at
its final size and filled image by image, its statistics counted in the same pass; a folder
whose pixels would not fit in memory is refused before it is decoded (:mod:`.memory`)."""

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from lightning_exact import DataError, drop_rows
from torch import Tensor

from src.task.data.augment import check_augment
from src.task.data.images import (
    MODES,
    ImageDataModule,
    PixelSums,
    decode_image,
    decode_source,
    read_images,
)
from src.task.data.memory import GB, PER_IMAGE_BYTES, PER_JOB_BYTES, memory_for_data
from src.task.data.survey import DECODE_ERRORS, Findings, said

EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}


def class_folders(split_dir: Path) -> list[Path]:
    """The class folders of one split, sorted by name (label = position)."""
    if not split_dir.is_dir():
        raise DataError(
            f"{split_dir} is not a folder: data.root must hold train/ and test/, each with one "
            "sub-folder of images per class"
        )
    folders = sorted(p for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not folders:
        raise DataError(f"{split_dir} has no class folders (one sub-folder of images per class)")
    return folders


def image_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """A class folder's image files (by extension) and what else it holds (skipped, named)."""
    with os.scandir(folder) as found:  # the file type from the listing: no stat per file
        entries = sorted((e for e in found if not e.name.startswith(".")), key=lambda e: e.name)
    images = {e.name for e in entries if e.is_file() and Path(e.name).suffix.lower() in EXTENSIONS}
    if not images:
        raise DataError(f"{folder} holds no images ({', '.join(sorted(EXTENSIONS))})")
    files = [folder / e.name for e in entries if e.name in images]
    return files, [folder / e.name for e in entries if e.name not in images]


def decode(path: Path, channels: int, size: Sequence[int] | None) -> np.ndarray:
    """:func:`decode_image`, a broken file named in one line."""
    try:
        return decode_image(path, channels, size)
    except DECODE_ERRORS as error:
        raise DataError(f"{path}: not a readable image ({error}); remove or replace it") from error


def listing(split_dir: Path, classes: Sequence[str]) -> tuple[list[str], Tensor, list[str]]:
    """The split's image files in (class, file name) order, their labels, and the other entries
    of its class folders (skipped). A sample's index is stable as long as the folder does not
    change."""
    files = []
    labels = []
    skipped = []
    for label, name in enumerate(classes):
        found, others = image_files(split_dir / name)
        files += [str(path) for path in found]
        labels += [label] * len(found)
        skipped += [str(path) for path in others]
    return files, torch.tensor(labels, dtype=torch.long), skipped


class FileImages:
    """Image ``i`` of a listing as ``uint8 [H, W, C]``, decoded on demand (picklable);
    ``original(i)``: its file's bytes, which src.prepare stores as they are (own size). With
    ``findings``, each file's own size and mode are recorded there and an unreadable file is
    too (None instead of its pixels), so that one pass finds them all."""

    def __init__(
        self,
        files: list[str],
        channels: int,
        size: tuple[int, int],
        findings: Findings | None = None,
    ) -> None:
        self.files = files
        self.channels = channels
        self.size = size
        self.findings = findings

    def __call__(self, i: int) -> np.ndarray | None:
        if self.findings is None:
            return decode(Path(self.files[i]), self.channels, self.size)
        try:
            pixels, height, width, mode = decode_source(self.files[i], self.channels, self.size)
        except DECODE_ERRORS as error:
            self.findings.failed(i, error)
            return None
        self.findings.saw(i, height, width, mode)
        return pixels

    def original(self, i: int) -> bytes:
        return Path(self.files[i]).read_bytes()

    def subset(self, rows: np.ndarray) -> "FileImages":
        """Only the files at ``rows`` (those left after the unreadable ones), renumbered."""
        return FileImages([self.files[i] for i in rows], self.channels, self.size)


def surveyed(
    split_dir: Path,
    classes: Sequence[str],
    channels: int,
    size: tuple[int, int],
    listed: tuple[list[str], Tensor, list[str]] | None = None,
) -> tuple[Tensor, FileImages]:
    """The split's labels and its images, each decoding recorded in ``image_at.findings``
    (``listed``: its :func:`listing`, where it was made already)."""
    files, labels, skipped = listed or listing(split_dir, classes)
    return labels, FileImages(files, channels, size, Findings(files, skipped))


class ImageFolderDataModule(ImageDataModule):
    """Classes are the sub-folders of ``train/`` (``test/`` must have the same ones); images
    are decoded as ``channels`` (1: grayscale, 3: RGB) at ``image_size`` (H, W)."""

    CONTENT_KEYS = (*ImageDataModule.CONTENT_KEYS, "image_size", "channels", "mean", "std")

    def __init__(
        self,
        name: str,
        root: str,
        image_size: Sequence[int],
        channels: int,
        batch_size: int,
        val_size: int,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        num_workers: int = 0,
        split_seed: int = 12345,
        shuffle_seed: int = 0,
        pin_memory: bool = False,
        device_resident: bool = False,
        augment: dict | None = None,
        folds: int | None = None,
        fold: int = 0,
        skip_unreadable: bool = False,
        memory_gb: float | None = None,
    ) -> None:
        if channels not in MODES:
            raise DataError(f"data.channels={channels} must be 1 (grayscale) or 3 (RGB)")
        size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        if len(size) != 2 or min(size) < 1:
            raise DataError(f"data.image_size={image_size} must be [height, width] or one side")
        super().__init__()
        check_augment(augment)
        self.save_hyperparameters(logger=False)  # stored in checkpoints; tracking logs the config
        self.root = Path(root).expanduser()
        self.image_shape = (channels, *size)
        self.source = str(self.root.resolve())
        self.classes = tuple(folder.name for folder in class_folders(self.root / "train"))
        self.mean = tuple(mean) if mean is not None else None
        self.std = tuple(std) if std is not None else None
        self._listed: dict[str, tuple[list[str], Tensor, list[str]]] = {}  # load(): for read()

    def prepare_data(self) -> None:
        test_classes = tuple(folder.name for folder in class_folders(self.root / "test"))
        if test_classes != self.classes:
            raise DataError(
                f"{self.root}/test has classes {list(test_classes)} but {self.root}/train has "
                f"{list(self.classes)}; both need the same class folders"
            )

    def load(self, stage: str | None = None) -> None:
        """The splits ``stage`` needs, each file decoded once; then what that pass found, said
        once for all of them: sizes, skipped files and converted modes, and every unreadable
        file (refused after the pass, or left out with ``data.skip_unreadable=true``)."""
        self._findings: dict[str, Findings] | None = {}
        try:
            self.check_memory(stage)
            super().load(stage)
        except DataError:
            if not any(found.errors for found in self._findings.values()):
                raise
            # Unreadable files first (another check stopped the load: the training split's size
            # counts them): the test split is decoded too, so the list holds every one.
            if stage in (None, "test") and "test" not in self._findings:
                self.load_test()
            self.say_findings()
            raise
        finally:
            self._listed = {}  # a split read later is listed again
        self.say_findings()

    def check_memory(self, stage: str | None) -> None:
        """Refuse, before decoding, splits whose pixels would not fit in memory: the images of
        the splits ``stage`` reads (listed here, for read()) times the copies this machine's
        ranks hold, plus what loading takes besides (measured, :mod:`.memory`), against what
        the machine has."""
        loaded = {"train": self.train_set, "test": self.test_set}
        to_read = [split for split in self.splits_for(stage) if loaded[split] is None]
        self._listed = {split: listing(self.root / split, self.classes) for split in to_read}
        counts = [len(files) for files, _, _ in self._listed.values()]
        if not counts:
            return
        copies = self.copies_to_read
        need = copies * self.bytes_to_load(counts, self.image_shape)
        have, source = memory_for_data(self.hparams.get("memory_gb"))
        if need <= have:
            return
        count = sum(counts)
        _, height, width = self.image_shape
        ranks = f" ({copies} ranks on this machine, a copy each)" if copies > 1 else ""
        line = (
            f"{count:,} images decoded at data.image_size=[{height},{width}] need "
            f"{need / GB:.3g} GB of memory{ranks}, more than the {have / GB:.3g} GB {source}; "
            f"stream them instead: python -m src.prepare data=image_folder data.root={self.root} "
            "out=DIR, then data=shards data.root=DIR"
        )
        smaller = self.fitting_size(counts, have // copies)
        if smaller:
            line += f", or decode them smaller: data.image_size=[{smaller[0]},{smaller[1]}] fits"
        raise DataError(line)

    def bytes_to_load(self, counts: Sequence[int], shape: Sequence[int]) -> int:
        """Peak memory one copy of splits of ``counts`` images of ``shape`` (C, H, W) takes
        to load: their pixels, what decoding needs besides, and, with loader workers, the
        largest split once more while its tensor moves to shared memory for them."""
        pixels = int(np.prod(shape))
        extra = max(counts) * pixels if self.hparams.num_workers else 0
        return sum(counts) * (pixels + PER_IMAGE_BYTES) + PER_JOB_BYTES + extra

    def fitting_size(self, counts: Sequence[int], room: int) -> tuple[int, int] | None:
        """A ``data.image_size`` of this aspect ratio whose images fit in ``room`` bytes, a
        tenth smaller at a time (None: none does)."""
        channels, height, width = self.image_shape
        scale = 1.0
        while scale > 0.01:
            scale *= 0.9
            size = (max(1, int(height * scale)), max(1, int(width * scale)))
            if self.bytes_to_load(counts, (channels, *size)) <= room:
                return size
        return None

    def say_findings(self) -> None:
        """What this load's pass found, said; refused here if files were unreadable."""
        found = self._findings
        self._findings = None  # from here a read() outside load() says its own
        if found:
            size = self.image_shape[1:]
            said(found, size, self.image_shape[0], self.hparams.skip_unreadable)

    def read(self, split: str) -> tuple[Tensor, Tensor]:
        channels, *size = self.image_shape
        listed = self._listed.pop(split, None)  # listed by load()'s memory check
        labels, image_at = surveyed(self.root / split, self.classes, channels, tuple(size), listed)
        statistics = split == "train" and self.mean is None
        sums = PixelSums(channels) if statistics else None
        images = read_images(image_at, range(len(labels)), self.image_shape, sums)
        findings = image_at.findings
        if getattr(self, "_findings", None) is None:  # read on its own: said (refused) here
            said({split: findings}, size, channels, self.hparams.skip_unreadable)
        else:  # in load(): said once for every split it reads
            self._findings[split] = findings
        if findings.errors and self.hparams.skip_unreadable:  # else load() refuses, after all
            kept = torch.from_numpy(findings.readable())
            images = drop_rows(images, kept)
            labels = labels[kept]
        if sums is not None and sums.pixels:
            # Per-channel statistics of the training pixels (set data.mean/std to fix them),
            # of the files that decoded.
            self.mean, self.std = sums.statistics()
        return images, labels

    def sample_source(self, split: str) -> tuple[Tensor, FileImages]:
        """The split's labels and its images one at a time, from the files: src.prepare
        converts a folder of millions of images in flat memory (and says what its scan found:
        ``image_at.findings``)."""
        channels, *size = self.image_shape
        return surveyed(self.root / split, self.classes, channels, tuple(size))
