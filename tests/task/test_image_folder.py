"""``data=image_folder``: class folders of PNG/JPEG files decoded once into the data contract's
uint8 tensors, and one line naming the file or folder for anything unusable."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning_exact.data import DataError
from PIL import Image
from torch import Tensor

from src.task.data.image_folder import ImageFolderDataModule
from src.task.data.images import PixelSums, decode_image
from src.task.data.memory import GB, PER_IMAGE_BYTES, PER_JOB_BYTES, cgroup_room
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
    """Summed an image at a time as it is decoded (no float copy of the split), in threads
    whose sums are merged, yet the statistics of the whole split in float64, to the float32
    the normalisation uses."""
    images = torch.randint(0, 256, (500, 3, 7, 9), dtype=torch.uint8)
    sums = PixelSums(3)
    for part in (images[:123], images[123:]):  # two threads' sums
        partial = PixelSums(3)
        for image in part.numpy():
            partial.add(image)
        sums.merge(partial)
    mean, std = sums.statistics()
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


def decoded_one_by_one(root: Path, split: str, size: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """A split the simple way: each file of each class folder (sorted) decoded on its own and
    stacked, those that do not decode left out; its labels."""
    images, labels = [], []
    for label, name in enumerate(CLASSES):
        for path in sorted((root / split / name).iterdir()):
            try:
                images.append(decode_image(path, 3, size))
            except (OSError, ValueError, SyntaxError):
                continue
            labels.append(label)
    stacked = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)
    return stacked, torch.tensor(labels)


def test_the_decoded_splits_are_each_file_decoded_on_its_own(tmp_path: Path) -> None:
    """One preallocated tensor filled image by image in threads, the statistics summed in the
    same pass, validation carved in place: the same pixels, labels and statistics as decoding
    each file on its own and stacking them (other sizes, modes, unreadable files left out)."""
    make_image_folder(tmp_path, n_train=70, n_test=9, suffix=".jpg")  # 350: two thread ranges
    for k, path in enumerate(sorted((tmp_path / "train").rglob("*.jpg"))[::17]):
        Image.open(path).resize((20 + 9 * k, 60 - 2 * k)).save(path.with_suffix(".png"))
        path.unlink()
    spoil(tmp_path)  # truncated files, a .txt, a grayscale PNG
    dm = datamodule(tmp_path, val_size=40, skip_unreadable=True)
    dm.load()
    train, train_labels = decoded_one_by_one(tmp_path, "train", (32, 32))
    test, test_labels = decoded_one_by_one(tmp_path, "test", (32, 32))
    whole = torch.empty_like(train)
    whole[dm.train_set.indices] = dm.train_set.inputs
    whole[dm.val_set.indices] = dm.val_set.inputs
    assert len(dm.train_set) + len(dm.val_set) == len(train) == 70 * 5 - 2 + 1
    assert torch.equal(whole, train) and torch.equal(dm.test_set.inputs, test)
    assert torch.equal(dm.train_set.targets, train_labels[dm.train_set.indices])
    assert torch.equal(dm.test_set.targets, test_labels)
    pixels = train.transpose(0, 1).reshape(3, -1).double() / 255
    assert torch.allclose(torch.tensor(dm.mean, dtype=torch.float64), pixels.mean(1), 0, 1e-15)
    assert torch.allclose(torch.tensor(dm.std, dtype=torch.float64), pixels.std(1), 0, 1e-12)
    # Each split held once: validation is the rows after training's, in the tensor the files
    # were decoded into (and after them the 2 rows of the unreadable training files).
    storage = dm.train_set.inputs.untyped_storage()
    assert dm.val_set.inputs.untyped_storage().data_ptr() == storage.data_ptr()
    assert storage.nbytes() == train.numel() + 2 * train[0].numel()


def folder_bytes(images: int, shape: tuple[int, int, int]) -> int:
    """What loading ``images`` of ``shape`` takes, by the figures data=image_folder uses."""
    return images * (int(np.prod(shape)) + PER_IMAGE_BYTES) + PER_JOB_BYTES


def test_a_folder_too_large_for_the_memory_is_refused_before_it_is_decoded(
    tmp_path: Path,
) -> None:
    """With ``data.memory_gb`` as the machine's memory (what the check reads instead of the
    memory available): one line with the figure and both fixes, before any file is decoded (a
    truncated one would be refused after the pass). The smaller size it names fits; two ranks
    on this machine need a copy each."""
    make_image_folder(tmp_path, n_train=6, n_test=3, size=(64, 64), suffix=".jpg")
    spoil(tmp_path)
    one = folder_bytes(6 * 5 + 1 + 3 * 5, (3, 64, 64))  # spoil() adds a grayscale image
    limit = (one - PER_JOB_BYTES) / 2 + PER_JOB_BYTES  # the copy's pixels fit twice over
    dm = datamodule(tmp_path, image_size=[64, 64], val_size=2, memory_gb=limit / GB)
    with pytest.raises(DataError) as refused:
        dm.load()
    assert str(refused.value) == (
        f"46 images decoded at data.image_size=[64,64] need {one / GB:.3g} GB of memory, more "
        f"than the {limit / GB:.3g} GB data.memory_gb={limit / GB} allows; stream them "
        f"instead: python -m src.prepare data=image_folder data.root={tmp_path} out=DIR, then "
        "data=shards data.root=DIR, or decode them smaller: data.image_size=[41,41] fits"
    )
    assert folder_bytes(46, (3, 41, 41)) <= limit < folder_bytes(46, (3, 45, 45))
    settings = {"val_size": 2, "memory_gb": limit / GB, "skip_unreadable": True}
    smaller = datamodule(tmp_path, image_size=[41, 41], **settings)
    smaller.load()
    assert smaller.test_set.inputs.shape == (14, 3, 41, 41)
    twice = datamodule(tmp_path, image_size=[41, 41], **settings)
    twice.copies_to_read = 2  # what the job sets on the first of two ranks on one machine
    with pytest.raises(DataError, match=r"of memory \(2 ranks on this machine, a copy each\)"):
        twice.load()


def test_the_cgroup_limit_is_read_where_one_is_set() -> None:
    """This process's cgroup memory limits as the kernel exposes them: none, or the room left
    under them (never more than the machine's memory)."""
    room = cgroup_room()
    assert room is None or 0 <= room <= __import__("psutil").virtual_memory().total
