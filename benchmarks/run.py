"""The template against the raw-PyTorch limit: ``python -m benchmarks.run [--tiny]``.

Prints one table and writes it as JSON to ``outputs/benchmarks/results.json`` (git-ignored;
``--out benchmarks/results.json`` updates the published figures). Each figure is the median
(min-max) of ``--repeats`` runs; on shared machines the ratios are what matter. Fashion-MNIST is
read from ``$TEMPLATE_DATA_DIR``; without it, rows 6 are skipped.

1. limit: a plain PyTorch loop over the same ConvNet, data tensors and batch size
2. template: ``python -m src.train`` itself, in this process (all callbacks, rich progress bar),
   with ``logger=none`` and the default MLflow logger: steady-state steps, and the ratio to 1
3. cold start: process start to the first optimizer step, without a logger and with MLflow,
   and what that adds to the floor every Lightning job pays (``import lightning.pytorch``)
4. data path: batched fetch (``__getitems__``) against per-sample ``__getitem__`` + collate
5. exactness cost: DDP test loop with the unpadded sampler against Lightning's padded one
6. whole job: ``python -m src.train data=fashion_mnist`` wall time and test accuracy
7. image folders: decoding the training split's images from PNG files into the in-memory tensor
8. GPU rows: resident data, bf16, compile (on the CPU in --tiny mode)
9. host time per step: raw loop, bare Lightning Trainer and ``src.train`` on a tiny network, and
   the default ConvNet's throughput ratio (:mod:`benchmarks.step_overhead`)
10. data at scale: peak memory and first step, streamed and in memory, for generated JPEGs;
   one loader worker's decode + augment throughput (:mod:`benchmarks.data_scale`)
11. sharding: per-rank parameter + gradient + optimizer memory, peak memory and steps/s of
   ``strategy=ddp`` against ``strategy=fsdp`` on 2 ranks (:mod:`benchmarks.sharding`)
12. exactness at any world size: step time of ``strategy.exact=true`` (global-batch BatchNorm
   and dropout) against ``false`` (per rank) on 2 ranks (:mod:`benchmarks.exact`)

``--tiny`` runs every row on a small generated dataset in about a minute (used by the tests).
"""

import argparse
import json
import math
import os
import platform
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, Dataset

from tests.real_data import DATA_DIR_ENV, has_real, real_data_dir

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = real_data_dir()  # $TEMPLATE_DATA_DIR, else None
DEFAULT_OUT = ROOT / "outputs" / "benchmarks" / "results.json"  # git-ignored
WARMUP = 3  # steps left out of every throughput figure
console = Console()


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def repeat(times: int, measure: Callable[[], float]) -> dict[str, float]:
    return summary([measure() for _ in range(times)])


# --- 1. the limit: plain PyTorch


