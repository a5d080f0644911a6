"""Data at scale: ``src.prepare`` writes LitData shards, ``data=shards`` streams them with the
project's samplers (the same global batches for any world size and loader workers, exact eval,
exact resume), ``data.augment`` is a function of (seed, epoch, index), and ``src.predict
images=...`` classifies new files. Real processes on tiny generated data."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning_exact.data import DataError, TensorSplit, keep_batch
from lightning_exact.testing.instruments import RECORD_BATCHES
from lightning_exact.testing.processes import one_error_line
from lightning_exact.testing.records import assert_same_tensors, load_checkpoint, read_metrics
from PIL import Image
from torch.utils.data import DataLoader

from src.task.data.augment import AugmentedSplit, EpochTaggedSampler, check_augment
from src.task.data.mnist import DATASETS, MNISTDataModule, load_split
from src.task.data.partitions import PartitionedBatchSampler, partition_rows
from src.task.data.shards import ShardDataModule, eval_rows, training_bytes
from tests.conftest import HARNESS, PROJECT
from tests.idx_data import make_dataset
from tests.image_data import make_image_folder, spoil


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]


N_TEST = HARNESS.n_test
N_TRAIN = HARNESS.n_train
VAL_SIZE = HARNESS.val_size
run_entry = HARNESS.run_entry
signal_at_step = HARNESS.signal_at_step
tiny_overrides = HARNESS.tiny_overrides

AUGMENT = "data.augment={crop_scale:[0.6,1.0],flip:true,jitter:0.3}"
# Networks without per-rank state (BatchNorm statistics, dropout masks), as test_distributed.
SMALL = ["model.net.batch_norm=false", "model.net.dropout=0"]
# In parallel runs (-n), one worker runs this module: its tests share the converted shards.
pytestmark = pytest.mark.xdist_group("shards")


def prepare(data_root: Path, out: Path, cwd: Path, *more: str, check: bool = True):
    args = [f"data.root={data_root}", "data.download=false", f"out={out}", "chunk_bytes=20KB"]
    return run_entry("prepare", *args, *more, "hydra.run.dir=prepare", cwd=cwd, check=check)


@pytest.fixture(scope="module")
def shards(tiny_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "tiny"
    prepare(tiny_root, out, out.parent)
    return out


def shard_overrides(tiny_root: Path, shards: Path) -> list[str]:
    """The tiny training job of conftest, without a logger, reading the shards of the same data."""
    source = tiny_overrides(tiny_root, logger="none")
    source = [o for o in source if not o.startswith("data.root")]
    source.remove("data.download=false")
    return ["data=shards", f"data.root={shards}", *source]


def source_split(tiny_root: Path, train: bool) -> TensorSplit:
    return TensorSplit(*load_split(tiny_root, DATASETS["mnist"], train=train))


def test_prepare_writes_what_the_source_holds_and_refuses_other_data(
    shards: Path, tiny_root: Path, tmp_path: Path
) -> None:
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["counts"] == {"train": N_TRAIN, "test": N_TEST}
    assert manifest["complete"] == ["train", "test"] and manifest["classes"] == list("0123456789")
    assert len(list((shards / "train").glob("chunk-*.bin"))) > 2  # several shards
    # The shards decode to exactly the source's pixels and labels, in index order.
    dm = ShardDataModule("shards", str(shards), batch_size=32, val_size=VAL_SIZE)
    for split, train in (("train", True), ("test", False)):
        decoded = TensorSplit(*dm.read(split))
        assert decoded.digest() == source_split(tiny_root, train).digest()
        assert manifest["identity"]["digests"][split] == decoded.digest()
    # Rerun: nothing to do. Other data into the same folder: one line, nothing written.
    again = prepare(tiny_root, shards, tmp_path)
    assert "train: already converted" in again.stdout
    other = tmp_path / "other"
    make_dataset(other, n_train=50, n_test=10, seed=1, learnable=True)
    before = (shards / "manifest.json").read_text()
    refused = prepare(other, shards, tmp_path, check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "holds shards of other data" in refused.stderr + refused.stdout
    assert (shards / "manifest.json").read_text() == before
    # Too large a validation split: refused, with sizes that fit (as for any dataset).
    too_large = ShardDataModule("shards", str(shards), batch_size=512, val_size=N_TRAIN)
    with pytest.raises(
        DataError,
        match=rf"for {N_TRAIN} training samples; use e\.g\. data\.val_size=40 "
        r"data\.batch_size=256",
    ):
        too_large.load("fit")


def test_an_image_folder_converts_a_chunk_at_a_time_to_what_training_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The files are read a chunk at a time (never the split at once), yet the digest and
    statistics are those of the whole split, and the shards decode to its pixels. Each file is
    stored as it is: augmentation crops it at its own size; without, it is resized as in memory.
    Unreadable files left out (data.skip_unreadable=true): the shards hold what the in-memory
    dataset holds with the same setting."""
    from src.prepare import scan
    from src.task.data.augment import augment_one, sample_generator
    from src.task.data.image_folder import ImageFolderDataModule

    images, out = make_image_folder(tmp_path / "images", 9, 3, size=(40, 36)), tmp_path / "out"
    odd = sorted((images / "train").rglob("*.png"))[::4]  # other sizes, other aspect ratios
    for k, path in enumerate(odd):
        Image.open(path).resize((20 + 9 * k, 60 - 3 * k)).save(path)
    spoil(images)  # 2 train and 1 test file truncated, a .txt, a grayscale PNG
    done = run_entry(
        "prepare",
        "data=image_folder",
        f"data.root={images}",
        "data.image_size=[32,32]",
        "data.val_size=5",
        "data.skip_unreadable=true",
        f"out={out}",
        "hydra.run.dir=prepare",
        cwd=tmp_path,
    )
    assert (
        "Note: 3 unreadable image files (train 2, test 1) left out (data.skip_unreadable=true), "
        f"listed in {tmp_path}/prepare/unreadable.txt; remaining: 44 train, 14 test"
    ) in done.stdout.splitlines()
    source = ImageFolderDataModule(
        "image_folder", str(images), [32, 32], 3, 8, val_size=5, skip_unreadable=True
    )
    labels, image_at = source.sample_source("train")
    digest, sums = scan(source, "train", labels, image_at, chunk=7)  # 46 files: 7 chunks
    whole = TensorSplit(*source.read("train"))  # sets mean/std from the whole split
    assert digest == whole.digest() and sums.statistics() == (source.mean, source.std)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["identity"]["digests"]["train"] == digest
    assert (tuple(manifest["mean"]), tuple(manifest["std"])) == (source.mean, source.std)
    assert manifest["left_out"] == {"train": 2, "test": 1} and manifest["counts"]["train"] == 44
    assert manifest["source_sizes"] == {"min": [27, 20], "max": [60, 119]}  # H, W
    shards = ShardDataModule("shards", str(out), batch_size=8, val_size=5)
    for split in ("train", "test"):
        assert (
            TensorSplit(*shards.read(split)).digest() == TensorSplit(*source.read(split)).digest()
        )
    files = image_at.subset(image_at.findings.readable()).files  # the 44 left
    capsys.readouterr()
    shards.setup("fit")  # training on the shards names the files' own sizes, with the fix
    assert capsys.readouterr().out.splitlines() == [
        "Note: images are 27x20 to 60x119 (heights 27-60, widths 20-119); training resizes them "
        "to 32x32 (data.image_size=[32,32] of src.prepare); to train at another size: "
        "src.prepare out=NEW_FOLDER data.image_size=[H,W]"
    ]
    settings = check_augment({"crop_scale": [0.5, 1.0], "flip": True})
    augmented = AugmentedSplit(shards.train_set, settings, 7, shards.mean, shards.std, (3, 32, 32))
    rows = list(range(len(shards.train_set)))
    batch = augmented.__getitems__([(2, row) for row in rows])
    assert batch.inputs.shape == (len(rows), 3, 32, 32)
    mean, std = (torch.tensor(v).view(3, 1, 1) for v in (shards.mean, shards.std))
    for row, index in enumerate(batch.indices.tolist()):
        with Image.open(files[index]) as file:
            own = torch.from_numpy(np.asarray(file.convert("RGB"))).permute(2, 0, 1)
        assert shards.train_set.originals([row])[0].shape == own.shape  # not squashed
        expected = augment_one(own.float() / 255, settings, sample_generator(7, 2, index), (32, 32))
        assert torch.allclose(batch.inputs[row], (expected - mean) / std, atol=1e-5)
    assert any(Path(files[i]) in odd for i in batch.indices.tolist())


