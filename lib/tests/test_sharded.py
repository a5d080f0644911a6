"""Sharded checkpoint folders: written whole or not at all, read like one file, consolidated into
the file torch's own optimizer would write; and, end to end, a 2-rank FSDP job's folders resumed
on 1 rank, evaluated, consolidated, refused where they cannot be read."""

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from lightning_exact.checkpoints.checkpoint import CheckpointError, read_checkpoint, resume_path
from lightning_exact.training.sharded import (
    META_FILE,
    by_parameter_number,
    consolidate,
    is_sharded_checkpoint,
    read_sharded,
    replaced_folder,
    save_swapped,
    staging_folder,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from tests.conftest import (
    best_checkpoint,
    read_metrics,
    run_entry,
    signal_at_step,
    tiny_overrides,
)


def trained_pair() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small network and its AdamW after one step, with two parameter groups."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(
        [{"params": net[2].parameters(), "lr": 0.1}, {"params": net[0].parameters()}], lr=0.01
    )
    net(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return net, optimizer


def write_sharded(folder: Path, net: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The layout Lightning's ModelParallelStrategy writes (one process here: one shard)."""
    state = {
        "state_dict": net.state_dict(),
        "optimizer_0": get_optimizer_state_dict(net, optimizer),
    }
    with warnings.catch_warnings():  # that it saves in one process: as asked
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, checkpoint_id=folder, no_dist=True)
    torch.save({"global_step": 7, "epoch": 1}, folder / META_FILE)


def test_a_sharded_folder_reads_as_one_file_with_shapes_or_weights(tmp_path: Path) -> None:
    net, optimizer = trained_pair()
    folder = tmp_path / "last.ckpt"
    write_sharded(folder, net, optimizer)
    assert is_sharded_checkpoint(folder) and not is_sharded_checkpoint(tmp_path)
    shapes = read_checkpoint(str(folder), weights=False)
    assert shapes["global_step"] == 7 and len(shapes["optimizer_states"]) == 1
    assert {key: value.shape for key, value in shapes["state_dict"].items()} == {
        key: value.shape for key, value in net.state_dict().items()
    }
    assert all(value.device.type == "meta" for value in shapes["state_dict"].values())
    weights = read_sharded(folder)["state_dict"]
    for key, value in net.state_dict().items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=0)


def test_consolidated_optimizer_state_is_the_one_torch_writes(tmp_path: Path) -> None:
    net, optimizer = trained_pair()
    write_sharded(tmp_path / "last.ckpt", net, optimizer)
    consolidate(tmp_path / "last.ckpt", tmp_path / "one.ckpt")
    whole = torch.load(tmp_path / "one.ckpt", weights_only=True)
    assert whole["global_step"] == 7
    (saved,) = whole["optimizer_states"]
    own = optimizer.state_dict()
    assert saved["param_groups"] == own["param_groups"]
    assert saved["state"].keys() == own["state"].keys()
    for number, state in own["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(saved["state"][number][key], value, rtol=0, atol=0)
    by_name = get_optimizer_state_dict(net, optimizer)
    assert by_parameter_number(by_name)["param_groups"] == own["param_groups"]
    # It loads into a fresh optimizer of the same network, as a resume under DDP does.
    fresh = torch.optim.AdamW(
        [{"params": net[2].parameters(), "lr": 0.1}, {"params": net[0].parameters()}], lr=0.01
    )
    fresh.load_state_dict(saved)
    consolidate(tmp_path / "last.ckpt", tmp_path / "last.ckpt")  # in place: a file for it
    assert (tmp_path / "last.ckpt").is_file() and not list(tmp_path.glob(".*"))


def test_a_save_killed_midway_leaves_the_last_checkpoint_as_it_was(tmp_path: Path) -> None:
    net, optimizer = trained_pair()
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.parent.mkdir()
    write_sharded(last, net, optimizer)
    before = sorted(path.name for path in last.iterdir())

    def killed(staging: Path) -> None:
        staging.mkdir()
        (staging / "__0_0.distcp").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_swapped(last, killed, barrier=lambda: None)
    assert sorted(path.name for path in last.iterdir()) == before
    assert staging_folder(last).is_dir(), "the half-written folder is left aside"
    assert resume_path("auto", tmp_path) == str(last), "and never taken"

    save_swapped(last, lambda staging: write_sharded(staging, net, optimizer), lambda: None)
    assert is_sharded_checkpoint(last)
    assert sorted(path.name for path in last.parent.iterdir()) == ["last.ckpt"]


def test_auto_takes_the_checkpoint_moved_aside_by_a_swap_cut_short(tmp_path: Path) -> None:
    net, optimizer = trained_pair()
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.parent.mkdir()
    write_sharded(replaced_folder(last), net, optimizer)  # killed between the two renames
    assert resume_path("auto", tmp_path) == str(replaced_folder(last))


def test_a_folder_that_is_not_a_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"is a folder but not a sharded checkpoint \(no "):
        read_checkpoint(str(tmp_path))
    net, optimizer = trained_pair()
    write_sharded(tmp_path / "last.ckpt", net, optimizer)
    (tmp_path / "last.ckpt" / ".metadata").write_bytes(b"not torch's")
    with pytest.raises(CheckpointError, match="is not a readable sharded checkpoint") as error:
        read_checkpoint(str(tmp_path / "last.ckpt"))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("damage", ["missing", "cut short"])
