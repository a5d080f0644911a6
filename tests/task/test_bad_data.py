"""The shipped datasets' refusals, end to end: ``python -m src.train`` without its MNIST files
stops with one line naming the folder and the missing files, before any work and leaving nothing
(tests/test_bad_input.py checks the rest of the bad input for any task)."""

from pathlib import Path

import pytest

from src.task.data.mnist import FILES
from tests.conftest import N_TEST, N_TRAIN
from tests.forked_entry import ForkedEntry
from tests.idx_data import make_dataset
from tests.test_bad_input import OFFLINE, fails_before_any_work

pytestmark = pytest.mark.slow


def test_missing_data_offline_with_download_on(tiny_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "nowhere"
    stderr = fails_before_any_work(tmp_path, "data.download=true", data_root=root, env=OFFLINE)
    assert f"MNIST-format data not found in {root}/MNIST/raw" in stderr
    assert "the download was tried" in stderr and "Download failed from" in stderr
    assert "data.download=true" not in stderr, "download is already on: no such advice"
    assert not root.exists(), "a refused data.root gets no folders"


def test_empty_data_root_with_download_off(
    tiny_root: Path, tmp_path: Path, forked: ForkedEntry
) -> None:
    root = tmp_path / "empty"
    root.mkdir()
    stderr = fails_before_any_work(tmp_path, "data.download=false", data_root=root, forked=forked)
    assert f"MNIST-format data not found in {root}/MNIST/raw" in stderr
    assert "or set data.download=true" in stderr
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("download", ["false", "true"])
def test_data_error_names_only_the_missing_file(download: str, tmp_path: Path) -> None:
    root = tmp_path / "partial"
    make_dataset(root, n_train=N_TRAIN, n_test=N_TEST)
    raw = root / "MNIST" / "raw"
    missing, *present = "t10k-labels-idx1-ubyte", *FILES[:3]
    (raw / f"{missing}.gz").unlink()
    env = OFFLINE if download == "true" else None
    stderr = fails_before_any_work(tmp_path, f"data.download={download}", data_root=root, env=env)
    assert f"MNIST-format data not found in {raw} (missing {missing}.gz;" in stderr
    assert not [name for name in present if name in stderr], f"present files named: {stderr}"
    assert sorted(p.name for p in raw.iterdir()) == sorted(f"{name}.gz" for name in present)