def test_prepare_says_sizes_skipped_files_and_every_unreadable_file_in_one_pass(
    tmp_path: Path,
) -> None:
    """Issue 60's folder (64x64 JPEGs, 3 truncated, a .txt, a grayscale PNG): one scan finds all
    three and refuses after it, naming the list (the job's folder keeps it; no out= folder).
    Converted with data.skip_unreadable=true: the test above."""
    images = make_image_folder(tmp_path / "images", 4, 2, size=(64, 64), suffix=".jpg")
    bad = spoil(images)
    out = tmp_path / "out"
    args = ["data=image_folder", f"data.root={images}", "data.val_size=5", f"out={out}"]
    refused = run_entry("prepare", *args, "hydra.run.dir=refused", cwd=tmp_path, check=False)
    said = refused.stdout.splitlines()
    assert refused.returncode == 1 and not out.exists()
    assert said[0] == (
        "Note: images are 64x64; training resizes them to 32x32 (data.image_size=[32,32]); "
        "to train at their own size: data.image_size=[64,64]"
    )
    job = tmp_path / "refused"
    assert said[1] == (
        "Note: 1 file skipped (not images: 1 .txt) and 1 image converted (1 L to RGB); "
        f"listed in {job}/skipped_or_converted.txt"
    )
    assert refused.stderr.strip() == (
        f"Error: 3 unreadable image files (train 2, test 1), listed in {job}/unreadable.txt; "
        "remove or replace them, or leave them out with data.skip_unreadable=true"
    )
    listed = (job / "unreadable.txt").read_text().splitlines()
    assert [row.split("\t")[0] for row in listed] == [str(path) for path in bad]


