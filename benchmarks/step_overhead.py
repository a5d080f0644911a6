"""Host time per training step: a raw loop, a bare Lightning ``Trainer`` and ``src.train``.

``python -m benchmarks.step_overhead [--tiny] [--repeats N]`` (also called by
``benchmarks.run``). Each figure is the median of alternating fresh processes, so a slow
moment of a shared machine hits every kind alike. Two settings:

* the tiny network (``channels=[4] hidden=8``, no BatchNorm, batch 32): the math is almost
  free, so a step's time is the Python around it; target: ``src.train`` within 1.5x the raw
  loop;
* the default ConvNet (batch 128): target: ``src.train`` at >= 0.95 of the raw loop's
  throughput.

All three train the same :class:`~src.task.model.ImageClassifier` on the same batches
(``__getitems__`` of the data module's training split): the raw loop calls its forward,
cross-entropy and AdamW by hand; the bare Trainer runs the module's ``training_step`` (and so
its metric updates) with no logger, callback, progress bar or checkpoint; ``src.train`` is the
real entry point with every default callback and the default MLflow logger. A step is timed
from the end of one step to the end of the next, after warm-up steps.
"""

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("raw", "bare", "template")
TINY_NET = ["model.net.channels=[4]", "model.net.hidden=8", "model.net.batch_norm=false"]
# (network overrides, batch, warm-up steps, timed steps) per setting
SETTINGS = {
    "tiny": (TINY_NET, 32, 20, 150),
    "convnet": ([], 128, 5, 40),
}
TARGETS = {"tiny": 1.5, "convnet": 0.95}
MARK = "STEP_OVERHEAD_MS"


# --- in the child process


class Clock:
    """Marks the end of step ``warmup - 1`` and of step ``warmup + steps - 1``: prints the wall
    time and the main thread's CPU time per step between them."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps, self.start = warmup, steps, (0.0, 0.0)

    def step_end(self, index: int) -> None:
        if index == self.warmup - 1:
            self.start = (time.perf_counter(), time.thread_time())
        elif index == self.warmup + self.steps - 1:
            wall = 1000 * (time.perf_counter() - self.start[0]) / self.steps
            cpu = 1000 * (time.thread_time() - self.start[1]) / self.steps
            print(MARK, wall, cpu, flush=True)
            os._exit(0)  # what follows the timed steps is not measured


def build(args: argparse.Namespace):
    """The data module's training split and the model, as ``src.train`` builds them."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from src.task import TASK

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=args.overrides)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    datamodule = TASK.datamodule_class(cfg.data.name)(**data)
    datamodule.load()
    model = TASK.build_model(OmegaConf.to_container(cfg.model, resolve=True), datamodule)
    return cfg, datamodule, model


def loader(train_set, batch: int):
    from lightning_exact.data import keep_batch
    from torch.utils.data import DataLoader

    return DataLoader(train_set, batch_size=batch, shuffle=True, collate_fn=keep_batch)


