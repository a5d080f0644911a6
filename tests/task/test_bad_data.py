"""The shipped datasets' refusals, end to end: ``python -m src.train`` without its MNIST files
stops with one line naming the folder and the missing files, a truncated file, an image folder
smaller than the defaults or with unreadable files, and every path of the image data mistyped:
each before any work and leaving nothing (lib/tests/test_bad_input.py checks the rest of the bad
input, on the library's test task)."""

import shutil
from functools import partial
from pathlib import Path

import pytest
from lightning_exact.testing import refusals
from lightning_exact.testing.forked_entry import ForkedEntry
from lightning_exact.testing.refusals import OFFLINE, TYPED, typed_arguments, typed_path

from src.task.data.mnist import FILES
from tests.conftest import HARNESS
from tests.idx_data import make_dataset
from tests.image_data import make_image_folder, spoil

N_TEST = HARNESS.n_test
N_TRAIN = HARNESS.n_train
tiny_overrides = HARNESS.tiny_overrides

pytestmark = pytest.mark.slow


# Training run with the given overrides (after ``base``, by default the tiny MNIST job's), in a
# fork of ``forked`` if given: its stderr, once it is checked that nothing was started.
fails_before_any_work = partial(refusals.fails_before_any_work, HARNESS)


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


def test_a_truncated_dataset_file(tiny_root: Path, tmp_path: Path, forked: ForkedEntry) -> None:
    root = tmp_path / "data"
    shutil.copytree(tiny_root, root)
    images = next((root / "MNIST" / "raw").glob("train-images*"))
    images.write_bytes(images.read_bytes()[:-100])
    stderr = fails_before_any_work(tmp_path, data_root=root, forked=forked)
    assert f"{images}:" in stderr and "truncated" in stderr and "re-download" in stderr


@pytest.fixture(scope="module")
def small_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """100 training images (20 in each of 5 classes): fewer than the default data.val_size and
    data.batch_size."""
    return make_image_folder(tmp_path_factory.mktemp("small_images"), n_train=20, n_test=5)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [],
            "data.val_size=1000 must be in (0, 100) for 100 training samples; use e.g. "
            "data.val_size=10 data.batch_size=64",
        ),
        (
            ["data.val_size=20"],
            "data.batch_size=128 is larger than the 80 training samples left after "
            "data.val_size=20; use e.g. data.batch_size=64",
        ),
        (  # a copy (68 MB: 125 x 32x32 RGB, 1.2 KB an image, 64 MB a job) fits, two do not
            ["data.memory_gb=0.1"],
            "125 images decoded at data.image_size=[32,32] need 0.135 GB of memory (2 ranks "
            "on this machine, a copy each), more than the 0.1 GB data.memory_gb=0.1 allows; "
            "stream them instead: python -m src.prepare data=image_folder data.root=",
        ),
    ],
    ids=["val-size-default", "batch-size-default", "memory"],
)
def test_a_small_image_folder(
    overrides: list[str], message: str, small_images: Path, tmp_path: Path, forked: ForkedEntry
) -> None:
    """README "Make it yours" step 1 as typed, on a folder smaller than the defaults expect (or
    a memory smaller than its two copies): one line before the two ranks start (it was a
    traceback from each rank)."""
    as_typed = ["data=image_folder", f"data.root={small_images}", "model=resnet"]
    as_typed += ["strategy=ddp", "devices=2", "callbacks.progress_bar=none"]
    stderr = fails_before_any_work(
        tmp_path, *overrides, data_root=small_images, base=as_typed, forked=forked
    )
    assert message in stderr