def test_an_interrupted_conversion_continues_where_it_stopped(tmp_path: Path) -> None:
    data, out = tmp_path / "data", tmp_path / "out"
    make_dataset(data, n_train=6000, n_test=10, seed=2, learnable=True)
    args = [f"data.root={data}", "data.download=false", f"out={out}", "chunk_bytes=10KB"]
    command = [sys.executable, "-m", "src.prepare", *args, "num_workers=1", "hydra.run.dir=p"]
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(PROJECT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "train" / "chunk-0-5.bin").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no shard written"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert json.loads((out / "manifest.json").read_text())["complete"] == []
    with pytest.raises(DataError, match="did not finish; rerun"):
        ShardDataModule("shards", str(out), batch_size=8, val_size=10)
    first = (out / "train" / "chunk-0-0.bin").stat().st_mtime_ns
    resumed = run_entry("prepare", *args, "hydra.run.dir=p2", cwd=tmp_path)
    assert "train: continuing the conversion that stopped" in resumed.stdout
    assert (out / "train" / "chunk-0-0.bin").stat().st_mtime_ns == first  # kept, not redone
    assert "lightning.ai" not in resumed.stdout  # LitData's chatter
    dm = ShardDataModule("shards", str(out), batch_size=8, val_size=10)
    source = TensorSplit(*load_split(data, DATASETS["mnist"], train=True))
    assert TensorSplit(*dm.read("train")).digest() == source.digest()


