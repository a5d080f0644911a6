"""What sharding saves per rank: ``python -m benchmarks.sharding [--tiny]``.

Rows ``11.`` (also in ``python -m benchmarks.run``): the real entry point,
``python -m src.train strategy=ddp|fsdp devices=2``, trains the ConvNet widened to
``model.net.hidden=8192`` (25.8 M parameters, nearly all in one Linear layer) on generated
MNIST-sized data, with one extra callback (``callbacks.extra``) through which each rank reports,
after its last measured step:

* the bytes of the parameters, gradients and AdamW state it holds (its local shards under
  FSDP): what sharding divides by the number of ranks;
* its peak memory: on a GPU ``torch.cuda.max_memory_allocated``, on the CPU the process's peak
  resident set, which also holds Python, torch and the data (the same on both strategies), and
  the whole model as built before ``configure_model`` shards it;
* steady-state training steps per second.

The figure per strategy is the largest over its ranks. On GPUs it uses up to 2 of those
visible (a 1-GPU machine shows 1 rank, where FSDP shards nothing).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import lightning.pytorch as L
import torch
from torch.distributed.tensor import DTensor

from benchmarks.run import summary, synchronize

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
WARMUP = 2  # steps left out of the steps/s figure


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds for ``tensors``: a sharded (DTensor) one counts its local shard."""
    held = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in held)


class RankMemory(L.Callback):
    """Writes this rank's figures to ``{out}/rank{k}.json`` at the end of step
    ``warmup + steps - 1``: after the optimizer step, while the gradients are still held, and
    before the epoch-end checkpoint (which gathers the whole state on rank 0)."""

    def __init__(self, out: str, steps: int, warmup: int = WARMUP) -> None:
        self.out = Path(out)
        self.steps = steps
        self.warmup = warmup
        self.start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.warmup:
            synchronize(pl_module.device.type)
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx != self.warmup + self.steps - 1:
            return
        synchronize(pl_module.device.type)
        seconds = time.perf_counter() - self.start
        parameters = list(pl_module.parameters())
        gradients = [p.grad for p in parameters if p.grad is not None]
        optimizer_state = [
            value
            for state in trainer.optimizers[0].state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        ]
        if pl_module.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(pl_module.device)
        else:  # Linux reports the peak resident set in KiB
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        figures = {
            "state": local_bytes([*parameters, *gradients, *optimizer_state]),
            "peak": peak,
            "steps_per_s": self.steps / seconds,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(figures))


def probed_job(
    overrides: Sequence[str], probe: str, steps: int, warmup: int, devices: int, workdir: Path
) -> list[dict]:
    """One short ``python -m src.train`` job (``overrides``: data, strategy, devices, ...) with
    the callback ``probe`` (a class path, built with ``out`` and ``steps``) added through
    ``callbacks.extra``, which writes each rank's figures to ``{out}/rank{k}.json``: their list,
    rank by rank."""
    run_dir = Path(tempfile.mkdtemp(dir=workdir, prefix="job-"))
    extra = "+callbacks.extra.probe"
    command = [
        sys.executable,
        "-m",
        "src.train",
        *overrides,
        "logger=none",
        "callbacks.progress_bar=none",
        "trainer.max_epochs=1",
        f"trainer.limit_train_batches={warmup + steps}",
        "trainer.limit_val_batches=0",
        "trainer.limit_test_batches=1",
        "trainer.num_sanity_val_steps=0",
        f"{extra}._target_={probe}",
        f"{extra}.out={run_dir}",
        f"{extra}.steps={steps}",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, cwd=workdir, capture_output=True, text=True, env=env)
    reports = sorted(run_dir.glob("rank*.json"))
    if proc.returncode or len(reports) != devices:
        raise RuntimeError(f"job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(report.read_text()) for report in reports]


def job(
    strategy: str,
    devices: int,
    hidden: int,
    steps: int,
    data: list[str],
    workdir: Path,
    extra: Sequence[str] = (),
) -> list[dict]:
    """One ``python -m src.train`` job (``extra``: more overrides); its ranks' figures."""
    overrides = [*data, f"strategy={strategy}", f"devices={devices}", f"model.net.hidden={hidden}"]
    probe = "benchmarks.sharding.RankMemory"
    return probed_job([*overrides, *extra], probe, steps, WARMUP, devices, workdir)


def measure(workdir: Path, tiny: bool, repeats: int) -> dict[str, dict]:
    """Rows 11 for DDP and FSDP, each ``repeats`` jobs (generated data in ``workdir``)."""
    from tests.idx_data import make_dataset

    gpus = torch.cuda.device_count()
    devices = min(2, gpus) if gpus else 2
    device = "gpu" if gpus else "cpu"
    hidden, steps, batch = (1024, 3, 32) if tiny else (8192, 20, 128)
    root = workdir / "sharding-data"
    make_dataset(root, n_train=batch * (WARMUP + steps) * devices + 100, n_test=batch)
    data = [
        "data=mnist",
        f"data.root={root}",
        "data.download=false",
        "data.val_size=100",
        f"data.batch_size={batch}",
        f"accelerator={device}",
    ]
    rows: dict[str, dict] = {}
    state = {}
    for strategy in ("ddp", "fsdp"):
        runs = [job(strategy, devices, hidden, steps, data, workdir) for _ in range(repeats)]
        name = f"11. {device}, {strategy.upper()} on {devices} ranks, hidden={hidden}"
        state[strategy] = summary([max(r["state"] for r in ranks) / MIB for ranks in runs])
        rows[f"{name}: parameters + gradients + AdamW state per rank (MiB)"] = state[strategy]
        peak = "GPU max allocated" if gpus else "peak resident set"
        rows[f"{name}: peak memory per rank, {peak} (MiB)"] = summary(
            [max(r["peak"] for r in ranks) / MIB for ranks in runs]
        )
        rows[f"{name}: training steps/s"] = summary(
            [min(r["steps_per_s"] for r in ranks) for ranks in runs]
        )
    rows[f"11. {device}, FSDP / DDP state per rank on {devices} ranks (1/N: sharded)"] = {
        k: state["fsdp"][k] / state["ddp"][k] for k in ("median", "min", "max")
    }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a narrow network, 3 steps, 1 job")
    parser.add_argument("--repeats", type=int, default=3, help="jobs per strategy")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        rows = measure(Path(workdir), args.tiny, 1 if args.tiny else args.repeats)
    for name, row in rows.items():
        print(f"{name}: {row['median']:,.4g} ({row['min']:,.4g} - {row['max']:,.4g})")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