def raw_loop(train_set, batch: int, steps: int) -> float:
    """Samples/s of a hand-written loop: index, normalise, forward, backward, step."""
    from src.task.nets.convnet import ConvNet

    torch.manual_seed(0)
    net = ConvNet(num_classes=10)
    optimizer = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)
    images, labels = train_set.inputs, train_set.targets
    order = torch.randperm(len(labels))
    start = 0.0
    for step in range(WARMUP + steps):
        if step == WARMUP:
            start = time.perf_counter()
        index = order[(step * batch) % (len(order) - batch) :][:batch]
        x = train_set.transform(images[index])  # normalise, as the data module does
        loss = F.cross_entropy(net(x), labels[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return steps * batch / (time.perf_counter() - start)


# --- 2. the template: ``python -m src.train`` itself


def template_job(overrides: list[str], workdir: Path, batch: int, steps: int) -> float:
    """Samples/s of the steady-state training steps of the real entry point, run in this
    process: every callback (per-step seeding, stop-on-signal, checkpointing), the progress bar
    and the logger the overrides choose. One extra callback holds the clock."""
    import lightning.pytorch as L
    import lightning_exact.job.jobs  # its build_callbacks gets one more callback

    class StepClock(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == WARMUP:
                synchronize(pl_module.device.type)
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == WARMUP + steps - 1:
                synchronize(pl_module.device.type)
                self.seconds = time.perf_counter() - self.start

    clock = StepClock()
    build = lightning_exact.job.jobs.build_callbacks
    argv = sys.argv
    lightning_exact.job.jobs.build_callbacks = lambda *a, **k: [*build(*a, **k), clock]
    sys.argv = [
        "src.train",
        *overrides,
        f"paths.root_dir={workdir}",
        f"hydra.run.dir={tempfile.mkdtemp(dir=workdir, prefix='job')}",
        f"data.batch_size={batch}",
        "trainer.max_epochs=1",
        f"trainer.limit_train_batches={WARMUP + steps}",
        "trainer.limit_val_batches=2",
        "trainer.limit_test_batches=2",
        "trainer.num_sanity_val_steps=0",
    ]
    try:  # as `python -m src.train`: Hydra finds conf/ from the script's path
        runpy.run_module("src.train", run_name="__main__")
    finally:
        lightning_exact.job.jobs.build_callbacks, sys.argv = build, argv
    return steps * batch / clock.seconds


# --- 3. cold start

FIRST_STEP = """
import os, sys, time
from lightning.pytorch.callbacks import Callback
import lightning_exact.job.jobs  # its build_callbacks gets one more callback

class FirstStep(Callback):
    def on_train_batch_end(self, *args):
        print("FIRST_STEP", time.time(), flush=True)
        os._exit(0)

build = lightning_exact.job.jobs.build_callbacks
lightning_exact.job.jobs.build_callbacks = lambda *a, **k: [*build(*a, **k), FirstStep()]
sys.argv = ["src.train", *sys.argv[1:]]
import runpy
runpy.run_module("src.train", run_name="__main__")
"""


def cold_start(overrides: list[str], workdir: Path) -> float:
    """Seconds from starting ``python -m src.train`` to the end of its first optimizer step.

    The child runs the real entry point with one extra callback that prints the time and exits.
    """
    command = [sys.executable, "-c", FIRST_STEP, *overrides, f"hydra.run.dir={workdir / 'cold'}"]
    start = time.time()
    proc = subprocess.run(
        command,
        cwd=workdir,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    marks = [line for line in proc.stdout.splitlines() if line.startswith("FIRST_STEP")]
    if not marks:
        raise RuntimeError(f"no first step:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return float(marks[0].split()[1]) - start


def framework_floor() -> float:
    """Seconds for a process that only imports Lightning: what any Lightning job pays."""
    start = time.time()
    subprocess.run([sys.executable, "-c", "import lightning.pytorch"], check=True)
    return time.time() - start


def import_profile(top: int = 8) -> list[tuple[str, float]]:
    """Where ``import src.train`` spends its time: cumulative seconds per top-level package
    (``python -X importtime``). mlflow and matplotlib should not appear: they load lazily."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import src.train"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    packages: dict[str, float] = {}
    for line in proc.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            name = parts[2].strip()
            if "." not in name and name != "src":  # a top-level package, nested imports included
                packages[name] = max(packages.get(name, 0.0), int(parts[1]) / 1e6)
    return sorted(packages.items(), key=lambda item: -item[1])[:top]


# --- 4. the data path


class PerSample(Dataset):
    """The baseline: one Python call and one tensor per sample, then the default collate."""

    def __init__(self, batches) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int):
        sample = self.batches[i]
        return sample.inputs, sample.targets


def loader_throughput(loader: DataLoader, batches: int) -> float:
    iterator, seen = iter(loader), 0
    start = time.perf_counter()
    for _ in range(batches):
        seen += len(next(iterator)[1])
    return seen / (time.perf_counter() - start)


# --- 5. exactness cost


def eval_loop(root: Path, name: str, devices: int, sampler: str, workdir: Path) -> float:
    command = [
        sys.executable,
        "-m",
        "benchmarks.eval_sampler",
        str(root),
        name,
        str(devices),
        sampler,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, cwd=workdir, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"eval_sampler failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1])["seconds"]


# --- 6. the whole default job


def timed_job(overrides: list[str], run_dir: Path, workdir: Path) -> tuple[float, float]:
    """Wall seconds and test accuracy of ``python -m src.train overrides`` (no logger, no bar)."""
    command = [sys.executable, "-m", "src.train", *overrides, "logger=none"]
    command += ["callbacks.progress_bar=none", f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    subprocess.run(
        command,
        cwd=workdir,
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    seconds = time.perf_counter() - start
    return seconds, json.loads((run_dir / "metrics.json").read_text())["test/acc"]


def whole_job(root: Path, workdir: Path) -> tuple[float, float]:
    run_dir = Path(tempfile.mkdtemp(dir=workdir, prefix="job"))  # one per repetition
    return timed_job(["data=fashion_mnist", f"data.root={root}"], run_dir, workdir)


# --- 8. accelerated: data resident on the device, bf16, channels_last, torch.compile

FAST = {"precision": "bf16-mixed", "channels_last": True, "compile": True}


def raw_device_loop(train_set, batch: int, steps: int, device: str, fast: bool) -> float:
    """Samples/s of the hand-written loop with the data on ``device`` (indices drawn there too:
    no host-to-device copy per step), optionally bf16 autocast, NHWC and torch.compile."""
    from src.task.nets.convnet import ConvNet

    torch.manual_seed(0)
    net = ConvNet(num_classes=10).to(device)
    layout = torch.channels_last if fast else torch.contiguous_format
    net = net.to(memory_format=layout)
    forward = torch.compile(net) if fast else net
    optimizer = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)
    images, labels = train_set.inputs.to(device), train_set.targets.to(device)
    mean, std = train_set.transform.mean.to(device), train_set.transform.std.to(device)
    order = torch.randperm(len(labels), device=device)
    start = 0.0
    for step in range(WARMUP + steps):
        if step == WARMUP:
            synchronize(device)
            start = time.perf_counter()
        index = order[(step * batch) % (len(order) - batch) :][:batch]
        x = images[index].float().div_(255).sub_(mean).div_(std).contiguous(memory_format=layout)
        with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=fast):
            loss = F.cross_entropy(forward(x), labels[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    synchronize(device)
    return steps * batch / (time.perf_counter() - start)


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def device_overrides(device: str, fast: bool) -> list[str]:
    accelerator = "gpu" if device == "cuda" else "cpu"
    overrides = [f"accelerator={accelerator}", "devices=1", "data.device_resident=true"]
    if fast:
        overrides += [
            f"trainer.precision={FAST['precision']}",
            "model.channels_last=true",
            "model.compile=true",
        ]
    return overrides


def time_to_accuracy(
    root: Path, name: str, overrides: list[str], target: float, workdir: Path, max_epochs: int
) -> tuple[float, int, float]:
    """Wall time of the shortest ``python -m src.train`` job (1, 2, ... epochs) whose test
    accuracy reaches ``target``: (seconds, epochs, accuracy); NaN seconds if none does."""
    accuracy = 0.0
    for epochs in range(1, max_epochs + 1):
        data = [f"data={name}", f"data.root={root}", *overrides, f"trainer.max_epochs={epochs}"]
        seconds, accuracy = timed_job(data, workdir / f"to-accuracy-{epochs}", workdir)
        if accuracy >= target:
            return seconds, epochs, accuracy
    return math.nan, max_epochs, accuracy


def accelerated_rows(
    train_set,
    batch: int,
    steps: int,
    repeats: int,
    data_overrides: list[str],
    workdir: Path,
    real: bool,
    tiny: bool,
) -> dict[str, dict]:
    """On a GPU: the template against the raw CUDA loop, plain and fast (bf16-mixed,
    channels_last, compile), and the time to 90% Fashion-MNIST test accuracy. Without one, the
    --tiny run checks the same code on the CPU (plain only); a full run says it was skipped."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not tiny:
        return {"8. GPU rows (resident data, bf16, compile)": {"skipped": "no GPU here"}}
    rows: dict[str, dict] = {}
    for fast in (False, True) if device == "cuda" else (False,):
        kind = "bf16+channels_last+compile" if fast else "fp32"
        limit = repeat(repeats, lambda f=fast: raw_device_loop(train_set, batch, steps, device, f))
        overrides = [*data_overrides, *device_overrides(device, fast), "logger=none"]
        ours = repeat(repeats, lambda o=overrides: template_job(o, workdir, batch, steps))
        rows[f"8. {device} raw loop, resident data, {kind} (samples/s)"] = limit
        rows[f"8. {device} template, resident data, {kind} (samples/s)"] = ours
        rows[f"8. {device} template / raw loop, {kind} (target >= 0.90)"] = {
            k: ours[k] / limit["median"] for k in ("median", "min", "max")
        }
    if device == "cuda" and real:
        # MNIST's training images are not fetchable offline; Fashion-MNIST's 90% stands in
        # for MNIST's 99% as the "trained well" mark.
        seconds, epochs, accuracy = time_to_accuracy(
            SHARED_DATA, "fashion_mnist", device_overrides(device, True), 0.90, workdir, 15
        )
        rows[
            f"8. time to 90% Fashion-MNIST test accuracy ({epochs} epochs, acc {accuracy:.4f}) (s)"
        ] = summary([seconds])
    return rows


# --- the run


def decode_folder(images: torch.Tensor, labels: torch.Tensor, count: int, workdir: Path) -> float:
    """Seconds for ``data=image_folder`` to decode ``count`` of ``images`` as PNG files (written
    once, in class folders) into its uint8 tensor."""
    from PIL import Image

    from src.task.data.image_folder import surveyed
    from src.task.data.images import read_images

    folder = workdir / f"png{count}" / "train"
    classes = [str(label) for label in range(int(labels.max()) + 1)]
    if not folder.is_dir():
        for name in classes:
            (folder / name).mkdir(parents=True)
        for i in range(count):
            label = str(int(labels[i]))
            Image.fromarray(images[i, 0].numpy()).save(folder / label / f"{i:05d}.png")
    present = [name for name in classes if any((folder / name).iterdir())]
    start = time.perf_counter()
    labels_read, image_at = surveyed(folder, present, 1, (28, 28))  # what data.load() decodes
    decoded = read_images(image_at, range(len(labels_read)), (1, 28, 28))
    elapsed = time.perf_counter() - start
    assert len(decoded) == count
    return elapsed


MEMORY_PROBE = """
import json, resource, sys
import PIL.Image
import psutil
from src.task.data.image_folder import ImageFolderDataModule
data = ImageFolderDataModule(name="image_folder", root=sys.argv[1], image_size=[28, 28],
                             channels=1, batch_size=8, val_size=int(sys.argv[2]))
PIL.Image.init()  # its format plugins: imported once by any image job, not the data's size
before = psutil.Process().memory_info().rss
data.prepare_data()
data.load()
describe = data.describe_splits()  # the digests tracking logs
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
splits = (data.train_set, data.val_set, data.test_set)
pixels = sum(len(s.inputs) * s.inputs[0].numel() for s in splits)
print(json.dumps((peak - before) / pixels))
"""


def folder_memory(workdir: Path, count: int) -> float:
    """Peak resident memory that ``data=image_folder`` adds to load the PNG folder of row 7 (its
    test split: the first images again), as a multiple of the decoded uint8 pixels, measured in
    a fresh process."""
    root = workdir / f"png{count}"
    if not (root / "test").is_dir():
        for folder in (root / "train").iterdir():
            (root / "test" / folder.name).mkdir(parents=True)
            for image in sorted(folder.iterdir())[:5]:
                (root / "test" / folder.name / image.name).write_bytes(image.read_bytes())
    probe = [sys.executable, "-c", MEMORY_PROBE, str(root), str(count // 10)]
    done = subprocess.run(probe, cwd=ROOT, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def machine() -> dict[str, object]:
    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def run(tiny: bool, repeats: int, steps: int, batch: int, workdir: Path) -> dict:
    from lightning_exact.data import keep_batch

    from src.task.data.mnist import MNISTDataModule

    real = not tiny and has_real("FashionMNIST")
    if real:
        root, name, val_size = SHARED_DATA, "fashion_mnist", 5000
    else:
        from tests.idx_data import make_dataset

        root, name, val_size = workdir / "data", "mnist", 100
        make_dataset(root, n_train=batch * (WARMUP + steps) + val_size + batch, n_test=300)
    datamodule_args = {"name": name, "root": str(root), "download": False, "val_size": val_size}
    datamodule = MNISTDataModule(**datamodule_args, batch_size=batch)
    datamodule.setup("fit")
    train_set = datamodule.train_set
    data_overrides = [f"data={name}", f"data.root={root}", f"data.val_size={val_size}"]

    rows: dict[str, dict] = {}
    limit = repeat(repeats, lambda: raw_loop(train_set, batch, steps))
    rows["1. limit: plain PyTorch loop (samples/s)"] = limit
    quick = [
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        "callbacks.progress_bar=none",
    ]
    templates = {}
    for logger in ("none", "mlflow"):
        templates[logger] = template = repeat(
            repeats,
            lambda logger=logger: template_job(
                [*data_overrides, f"logger={logger}"], workdir, batch, steps
            ),
        )
        rows[f"2. template, python -m src.train logger={logger} (samples/s)"] = template
        rows[f"2. template / limit, logger={logger} (target >= 0.90)"] = {
            k: template[k] / limit["median"] for k in ("median", "min", "max")
        }
    floor = repeat(repeats, framework_floor)
    rows["3. cold start floor: import lightning.pytorch (s)"] = floor
    for logger in ("none", "mlflow"):
        start = repeat(
            repeats,
            lambda logger=logger: cold_start(
                [*data_overrides, *quick, f"logger={logger}"], workdir
            ),
        )
        rows[f"3. cold start to first step, logger={logger} (s; target <= 3 for none)"] = start
        rows[f"3. cold start cost over the floor, logger={logger} (s)"] = {
            k: start[k] - floor["median"] for k in ("median", "min", "max")
        }
    per_batch = DataLoader(train_set, batch_size=batch, shuffle=True, collate_fn=keep_batch)
    per_sample = DataLoader(PerSample(train_set), batch_size=batch, shuffle=True)
    fast = repeat(repeats, lambda: loader_throughput(per_batch, steps))
    slow = repeat(repeats, lambda: loader_throughput(per_sample, min(steps, 20)))
    rows["4. data path, batched __getitems__ (samples/s)"] = fast
    rows["4. data path, per-sample __getitem__ baseline (samples/s)"] = slow
    share = (
        100 * templates["none"]["median"]
    )  # % of an epoch spent fetching: template / loader speed
    rows["4. data loading share of a training epoch (%; target < 2)"] = {
        "median": share / fast["median"],
        "min": share / fast["max"],
        "max": share / fast["min"],
    }
    for devices in (2,) if tiny else (2, 3):  # --tiny: the code of every row, once
        seconds = {
            s: repeat(repeats, lambda s=s, d=devices: eval_loop(root, name, d, s, workdir))
            for s in ("unpadded", "padded")
        }
        rows[f"5. DDP test loop, devices={devices}, unpadded (s)"] = seconds["unpadded"]
        rows[f"5. DDP test loop, devices={devices}, padded (s)"] = seconds["padded"]
        rows[f"5. exactness cost, devices={devices} (%; target < 2)"] = {
            "median": 100 * (seconds["unpadded"]["median"] / seconds["padded"]["median"] - 1),
            "min": 100 * (seconds["unpadded"]["min"] / seconds["padded"]["max"] - 1),
            "max": 100 * (seconds["unpadded"]["max"] / seconds["padded"]["min"] - 1),
        }
    if real:
        jobs = [whole_job(root, workdir) for _ in range(repeats)]
        rows["6. whole default job on Fashion-MNIST (s)"] = summary(
            [seconds for seconds, _ in jobs]
        )
        rows["6. whole default job, test accuracy"] = summary([accuracy for _, accuracy in jobs])
    else:
        rows["6. whole default job on Fashion-MNIST"] = {
            "skipped": f"needs Fashion-MNIST in ${DATA_DIR_ENV}, not --tiny"
        }
    # The whole official training split (train + validation): 60,000 images for Fashion-MNIST.
    images = torch.cat([train_set.inputs, datamodule.val_set.inputs])
    labels = torch.cat([train_set.targets, datamodule.val_set.targets])
    count = len(labels) if real else 600
    seconds = repeat(repeats, lambda: decode_folder(images, labels, count, workdir))
    rows[f"7. image folder: decode {count:,} PNG images (s)"] = seconds
    rows["7. image folder: peak memory of its load / uint8 pixels (target <= 2)"] = repeat(
        repeats, lambda: folder_memory(workdir, count)
    )
    rows["7. image folder: decoded images/s"] = {
        "median": count / seconds["median"],
        "min": count / seconds["max"],
        "max": count / seconds["min"],
    }
    rows |= accelerated_rows(train_set, batch, steps, repeats, data_overrides, workdir, real, tiny)
    from benchmarks import step_overhead

    rows |= step_overhead.measure(
        step_overhead.data_overrides(workdir, tiny), workdir, repeats, tiny
    )
    from benchmarks import data_scale

    rows |= data_scale.run_rows(tiny, workdir, repeats)
    from benchmarks import sharding

    rows |= sharding.measure(workdir, tiny, repeats)
    from benchmarks import exact

    rows |= exact.measure(workdir, tiny, repeats)
    return {
        "machine": machine(),
        "settings": {
            "tiny": tiny,
            "repeats": repeats,
            "steps": steps,
            "batch": batch,
            "data": name,
        },
        "rows": rows,
        "slowest_imports_of_src.train_s": import_profile(),
    }


def show(results: dict) -> None:
    table = Table("figure", "median", "min", "max", title="Template vs. raw PyTorch")
    for name, row in results["rows"].items():
        if "skipped" in row:
            table.add_row(name, row["skipped"], "", "")
        else:
            table.add_row(name, *(f"{row[k]:,.3g}" for k in ("median", "min", "max")))
    console.print(table)
    console.print("machine:", results["machine"], "settings:", results["settings"])
    console.print("slowest imports of src.train (s):", results["slowest_imports_of_src.train_s"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="small generated data, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150, help="training steps per throughput run")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="where the JSON goes (default: outputs/benchmarks/results.json, not tracked; "
        "benchmarks/results.json is the published one)",
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    repeats, steps = (1, 10) if args.tiny else (args.repeats, args.steps)
    with tempfile.TemporaryDirectory() as workdir:
        results = run(args.tiny, repeats, steps, args.batch, Path(workdir))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    show(results)
    console.print(f"written to {args.out}")
    finite = all(
        math.isfinite(v)
        for row in results["rows"].values()
        for k, v in row.items()
        if k != "skipped"
    )
    sys.exit(0 if finite else 1)


if __name__ == "__main__":
    main()