@pytest.mark.slow
def test_shards_train_as_the_source_and_the_same_global_batches_on_two_ranks(
    shards: Path, tiny_root: Path, tmp_path: Path
) -> None:
    """IDX data vs its shards (1 rank): identical metrics. Shards on 1 rank vs 2 ranks with 2
    loader workers each: the same global batches, the same weights up to float summation order;
    then evaluation of that checkpoint on 2 ranks equals 1 rank."""
    env = {"PYTHONPATH": f"{RECORD_BATCHES}{os.pathsep}{PROJECT}"}
    jobs = {
        "idx": [*tiny_overrides(tiny_root, logger="none"), "trainer.max_epochs=1"],
        "shards1": [*shard_overrides(tiny_root, shards), "trainer.max_epochs=1"],
        "shards2": [
            *shard_overrides(tiny_root, shards),
            "trainer.max_epochs=1",
            "data.num_workers=2",
        ],
    }
    jobs["shards2"] += ["strategy=ddp", "devices=2"]
    for name, args in jobs.items():
        record = tmp_path / f"{name}.jsonl"
        run_entry(
            "train",
            *args,
            *SMALL,
            f"hydra.run.dir={name}",
            cwd=tmp_path,
            env={**env, "RECORD_BATCHES": str(record)},
        )
    assert read_metrics(tmp_path / "idx") == read_metrics(tmp_path / "shards1")

    one, two = (
        global_batches(tmp_path / "shards1.jsonl"),
        global_batches(tmp_path / "shards2.jsonl"),
    )
    assert one == two and len(one) == (N_TRAIN - VAL_SIZE) // 32
    assert_weights_close(tmp_path / "shards1", tmp_path / "shards2")

    ckpt = tmp_path / "shards1" / "checkpoints" / "last.ckpt"
    evals = {}
    for devices in (1, 2):
        ddp = ["strategy=ddp", f"devices={devices}"] if devices > 1 else []
        run_dir = tmp_path / f"eval{devices}"
        run_entry(
            "eval",
            f"ckpt_path={ckpt}",
            "data=shards",
            f"data.root={shards}",
            "data.num_workers=1",
            "logger=none",
            *ddp,
            f"hydra.run.dir={run_dir}",
            cwd=tmp_path,
        )
        evals[devices] = read_metrics(run_dir)
    assert evals[1]["test/samples"] == evals[2]["test/samples"] == N_TEST
    assert evals[1]["test/acc"] == evals[2]["test/acc"]
    assert evals[1]["test/loss"] == pytest.approx(evals[2]["test/loss"], rel=1e-5)


def global_batches(record: Path) -> dict[tuple[int, int], list[int]]:
    """Each (epoch, batch)'s samples over all ranks, from ``tests/record_batches``."""
    batches = defaultdict(list)
    for line in record.read_text().splitlines():
        step = json.loads(line)
        batches[step["epoch"], step["batch"]] += step["indices"]
    return {key: sorted(indices) for key, indices in batches.items()}


def assert_weights_close(a: Path, b: Path) -> None:
    expected, actual = final_weights(a), final_weights(b)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_augmented_shards_resumed_mid_epoch_with_workers_equal_the_uninterrupted_job(
    shards: Path, tiny_root: Path, tmp_path: Path
) -> None:
    args = [*shard_overrides(tiny_root, shards), AUGMENT, *SMALL, "trainer.max_epochs=2"]
    run_entry("train", *args, "hydra.run.dir=whole", cwd=tmp_path)
    workers = [*args, "data.num_workers=2"]
    # Stopped by a signal, not shortened: a shorter job is another job (its lr schedule spans
    # its own steps).
    cut = run_entry(
        "train",
        *workers,
        "hydra.run.dir=cut",
        cwd=tmp_path,
        check=False,
        env=signal_at_step("13:SIGTERM"),
    )
    assert cut.returncode == 143, cut.stderr[-3000:]
    last = tmp_path / "cut" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 14  # mid-epoch 2
    run_entry("train", *workers, f"ckpt_path={last}", "hydra.run.dir=resumed", cwd=tmp_path)
    expected = torch.load(tmp_path / "whole/checkpoints/last.ckpt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)
    for part in ("epoch", "global_step", "state_dict", "optimizer_states"):
        assert_same_tensors(resumed[part], expected[part], part)
    whole, again = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "resumed")
    assert again == pytest.approx(whole, rel=1e-5, abs=1e-6)


def augmented_batches(split: TensorSplit, world: int, workers: int, epoch: int) -> torch.Tensor:
    """The augmented samples of every global batch of ``epoch``, rank by rank concatenated."""
    settings = check_augment({"crop_scale": [0.5, 1.0], "flip": True, "jitter": 0.4})
    data = AugmentedSplit(split, settings, seed=3, mean=[0.5], std=[0.25], image_shape=(1, 28, 28))
    per_rank = []
    for rank in range(world):
        sampler = EpochTaggedSampler(split, world, rank, global_batch_size=8, seed=3)
        sampler.set_epoch(epoch)
        loader = DataLoader(
            data,
            batch_size=8 // world,
            sampler=sampler,
            num_workers=workers,
            collate_fn=keep_batch,
        )
        per_rank.append([batch.inputs for batch in loader])
    return torch.cat([torch.cat(step) for step in zip(*per_rank, strict=True)])


