"""Data at scale: streamed shards against the in-memory image folder, on generated JPEGs.

``python -m benchmarks.data_scale [--sizes 20000,200000,1000000] [--tiny]`` (its rows, with
small sizes in ``--tiny``, are also in ``python -m benchmarks.run``). Run it under ``nice`` on
a shared machine. Rows ``10.``:

* for each size, RGB 64x64 JPEGs in 10 class folders (generated on every core, cached in
  ``--workdir`` between runs, as are their shards from ``python -m src.prepare format=jpeg``):
  the peak resident memory of the rank process (and of the rank with its loader workers, a sum
  of RSS that counts shared pages once per process) and the time from process start to the end
  of the first optimizer step, of ``python -m src.train data=shards data.num_workers=2`` (target:
  < 2 GB and < 10 s at every size) and of ``data=image_folder`` (in memory, its default
  ``num_workers=0``), both with ``data.augment={crop_scale:[0.08,1],flip:true}``, one device.
  The in-memory path is skipped where its decoded pixels would not fit in the memory available;
* decode + augment throughput of one loader worker (one process, one torch thread, as a
  DataLoader worker runs) for 64x64 and 224x224 JPEGs: ``data=shards``' training loader
  against what users pick instead, ``torchvision.datasets.ImageFolder`` with
  ``RandomResizedCrop`` + ``RandomHorizontalFlip`` and the default collate; where torchvision
  does not import (a CPU torch with PyPI's CUDA torchvision), the closest equivalent: a
  per-sample PIL-decode ``Dataset`` doing the same crop and flip the way torchvision does (PIL
  crop + bilinear resize, per sample) and the default collate. Target: >= 600 images/s per core
  at 224x224;
* the share of a training step spent waiting for data, ``data=shards data.num_workers=2``: the
  time between one step's end and the next one's start (the loader's ``next()``, plus
  Lightning's bookkeeping) over the time from step end to step end, after warm-up steps;
* what the in-memory path costs per image (``benchmarks.run``: 1 rank; ``--memory``: 1, 2 and
  4 ranks, and nothing else): the real command, ``python -m src.train data=image_folder
  data.val_size=50 data.image_size=[128,128] trainer.max_steps=3 logger=none`` (``strategy=ddp
  devices=N`` for N ranks), on folders of 500 and 5,000 RGB 128x128 JPEGs (50 test images in
  both: only the training split grows): the peak resident memory of its largest process (what
  ``/usr/bin/time -v`` prints: the kernel's ``ru_maxrss``) and of all its processes together
  (sampled every 20 ms), and the slope: what each added image adds to a rank's peak, over its
  decoded pixels (target <= 1.5).
"""

import argparse
import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "databench"
AUGMENT = "{crop_scale:[0.08,1],flip:true}"
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
CLASSES = 10
MARK = "DATA_SCALE"
GB = 1e9

# --- generated JPEGs, cached


def _write_images(job: tuple[str, int, int, int]) -> None:
    from PIL import Image

    folder, start, stop, size = job
    for i in range(start, stop):
        rng = np.random.default_rng(i)
        label = i % CLASSES
        corners = rng.integers(0, 256, (4, 4, 3)).astype(np.uint8)
        corners[..., label % 3] //= 2  # a class-dependent tint: something to learn
        smooth = np.asarray(Image.fromarray(corners).resize((size, size), Image.BILINEAR))
        noisy = smooth + rng.normal(0, 6, smooth.shape)  # photo-like entropy, not flat colour
        image = Image.fromarray(noisy.clip(0, 255).astype(np.uint8))
        image.save(f"{folder}/{label}/{i:07d}.jpg", quality=90)


