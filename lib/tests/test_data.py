"""Tests for lib/lightning_exact/data.py, on the machinery's own test task
(tests/machinery_task.py):
the validation carve-out, loaders and their workers, device-resident splits, batch sizes per
device, and the predict split."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from lightning_exact.data import DataError, drop_rows

from tests.conftest import PROJECT, process_group
from tests.machinery_task import synthetic_data


def test_setup_splits_are_deterministic_permutations() -> None:
    dm = synthetic_data()
    dm.setup("fit")
    dm.setup("fit")  # idempotent
    assert len(dm.val_set) == 10 and len(dm.train_set) == 40
    both = torch.cat([dm.val_set.indices, dm.train_set.indices])
    assert sorted(both.tolist()) == list(range(50))
    again = synthetic_data()
    again.setup("fit")
    assert torch.equal(again.val_set.indices, dm.val_set.indices)
    other = synthetic_data(split_seed=7)
    other.setup("fit")
    assert not torch.equal(other.val_set.indices, dm.val_set.indices)


def test_the_training_split_keeps_the_read_tensors_in_place() -> None:
    """The carve-out takes no second copy of the training inputs: what read() returned, its
    validation rows moved after the training rows, holds both splits (peak memory 1x the
    inputs and the validation rows, not 2x; afterwards 1x)."""
    dm = synthetic_data()
    read = dm.read
    returned = []
    dm.read = lambda split: returned.append(read(split)) or returned[-1]  # type: ignore[method-assign]
    original = read("train")[0]
    dm.setup("fit")
    inputs = returned[0][0]
    assert dm.train_set.inputs.untyped_storage().data_ptr() == inputs.untyped_storage().data_ptr()
    assert dm.val_set.inputs.untyped_storage().data_ptr() == inputs.untyped_storage().data_ptr()
    assert inputs.untyped_storage().nbytes() == original.untyped_storage().nbytes()
    assert torch.equal(dm.train_set.inputs, original[dm.train_set.indices])
    assert torch.equal(dm.val_set.inputs, original[dm.val_set.indices])
    rows = torch.arange(1000).view(100, 10)
    kept = torch.randperm(100, generator=torch.Generator().manual_seed(0))[:63].sort().values
    assert torch.equal(drop_rows(rows.clone(), kept, chunk_bytes=7 * 80), rows[kept])


def test_loader_workers_start_from_a_single_threaded_process() -> None:
    """A rank runs threads (gloo's, the watchdogs, system metrics); a worker forked from it
    while one of them held a lock hung before its first line (1 CI job in ~100). Workers come
    from a process with one thread, and give the batches the rank would read itself."""
    dm = synthetic_data(num_workers=2)
    dm.setup("fit")
    busy = threading.Event()
    thread = threading.Thread(target=busy.wait, daemon=True)  # this process: multi-threaded
    thread.start()
    loader = dm.train_dataloader()
    batches = iter(loader)
    first = next(batches)
    parents = {psutil.Process(w.pid).parent() for w in batches._workers}
    busy.set()
    assert os.getpid() not in {parent.pid for parent in parents}
    assert [parent.num_threads() for parent in parents] == [1]
    inline = synthetic_data()
    inline.setup("fit")
    expected = next(iter(inline.train_dataloader()))
    assert all(torch.equal(a, b) for a, b in zip(first, expected, strict=True))


KILLED_WITH_WORKERS = """
import os, signal
from tests.machinery_task import synthetic_data
dm = synthetic_data(num_workers=2)
dm.setup("fit")
batches = iter(dm.train_dataloader())
next(batches)  # from one of its two workers
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_loader_workers_end_with_a_killed_rank(tmp_path: Path) -> None:
    """Their forkserver and they kept each other alive after the rank died (their parent is the
    forkserver, which torch's check of a worker's parent watched), forever, holding memory."""
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    rank = subprocess.Popen(
        [sys.executable, "-c", KILLED_WITH_WORKERS],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert rank.wait(timeout=120) == -9, "the rank read a batch, then was killed"
        _, alive = psutil.wait_procs(process_group(rank.pid), timeout=30)
        assert not alive, f"outlived the rank: {[p.cmdline()[-1][:60] for p in alive]}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rank.pid, signal.SIGKILL)  # what the rank left, if the test fails


def test_device_resident_loaders_give_the_same_batches() -> None:
    """data.device_resident: each split is copied once (here to the CPU "device") and sliced
    there, with the same batches as the host path; the host copy stays for digests."""
    host, resident = synthetic_data(), synthetic_data(device_resident=True)
    for dm in (host, resident):
        dm.setup("fit")
    for loader in ("train_dataloader", "val_dataloader"):
        ours = list(getattr(resident, loader)())
        assert ours[0].inputs.device == resident._resident(resident.train_set).inputs.device
        for a, b in zip(list(getattr(host, loader)()), ours, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert resident.train_dataloader().dataset is resident.train_dataloader().dataset  # once
    assert resident.train_dataloader().dataset is not resident.train_set
    assert resident.describe_splits() == host.describe_splits()


def test_batch_size_must_divide_world_size() -> None:
    dm = synthetic_data(batch_size=10)
    dm.trainer = SimpleNamespace(world_size=3)
    with pytest.raises(DataError, match=r"data.batch_size=10 .* world size 3.*batch_size=9"):
        dm.setup("fit")
    dm.trainer = SimpleNamespace(world_size=2)
    dm.setup("fit")
    assert dm.per_device_batch_size == 5


def test_val_size_too_large() -> None:
    with pytest.raises(DataError, match="data.val_size=50.*50"):
        synthetic_data(val_size=50).setup("fit")


def test_predict_split_and_test_loader() -> None:
    dm = synthetic_data()
    dm.setup("test")
    assert sum(len(b.targets) for b in dm.test_dataloader()) == 17
    dm.predict_split = "val"
    dm.setup("predict")
    assert sum(len(b.targets) for b in dm.predict_dataloader()) == 10


def test_hparams_load_with_weights_only(tmp_path: Path) -> None:
    dm = synthetic_data()
    torch.save(dict(dm.hparams), tmp_path / "hp.pt")
    assert torch.load(tmp_path / "hp.pt", weights_only=True)["val_size"] == 10
