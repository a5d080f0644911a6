"""What exact training at any world size costs: ``python -m benchmarks.exact [--tiny]``.

Rows ``12.`` (also in ``python -m benchmarks.run``): the real entry point,
``python -m src.train strategy=ddp devices=2``, trains the default ConvNet (BatchNorm after each
conv, dropout 0.25) at a global batch of 128 on generated MNIST-sized data, with
``strategy.exact=true`` (the default: BatchNorm over the global batch, one all-gather forward and
one reduce-scatter backward per BatchNorm layer; dropout masks drawn for the global batch) and
with ``strategy.exact=false`` (per rank), the two alternating, back to back. One extra callback
(``callbacks.extra``: :class:`StepTimes`) times the steady-state steps on each rank: wall time,
and the main thread's CPU time, which other jobs on the machine do not lengthen (a rank waiting
for the other in a collective sleeps). A job's figure is its slowest rank's. On GPUs it uses up
to 2 of those visible (on 1 GPU there is one rank, where both settings train alike).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import lightning.pytorch as L
import torch

from benchmarks.run import summary, synchronize
from benchmarks.sharding import probed_job

WARMUP = 3  # steps left out


class StepTimes(L.Callback):
    """Writes this rank's ms per step (wall and main-thread CPU) over steps ``warmup`` to
    ``warmup + steps - 1`` to ``{out}/rank{k}.json``."""

    def __init__(self, out: str, steps: int, warmup: int = WARMUP) -> None:
        self.out = Path(out)
        self.steps = steps
        self.warmup = warmup
        self.start = (0.0, 0.0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.warmup:
            synchronize(pl_module.device.type)
            self.start = (time.perf_counter(), time.thread_time())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.warmup + self.steps - 1:
            synchronize(pl_module.device.type)
            wall = time.perf_counter() - self.start[0]
            cpu = time.thread_time() - self.start[1]
            figures = {"wall_ms": 1000 * wall / self.steps, "cpu_ms": 1000 * cpu / self.steps}
            (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(figures))


def job(exact: bool, devices: int, steps: int, data: list[str], workdir: Path) -> list[dict]:
    """One ``python -m src.train strategy=ddp`` job; its ranks' figures."""
    overrides = [*data, "strategy=ddp", f"devices={devices}", f"strategy.exact={exact}"]
    return probed_job(overrides, "benchmarks.exact.StepTimes", steps, WARMUP, devices, workdir)


def measure(workdir: Path, tiny: bool, repeats: int, steps: int = 40) -> dict[str, dict]:
    """Rows 12: ms per training step, exact and per rank, and the exactness cost, each setting
    ``repeats`` jobs of ``steps`` timed steps (generated data in ``workdir``)."""
    from tests.idx_data import make_dataset

    gpus = torch.cuda.device_count()
    devices = min(2, gpus) if gpus else 2
    device = "gpu" if gpus else "cpu"
    steps, batch = (3, 32) if tiny else (steps, 128)
    root = workdir / "exact-data"
    make_dataset(root, n_train=batch * (WARMUP + steps) + 100, n_test=batch)
    data = ["data=mnist", f"data.root={root}", "data.download=false", "data.val_size=100"]
    data += [f"data.batch_size={batch}", f"accelerator={device}"]
    times: dict[tuple[bool, str], list[float]] = {}
    for _ in range(repeats):
        for exact in (True, False):  # back to back: the machine's load alike for both
            ranks = job(exact, devices, steps, data, workdir)
            for kind in ("wall_ms", "cpu_ms"):
                times.setdefault((exact, kind), []).append(max(rank[kind] for rank in ranks))
    rows = {}
    for kind, what in (("wall_ms", "wall"), ("cpu_ms", "main-thread CPU")):
        name = f"12. {device}, {devices} ranks, ConvNet, global batch {batch}, ms per step ({what})"
        rows[f"{name}: strategy.exact=true"] = summary(times[True, kind])
        rows[f"{name}: strategy.exact=false (per rank)"] = summary(times[False, kind])
        pairs = zip(times[True, kind], times[False, kind], strict=True)
        cost = summary([100 * (exact / per_rank - 1) for exact, per_rank in pairs])
        rows[f"12. {device}, exactness cost on {devices} ranks, {what} (%)"] = cost
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="3 steps, batch 32, 1 job each")
    parser.add_argument("--repeats", type=int, default=3, help="jobs per setting")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per job")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        rows = measure(Path(workdir), args.tiny, 1 if args.tiny else args.repeats, args.steps)
    for name, row in rows.items():
        print(f"{name}: {row['median']:,.4g} ({row['min']:,.4g} - {row['max']:,.4g})")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
