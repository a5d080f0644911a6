"""Distributed runs give the single-process answer: samplers, then real multi-process jobs.

The end-to-end tests start real processes (gloo on CPU) through the real entry points, in
subprocesses: a DDP launch inside pytest would re-launch pytest itself.
"""

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException as ConfigError
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning_exact.checkpoints.resume import GlobalBatchSampler
from lightning_exact.job.settings import JobSettings
from lightning_exact.testing import processes
from lightning_exact.training.distributed import (
    WatchedDDPStrategy,
    check_shardable,
    shard,
    sharded_units,
)
from lightning_exact.training.trainer import build_trainer
from mlflow import MlflowClient
from torch import nn
from torch.utils.data import TensorDataset

from tests.conftest import (
    BATCH_SIZE,
    DATA_NAME,
    N_TEST,
    N_TRAIN,
    PROJECT,
    VAL_SIZE,
    assert_rank_logs,
    assert_same_metrics,
    best_checkpoint,
    free_port,
    load_checkpoint,
    only_run,
    processes_with_env,
    read_metrics,
    run_entry,
    run_job,
    tiny_overrides,
    wait_for_file,
)
from tests.machinery_task import TASK
from tests.test_config import compose_config


def dataset(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


# --- samplers


def unpadded(n: int, world: int, rank: int) -> UnrepeatedDistributedSampler:
    return UnrepeatedDistributedSampler(dataset(n), world, rank, shuffle=False)


@pytest.mark.parametrize("n", [4, 5, 67, 131])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_eval_sampler_covers_every_sample_once(n: int, world: int) -> None:
    """Lightning's sampler, as the data module uses it (lib/lightning_exact/data.py)."""
    shares = [list(unpadded(n, world, rank)) for rank in range(world)]
    assert sorted(i for share in shares for i in share) == list(range(n))
    assert [len(s) for s in shares] == [len(unpadded(n, world, r)) for r in range(world)]
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize("world", [2, 4])
def test_global_batches_do_not_depend_on_world_size(world: int) -> None:
    data, batch = dataset(100), 8

    def global_batches(world: int, epoch: int) -> list[list[int]]:
        shares = []
        for rank in range(world):
            sampler = GlobalBatchSampler(data, world, rank, batch, seed=3)
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
        local = batch // world
        steps = len(shares[0]) // local
        return [
            sorted(i for share in shares for i in share[s * local : (s + 1) * local])
            for s in range(steps)
        ]

    single = global_batches(1, epoch=0)
    assert len(single) == 100 // 8, "the incomplete last global batch is dropped"
    assert [sorted(b) for b in global_batches(world, epoch=0)] == [sorted(b) for b in single]
    assert global_batches(1, epoch=1) != single, "each epoch reshuffles"
    assert len({i for b in single for i in b}) == 96, "no sample twice in an epoch"


@pytest.mark.parametrize("world", [1, 2])
def test_a_resumed_sampler_draws_what_its_epoch_had_left(world: int) -> None:
    data, batch, done = dataset(100), 8, 5
    for rank in range(world):
        uninterrupted = GlobalBatchSampler(data, world, rank, batch, seed=3)
        uninterrupted.set_epoch(2)
        resumed = GlobalBatchSampler(data, world, rank, batch, seed=3)
        resumed.resume_at(epoch=2, batches_done=done)  # no set_epoch: the loader may not call it
        local = batch // world
        assert list(resumed) == list(uninterrupted)[done * local :]
        assert len(resumed) == len(uninterrupted), "Lightning counts the epoch's full length"
        resumed.set_epoch(3)
        uninterrupted.set_epoch(3)
        assert list(resumed) == list(uninterrupted), "the next epoch is whole"


def test_global_batch_sampler_refuses_a_batch_larger_than_the_data() -> None:
    with pytest.raises(ValueError, match="larger than the 5 training samples"):
        GlobalBatchSampler(dataset(5), 1, 0, global_batch_size=8, seed=0)


# --- real multi-process jobs

# 3 does not divide 32: evaluation splits the data by samples, not by global batches.
EVAL_BATCH = "data.batch_size=32"
MONITOR = TASK.monitor


@pytest.mark.parametrize(
    ("overrides", "watched"),
    [
        (["strategy=ddp", "devices=2"], True),
        (["devices=2"], True),  # strategy=auto asked for several processes: the same DDP
        (["num_nodes=2"], True),
        (["devices=1"], False),
    ],
)
def test_several_processes_always_get_the_watched_ddp(
    overrides: list[str], watched: bool, tmp_path: Path
) -> None:
    cfg = compose_config("train", ["logger=none", "strategy.timeout_s=60", *overrides], tmp_path)
    strategy = build_trainer(cfg, JobSettings.from_config(cfg), [], [], fitting=False).strategy
    assert isinstance(strategy, WatchedDDPStrategy) == watched
    if watched:
        assert strategy._timeout.total_seconds() == 60


def evaluate(split: str, devices: int, ckpt: Path, data_root: Path, workdir: Path) -> dict:
    run_dir = workdir / f"eval-{split}-{devices}"
    run_entry(
        "eval",
        f"ckpt_path={ckpt}",
        f"data.val_size={VAL_SIZE}",
        EVAL_BATCH,
        f"split={split}",
        "strategy=ddp" if devices > 1 else "strategy=auto",
        f"devices={devices}",
        "logger=none",
        f"hydra.run.dir={run_dir}",
        cwd=workdir,
    )
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def single_process_eval(
    trained: dict, tiny_root: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict]:
    """The reference: val and test metrics of the trained checkpoint on one process."""
    workdir = tmp_path_factory.mktemp("eval1")
    ckpt = best_checkpoint(trained["run_dir"])
    return {split: evaluate(split, 1, ckpt, tiny_root, workdir) for split in ("val", "test")}


@pytest.mark.slow
# Each world size once and each split twice: the sampler is the same code for both splits.
@pytest.mark.parametrize(("split", "devices"), [("val", 3), ("test", 2), ("test", 4)])
def test_ddp_eval_equals_single_process(
    devices: int,
    split: str,
    single_process_eval: dict[str, dict],
    trained: dict,
    tiny_root: Path,
    tmp_path: Path,
) -> None:
    single = single_process_eval[split]
    multi = evaluate(split, devices, best_checkpoint(trained["run_dir"]), tiny_root, tmp_path)
    # 43 and 73 samples split unevenly: no rank's sample may be padded or dropped.
    assert (
        single[f"{split}/samples"]
        == multi[f"{split}/samples"]
        == {"val": VAL_SIZE, "test": N_TEST}[split]
    )
    assert multi.keys() == single.keys()
    for key, value in single.items():  # loss and mae: sums of the same rows, in another order
        assert multi[key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.slow
def test_ddp_predict_writes_every_sample_once_in_order(
    trained: dict, tiny_root: Path, tmp_path: Path
) -> None:
    rows = {}
    for devices in (1, 3):
        run_dir = tmp_path / f"predict{devices}"
        run_entry(
            "predict",
            f"ckpt_path={best_checkpoint(trained['run_dir'])}",
            EVAL_BATCH,
            "strategy=ddp",
            f"devices={devices}",
            f"hydra.run.dir={run_dir}",
            cwd=tmp_path,
        )
        with (run_dir / "predictions_test.csv").open() as file:
            rows[devices] = list(csv.DictReader(file))
        assert not list(run_dir.glob(".*.pt")), "per-rank shards are cleaned up"
    assert [int(r["index"]) for r in rows[3]] == list(range(N_TEST))
    assert [r["target"] for r in rows[3]] == [r["target"] for r in rows[1]]
    # each row's prediction alone (BatchNorm in evaluation): the same, up to float32 kernels
    predicted = {devices: [float(r["predicted"]) for r in rows[devices]] for devices in rows}
    assert predicted[3] == pytest.approx(predicted[1], rel=1e-6, abs=1e-6)


@pytest.mark.slow
def test_four_ranks_log_one_mlflow_run_and_use_their_share_of_cores(
    tiny_root: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    run_entry(
        "train",
        *tiny_overrides(tiny_root),
        "strategy=ddp",
        "devices=4",
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name(DATA_NAME).experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["world_size"] == "4"
    assert len(client.get_metric_history(run.info.run_id, MONITOR)) == 2, "once per epoch"
    assert read_metrics(run_dir)["val/samples"] == VAL_SIZE

    # Every rank logged its setup to its own file; all trained with the same hyperparameters,
    # 1/4 of the batch, and ended with the same monitored metric.
    logs = [run_dir / "train.log", *sorted(run_dir.glob("train_ddp_process_*.log"))]
    assert len(logs) == 4
    threads = max(1, len(os.sched_getaffinity(0)) // 4)
    final = read_metrics(run_dir)[MONITOR]
    digests = set()
    for rank, log in enumerate(logs):
        text = log.read_text()
        setup = (
            f"rank {rank}/4 (node 0, local {rank}) fit: backend gloo, {threads} CPU threads, "
            f"per-device batch {BATCH_SIZE // 4}, hyperparameters md5 "
        )
        assert setup in text
        digests.add(text.split(setup, 1)[1][:8])
        assert f"rank {rank}/4: {MONITOR} {final:.6f}" in text, "the same value on every rank"
    assert len(digests) == 1, "every rank trained the same hyperparameters"
    # Checkpoints come from rank 0 only: one best and one last.
    best, last = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert best.startswith("epoch00") and last == "last.ckpt"


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]


@pytest.mark.slow
def test_two_ranks_train_the_same_weights_as_one(tiny_root: Path, tmp_path: Path) -> None:
    # Same global batches in the same order (GlobalBatchSampler) and DDP's averaged gradient
    # equal to the global batch's, with data resident on the device and sharded (FSDP): a
    # network without BatchNorm and dropout, whose global-batch layers tests/test_exact.py
    # checks. It differs only by float summation order (rank means averaged vs. one mean),
    # hence the 1e-5 tolerance.
    overrides = [
        *tiny_overrides(tiny_root, logger="none"),
        "trainer.max_epochs=1",
        "model.batch_norm=false",
        "model.dropout=0",
    ]
    weights = {}
    # The third job slices its batches from data copied once to the device (data.device_resident);
    # the fourth shards weights, gradients and optimizer state (FSDP2) and its checkpoint.
    for name, devices, more in (
        (1, 1, ["strategy=ddp"]),
        (2, 2, ["strategy=ddp"]),
        ("2-resident", 2, ["strategy=ddp", "data.device_resident=true"]),
        ("2-fsdp", 2, ["strategy=fsdp"]),
    ):
        run_dir = tmp_path / f"run{name}"
        run_entry(
            "train",
            *overrides,
            *more,
            f"devices={devices}",
            f"hydra.run.dir={run_dir}",
            cwd=tmp_path,
        )
        weights[name] = final_weights(run_dir)
        trained = (N_TRAIN - VAL_SIZE) // BATCH_SIZE * BATCH_SIZE
        assert read_metrics(run_dir)["train/samples"] == trained
        sharded = "fit: backend gloo (FSDP: sharded), " in (run_dir / "train.log").read_text()
        assert sharded == (name == "2-fsdp"), "each rank's log says whether it shards"
    for name, value in weights[1].items():
        for other in (2, "2-resident", "2-fsdp"):
            torch.testing.assert_close(weights[other][name], value, atol=1e-5, rtol=1e-4, msg=name)


def launch_together(commands: list[list[str]], envs: list[dict[str, str]], cwd: Path) -> None:
    """Start processes the way a cluster launcher would, one per node or task, and wait."""
    processes.launch_together(commands, envs, cwd, project=PROJECT)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nodes", "per_node", "strategy"), [(1, 2, "ddp"), (2, 1, "ddp"), (2, 1, "fsdp")]
)
def test_torchrun_from_a_fresh_store_matches_two_devices(
    nodes: int,
    per_node: int,
    strategy: str,
    two_devices: dict[str, float],
    tiny_root: Path,
    tmp_path: Path,
) -> None:
    # All ranks start at once with the default MLflow store, which does not exist yet: only
    # rank 0 may create it (its schema creation raced with the other ranks' loggers before).
    # Sharded over 2 "nodes", FSDP trains what DDP on 2 devices trains.
    port, run_dir = free_port(), tmp_path / "run"
    train = ["-m", "src.train", *tiny_overrides(tiny_root), "trainer.max_epochs=1"]
    train += [f"strategy={strategy}", f"devices={per_node}", f"num_nodes={nodes}"]
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nodes}",
            f"--node-rank={node}",
            f"--nproc-per-node={per_node}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            *train,
            f"hydra.run.dir={run_dir}",
        ]
        for node in range(nodes)
    ]
    launch_together(commands, [{}] * nodes, cwd=tmp_path)
    assert_same_metrics(run_dir, two_devices)
    node, local = (1, 0) if nodes == 2 else (0, 1)
    assert_rank_logs(run_dir, node, local)
    _, run = only_run(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"


@pytest.mark.slow
def test_a_dead_rank_ends_the_torchrun_job_within_seconds(tiny_root: Path, tmp_path: Path) -> None:
    train = ["-m", "src.train", *tiny_overrides(tiny_root), "trainer.max_epochs=500"]
    train += ["strategy=ddp", "devices=2", "hydra.run.dir=run"]
    # --standalone: the rendezvous binds a port the OS chooses (tests may run in parallel).
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += train
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    torchrun = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for_file(tmp_path / "run/checkpoints/last.ckpt")
        children = {p.pid for p in psutil.Process(torchrun.pid).children(recursive=True)}
        (rank1,) = [p for p in processes_with_env(RANK="1") if p.pid in children]
        rank1.kill()
        start = time.monotonic()
        _, stderr = torchrun.communicate(timeout=60)
        seconds = time.monotonic() - start
    finally:
        if torchrun.poll() is None:
            os.killpg(torchrun.pid, signal.SIGKILL)
    assert seconds < 30, f"the job outlived its dead rank by {seconds:.0f} s"
    assert torchrun.returncode != 0
    assert "local_rank: 1" in stderr and "Signal 9 (SIGKILL)" in stderr, stderr[-3000:]
    _, run = only_run(tmp_path / "mlflow.db")
    assert run.info.status == "FAILED"


def test_fsdp_refuses_parameters_outside_the_sharded_blocks() -> None:
    """A module holding parameters outside every unit would fail at the first resume (Lightning
    loads a gathered checkpoint unit by unit): refused, naming it and the fix."""
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 10))
    with pytest.raises(ConfigError, match=r"1 \(BatchNorm2d\) hold parameters outside the"):
        shard(net, mesh=None, blocks=(nn.Conv2d, nn.Linear))
    check_shardable("ddp", net, (nn.Conv2d, nn.Linear))  # only strategy=fsdp shards