def test_a_lost_or_cut_shard_is_refused_in_one_line_before_any_tensor_is_read(
    damage: str, tmp_path: Path
) -> None:
    net, optimizer = trained_pair()
    write_sharded(tmp_path / "last.ckpt", net, optimizer)
    (shard,) = (tmp_path / "last.ckpt").glob("*.distcp")
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError) as error:
        read_checkpoint(str(tmp_path / "last.ckpt"), weights=False)
    prefix = f"ckpt_path={tmp_path / 'last.ckpt'} is not a readable sharded checkpoint "
    assert str(error.value).startswith(f"{prefix}(its shard {shard.name} is {damage}")
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_fsdp_checkpoint_folders_resume_on_one_rank_evaluate_and_consolidate(
    tiny_root: Path, tmp_path: Path
) -> None:
    """Each of 2 ranks writes its shard; the folder resumes on 1 rank (resharded on load) to the
    weights of the 2-rank job trained on without a stop (elastic: in float64, with exact
    BatchNorm and dropout, equal to 1e-8 of each tensor's largest value), and eval of the folder
    or of its consolidated file gives the job's test metrics."""
    same = [
        *tiny_overrides(tiny_root),
        "trainer.precision=64-true",
        "strategy=fsdp",
        f"paths.root_dir={tmp_path}",
    ]
    whole = tmp_path / "whole"
    run_entry(
        "train", *same, "trainer.max_epochs=2", "devices=2", f"hydra.run.dir={whole}", cwd=tmp_path
    )
    last = whole / "checkpoints" / "last.ckpt"
    assert sorted(path.name for path in last.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        META_FILE,
    ]
    assert sorted(path.name for path in last.parent.iterdir()) == [
        best_checkpoint(whole).name,
        "last.ckpt",
    ]
    logged = list(
        tmp_path.glob(f"mlartifacts/*/artifacts/checkpoints/{best_checkpoint(whole).name}/*")
    )
    assert len(logged) == 4, "the best checkpoint's folder is the run's artifact"

    # Refused where it cannot be read, before any run or folder.
    proc = run_entry("train", *same, "strategy=ddp", f"ckpt_path={last}", cwd=tmp_path, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "Error: last.ckpt is a sharded checkpoint folder (written under strategy=fsdp); resume "
        f"it with strategy=fsdp, or make it one file first: python -m src.consolidate {last}"
    )
    # The one-file path's checks read the folder's meta.pt and shapes: another job's settings,
    # another network's weights.
    for more, error in (
        (f"ckpt_path={last}", "Error: last.ckpt was trained with model.hidden=32 (here 64); "),
        (f"weights_from={last}", "Error: last.ckpt does not fit this model: layer "),
    ):
        proc = run_entry("train", *same, "model.hidden=64", more, cwd=tmp_path, check=False)
        assert proc.returncode == 1
        assert proc.stderr.strip().splitlines()[-1].startswith(error), proc.stderr[-2000:]
    assert not (tmp_path / "outputs").exists()

    # The same job stopped mid-epoch 2 (ranks agree every 3rd step: asked in 26, after 28)...
    stopped = tmp_path / "stopped"
    proc = run_entry(
        "train",
        *same,
        "trainer.max_epochs=2",
        "devices=2",
        "callbacks.stop_check_every_n_steps=3",
        f"hydra.run.dir={stopped}",
        cwd=tmp_path,
        check=False,
        env=signal_at_step("26:SIGTERM"),
    )
    assert proc.returncode == 143, proc.stderr[-3000:]
    # ... resumes on one rank to the weights of the job that was not stopped.
    resumed = tmp_path / "resumed"
    run_entry(
        "train",
        *same,
        "trainer.max_epochs=2",
        "devices=1",
        "strategy.sharded_checkpoints=false",  # rank 0 gathers one file
        f"ckpt_path={stopped / 'checkpoints' / 'last.ckpt'}",
        f"hydra.run.dir={resumed}",
        cwd=tmp_path,
    )
    assert (resumed / "checkpoints" / "last.ckpt").is_file()
    expected = read_checkpoint(str(last))
    got = read_checkpoint(str(resumed / "checkpoints" / "last.ckpt"))
    assert got["global_step"] == expected["global_step"]
    for name, value in expected["state_dict"].items():
        equal = 1e-8 * value.double().abs().max().clamp_min(1e-3).item()  # of its largest value
        torch.testing.assert_close(got["state_dict"][name], value, atol=equal, rtol=0, msg=name)
    tested = {k: v for k, v in read_metrics(whole).items() if k.startswith("test/")}
    assert {k: read_metrics(resumed)[k] for k in tested} == pytest.approx(tested, rel=1e-6)

    best = best_checkpoint(whole)
    proc = run_entry("consolidate", str(best), "--output", str(tmp_path / "b.ckpt"), cwd=tmp_path)
    assert proc.stdout.startswith(f"wrote {tmp_path / 'b.ckpt'}: ")
    tested = read_metrics(whole)["test/loss"]
    for ckpt in (best, tmp_path / "b.ckpt"):
        run_dir = tmp_path / f"eval-{ckpt.name}"
        run_entry(
            "eval",
            f"ckpt_path={ckpt}",
            f"paths.root_dir={tmp_path}",
            f"hydra.run.dir={run_dir}",
            cwd=tmp_path,
        )
        assert read_metrics(run_dir)["test/loss"] == pytest.approx(tested, rel=1e-5), ckpt.name
