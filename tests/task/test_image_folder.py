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
from tests.image_data import CLASSES, make_image_folder, spoil


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
            "1 unreadable image file .*data.skip_unreadable=true",
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


def listed(line: str, name: str) -> list[str]:
    """The lines of the list file a job's line names (``listed in PATH``)."""
    path = Path(line.split("listed in ")[1].split(";")[0].split(",")[0].strip())
    assert path.name == name, line
    return path.read_text().splitlines()


def test_every_unreadable_file_is_found_in_one_pass_then_refused(tmp_path: Path) -> None:
    make_image_folder(tmp_path, n_train=3, n_test=2, suffix=".jpg")
    bad = spoil(tmp_path)
    with pytest.raises(DataError) as refused:
        datamodule(tmp_path, val_size=2).load()
    line = str(refused.value)
    assert line.startswith("3 unreadable image files (train 2, test 1), listed in "), line
    assert line.endswith("remove or replace them, or leave them out with data.skip_unreadable=true")
    rows = listed(line, "unreadable.txt")
    assert [row.split("\t")[0] for row in rows] == [str(path) for path in bad]
    assert all("truncated" in row.lower() for row in rows), rows
    with pytest.raises(DataError, match="^2 unreadable image files, listed in "):
        datamodule(tmp_path, val_size=2).read("train")  # a split read on its own: refused too


def test_skip_unreadable_leaves_them_out_and_counts_them(tmp_path: Path, capsys) -> None:
    make_image_folder(tmp_path / "spoilt", n_train=3, n_test=2, suffix=".jpg")
    shutil.copytree(tmp_path / "spoilt", tmp_path / "clean")
    bad = spoil(tmp_path / "spoilt")
    for path in bad:  # the clean folder: the same images, without the unreadable ones
        (tmp_path / "clean" / path.relative_to(tmp_path / "spoilt")).unlink()
    spoilt = datamodule(tmp_path / "spoilt", val_size=2, skip_unreadable=True)
    spoilt.load()
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("Note: 3 unreadable image files (train 2, test 1) left out "), line
    assert "(data.skip_unreadable=true)" in line and line.endswith("remaining: 14 train, 9 test")
    assert len(listed(line, "unreadable.txt")) == 3
    gray = tmp_path / "spoilt" / "train" / "circle" / "gray.png"  # kept: it decodes
    shutil.copy(gray, tmp_path / "clean" / "train" / "circle")
    clean = datamodule(tmp_path / "clean", val_size=2)
    clean.load()
    for split in ("train_set", "val_set", "test_set"):
        assert getattr(spoilt, split).digest() == getattr(clean, split).digest(), split
    assert (spoilt.mean, spoilt.std) == (clean.mean, clean.std)


def test_skipped_files_and_converted_modes_are_counted_and_listed(tmp_path: Path, capsys) -> None:
    make_image_folder(tmp_path, n_train=3, n_test=2)
    (tmp_path / "train" / "dot" / "notes.txt").write_text("not an image")
    (tmp_path / "train" / "dot" / ".DS_Store").write_text("hidden: not looked at")
    gray, palette = (
        tmp_path / "test" / "cross" / "0000.png",
        tmp_path / "train" / "dot" / "0000.png",
    )
    Image.open(gray).convert("L").save(gray)
    Image.open(palette).convert("P").save(palette)
    datamodule(tmp_path, val_size=2).load()
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(
        "Note: 1 file skipped (not images: 1 .txt) and 2 images converted "
        "(1 L to RGB, 1 P to RGB); listed in "
    ), line
    assert sorted(listed(line, "skipped_or_converted.txt")) == sorted(
        [
            f"converted\t{palette}\tP to RGB",
            f"converted\t{gray}\tL to RGB",
            f"skipped\t{tmp_path}/train/dot/notes.txt\tnot an image file (.txt)",
        ]
    )


@pytest.mark.parametrize(
    ("sizes", "note"),
    [
        ([(32, 32)], None),
        (
            [(64, 64)],
            "Note: images are 64x64; training resizes them to 32x32 (data.image_size=[32,32]); "
            "to train at their own size: data.image_size=[64,64]",
        ),
        (
            [(64, 48), (20, 90)],
            "Note: images are 20x48 to 64x90 (heights 20-64, widths 48-90); training resizes "
            "them to 32x32 (data.image_size=[32,32]); to train at another size: "
            "data.image_size=[H,W]",
        ),
    ],
    ids=["same", "larger", "mixed"],
)
def test_the_files_own_size_is_said_where_training_resizes(
    tmp_path: Path, capsys, sizes: list, note: str | None
) -> None:
    make_image_folder(tmp_path, n_train=2, n_test=1, size=sizes[0])
    if len(sizes) > 1:
        make_image_folder(tmp_path, n_train=1, n_test=1, size=sizes[1], classes=CLASSES)
        path = tmp_path / "test" / "dot" / "0000.png"
        Image.open(path).resize(sizes[1][::-1]).save(path)
    datamodule(tmp_path, val_size=2, batch_size=4).load()
    assert capsys.readouterr().out.splitlines() == ([note] if note else [])
