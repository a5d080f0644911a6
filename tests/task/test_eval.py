"""``python -m src.eval`` on the shipped task's checkpoints: one written before the image
model's newer keys, top-level and nested (lib/tests/test_eval.py checks eval for any task)."""

from pathlib import Path

import pytest
import torch
from lightning_exact.testing.records import best_checkpoint, read_metrics

from tests.conftest import HARNESS

run_entry = HARNESS.run_entry


@pytest.mark.slow
def test_eval_loads_a_checkpoint_written_before_newer_config_keys(
    trained: dict[str, Path], tiny_root: Path, tmp_path: Path
) -> None:
    saved = torch.load(best_checkpoint(trained["run_dir"]), weights_only=True)
    del saved["hyper_parameters"]["channels_last"]  # as if written before the key existed
    del saved["hyper_parameters"]["net"]["batch_norm"]  # default True: what it was trained with
    torch.save(saved, tmp_path / "old.ckpt")
    proc = run_entry(
        "eval",
        f"ckpt_path={tmp_path / 'old.ckpt'}",
        f"data.root={tiny_root}",
        "logger=none",
        f"hydra.run.dir={tmp_path / 'eval'}",
        cwd=tmp_path,
    )
    warning = "old.ckpt predates config keys channels_last=False, net.batch_norm=True"
    assert warning in " ".join(proc.stderr.split())
    metrics = read_metrics(tmp_path / "eval")
    assert metrics["test/acc"] == read_metrics(trained["run_dir"])["test/acc"]