def test_augmentation_is_a_function_of_seed_epoch_and_sample(tiny_root: Path) -> None:
    images, labels = load_split(tiny_root, DATASETS["mnist"], train=False)
    from src.task.data.images import Normalize

    split = TensorSplit(images[:40], labels[:40], transform=Normalize([0.5], [0.25]))
    one = augmented_batches(split, world=1, workers=0, epoch=1)
    assert torch.equal(one, augmented_batches(split, world=2, workers=2, epoch=1))
    assert torch.equal(one, augmented_batches(split, world=4, workers=0, epoch=1))
    assert not torch.equal(one, augmented_batches(split, world=1, workers=0, epoch=2))
    plain = torch.cat([split.__getitems__(list(range(40))).inputs])
    assert one.shape == (40, 1, 28, 28) and not torch.equal(one.sort(0)[0], plain.sort(0)[0])
    with pytest.raises(DataError, match="unknown keys"):
        check_augment({"rotate": 10})


def test_evaluation_loaders_are_not_augmented(tiny_root: Path) -> None:
    settings = {"name": "mnist", "root": str(tiny_root), "download": False, "batch_size": 32}
    dm = MNISTDataModule(**settings, val_size=VAL_SIZE, augment={"flip": True, "jitter": 0.5})
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    assert torch.equal(batch.inputs, dm.val_set.__getitems__(list(range(32))).inputs)
    assert isinstance(dm.train_dataloader().dataset, AugmentedSplit)