def run_raw(args: argparse.Namespace, clock: Clock) -> None:
    import torch
    import torch.nn.functional as F

    cfg, datamodule, model = build(args)
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.model.lr, weight_decay=cfg.model.weight_decay
    )
    model.train()
    for index, batch in enumerate(loader(datamodule.train_set, cfg.data.batch_size)):
        loss = F.cross_entropy(model(batch.inputs), batch.targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        clock.step_end(index)


def clock_callback(clock: Clock):
    import lightning.pytorch as L

    class StepClock(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            clock.step_end(batch_idx)

    return StepClock()


def run_bare(args: argparse.Namespace, clock: Clock) -> None:
    import lightning.pytorch as L
    import torch

    cfg, datamodule, model = build(args)
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        callbacks=[clock_callback(clock)],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=args.workdir,
    )
    trainer.fit(model, train_dataloaders=loader(datamodule.train_set, cfg.data.batch_size))


def run_template(args: argparse.Namespace, clock: Clock) -> None:
    """``python -m src.train`` in this process, one callback added: the clock."""
    import lightning_exact.job.jobs  # its build_callbacks gets one more callback

    jobs = lightning_exact.job.jobs
    build = jobs.build_callbacks
    jobs.build_callbacks = lambda *a, **k: [*build(*a, **k), clock_callback(clock)]
    sys.argv = [
        "src.train",
        *args.overrides,
        f"paths.root_dir={args.workdir}",
        f"hydra.run.dir={tempfile.mkdtemp(dir=args.workdir, prefix='job')}",
        "trainer.limit_val_batches=2",
        "trainer.num_sanity_val_steps=0",
    ]
    runpy.run_module("src.train", run_name="__main__")


def child(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    clock = Clock(args.warmup, args.steps)
    {"raw": run_raw, "bare": run_bare, "template": run_template}[args.kind](args, clock)
    raise SystemExit(f"{args.kind}: the run ended before {args.warmup + args.steps} steps")


# --- in the parent process


def time_step(
    kind: str, setting: str, data: list[str], workdir: Path, tiny: bool, threads: int = 0
) -> tuple[float, float]:
    """Milliseconds per step of one fresh process of ``kind``: wall time, and the main thread's
    CPU time (what the host spends, less blurred by whatever else runs on the machine).
    ``threads``: torch's intra-op threads (0: its default, one per core)."""
    net, batch, warmup, steps = SETTINGS[setting]
    if tiny:
        warmup, steps = 3, 10
    overrides = [
        *data,
        *net,
        f"data.batch_size={batch}",
        "trainer.max_epochs=1",
        f"trainer.limit_train_batches={warmup + steps + 5}",
    ]
    command = [
        sys.executable,
        "-m",
        "benchmarks.step_overhead",
        "--child",
        kind,
        f"--warmup={warmup}",
        f"--steps={steps}",
        f"--workdir={workdir}",
        *overrides,
    ]
    proc = subprocess.run(
        command,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            **({"OMP_NUM_THREADS": str(threads)} if threads else {}),
        },
    )
    marks = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if not marks:
        raise RuntimeError(
            f"{kind} ({setting}) timed no steps:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    wall, cpu = marks[-1].split()[1:]
    return float(wall), float(cpu)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def ratio(ours: list[float], raw: list[float], throughput: bool) -> dict[str, float]:
    """src.train against the raw loop: time per step (or, ``throughput``, its inverse)."""
    if throughput:
        ours, raw = raw, ours
    return {
        "median": statistics.median(ours) / statistics.median(raw),
        "min": min(ours) / max(raw),
        "max": max(ours) / min(raw),
    }


def measure(
    data: list[str], workdir: Path, repeats: int, tiny: bool, threads: int = 0
) -> dict[str, dict]:
    """The rows: ms per step of each kind on each setting (medians of alternating runs), the
    ratios and their targets; on the tiny network also the main thread's CPU time per step."""
    rows: dict[str, dict] = {}
    label = {"raw": "raw loop", "bare": "bare L.Trainer", "template": "python -m src.train"}
    for setting in SETTINGS:
        kinds = KINDS if setting == "tiny" else ("raw", "template")
        wall: dict[str, list[float]] = {kind: [] for kind in kinds}
        cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(repeats):
            for kind in kinds:  # alternating: raw, bare, template, raw, ...
                seconds = time_step(kind, setting, data, workdir, tiny, threads)
                wall[kind].append(seconds[0])
                cpu[kind].append(seconds[1])
        for kind in kinds:
            rows[f"9. {setting}: {label[kind]} (ms per step)"] = summary(wall[kind])
        if setting == "tiny":
            for kind in kinds:
                rows[f"9. tiny: {label[kind]} (main-thread CPU ms per step)"] = summary(cpu[kind])
            target = f"target <= {TARGETS['tiny']}"
            rows[f"9. tiny: src.train / raw loop, time per step ({target})"] = ratio(
                wall["template"], wall["raw"], throughput=False
            )
            rows[f"9. tiny: src.train / raw loop, main-thread CPU per step ({target})"] = ratio(
                cpu["template"], cpu["raw"], throughput=False
            )
        else:
            name = f"9. convnet: src.train / raw loop, throughput (target >= {TARGETS['convnet']})"
            rows[name] = ratio(wall["template"], wall["raw"], throughput=True)
    return rows


def data_overrides(workdir: Path, tiny: bool) -> list[str]:
    """Fashion-MNIST from $TEMPLATE_DATA_DIR when there and not --tiny; else a generated set."""
    from tests.real_data import has_real, real_data_dir

    if not tiny and has_real("FashionMNIST"):
        return ["data=fashion_mnist", f"data.root={real_data_dir()}", "data.download=false"]
    from tests.idx_data import make_dataset

    root = workdir / "step-data"
    if not root.is_dir():
        make_dataset(root, n_train=3000, n_test=300)  # 18 batches of 128
    return ["data=mnist", f"data.root={root}", "data.download=false", "data.val_size=100"]


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="generated data, few steps, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (default: one per core)"
    )
    parser.add_argument("--only", choices=tuple(SETTINGS), help="one setting only")
    args = parser.parse_args()
    if args.only:
        for name in set(SETTINGS) - {args.only}:
            del SETTINGS[name]
    with tempfile.TemporaryDirectory() as folder:
        workdir = Path(folder)
        repeats = 1 if args.tiny else args.repeats
        data = data_overrides(workdir, args.tiny)
        rows = measure(data, workdir, repeats, args.tiny, args.threads)
    width = max(map(len, rows))
    for name, row in rows.items():
        figures = "  ".join(f"{key} {row[key]:8.3f}" for key in ("median", "min", "max"))
        print(f"{name:<{width}}  {figures}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
