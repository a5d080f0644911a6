"""What exact training at any world size costs: ``python -m benchmarks.exact [--tiny]``.

Rows ``12.`` (also in ``python -m benchmarks.run``): the real entry point,
``python -m src.train strategy=ddp devices=2``, trains the default ConvNet (BatchNorm after each
conv, dropout 0.25) at a global batch of 128 on generated MNIST-sized data, with
``strategy.exact=true`` (the default: BatchNorm over the global batch, one all-gather forward and
one reduce-scatter backward per BatchNorm layer; dropout masks drawn for the global batch) and
with ``strategy.exact=false`` (per rank), the two alternating, back to back. One extra callback
(``callbacks.extra``: :class:`benchmarks.sharding.RankMemory`) times the steady-state steps on
each rank; a job's figure is its slowest rank's. On GPUs it uses up to 2 of those visible (on 1
GPU there is one rank, where both settings train alike).
"""

import argparse
import json
import tempfile
from pathlib import Path

import torch

from benchmarks.run import summary
from benchmarks.sharding import WARMUP, job

HIDDEN = 128  # the shipped ConvNet's


def measure(workdir: Path, tiny: bool, repeats: int) -> dict[str, dict]:
    """Rows 12: ms per training step exact and per rank, and the exactness cost, each setting
    ``repeats`` jobs (generated data in ``workdir``)."""
    from tests.idx_data import make_dataset

    gpus = torch.cuda.device_count()
    devices = min(2, gpus) if gpus else 2
    device = "gpu" if gpus else "cpu"
    steps, batch = (3, 32) if tiny else (30, 128)
    root = workdir / "exact-data"
    make_dataset(root, n_train=batch * (WARMUP + steps) + 100, n_test=batch)
    data = [
        "data=mnist",
        f"data.root={root}",
        "data.download=false",
        "data.val_size=100",
        f"data.batch_size={batch}",
        f"accelerator={device}",
    ]
    ms: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for exact in (True, False):  # back to back: the machine's load alike for both
            ranks = job("ddp", devices, HIDDEN, steps, data, workdir, [f"strategy.exact={exact}"])
            ms[exact].append(1000 / min(rank["steps_per_s"] for rank in ranks))
    name = f"12. {device}, {devices} ranks, ConvNet, global batch {batch}"
    rows = {
        f"{name}, strategy.exact=true: ms per training step": summary(ms[True]),
        f"{name}, strategy.exact=false (per rank): ms per training step": summary(ms[False]),
    }
    cost = [
        100 * (exact / per_rank - 1) for exact, per_rank in zip(ms[True], ms[False], strict=True)
    ]
    rows[f"12. {device}, exactness cost on {devices} ranks, pairs run back to back (%)"] = summary(
        cost
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="3 steps, batch 32, 1 job each")
    parser.add_argument("--repeats", type=int, default=3, help="jobs per setting")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        rows = measure(Path(workdir), args.tiny, 1 if args.tiny else args.repeats)
    for name, row in rows.items():
        print(f"{name}: {row['median']:,.4g} ({row['min']:,.4g} - {row['max']:,.4g})")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
