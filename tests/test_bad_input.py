"""Bad input stops ``python -m src.train`` with one specific line before any work starts,
typed as a user types it (no ``hydra.run.dir``): no traceback, exit code 1, and nothing left
behind: no output folder, no MLflow store or run, no checkpoint, no folder in ``data.root``."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import N_TRAIN, run_entry, tiny_overrides
from tests.forked_entry import ForkedEntry
from tests.image_data import make_image_folder, spoil

pytestmark = pytest.mark.slow


def fails_before_any_work(
    workdir: Path,
    *overrides: str,
    data_root: Path,
    env: dict[str, str] | None = None,
    base: list[str] | None = None,
    forked: ForkedEntry | None = None,
) -> str:
    """Run training with ``overrides`` (after ``base``, by default the tiny MNIST job's), in a
    fork of ``forked`` if given; return its stderr after checking nothing was started."""
    args = [*(tiny_overrides(data_root) if base is None else base), *overrides]
    if forked and env is None:
        proc = forked.run("train", *args, cwd=workdir)
    else:
        proc = run_entry("train", *args, cwd=workdir, check=False, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert not (workdir / "outputs").is_dir(), "a refused job leaves no output folder"
    assert not (workdir / "mlflow.db").exists(), "a refused job creates no MLflow store or run"
    written = [p for p in workdir.rglob("*") if p.suffix in (".ckpt", ".tmp")]
    assert not [p for p in written if "given" not in p.parts], f"checkpoints written: {written}"
    return " ".join(proc.stderr.split())  # unwrapped


CORES = len(os.sched_getaffinity(0))
DEVICES_HELP = "is not valid: use devices=N for N processes per machine (N >= 1"


# A proxy on a closed local port: every download fails at once, as on a machine offline.
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.no_such_key=1"],
            "model.no_such_key is not a config key; model has: channels_last, compile, lr, net,"
            " warmup, weight_decay",
        ),
        (
            ["+model.learning_rate=0.01"],
            "model.learning_rate is not a setting of model (ImageClassifier); valid keys: "
            "model.net, model.lr, model.weight_decay",
        ),
        (["trainer.max_epoch=1"], "trainer.max_epoch is not a config key (did you mean "),
        (["+model.net.chanels=[4,8]"], "(did you mean model.net.channels?); valid keys:"),
        (["+trainer.devices=2"], "trainer.devices is set from the top-level key devices"),
        (["trainer.devices=2"], "trainer.devices is set from the top-level key devices; remove"),
        (["mdoel.lr=0.1"], "mdoel.lr is not a config key (did you mean model.lr?); top-level"),
        (
            ["trainer.acumulate_grad_batches=2"],
            "trainer.acumulate_grad_batches is not a config key (did you mean "
            "trainer.accumulate_grad_batches?); trainer has: accumulate_grad_batches,",
        ),
        (
            ["data=cifar10"],
            "data=cifar10 is not an option of the 'data' group; options: fashion_mnist, "
            "image_folder, mnist",
        ),
        (["model=nope"], "model=nope is not an option of the 'model' group; options: convnet"),
        (["model.lr=["], "model.lr=[ is not a valid override"),
        (["devices=0"], f"devices=0 {DEVICES_HELP}"),
        (["devices=-2"], f"devices=-2 {DEVICES_HELP}"),
        (["devices=two"], f"devices=two {DEVICES_HELP}"),
        (["devices=[0,1]"], "devices=[0, 1] lists GPU indices but no GPU is used here"),
        (["num_nodes=0"], "num_nodes=0 is not valid: it is the number of machines"),
        (
            ["accelerator=cpu", "devices=1000"],
            f"devices=1000 would start 1000 processes on this machine's {CORES} CPU core(s); "
            f"use devices={CORES} (one process per core",
        ),
        (["devices=-1"], "devices=-1 means every GPU, and no GPU is used here"),
        (["seed=abc"], "seed=abc is not valid: it must be a whole number >= 0"),
        (["data.batch_size=0"], "data.batch_size=0 is not valid: it must be a whole number >= 1"),
        (["data.num_workers=-1"], "data.num_workers=-1 must be 0 or more"),
        (
            ["data.device_resident=true", "data.num_workers=2"],
            "data.device_resident=true slices batches on the device, in the main process; set "
            "data.num_workers=0",
        ),
        (
            ["callbacks.stop_check_every_n_steps=0"],
            "callbacks.stop_check_every_n_steps=0 is not valid: it must be a whole number >= 1",
        ),
        (["trainer.max_epochs=-1"], "trainer.max_epochs=-1 with trainer.max_steps=-1 trains"),
        (
            ["callbacks.checkpoint.every_n_train_steps=0"],
            "callbacks.checkpoint.every_n_train_steps=0 is not valid: it must be a whole number",
        ),
        (["trainer.precision=banana"], "trainer settings refused: Precision 'banana' is invalid"),
        (["model.lr=abc"], "model settings refused: model.lr=abc must be a number > 0"),
        (["model.net.dropout=1.5"], "model settings refused: dropout probability has to be"),
        (
            ["strategy=ddp", "devices=3"],
            "data.batch_size=32 is the global batch size and must be divisible by the world "
            "size 3 (devices x num_nodes); use e.g. data.batch_size=33",
        ),
        (
            [f"data.val_size={N_TRAIN}"],
            f"data.val_size={N_TRAIN} must be in (0, {N_TRAIN}) for {N_TRAIN} training samples",
        ),
        (["ckpt_path=missing.ckpt"], "ckpt_path=missing.ckpt: no such file"),
        (["logger.run_id=abc123"], "logger.run_id=abc123 is not a run of sqlite:///"),
        (["logger.offline=true"], "logger.offline=true is for an MLflow server"),
        (["+logger.tags.task=mine"], "logger.tags.task is a tag the template sets; use another"),
    ],
    ids=[
        "unknown-key",
        "unknown-key-appended",
        "near-miss-key",
        "near-miss-appended",
        "key-set-elsewhere",
        "key-set-elsewhere-typed",
        "near-miss-section",
        "near-miss-trainer-argument",
        "unknown-option",
        "unknown-model",
        "override-syntax",
        "devices-0",
        "devices-negative",
        "devices-word",
        "gpu-indices-on-cpu",
        "num-nodes-0",
        "more-processes-than-cores",
        "devices-all-gpus-on-cpu",
        "seed-word",
        "batch-size-0",
        "workers-negative",
        "resident-with-workers",
        "stop-check-every-0-steps",
        "endless-epochs",
        "checkpoint-every-0-steps",
        "precision-unknown",
        "lr-word",
        "dropout-above-1",
        "batch-vs-world",
        "val-size",
        "missing-ckpt",
        "unknown-run-id",
        "offline-sqlite",
        "tag-the-template-sets",
    ],
)
def test_bad_setting(
    overrides: list[str], message: str, tiny_root: Path, tmp_path: Path, forked: ForkedEntry
) -> None:
    if overrides in (["devices=[0,1]"], ["devices=-1"]) and torch.cuda.is_available():
        pytest.skip("GPU indices are valid on a machine with GPUs")
    stderr = fails_before_any_work(tmp_path, *overrides, data_root=tiny_root, forked=forked)
    assert message in stderr


def test_more_gpus_than_the_machine_has(
    tiny_root: Path, tmp_path: Path, forked: ForkedEntry
) -> None:
    gpus = torch.cuda.device_count()
    stderr = fails_before_any_work(
        tmp_path, "accelerator=gpu", f"devices={gpus + 1}", data_root=tiny_root, forked=forked
    )
    if gpus == 0:
        assert "accelerator=gpu but no GPU is visible here" in stderr
    else:
        assert f"devices={gpus + 1} but this machine has {gpus} GPU(s)" in stderr


def test_an_unreachable_tracking_server(tiny_root: Path, tmp_path: Path) -> None:
    """Nothing but the one line: no config line before it, no urllib3 'Retrying' warning."""
    proc = run_entry(
        "train",
        *tiny_overrides(tiny_root),
        "logger.tracking_uri=http://127.0.0.1:9",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 1
    (line,) = (proc.stdout + proc.stderr).strip().splitlines()
    assert line.startswith(
        "Error: MLflow server http://127.0.0.1:9 is not reachable ([Errno 111] Connection refused)"
    ), line
    assert line.endswith("or log locally with logger.tracking_uri=sqlite:///mlflow.db")
    assert list(tmp_path.iterdir()) == [], "nothing is left behind"


def test_a_file_that_is_not_a_checkpoint(
    tiny_root: Path, tmp_path: Path, forked: ForkedEntry
) -> None:
    (tmp_path / "given").mkdir()
    (tmp_path / "given" / "notes.ckpt").write_text("my notes")
    stderr = fails_before_any_work(
        tmp_path, "ckpt_path=given/notes.ckpt", data_root=tiny_root, forked=forked
    )
    assert "ckpt_path=given/notes.ckpt is not a readable checkpoint" in stderr


def test_a_checkpoint_of_another_network(
    trained: dict[str, Path], tiny_root: Path, tmp_path: Path, forked: ForkedEntry
) -> None:
    given = tmp_path / "given"
    given.mkdir()
    shutil.copy(trained["run_dir"] / "checkpoints" / "last.ckpt", given)
    # A new job from its weights: they must fit the network.
    stderr = fails_before_any_work(
        tmp_path,
        "weights_from=given/last.ckpt",
        "model.net.channels=[4,16]",
        data_root=tiny_root,
        forked=forked,
    )
    assert (
        "last.ckpt does not fit this model: layer net.features.0.weight is (8, 1, 3, 3) in the "
        "checkpoint but (4, 1, 3, 3) in this model; the checkpoint was trained with "
        "model.net.channels=[8, 16] (here [4, 16])"
    ) in stderr
    # A resume is its checkpoint's job: another network is another job, named as such.
    stderr = fails_before_any_work(
        tmp_path,
        "ckpt_path=given/last.ckpt",
        "model.net.channels=[4,16]",
        data_root=tiny_root,
        forked=forked,
    )
    assert "last.ckpt was trained with " in stderr
    assert "model.net.channels=[8, 16] (here [4, 16])" in stderr
    assert "weights_from=given/last.ckpt instead of ckpt_path" in stderr


def test_an_output_folder_that_cannot_be_created(
    tiny_root: Path, tmp_path: Path, forked: ForkedEntry
) -> None:
    (tmp_path / "outputs").write_text("a file where the output folders should go")
    stderr = fails_before_any_work(tmp_path, data_root=tiny_root, forked=forked)
    assert (
        f"output folder {tmp_path}/outputs/train/runs/" in stderr
        and f"cannot be created: {tmp_path}/outputs is a file" in stderr
    )
    assert "paths.log_dir=" in stderr


def test_a_truncated_dataset_file(tiny_root: Path, tmp_path: Path, forked: ForkedEntry) -> None:
    root = tmp_path / "data"
    shutil.copytree(tiny_root, root)
    images = next((root / "MNIST" / "raw").glob("train-images*"))
    images.write_bytes(images.read_bytes()[:-100])
    stderr = fails_before_any_work(tmp_path, data_root=root, forked=forked)
    assert f"{images}:" in stderr and "truncated" in stderr and "re-download" in stderr


@pytest.mark.parametrize("entry", ["eval", "predict"])
def test_an_unknown_split(entry: str, tiny_root: Path, tmp_path: Path) -> None:
    proc = run_entry(
        entry,
        f"data.root={tiny_root}",
        "ckpt_path=x.ckpt",
        "split=validation",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "split=validation is not valid; use split=test or split=val" in proc.stderr
    assert list(tmp_path.iterdir()) == [], "nothing is left behind"


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
    ],
    ids=["val-size-default", "batch-size-default"],
)
def test_a_small_image_folder(
    overrides: list[str], message: str, small_images: Path, tmp_path: Path, forked: ForkedEntry
) -> None:
    """README "Make it yours" step 1 as typed, on a folder smaller than the defaults expect:
    one line before the two ranks start (it was a traceback from each rank)."""
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


# --- nothing created for a mistake: every path-valued setting, typed with a mistake in it

TYPED = {"relative": "typo/a/b", "absolute": "{elsewhere}/typo/a/b"}  # neither exists yet


def typed_path(form: str, workdir: Path) -> str:
    """A path whose first two folders do not exist: relative to the launch folder, or absolute
    in a folder beside it."""
    elsewhere = workdir.parent / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    return TYPED[form].format(elsewhere=elsewhere)


def tree(folder: Path) -> set[Path]:
    """Everything under ``folder`` but the forked commands' own stdout and stderr files."""
    return {path for path in folder.rglob("*") if path.suffix not in (".stdout", ".stderr")}


def refused_leaving_nothing(
    module: str, args: list[str], workdir: Path, forked: ForkedEntry | None, env: dict | None
) -> str:
    """Run ``src.<module> args`` in ``workdir`` (a fork, unless ``env`` is given); check it was
    refused in one line and that nothing was added beside or under the launch folder."""
    before = tree(workdir.parent)
    if forked and env is None:
        proc = forked.run(module, *args, cwd=workdir)
    else:
        proc = run_entry(module, *args, cwd=workdir, check=False, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert sorted(tree(workdir.parent) - before) == [], "a refused job creates nothing"
    return " ".join(proc.stderr.split())


def base_overrides(module: str, overrides: list[str], data_root: Path) -> list[str]:
    """The tiny job's overrides (eval, predict, prepare: its data), less those ``overrides``
    set or make moot (another dataset has no ``data.download``)."""
    base = tiny_overrides(data_root) if module == "train" else [f"data.root={data_root}"]
    keys = {override.split("=")[0] for override in overrides}
    if keys & {"data", "data.root", "paths.data_dir"}:
        keys |= {"data.root", "data.download"}
    return [override for override in base if override.split("=")[0] not in keys]


# Each path-valued setting, with a mistake (folders that do not exist) where {typed} stands: the
# job is refused by the work the path was given for, after anything that might create it.
# OFFLINE: a download is tried, and fails.
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
        "train",
        ["paths.log_dir={typed}", "model.lr=abc"],
        None,
        "model.lr=abc must be",
        id="paths.log_dir",
    ),
    pytest.param(
        "train",
        ["hydra.run.dir={typed}", "model.lr=abc"],
        None,
        "model.lr=abc must be",
        id="hydra.run.dir",
    ),
    pytest.param(
        "train",
        ["paths.root_dir={typed}", "model.lr=abc"],
        None,
        "model.lr=abc must be",
        id="paths.root_dir",
    ),
    pytest.param(
        "train",
        ["logger.tracking_uri=sqlite:///{typed}/mlflow.db", "logger.experiment_name=''"],
        None,
        "Invalid experiment name",
        id="store-refused-after-creating-it",
    ),
    pytest.param(
        "train",
        ["logger.tracking_uri=sqlite:///{typed}/mlflow.db", "logger.run_id=abc"],
        None,
        "logger.run_id=abc is not a run of",
        id="store-unknown-run",
    ),
    pytest.param(
        "train",
        ["ckpt_path={typed}/last.ckpt"],
        None,
        "/last.ckpt: no such file",
        id="ckpt_path",
    ),
    pytest.param(
        "train",
        ["ckpt_path=auto", "hydra.run.dir={typed}", "model.lr=abc"],
        None,
        "model.lr=abc must be",
        id="ckpt_path-auto",
    ),
    pytest.param(
        "train",
        ["-m", "hydra.sweep.dir={typed}", "model.nokey=1,2"],
        None,
        "model.nokey is not a config key",
        id="hydra.sweep.dir",
    ),
    pytest.param(
        "prepare",
        ["out={typed}", "format=gif"],
        None,
        "format=gif is not valid",
        id="prepare-out",
    ),
    pytest.param(
        "eval",
        ["ckpt_path=x.ckpt", "split=nope", "hydra.run.dir={typed}"],
        None,
        "split=nope is not valid",
        id="eval-hydra.run.dir",
    ),
    pytest.param(
        "predict",
        ["ckpt_path={ckpt}", "images={typed}"],
        None,
        "typo/a/b: no such file or folder",
        id="predict-images",
    ),
    pytest.param(
        "predict",
        ["ckpt_path={ckpt}", "images=none", "hydra.run.dir={typed}"],
        None,
        "none: no such file or folder",
        id="predict-hydra.run.dir",
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
    ``typo2/a``. Here every path-valued setting, typed relative and absolute."""
    workdir = tmp_path / "launch"
    workdir.mkdir()
    typed = typed_path(form, workdir)
    ckpt = trained["run_dir"] / "checkpoints" / "last.ckpt"
    typed_overrides = [o.format(typed=typed, ckpt=ckpt) for o in overrides]
    flags = [o for o in typed_overrides if o.startswith("-")]  # -m: before every override
    overrides = [o for o in typed_overrides if o not in flags]
    args = [*flags, *base_overrides(module, overrides, tiny_root), *overrides]
    assert message in refused_leaving_nothing(module, args, workdir, forked, env)