@pytest.mark.slow
def test_predict_classifies_a_folder_of_new_images(
    shards: Path, tiny_root: Path, tmp_path: Path
) -> None:
    run_entry("train", *shard_overrides(tiny_root, shards), "hydra.run.dir=t", cwd=tmp_path)
    images, labels = load_split(tiny_root, DATASETS["mnist"], train=False)
    folder = tmp_path / "new"
    for i in range(30):
        path = folder / ("nested" if i % 2 else "") / f"{i:03d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[i, 0].numpy()).save(path)
    # What a folder of new images also holds: each said, none stops the job.
    (folder / "readme.txt").write_text("not an image")
    Image.fromarray(images[0, 0].numpy()).convert("RGB").resize((56, 56)).save(folder / "big.png")
    cut = (folder / "000.png").read_bytes()
    (folder / "cut.png").write_bytes(cut[: len(cut) // 2])
    ckpt = tmp_path / "t" / "checkpoints" / "last.ckpt"
    done = run_entry(
        "predict", f"ckpt_path={ckpt}", f"images={folder}", "hydra.run.dir=p", cwd=tmp_path
    )
    job = tmp_path / "p"
    assert done.stdout.splitlines()[-4:] == [
        "Note: images are 28x28 to 56x56 (heights 28-56, widths 28-56); they are resized to "
        "28x28, the size the model was trained at",
        "Note: 1 file skipped (not images: 1 .txt) and 1 image converted (1 RGB to L); listed "
        f"in {job}/skipped_or_converted.txt",
        f"Note: 1 unreadable image file left out, listed in {job}/unreadable.txt; remaining: "
        "31 to classify",
        f"31 image(s) classified: {job}/predictions_inputs.csv",
    ]
    assert (job / "unreadable.txt").read_text().startswith(f"{folder}/cut.png\t")
    with (job / "predictions_inputs.csv").open() as f:
        rows = list(csv.DictReader(f))
    paths = [r["path"] for r in rows]
    assert paths == sorted(paths) and {Path(p).name for p in paths} == {
        *(f"{i:03d}.png" for i in range(30)),
        "big.png",
    }
    rows = [r for r in rows if Path(r["path"]).stem.isdigit()]
    assert all(0 < float(r["confidence"]) <= 1 for r in rows)
    right = sum(int(r["class_name"]) == int(labels[int(Path(r["path"]).stem)]) for r in rows)
    assert right >= 27, rows  # the tiny data is learnable: test accuracy is ~1
    missing = run_entry(
        "predict",
        f"ckpt_path={ckpt}",
        f"images={folder}/*.jpg",
        "hydra.run.dir=q",
        cwd=tmp_path,
        check=False,
    )
    assert missing.returncode == 1 and "no images" in missing.stderr + missing.stdout


def chunk_of(manifest: dict, positions: list[int]) -> set[int]:
    ends = torch.tensor(manifest["chunks"]["train"]).cumsum(0)
    return set(torch.searchsorted(ends, torch.tensor(positions), right=True).tolist())


def test_the_cache_must_hold_the_shards_a_rank_reads_in_an_epoch() -> None:
    chunks = [{"chunk_size": 10, "chunk_bytes": 100 * (k + 1)} for k in range(8)]  # 3,600 B
    assert training_bytes(chunks, partitions=None) == 3600
    # 4 partitions of 2 shards; rank r of 2 reads partitions 2r and 2r + 1 (the sampler's mine).
    for world, rank, expected in (
        (2, 0, 100 + 200 + 300 + 400),
        (2, 1, 500 + 600 + 700 + 800),
        (4, 2, 500 + 600),
    ):
        parts = [torch.arange(8)] * 4  # the sampler only needs as many partitions
        mine = PartitionedBatchSampler(range(32), world, rank, 4, 0, parts).mine
        assert training_bytes(chunks, partitions=4, mine=mine) == expected


def test_partitions_give_each_rank_its_own_shards_and_every_world_the_same_batches(
    shards: Path,
) -> None:
    dm = ShardDataModule("shards", str(shards), batch_size=32, val_size=VAL_SIZE, partitions=4)
    dm.load("fit")
    split, manifest = dm.train_set, dm.manifest
    parts = partition_rows(manifest["chunks"]["train"], 4, split.indices)
    batches, touched = {}, {}
    for world in (1, 2, 4):
        samplers = [
            PartitionedBatchSampler(split, world, rank, 32, seed=5, parts=parts)
            for rank in range(world)
        ]
        for sampler in samplers:
            sampler.set_epoch(1)
        shares = [torch.tensor(list(s)).view(len(s) // (32 // world), -1) for s in samplers]
        batches[world] = [sorted(torch.cat(step).tolist()) for step in zip(*shares, strict=True)]
        touched[world] = [
            chunk_of(manifest, split.indices[share.flatten()].tolist()) for share in shares
        ]
    assert batches[1] == batches[2] == batches[4] and len(batches[1]) >= 8
    all_chunks = set(range(len(manifest["chunks"]["train"])))
    for world in (2, 4):  # disjoint shards per rank, together all of them
        assert set().union(*touched[world]) == touched[1][0] == all_chunks
        assert sum(len(t) for t in touched[world]) == len(all_chunks)
    # Evaluation: every sample once, and each rank reads its own run of shards (those of a
    # validation carved at random: at most one shared at each boundary).
    dm.load("test")
    for data, name in ((dm.val_set, "train"), (dm.test_set, "test")):
        sizes = {"chunks": {"train": manifest["chunks"][name]}}
        for world in (2, 4):
            rows = [eval_rows(data.indices, world, rank) for rank in range(world)]
            assert sorted(sum(rows, [])) == list(range(len(data)))
            reads = [chunk_of(sizes, data.indices[mine].tolist()) for mine in rows]
            assert sum(map(len, reads)) <= len(sizes["chunks"]["train"]) + world - 1, reads
    # Resumed after 3 batches: the rest of the epoch, and another epoch is another order.
    full = PartitionedBatchSampler(split, 2, 1, 32, seed=5, parts=parts)
    full.set_epoch(1)
    resumed = PartitionedBatchSampler(split, 2, 1, 32, seed=5, parts=parts)
    resumed.resume_at(1, 3)
    assert list(resumed) == list(full)[3 * 16 :]
    full.set_epoch(2)
    assert list(full) != list(resumed)
    with pytest.raises(DataError, match="multiple of the world size 3"):
        PartitionedBatchSampler(split, 3, 0, 33, seed=5, parts=parts)
    dm.check_world_size(2)  # at start: what the sampler would refuse on this world size
    with pytest.raises(
        DataError, match="^data.partitions=4 must be a multiple of the world size 3"
    ):
        dm.check_world_size(3)


@pytest.mark.slow
def test_partitioned_shards_stopped_on_two_ranks_resume_on_one_to_the_same_job(
    shards: Path, tiny_root: Path, tmp_path: Path
) -> None:
    """Elastic resume with data.partitions: a job stopped mid-epoch on 2 ranks (each reading its
    partition's shards) and resumed on 1 trains the global batches of the 1-process job, to its
    weights (float64, exact BatchNorm and dropout: to 1e-8 of each tensor's largest value) and
    metrics. (Other global batches would train other weights, far more than 1e-8 away; which
    samples each rank reads is the daily test's above.)"""
    args = [
        *shard_overrides(tiny_root, shards),
        "trainer.max_epochs=1",
        "trainer.precision=64-true",
    ]
    args += ["data.partitions=2", AUGMENT, "data.num_workers=1"]
    run_entry("train", *args, "hydra.run.dir=one", cwd=tmp_path)
    stopped = run_entry(
        "train",
        *args,
        "strategy=ddp",
        "devices=2",
        "callbacks.stop_check_every_n_steps=2",
        "hydra.run.dir=two",
        cwd=tmp_path,
        check=False,
        env=signal_at_step("4:SIGTERM"),
    )
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    last = tmp_path / "two" / "checkpoints" / "last.ckpt"
    assert 4 <= torch.load(last, weights_only=True)["global_step"] < 10, "stopped mid-epoch"
    run_entry(
        "train",
        *args,
        f"ckpt_path={last}",
        "hydra.run.dir=resumed",
        cwd=tmp_path,
    )
    # Refused at start on a world size that cannot own whole partitions: no folder, no rank.
    refused = run_entry(
        "train",
        *args,
        "devices=4",
        f"ckpt_path={last}",
        "hydra.run.dir=on4",
        cwd=tmp_path,
        check=False,
    )
    assert one_error_line(refused.stderr).startswith(
        "Error: data.partitions=2 must be a multiple of the world size 4"
    )
    assert not (tmp_path / "on4").exists()
    expected, resumed = final_weights(tmp_path / "one"), final_weights(tmp_path / "resumed")
    for name, value in expected.items():
        equal = 1e-8 * value.double().abs().max().clamp_min(1e-3).item()
        torch.testing.assert_close(resumed[name], value, atol=equal, rtol=0, msg=name)
    metrics, one_metrics = read_metrics(tmp_path / "resumed"), read_metrics(tmp_path / "one")
    assert metrics == pytest.approx(one_metrics, rel=1e-6)


def upload(folder: Path, bucket: str, prefix: str, env: dict[str, str]) -> str:
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )
    s3.create_bucket(Bucket=bucket)
    for path in folder.rglob("*"):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")
    return f"s3://{bucket}/{prefix}"


@pytest.mark.slow
def test_shards_stream_from_s3_through_a_bounded_cache(
    shards: Path, tiny_root: Path, tmp_path: Path, s3_server: dict[str, str], monkeypatch
) -> None:
    root = upload(shards, "data", "tiny", s3_server)
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    cache = tmp_path / "cache"
    # In this process: no loader workers, whose forkserver may predate this environment.
    remote = ShardDataModule(
        "shards",
        root,
        batch_size=32,
        val_size=VAL_SIZE,
        cache_dir=str(cache),
        max_cache_size="1MB",
    )
    local = ShardDataModule("shards", str(shards), batch_size=32, val_size=VAL_SIZE)
    for dm in (remote, local):
        dm.setup("fit")
    batches = [list(dm.train_dataloader())[:4] for dm in (remote, local)]
    for got, expected in zip(*batches, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert list(cache.rglob("chunk-*.bin")), "shards were not cached"
    # A prefix or bucket without shards: one line, as for a local folder.
    for wrong in ("s3://data/elsewhere", "s3://no-such-bucket/tiny"):
        with pytest.raises(DataError, match=rf"{wrong}/manifest.json: .*written by"):
            ShardDataModule("shards", wrong, batch_size=32, val_size=VAL_SIZE)
    # A cache too small for a rank's shards (read in random order: a shard per sample) is
    # refused in one line, before any download.
    small = ShardDataModule("shards", root, batch_size=32, val_size=VAL_SIZE, max_cache_size="50KB")
    small.setup("fit")
    with pytest.raises(DataError, match=r"data.max_cache_size=50KB cannot hold the .* set data"):
        small.train_dataloader()
    # A real training job reading the bucket in loader workers, with the bounded cache.
    args = [*shard_overrides(tiny_root, shards), "trainer.max_epochs=1"]
    args += ["data.num_workers=2"]
    args = [a for a in args if not a.startswith("data.root")] + [f"data.root={root}"]
    args += [f"data.cache_dir={tmp_path / 'job-cache'}", "data.max_cache_size=1MB"]
    run_entry("train", *args, "hydra.run.dir=s3", cwd=tmp_path, env=s3_server)
    assert read_metrics(tmp_path / "s3")["test/samples"] == N_TEST
