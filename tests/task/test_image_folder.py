"""``data=image_folder``: class folders of PNG/JPEG files decoded once into the data contract's
uint8 tensors, and one line naming the file or folder for anything unusable."""

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from src.task.data.image_folder import ImageFolderDataModule
from src.task.data.images import channel_statistics, pixel_counts
from src.template.data import DataError
from tests.image_data import CLASSES, make_image_folder


def datamodule(root: Path, **overrides) -> ImageFolderDataModule:
    settings = {"name": "image_folder", "root": str(root), "image_size": [32, 32]}
    settings |= {"channels": 3, "batch_size": 10, "val_size": 10}
    return ImageFolderDataModule(**(settings | overrides))


def test_rgb_folders_become_the_contracts_tensors(tmp_path: Path) -> None:
    make_image_folder(tmp_path, n_train=6, n_test=3)
    dm = datamodule(tmp_path)
    dm.prepare_data()
    dm.load()
    assert dm.classes == CLASSES and dm.image_shape == (3, 32, 32)
    assert len(dm.train_set) + len(dm.val_set) == 30 and len(dm.test_set) == 15
    assert dm.test_set.inputs.dtype == torch.uint8 and dm.test_set.inputs.shape == (15, 3, 32, 32)
    # (class, file name) order: index i of the test split is file i of that order.
    assert dm.test_set.targets.tolist() == [c for c in range(5) for _ in range(3)]
    first = torch.from_numpy(
        __import__("numpy").asarray(Image.open(tmp_path / "test/circle/0000.png"))
    )
    assert torch.equal(dm.test_set.inputs[0], first.permute(2, 0, 1))
    assert len(dm.mean) == len(dm.std) == 3 and dm.state_dict()["std"] == dm.std
    batch = dm.test_set.__getitems__([0, 1])
    assert batch.inputs.shape == (2, 3, 32, 32) and batch.inputs.dtype == torch.float32


def test_channel_statistics_are_those_of_every_pixel_at_once() -> None:
    """Counted a chunk at a time (no float copy of the split), yet the statistics of the whole
    split in float64, to the float32 the normalisation uses."""
    images = torch.randint(0, 256, (500, 3, 7, 9), dtype=torch.uint8)
    mean, std = channel_statistics(pixel_counts(images, chunk_bytes=1000))  # 6 images a chunk
    pixels = images.transpose(0, 1).reshape(3, -1).double() / 255
    assert torch.tensor(mean).float().tolist() == pixels.mean(dim=1).float().tolist()
    assert torch.tensor(std).float().tolist() == pixels.std(dim=1).float().tolist()


def test_grayscale_and_resizing(tmp_path: Path) -> None:
    make_image_folder(tmp_path, n_train=4, n_test=2, size=(40, 20), channels=3)
    dm = datamodule(tmp_path, channels=1, image_size=[16, 8], val_size=5)
    dm.load()
    assert dm.image_shape == (1, 16, 8) and dm.test_set.inputs.shape == (10, 1, 16, 8)


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda root: (root / "test").rename(root / "tests"), "test is not a folder"),
        (lambda root: shutil.rmtree(root / "test" / "dot"), "both need the same"),
        (
            lambda root: [p.unlink() for p in (root / "train" / "cross").iterdir()],
            "train/cross holds no images",
        ),
        (
            lambda root: (root / "train" / "dot" / "0001.png").write_bytes(b"not a png"),
            "train/dot/0001.png: not a readable image",
        ),
    ],
    ids=["no-test-folder", "other-classes", "empty-class", "unreadable-file"],
)
def test_unusable_folders_are_named(tmp_path: Path, break_it, message: str) -> None:
    make_image_folder(tmp_path, n_train=3, n_test=2)
    break_it(tmp_path)
    with pytest.raises(DataError, match=message):
        dm = datamodule(tmp_path, val_size=2)
        dm.prepare_data()
        dm.load()


def test_no_train_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"{tmp_path}/train is not a folder: data.root must hold"):
        datamodule(tmp_path)


def test_a_model_trained_on_other_classes_is_refused(tmp_path: Path) -> None:
    make_image_folder(tmp_path, n_train=2, n_test=1)
    dm = datamodule(tmp_path)
    trained = {**dm.state_dict(), "classes": ["apple", *CLASSES[1:]]}
    with pytest.raises(DataError, match=r"has classes \['circle', .* trained on \['apple'"):
        dm.load_state_dict(trained)
