"""Tests for the shipped task's datasets (src/task/data/mnist.py, src/task/data/images.py): IDX
parsing, downloads from mirrors with MD5 checks, normalised image batches, and the real files."""

import dataclasses
import functools
import hashlib
import http.server
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning_exact.data import Batch, DataError, TensorSplit, keep_batch
from torch.utils.data import DataLoader

from src.task.data.images import Normalize
from src.task.data.mnist import DATASETS, FILES, MNISTDataModule, download, load_split, read_idx
from tests.conftest import PROJECT
from tests.idx_data import idx_bytes, make_dataset, write_idx
from tests.real_data import DATA_DIR_ENV, real_data_dir


def make_module(root: Path, **overrides: object) -> MNISTDataModule:
    kwargs: dict[str, object] = {
        "name": "mnist",
        "root": str(root),
        "download": False,
        "batch_size": 8,
        "val_size": 10,
    }
    return MNISTDataModule(**(kwargs | overrides))


SHARED_DATA = real_data_dir()  # $TEMPLATE_DATA_DIR, else None


def md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_root(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A local HTTP server over a temp folder: yields (folder, base URL)."""
    www = tmp_path / "www"
    www.mkdir()
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(www))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield www, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def serve_good_and_bad(www: Path) -> dict[str, str]:
    """www/good holds a valid tiny dataset, www/bad the same names with corrupted bytes."""
    make_dataset(www / "src", n_train=20, n_test=7)
    sums = {}
    for name in FILES:
        data = (www / "src" / "MNIST" / "raw" / f"{name}.gz").read_bytes()
        (www / "good").mkdir(exist_ok=True)
        (www / "bad").mkdir(exist_ok=True)
        (www / "good" / f"{name}.gz").write_bytes(data)
        (www / "bad" / f"{name}.gz").write_bytes(data[:-5] + b"xxxxx")
        sums[f"{name}.gz"] = hashlib.md5(data).hexdigest()
    return sums


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("suffix", [".gz", ""])
def test_read_idx_round_trip(tmp_path: Path, suffix: str) -> None:
    images = np.random.default_rng(1).integers(0, 256, (5, 28, 28), dtype=np.uint8)
    labels = np.arange(5, dtype=np.uint8)
    out_images = read_idx(write_idx(tmp_path / f"img{suffix}", images), 3)
    out_labels = read_idx(write_idx(tmp_path / f"lbl{suffix}", labels), 1)
    np.testing.assert_array_equal(out_images, images)
    np.testing.assert_array_equal(out_labels, labels)
    assert out_images.flags.writeable


def test_read_idx_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "short-images"
    path.write_bytes(idx_bytes(np.zeros((3, 28, 28), np.uint8))[:-10])
    with pytest.raises(DataError, match="short-images.*2352 bytes, found 2342"):
        read_idx(path, 3)


def test_read_idx_truncated_gzip(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "cut-images.gz", np.zeros((3, 28, 28), np.uint8))
    path.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(DataError, match="cut-images.gz"):
        read_idx(path, 3)


def test_read_idx_wrong_magic(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "labels", np.zeros(4, np.uint8))
    with pytest.raises(DataError, match=r"labels.*magic 0x00000801, expected 0x00000803"):
        read_idx(path, 3)


def test_load_split_count_mismatch(tmp_path: Path) -> None:
    make_dataset(tmp_path)
    write_idx(
        tmp_path / "MNIST" / "raw" / "train-labels-idx1-ubyte.gz",
        np.zeros(49, np.uint8),
    )
    with pytest.raises(DataError, match="train-images-idx3-ubyte.*train-labels-idx1-ubyte"):
        load_split(tmp_path, DATASETS["mnist"], train=True)


def test_load_split_label_out_of_range(tmp_path: Path) -> None:
    make_dataset(tmp_path)
    write_idx(
        tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte.gz",
        np.full(17, 10, np.uint8),
    )
    with pytest.raises(DataError, match="label 10"):
        load_split(tmp_path, DATASETS["mnist"], train=False)


def test_load_split_prefers_gz_and_accepts_extracted(tmp_path: Path) -> None:
    arrays = make_dataset(tmp_path, gz=False)
    images, labels = load_split(tmp_path, DATASETS["mnist"], train=False)
    assert images.dtype == torch.uint8 and images.shape == (17, 1, 28, 28)
    assert labels.dtype == torch.int64
    np.testing.assert_array_equal(labels.numpy(), arrays["t10k-labels-idx1-ubyte"])
    other = np.zeros(17, np.uint8)
    write_idx(tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte.gz", other)
    assert load_split(tmp_path, DATASETS["mnist"], train=False)[1].sum() == 0


def test_download_good(tmp_path: Path, http_root: tuple[Path, str]) -> None:
    www, url = http_root
    spec = dataclasses.replace(
        DATASETS["mnist"], mirrors=(url + "good/",), md5=serve_good_and_bad(www)
    )
    download(tmp_path / "data", spec)
    raw = tmp_path / "data" / "MNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(f"{n}.gz" for n in FILES)
    assert all(md5(raw / gz) == expected for gz, expected in spec.md5.items())
    images, labels = load_split(tmp_path / "data", spec, train=True)
    assert images.shape == (20, 1, 28, 28) and labels.shape == (20,)


def test_download_falls_back_to_next_mirror(tmp_path: Path, http_root: tuple[Path, str]) -> None:
    www, url = http_root
    sums = serve_good_and_bad(www)
    spec = dataclasses.replace(DATASETS["mnist"], mirrors=(url + "bad/", url + "good/"), md5=sums)
    download(tmp_path, spec)
    raw = tmp_path / "MNIST" / "raw"
    assert {p.name: md5(p) for p in raw.iterdir()} == sums


def test_download_only_fetches_missing(tmp_path: Path, http_root: tuple[Path, str]) -> None:
    www, url = http_root
    sums = serve_good_and_bad(www)
    make_dataset(tmp_path, n_train=20, n_test=7, gz=False)
    (tmp_path / "MNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    spec = dataclasses.replace(DATASETS["mnist"], mirrors=(url + "good/",), md5=sums)
    download(tmp_path, spec)
    gz = [p.name for p in (tmp_path / "MNIST" / "raw").glob("*.gz")]
    assert gz == ["t10k-labels-idx1-ubyte.gz"]


@pytest.mark.parametrize("mirrors", [("bad/",), ("bad/", "missing/")])
def test_download_all_mirrors_bad(
    tmp_path: Path, http_root: tuple[Path, str], mirrors: tuple[str, ...]
) -> None:
    www, url = http_root
    spec = dataclasses.replace(
        DATASETS["mnist"],
        mirrors=tuple(url + m for m in mirrors),
        md5=serve_good_and_bad(www),
    )
    with pytest.raises(DataError) as info:
        download(tmp_path, spec)
    message = str(info.value)
    raw = tmp_path / "MNIST" / "raw"
    for expected in (str(raw), "data.root", *FILES):
        assert expected in message
    assert "data.download=true" not in message, "download is on: the advice is elsewhere"
    assert not (tmp_path / "MNIST").exists(), "folders made for the download are removed"


def test_download_unreachable_mirror(tmp_path: Path) -> None:
    spec = dataclasses.replace(DATASETS["mnist"], mirrors=(f"http://127.0.0.1:{closed_port()}/",))
    with pytest.raises(DataError, match=r"(?s)data\.root.*internet.*last error"):
        download(tmp_path, spec)
    assert list(tmp_path.iterdir()) == []


def test_the_datasets_name_their_classes(tmp_path: Path) -> None:
    make_dataset(tmp_path)
    dm = make_module(tmp_path)
    dm.setup("fit")
    assert dm.num_classes == 10 and dm.classes[3] == "3"
    fashion = DATASETS["fashion_mnist"].classes
    assert len(fashion) == 10 and fashion[0] == "T-shirt/top"


def test_loader_batches_are_normalised(tmp_path: Path) -> None:
    arrays = make_dataset(tmp_path)
    raw_images = torch.from_numpy(arrays["train-images-idx3-ubyte"])
    raw_labels = torch.from_numpy(arrays["train-labels-idx1-ubyte"]).long()
    dm = make_module(tmp_path)
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    assert isinstance(batch, Batch)
    assert batch.inputs.dtype == torch.float32 and batch.inputs.shape == (8, 1, 28, 28)
    assert batch.targets.dtype == torch.int64 and batch.indices.dtype == torch.int64
    assert torch.equal(batch.targets, raw_labels[batch.indices])
    i = int(batch.indices[0])
    pixel = float(raw_images[i, 5, 7])
    expected = (pixel / 255 - 0.1307) / 0.3081
    assert batch.inputs[0, 0, 5, 7].item() == pytest.approx(expected, abs=1e-5)
    one = dm.val_set[0]
    assert one.inputs.shape == (1, 28, 28)
    assert torch.equal(one.inputs, batch.inputs[0]) and int(one.indices) == i
    sizes = [len(b.targets) for b in dm.train_dataloader()]
    assert sizes == [8] * 5


def test_image_batches_work_with_any_sampler() -> None:
    ds = TensorSplit(
        torch.zeros(6, 1, 28, 28, dtype=torch.uint8),
        torch.arange(6),
        transform=Normalize([0.0], [1.0]),
    )
    sampler = torch.utils.data.SequentialSampler(range(6))
    loader = DataLoader(ds, batch_size=4, sampler=sampler, collate_fn=keep_batch)
    assert [b.indices.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5]]


def test_missing_files_without_download(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        make_module(tmp_path).prepare_data()
    assert str(tmp_path / "MNIST" / "raw") in str(info.value) and "data.root" in str(info.value)


@pytest.mark.parametrize("download", [False, True])
def test_missing_files_message_names_only_the_missing_ones(tmp_path: Path, download: bool) -> None:
    make_dataset(tmp_path, n_train=20, n_test=7)
    raw = tmp_path / "MNIST" / "raw"
    for name in FILES[2:]:  # the test split's two files
        (raw / f"{name}.gz").unlink()
    dm = make_module(tmp_path, download=download)
    dm.spec = dataclasses.replace(dm.spec, mirrors=(f"http://127.0.0.1:{closed_port()}/",))
    with pytest.raises(DataError) as info:
        dm.prepare_data()  # without download, or with a download that fails
    message = str(info.value)
    assert f"missing {FILES[2]}.gz, {FILES[3]}.gz;" in message
    assert not any(name in message for name in FILES[:2]), "present files are not named"
    assert sorted(p.name for p in raw.iterdir()) == sorted(f"{n}.gz" for n in FILES[:2])


def test_unknown_dataset_name(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="fashion_mnist"):
        make_module(tmp_path, name="cifar")


def _require(folder: str, *names: str) -> None:
    if SHARED_DATA is None:
        pytest.skip(
            f"real data not available: set {DATA_DIR_ENV} to a folder that holds {folder}/raw/ "
            "(torchvision's raw layout)"
        )
    raw = SHARED_DATA / folder / "raw"
    absent = [n for n in names if not (raw / f"{n}.gz").exists() and not (raw / n).exists()]
    if absent:
        pytest.skip(
            f"real data not available: {raw} lacks {', '.join(absent)} "
            f"(set {DATA_DIR_ENV} to a folder that holds {folder}/raw/)"
        )


def real_data_skip(env: dict[str, str]) -> str:
    """Why test_real_fashion_mnist skips in a pytest run with ``env``: its -rs reason."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            f"{__file__}::test_real_fashion_mnist",
            "-rs",
            "-p",
            "no:cacheprovider",
        ],
        cwd=PROJECT,
        env={**env, "PYTHONPATH": str(PROJECT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout[-2000:]
    unwrapped = " ".join(proc.stdout.split())
    return unwrapped.partition("real data not available: ")[2].partition(" ===")[0]


def test_real_data_folder_is_taken_from_the_environment(tmp_path: Path) -> None:
    """The real-data tests look where TEMPLATE_DATA_DIR says, and skip naming that folder."""
    reason = real_data_skip({**os.environ, DATA_DIR_ENV: str(tmp_path)})
    assert reason.startswith(f"{tmp_path / 'FashionMNIST' / 'raw'} lacks")
    assert f"set {DATA_DIR_ENV} to a folder" in reason


def test_without_a_real_data_folder_the_skip_says_how_to_give_one() -> None:
    """No folder of some machine is guessed, or named: the reason is the variable to set."""
    env = {key: value for key, value in os.environ.items() if key != DATA_DIR_ENV}
    assert real_data_skip(env) == (
        f"set {DATA_DIR_ENV} to a folder that holds FashionMNIST/raw/ (torchvision's raw layout)"
    )


def test_real_fashion_mnist() -> None:
    _require("FashionMNIST", *FILES)
    spec = DATASETS["fashion_mnist"]
    images, labels = load_split(SHARED_DATA, spec, train=True)
    assert images.shape == (60000, 1, 28, 28) and images.dtype == torch.uint8
    assert np.bincount(labels.numpy(), minlength=10).tolist() == [6000] * 10
    images, labels = load_split(SHARED_DATA, spec, train=False)
    assert images.shape == (10000, 1, 28, 28) and int(labels.max()) == 9


def test_real_mnist_test_split() -> None:
    _require("MNIST", *FILES[2:])
    images, labels = load_split(SHARED_DATA, DATASETS["mnist"], train=False)
    assert images.shape == (10000, 1, 28, 28) and labels.shape == (10000,)
    assert labels.dtype == torch.int64 and int(labels.min()) >= 0 and int(labels.max()) == 9