class TiedNet(nn.Module):
    """An embedding and an output layer sharing one weight, as most language models do."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 4)
        self.body = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.wte.weight


def test_fsdp_refuses_weights_tied_across_units_and_names_the_group_to_shard_together() -> None:
    """FSDP would fail in every rank ("Parameter 'lm_head.weight' is shared with a parameter
    already managed by another FSDP group"): refused before any rank, with torch's fix."""
    wrapper = nn.Module()
    wrapper.net = TiedNet()  # what the check sees: the LightningModule holding the network
    with pytest.raises(ConfigError) as refused:
        check_shardable("fsdp", wrapper, (nn.Embedding, nn.LayerNorm, nn.Linear))
    assert str(refused.value) == (
        "strategy=fsdp: net.lm_head and net.wte share a parameter (net.lm_head.weight: tied "
        "weights) but are sharded apart; shard them together: add ('lm_head', 'wte') to "
        "Task.sharded_blocks"
    )
    blocks = (nn.LayerNorm, nn.Linear, ("lm_head", "wte"))
    check_shardable("fsdp", wrapper, blocks)  # the network itself, as shard() is given it:
    units = sharded_units(wrapper.net, blocks)
    assert [[type(m).__name__ for m in unit] for unit in units] == [
        ["LayerNorm"],
        ["Linear"],
        ["Linear", "Embedding"],
    ], "innermost first; the group one unit"
    with pytest.raises(ConfigError, match=r"names \('lm_head', 'head'\), not all of them"):
        sharded_units(wrapper.net, (nn.LayerNorm, nn.Linear, ("lm_head", "head")))


# src.train with the task, but sharded_blocks that name no block: every parameter is loose.
WITHOUT_SHARDED_BLOCKS = """
import dataclasses, runpy, sys
import src.task
src.task.TASK = dataclasses.replace(src.task.TASK, sharded_blocks=())
sys.argv = ["src.train", *sys.argv[1:]]
runpy.run_module("src.train", run_name="__main__")
"""


def test_an_unshardable_model_is_refused_before_any_run_or_rank(
    tiny_root: Path, tmp_path: Path
) -> None:
    command = [sys.executable, "-c", WITHOUT_SHARDED_BLOCKS, *tiny_overrides(tiny_root)]
    command += ["strategy=fsdp", "devices=2", f"paths.root_dir={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    proc = run_job(command, cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    (error,) = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    # Every module of the task's model holding parameters, by its path (the image task's: net).
    named = re.fullmatch(r"Error: strategy=fsdp: ([\w.]+(?:, [\w.]+)*) \(([\w, ]+)\) (.*)", error)
    assert named, error
    assert named.group(3) == (
        "hold parameters outside the sharded blocks []; add its type to them "
        "(Task.sharded_blocks and the task's configure_model)"
    ), error
    assert "Initializing distributed" not in proc.stderr + proc.stdout, "no rank was started"
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "outputs").exists()
