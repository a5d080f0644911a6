"""Bad input stops ``python -m src.train`` with one specific line before any work starts:
no MLflow run is created (so none is left RUNNING) and no checkpoint is written."""

import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import N_TRAIN, run_entry, tiny_overrides

pytestmark = pytest.mark.slow


def fails_before_any_work(workdir: Path, *overrides: str, data_root: Path) -> str:
    """Run training with ``overrides``; return its stderr after checking nothing was started."""
    proc = run_entry(
        "train",
        *tiny_overrides(data_root),
        *overrides,
        cwd=workdir,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    store = workdir / "mlflow.db"
    if store.exists():
        from mlflow import MlflowClient

        client = MlflowClient(f"sqlite:///{store}")
        assert client.search_runs([e.experiment_id for e in client.search_experiments()]) == []
    written = [p for p in workdir.rglob("*") if p.suffix in (".ckpt", ".tmp")]
    assert not [p for p in written if "given" not in p.parts], f"checkpoints written: {written}"
    return " ".join(proc.stderr.split())  # unwrapped


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.no_such_key=1"], "Could not override 'model.no_such_key'"),
        (["data=cifar10"], "Could not find 'data/cifar10'"),
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
    ],
    ids=["unknown-key", "unknown-option", "batch-vs-world", "val-size", "missing-ckpt"],
)
def test_bad_setting(overrides: list[str], message: str, tiny_root: Path, tmp_path: Path) -> None:
    assert message in fails_before_any_work(tmp_path, *overrides, data_root=tiny_root)


def test_more_gpus_than_the_machine_has(tiny_root: Path, tmp_path: Path) -> None:
    gpus = torch.cuda.device_count()
    stderr = fails_before_any_work(
        tmp_path, "accelerator=gpu", f"devices={gpus + 1}", data_root=tiny_root
    )
    if gpus == 0:
        assert "accelerator=gpu but no GPU is visible here" in stderr
    else:
        assert f"devices={gpus + 1} but this machine has {gpus} GPU(s)" in stderr


def test_a_file_that_is_not_a_checkpoint(tiny_root: Path, tmp_path: Path) -> None:
    (tmp_path / "given").mkdir()
    (tmp_path / "given" / "notes.ckpt").write_text("my notes")
    stderr = fails_before_any_work(tmp_path, "ckpt_path=given/notes.ckpt", data_root=tiny_root)
    assert "ckpt_path=given/notes.ckpt is not a readable checkpoint" in stderr


def test_a_checkpoint_of_another_network(
    trained: dict[str, Path], tiny_root: Path, tmp_path: Path
) -> None:
    given = tmp_path / "given"
    given.mkdir()
    shutil.copy(trained["run_dir"] / "checkpoints" / "last.ckpt", given)
    stderr = fails_before_any_work(
        tmp_path, "ckpt_path=given/last.ckpt", "model.net.channels=[4,16]", data_root=tiny_root
    )
    assert (
        "last.ckpt does not fit this model: layer net.features.0.weight is (8, 1, 3, 3) in the "
        "checkpoint but (4, 1, 3, 3) in this model; the checkpoint was trained with "
        "model.net.channels=[8, 16] (here [4, 16])"
    ) in stderr


def test_an_output_folder_that_cannot_be_created(tiny_root: Path, tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file, not a folder")
    stderr = fails_before_any_work(
        tmp_path, f"hydra.run.dir={tmp_path}/taken/run", data_root=tiny_root
    )
    assert (
        f"output folder {tmp_path}/taken/run cannot be created: {tmp_path}/taken is a file"
        in stderr
    )
    assert "paths.log_dir=" in stderr


def test_a_truncated_dataset_file(tiny_root: Path, tmp_path: Path) -> None:
    root = tmp_path / "data"
    shutil.copytree(tiny_root, root)
    images = next((root / "MNIST" / "raw").glob("train-images*"))
    images.write_bytes(images.read_bytes()[:-100])
    stderr = fails_before_any_work(tmp_path, data_root=root)
    assert f"{images}:" in stderr and "truncated" in stderr and "re-download" in stderr