def test_unreadable_images_are_all_listed_before_the_ranks_start(
    tmp_path: Path, forked: ForkedEntry
) -> None:
    """Issue 60's trial as typed (a folder with 3 truncated JPEGs, DDP on 2 ranks): one line
    naming all three, before any rank, run or checkpoint; the output folder is kept only for
    the lists that line names (docs/troubleshooting.md)."""
    images = make_image_folder(tmp_path / "images", n_train=4, n_test=2, suffix=".jpg")
    bad = spoil(images)
    workdir = tmp_path / "work"
    workdir.mkdir()
    as_typed = ["data=image_folder", f"data.root={images}", "model=resnet", "strategy=ddp"]
    proc = forked.run("train", *as_typed, "devices=2", "data.val_size=5", cwd=workdir)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert errors[0].startswith("Error: 3 unreadable image files (train 2, test 1), listed in ")
    assert errors[0].endswith("or leave them out with data.skip_unreadable=true")
    listed = Path(errors[0].split("listed in ")[1].split(";")[0])
    assert [row.split("\t")[0] for row in listed.read_text().splitlines()] == list(map(str, bad))
    job = listed.parent
    left = {p.name for p in job.rglob("*") if p.is_file() and ".hydra" not in p.parts}
    assert left <= {"unreadable.txt", "skipped_or_converted.txt", "train.log"}, left
    assert not (workdir / "mlflow.db").exists(), "a refused job creates no MLflow store or run"
    assert not list(workdir.rglob("*.ckpt")) and "rank 1" not in proc.stderr


# --- nothing created for a mistake: every path-valued setting of the image data, typed with a
# mistake in it


def base_overrides(module: str, overrides: list[str], data_root: Path) -> list[str]:
    """The tiny job's overrides (eval, predict, prepare: its data), less those ``overrides``
    set or make moot (another dataset has no ``data.download``)."""
    base = tiny_overrides(data_root) if module == "train" else [f"data.root={data_root}"]
    keys = {override.split("=")[0] for override in overrides}
    if keys & {"data", "data.root", "paths.data_dir"}:
        keys |= {"data.root", "data.download"}
    return [override for override in base if override.split("=")[0] not in keys]


PATH_SETTINGS = [
    pytest.param(
        "train",
        ["data.download=true", "data.root={typed}"],
        OFFLINE,
        "MNIST-format data not found in",
        id="data.root-downloaded",
    ),
    pytest.param(
        "train",
        ["data.download=true", "paths.data_dir={typed}"],
        OFFLINE,
        "MNIST-format data not found in",
        id="paths.data_dir-downloaded",
    ),
    pytest.param(
        "prepare",
        ["data.root={typed}", "out=shards"],
        OFFLINE,
        "MNIST-format data not found in",
        id="prepare-data.root-downloaded",
    ),
    pytest.param(
        "train",
        ["data=image_folder", "data.root={typed}"],
        None,
        "/train is not a folder",
        id="data.root-image_folder",
    ),
    pytest.param(
        "train",
        ["data=shards", "data.root={typed}"],
        None,
        "/manifest.json not found",
        id="data.root-shards",
    ),
    pytest.param(
        "prepare",
        ["out={typed}", "format=gif"],
        None,
        "format=gif is not valid",
        id="prepare-out",
    ),
    pytest.param(
        "predict",
        ["ckpt_path={ckpt}", "images={typed}"],
        None,
        "typo/a/b: no such file or folder",
        id="predict-images",
    ),
]


@pytest.mark.parametrize("form", TYPED)
@pytest.mark.parametrize(("module", "overrides", "env", "message"), PATH_SETTINGS)
def test_a_mistyped_path_creates_nothing(
    module: str,
    overrides: list[str],
    env: dict[str, str] | None,
    message: str,
    form: str,
    tiny_root: Path,
    trained: dict[str, Path],
    tmp_path: Path,
    forked: ForkedEntry,
) -> None:
    """Reported: ``data.root=/nonexistent/data`` created ``/nonexistent`` (the download made the
    folders and removed only those it named on failure); ``data.root=typo2/a/b`` left
    ``typo2/a``. Here every path-valued setting of the image task's data, typed relative and
    absolute (the library's: lib/tests/test_bad_input.py)."""
    workdir = tmp_path / "launch"
    workdir.mkdir()
    ckpt = trained["run_dir"] / "checkpoints" / "last.ckpt"
    typed = typed_path(form, workdir)
    base = partial(base_overrides, module, data_root=tiny_root)
    args = typed_arguments(overrides, typed, ckpt, base)
    assert message in refusals.refused_leaving_nothing(HARNESS, module, args, workdir, forked, env)


@pytest.mark.slow
def test_missing_data_is_one_short_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    proc = HARNESS.run_entry(
        "train",
        f"data.root={empty}",
        "data.download=false",
        "logger=none",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"not found in {empty}/MNIST/raw" in proc.stderr.replace("\n", "")
    assert "data.root=" in proc.stderr and "train-images-idx3-ubyte.gz" in proc.stderr
    assert not empty.exists(), "nothing is written when nothing can be read"