def generate(root: Path, count: int, size: int, test: int | None = None) -> Path:
    """``root/train/<class>/*.jpg`` (``count`` images) and ``root/test`` (``test``; None: 2 %,
    at least 20), ``size`` x ``size`` RGB, written on every core; kept for the next run
    (``root/complete``)."""
    if (root / "complete").is_file():
        return root
    jobs = []
    for split, n in (("train", count), ("test", test or max(20, count // 50))):
        for label in range(CLASSES):
            (root / split / str(label)).mkdir(parents=True, exist_ok=True)
        step = max(1, min(2000, n // (4 * (os.cpu_count() or 1))))
        jobs += [(str(root / split), s, min(s + step, n), size) for s in range(0, n, step)]
    with multiprocessing.get_context("fork").Pool() as pool:
        for _ in pool.imap_unordered(_write_images, jobs):
            pass
    (root / "complete").write_text(str(count))
    return root


def folder_overrides(images: Path, size: int, count: int) -> list[str]:
    val = min(1000, max(CLASSES, count // 20))
    return [
        "data=image_folder",
        f"data.root={images}",
        f"data.image_size=[{size},{size}]",
        f"data.val_size={val}",
    ]


def convert(images: Path, shards: Path, size: int, count: int) -> Path:
    """``python -m src.prepare ... format=jpeg``, in this process (no second start of torch and
    Lightning), once: a finished conversion is not redone."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from src.prepare import prepare
    from src.task import TASK

    manifest = shards / "manifest.json"
    if manifest.is_file() and len(json.loads(manifest.read_text())["complete"]) == 2:
        return shards
    overrides = [
        *folder_overrides(images, size, count),
        f"out={shards}",
        "format=jpeg",
        "jpeg_quality=90",
        f"paths.root_dir={shards.parent}",
    ]
    GlobalHydra.instance().clear()  # benchmarks.run may have run src.train in this process
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        prepare(compose("prepare", overrides=overrides), TASK)
    return shards


def dataset(workdir: Path, count: int, size: int) -> tuple[Path, Path, float, float]:
    """(image folder, shards, seconds to generate, seconds to convert); 0 s when cached."""
    images = workdir / f"jpeg{size}-{count}"
    start = time.perf_counter()
    generate(images, count, size)
    generated = time.perf_counter() - start
    start = time.perf_counter()
    shards = convert(images, workdir / f"shards{size}-{count}", size, count)
    return images, shards, generated, time.perf_counter() - start


# --- a training job: peak memory, first step, waiting for data

CHILD = """
import os, sys, time
from lightning.pytorch.callbacks import Callback
import lightning_exact.job.jobs  # its build_callbacks gets one more callback

steps, warmup = int(sys.argv[1]), int(sys.argv[2])

class Steps(Callback):
    '''Marks the end of the first step (as benchmarks.run's cold start does), then measures
    the time between a step's end and the next one's start: the wait for the next batch.'''
    waits, total, last = 0.0, 0.0, None

    def on_train_batch_start(self, trainer, module, batch, index):
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, index):
        now = time.perf_counter()
        if index == 0:
            print("FIRST_STEP", time.time(), flush=True)
        if index >= warmup:
            self.waits += self.start - self.last
            self.total += now - self.last
        self.last = now
        if index == steps - 1:
            print("WAIT_SHARE", self.waits / self.total if self.total else 0.0, flush=True)
            os._exit(0)

build = lightning_exact.job.jobs.build_callbacks
lightning_exact.job.jobs.build_callbacks = lambda *a, **k: [*build(*a, **k), Steps()]
sys.argv = ["src.train", *sys.argv[3:]]
import runpy
runpy.run_module("src.train", run_name="__main__")
"""


def train_job(overrides: list[str], workdir: Path, steps: int, warmup: int) -> dict[str, float]:
    """``python -m src.train`` for ``steps`` steps, one device, sampled every 50 ms: peak RSS
    of the rank process and of the rank with its loader workers (GB), seconds from process
    start to the end of the first step, and the share of a step spent waiting for data."""
    run_dir = tempfile.mkdtemp(dir=workdir, prefix="job")
    command = [
        sys.executable,
        "-c",
        CHILD,
        str(steps),
        str(warmup),
        *overrides,
        "devices=1",
        "logger=none",
        "callbacks.progress_bar=none",
        "trainer.max_epochs=1",
        "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.time()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, cwd=workdir, stdout=out, stderr=err, env=env)
        rank, tree = 0, 0
        process = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                own = process.memory_info().rss
                workers = sum(child.memory_info().rss for child in process.children(True))
            except psutil.Error:  # it ended, or a worker did, between two calls
                continue
            rank, tree = max(rank, own), max(tree, own + workers)
            time.sleep(0.05)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    shutil.rmtree(run_dir, ignore_errors=True)  # its config and log: nothing to keep
    marks = dict(line.split()[:2] for line in stdout.splitlines() if line[:5] in ("FIRST", "WAIT_"))
    if proc.returncode or len(marks) != 2:
        raise RuntimeError(f"training failed:\n{stdout[-2000:]}\n{stderr[-2000:]}")
    return {
        "rank": rank / GB,
        "tree": tree / GB,
        "first": float(marks["FIRST_STEP"]) - start,
        "wait": 100 * float(marks["WAIT_SHARE"]),
    }


def fits_in_memory(count: int, size: int) -> tuple[bool, str]:
    """The in-memory path holds the decoded split (and briefly more: 2.3x the pixels measured
    in row 7) on top of ~1 GB of imports: run it only where 3x its pixels + 1 GB fit in 60 %
    of the memory available now (other jobs share this machine)."""
    need = 3 * count * size * size * 3 + GB
    available = psutil.virtual_memory().available
    reason = f"needs ~{need / GB:.0f} GB (3x its {count * size * size * 3 / GB:.1f} GB of pixels)"
    return need <= 0.6 * available, f"{reason}, {available / GB:.0f} GB available"


# --- the in-memory path's memory per image, on 1, 2 and 4 ranks

SLOPE_TEST = 50  # test images of every slope folder: only the training split grows


def peak_memory(command: list[str], cwd: Path) -> tuple[float, float]:
    """Peak RSS (GB) of ``command``'s largest process, as ``/usr/bin/time -v`` reports it (the
    kernel's ``ru_maxrss`` of the process and the children it waited for), and of all its
    processes together (sampled every 20 ms: a sum of RSS, the pages they share counted once
    per process)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        together = [0]
        done = threading.Event()

        def sample() -> None:
            process = psutil.Process(proc.pid)
            while not done.is_set():
                try:
                    tree = [process, *process.children(recursive=True)]
                    together[0] = max(together[0], sum(p.memory_info().rss for p in tree))
                except psutil.Error:  # a process ended between two calls
                    pass
                time.sleep(0.02)

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        done.set()
        watcher.join()
        if proc.returncode:
            out.seek(0)
            raise RuntimeError(f"{' '.join(command)} failed:\n{out.read()[-3000:]}")
    return usage.ru_maxrss * 1024 / GB, together[0] / GB


def memory_slope(
    workdir: Path,
    counts: tuple[int, int],
    size: int,
    ranks: int,
    repeats: int,
    batch: int = 128,
) -> dict[str, dict]:
    """Rows ``10.`` of the in-memory path on ``ranks`` ranks: peaks at both ``counts`` and the
    slope per added image over its decoded pixels, the median of ``repeats`` runs alternating
    the two counts (a peak varies by ~0.1 GB run to run: the allocators' arenas)."""
    peaks: dict[int, list[tuple[float, float]]] = {count: [] for count in counts}
    for count in [count for _ in range(repeats) for count in counts]:
        images = generate(workdir / f"slope{size}-{count}", count, size, test=SLOPE_TEST)
        run_dir = tempfile.mkdtemp(dir=workdir, prefix="job")
        command = [
            sys.executable,
            "-m",
            "src.train",
            "data=image_folder",
            f"data.root={images}",
            f"data.val_size={min(50, counts[0] // 4)}",  # --tiny: 10
            f"data.image_size=[{size},{size}]",
            f"data.batch_size={batch}",
            "trainer.max_steps=3",
            "logger=none",
            "callbacks.progress_bar=none",
            f"hydra.run.dir={run_dir}",
            *(["strategy=ddp", f"devices={ranks}"] if ranks > 1 else []),
        ]
        peaks[count].append(peak_memory(command, workdir))
        shutil.rmtree(run_dir, ignore_errors=True)
    small, large = counts
    pixels = (large - small) * size * size * 3 / GB
    name = f"10. in memory, {size}x{size} JPEGs, {ranks} rank{'s' * (ranks > 1)}"
    rows = {}
    for count, runs in peaks.items():
        rows[f"{name}: peak RSS of a rank, {count:,} images (GB)"] = summary([r for r, _ in runs])
        if ranks > 1:
            rows[f"{name}: peak RSS of all, {count:,} images (GB)"] = summary([a for _, a in runs])
    for which, what in ((0, "a rank's peak"), (1, "all ranks' peak")):
        if which and ranks == 1:
            break
        target = " (target <= 1.5)" if which == 0 else ""
        row = f"{name}: slope of {what} / pixels added{target}"
        if pixels < 0.1:  # --tiny
            rows[row] = {"skipped": f"{pixels * 1e3:.1f} MB added: below a peak's noise (0.1 GB)"}
            continue
        lows = [run[which] for run in peaks[small]]
        highs = [run[which] for run in peaks[large]]
        rows[row] = {  # medians; the extremes of the runs
            "median": (summary(highs)["median"] - summary(lows)["median"]) / pixels,
            "min": (min(highs) - max(lows)) / pixels,
            "max": (max(highs) - min(lows)) / pixels,
        }
    return rows


# --- one loader worker: decode + augment


def shard_throughput(shards: Path, batch: int, batches: int) -> float:
    """Images/s of ``data=shards``' training loader in this process (what one worker does:
    read, decode, augment, normalise)."""
    from src.task.data.shards import ShardDataModule

    data = ShardDataModule(
        "shards",
        str(shards),
        batch_size=batch,
        val_size=batch,
        augment={"crop_scale": list(SCALE), "flip": True},
    )
    data.setup("fit")
    loader = iter(data.train_dataloader())
    next(loader)  # opens the shards
    start, seen = time.perf_counter(), 0
    for _ in range(batches):
        seen += len(next(loader).targets)
    return seen / (time.perf_counter() - start)


class PerSampleFolder(torch.utils.data.Dataset):
    """torchvision's ImageFolder + RandomResizedCrop + RandomHorizontalFlip + ToTensor +
    Normalize, without torchvision: each sample opened with PIL, cropped and resized with PIL's
    bilinear filter, flipped, converted and normalised on its own."""

    def __init__(self, root: Path, size: int) -> None:
        self.files = sorted(root.glob("*/*.jpg"))
        self.labels = [int(path.parent.name) for path in self.files]
        self.size = size
        self.mean = torch.tensor([0.5, 0.5, 0.5]).view(3, 1, 1)
        self.std = torch.tensor([0.25, 0.25, 0.25]).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        import random

        from PIL import Image

        with Image.open(self.files[i]) as image:
            image = image.convert("RGB")
        width, height = image.size
        for _ in range(10):  # torchvision's RandomResizedCrop.get_params
            area = height * width * random.uniform(*SCALE)
            aspect = math.exp(random.uniform(math.log(RATIO[0]), math.log(RATIO[1])))
            w, h = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
            if 0 < w <= width and 0 < h <= height:
                top, left = random.randint(0, height - h), random.randint(0, width - w)
                break
        else:
            top, left, h, w = 0, 0, height, width
        image = image.resize((self.size, self.size), Image.BILINEAR, (left, top, left + w, top + h))
        if random.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float().div_(255)
        return (pixels - self.mean) / self.std, self.labels[i]


def baseline_dataset(root: Path, size: int) -> tuple[torch.utils.data.Dataset, str]:
    """torchvision's ImageFolder where it imports; else :class:`PerSampleFolder` (and why)."""
    try:
        from torchvision import datasets, transforms
    except Exception as error:  # noqa: BLE001  (a CUDA torchvision on a CPU torch: any error)
        reason = f"torchvision does not import here ({type(error).__name__})"
        return PerSampleFolder(root, size), f"per-sample PIL Dataset, {reason}"
    transform = transforms.Compose(
        [
            transforms.RandomResizedCrop(size, scale=SCALE, antialias=True),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize([0.5] * 3, [0.25] * 3),
        ]
    )
    return datasets.ImageFolder(str(root), transform=transform), "torchvision ImageFolder"


def baseline_throughput(dataset: torch.utils.data.Dataset, batch: int, batches: int) -> float:
    loader = iter(torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True))
    next(loader)
    start, seen = time.perf_counter(), 0
    for _ in range(batches):
        seen += len(next(loader)[1])
    return seen / (time.perf_counter() - start)


def one_worker(measure, repeats: int) -> dict[str, float]:
    """``measure()`` with one torch thread, as in a DataLoader worker; median (min-max)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        values = [measure() for _ in range(repeats)]
    finally:
        torch.set_num_threads(threads)
    return summary(values)


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": ordered[len(ordered) // 2], "min": ordered[0], "max": ordered[-1]}


# --- the rows


def measure(sizes: list[int], workdir: Path, tiny: bool, repeats: int = 3) -> dict[str, dict]:
    """Rows ``10.``: memory and first step per size and path, one worker's throughput at
    64x64 and 224x224, and the share of a step spent waiting for data (the largest size)."""
    workdir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, dict] = {}
    batch, steps, warmup = (16, 4, 1) if tiny else (128, 40, 5)
    common = [
        f"data.batch_size={batch}",
        f"data.augment={AUGMENT}",
        f"trainer.limit_train_batches={steps}",
    ]
    wait = None
    for count in sizes:
        images, shards, generated, converted = dataset(workdir, count, 64)
        name = f"10. {count:,} JPEGs 64x64"
        if not tiny:
            print(
                f"{count:,} images: generated in {generated:.0f} s, converted in "
                f"{converted:.0f} s (0: cached)",
                flush=True,
            )
        streamed = train_job(
            ["data=shards", f"data.root={shards}", "data.num_workers=2", *common],
            workdir,
            steps,
            warmup,
        )
        for key, what in (
            ("rank", "peak RSS of the rank (GB; target < 2)"),
            ("tree", "peak RSS, rank + 2 loader workers (GB)"),
            ("first", "time to first step (s; target < 10)"),
        ):
            rows[f"{name}, streamed: {what}"] = summary([streamed[key]])
        wait = streamed["wait"]
        fits, why = fits_in_memory(count, 64)
        if fits:
            memory = train_job(
                [*folder_overrides(images, 64, count), *common], workdir, steps, warmup
            )
            rows[f"{name}, in memory: peak RSS of the rank (GB)"] = summary([memory["rank"]])
            rows[f"{name}, in memory: time to first step (s)"] = summary([memory["first"]])
        else:
            rows[f"{name}, in memory"] = {"skipped": why}
        if not tiny:
            print(json.dumps({k: v for k, v in rows.items() if k.startswith(name)}), flush=True)
    share = f"10. share of a step waiting for data, streamed, 2 workers, {sizes[-1]:,} (%)"
    rows[share] = summary([wait])
    # --tiny: the 64x64 images above; 224x224 only in a full run (a conversion costs seconds)
    for size, count in [(64, sizes[0])] if tiny else [(64, 4000), (224, 4000)]:
        images, shards, _, _ = dataset(workdir, count, size)
        loads = (32, 2) if tiny else (128, 20)  # batch, batches
        ours = one_worker(lambda s=shards, n=loads: shard_throughput(s, *n), repeats)
        target = "; target >= 600" if size == 224 else ""
        name = f"10. decode + augment {size}x{size}"
        rows[f"{name}, data=shards, one worker (images/s{target})"] = ours
        baseline, kind = baseline_dataset(images / "train", size)
        theirs = one_worker(lambda b=baseline, n=loads: baseline_throughput(b, *n), repeats)
        rows[f"{name}, {kind}, one worker (images/s)"] = theirs
    return rows


def run_rows(tiny: bool, workdir: Path, repeats: int) -> dict[str, dict]:
    """The rows for ``benchmarks.run``: 200 images in its temporary folder with ``--tiny`` (and
    the memory slope from 40 to 120 images of 32x32), else 20,000 and 200,000 cached in
    :data:`DEFAULT_WORKDIR` (and the slope from 500 to 5,000 images of 128x128, one rank)."""
    if tiny:
        rows = measure([200], workdir / "data-scale", tiny, repeats)
        return rows | memory_slope(workdir / "data-scale", (40, 120), 32, 1, 1, batch=16)
    rows = measure([20_000, 200_000], DEFAULT_WORKDIR, tiny, repeats)
    return rows | memory_slope(DEFAULT_WORKDIR, (500, 5_000), 128, 1, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="20000,200000", help="image counts, comma-separated")
    parser.add_argument("--tiny", action="store_true", help="200 images, few steps, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs")
    kept = f"generated images and shards, kept between runs ({DEFAULT_WORKDIR})"
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help=kept)
    slope = "only the in-memory path's memory per image: 500 -> 5,000 images, 1, 2, 4 ranks"
    parser.add_argument("--memory", action="store_true", help=slope)
    parser.add_argument("--ranks", default="1,2,4", help="with --memory: rank counts")
    args = parser.parse_args()
    sizes = [200] if args.tiny else [int(n) for n in args.sizes.split(",")]
    if args.memory:
        args.workdir.mkdir(parents=True, exist_ok=True)
        rows = {}
        for ranks in [int(n) for n in args.ranks.split(",")]:
            found = memory_slope(args.workdir, (500, 5_000), 128, ranks, args.repeats)
            show(found)
            rows |= found
    else:
        rows = measure(sizes, args.workdir, args.tiny, 1 if args.tiny else args.repeats)
        show(rows)
    print(json.dumps(rows))


def show(rows: dict[str, dict]) -> None:
    for name, row in rows.items():
        figure = row.get("skipped") or "{median:,.3g} ({min:,.3g} - {max:,.3g})".format(**row)
        print(f"{name}: {figure}", flush=True)


if __name__ == "__main__":
    main()
