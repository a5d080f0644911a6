"""Bad input stops ``python -m src.train`` with one specific line before any work starts,
typed as a user types it (no ``hydra.run.dir``): no traceback, exit code 1, and nothing left
behind: no output folder, no MLflow store or run, no checkpoint, no folder a mistyped path names.
On the test task; the image task's own data refusals: tests/task/test_bad_data.py."""

import os
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from lightning_exact.testing import refusals
from lightning_exact.testing.forked_entry import ForkedEntry
from lightning_exact.testing.refusals import TYPED, typed_arguments, typed_path

from tests.conftest import HARNESS, N_TRAIN, run_entry, tiny_overrides

pytestmark = pytest.mark.slow


# Training run with the given overrides (after ``base``, by default the tiny job's), in a fork of
# ``forked`` if given: its stderr, once it is checked that nothing was started.
fails_before_any_work = partial(refusals.fails_before_any_work, HARNESS)


CORES = len(os.sched_getaffinity(0))
DEVICES_HELP = "is not valid: use devices=N for N processes per machine (N >= 1"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.no_such_key=1"],
            "model.no_such_key is not a config key; model has: batch_norm, dropout, hidden, lr,"
            " lr_decay",
        ),
        (
            ["+model.learning_rate=0.01"],
            "model.learning_rate is not a setting of model (Regressor); valid keys: "
            "model.hidden, model.lr, model.lr_decay",
        ),
        (["trainer.max_epoch=1"], "trainer.max_epoch is not a config key (did you mean "),
        (["+model.hiden=8"], "(did you mean model.hidden?); valid keys:"),
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
            "data=cifar10 is not an option of the 'data' group; options: noisy, synthetic",
        ),
        (["model=nope"], "model=nope is not an option of the 'model' group; options: mlp"),
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
        (["model.dropout=1.5"], "model settings refused: dropout probability has to be"),
        (
            ["strategy=ddp", "devices=3"],
            "data.batch_size=16 is the global batch size and must be divisible by the world "
            "size 3 (devices x num_nodes); use e.g. data.batch_size=15",
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
        "model.hidden=16",
        data_root=tiny_root,
        forked=forked,
    )
    assert (
        "last.ckpt does not fit this model: layer net.0.weight is (32, 8) in the checkpoint but "
        "(16, 8) in this model; the checkpoint was trained with model.hidden=32 (here 16)"
    ) in stderr
    # A resume is its checkpoint's job: another network is another job, named as such.
    stderr = fails_before_any_work(
        tmp_path,
        "ckpt_path=given/last.ckpt",
        "model.hidden=16",
        data_root=tiny_root,
        forked=forked,
    )
    assert "last.ckpt was trained with " in stderr
    assert "model.hidden=32 (here 16)" in stderr
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


@pytest.mark.parametrize("entry", ["eval", "predict"])
def test_an_unknown_split(entry: str, tiny_root: Path, tmp_path: Path) -> None:
    proc = run_entry(
        entry,
        "ckpt_path=x.ckpt",
        "split=validation",
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "split=validation is not valid; use split=test or split=val" in proc.stderr
    assert list(tmp_path.iterdir()) == [], "nothing is left behind"


# --- nothing created for a mistake: every path-valued setting, typed with a mistake in it


def refused_leaving_nothing(
    module: str, args: list[str], workdir: Path, forked: ForkedEntry | None, env: dict | None
) -> str:
    """Run ``src.<module> args`` in ``workdir`` (a fork, unless ``env`` is given); check it was
    refused in one line and that nothing was added beside or under the launch folder."""
    return refusals.refused_leaving_nothing(HARNESS, module, args, workdir, forked, env)


def base_overrides(module: str, overrides: list[str], data_root: Path) -> list[str]:
    """The tiny job's overrides (train; eval and predict take the data from the checkpoint),
    less those ``overrides`` set."""
    base = tiny_overrides(data_root) if module == "train" else []
    keys = {override.split("=")[0] for override in overrides}
    return [override for override in base if override.split("=")[0] not in keys]


# Each path-valued setting of the library, with a mistake (folders that do not exist) where
# {typed} stands: the job is refused by the work the path was given for, after anything that
# might create it (the image task's data paths: tests/task/test_bad_data.py).
PATH_SETTINGS = [
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
        "eval",
        ["ckpt_path=x.ckpt", "split=nope", "hydra.run.dir={typed}"],
        None,
        "split=nope is not valid",
        id="eval-hydra.run.dir",
    ),
    pytest.param(
        "predict",
        ["ckpt_path={ckpt}", "inputs=none", "hydra.run.dir={typed}"],
        None,
        "inputs=none: this task predicts its data splits only",
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
    ckpt = trained["run_dir"] / "checkpoints" / "last.ckpt"
    typed = typed_path(form, workdir)
    base = partial(base_overrides, module, data_root=tiny_root)
    args = typed_arguments(overrides, typed, ckpt, base)
    assert message in refused_leaving_nothing(module, args, workdir, forked, env)
