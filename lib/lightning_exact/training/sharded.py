"""Sharded checkpoints (``strategy=fsdp``, ``strategy.sharded_checkpoints=true``): a folder named
like the one-file checkpoint (``last.ckpt/``) in which every rank writes its own shard (torch's
distributed checkpoint: ``__<rank>_0.distcp`` and ``.metadata``) and rank 0 the rest (``meta.pt``:
loops, callbacks, the job). It is written beside its place and swapped in whole, read like a
one-file checkpoint by the checks, eval and predict, and made one file by ``src.consolidate``."""

import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_exact.files import fsync_folder, write_atomically

# What Lightning names rank 0's file of everything but weights and optimizer states (private.py).
META_FILE = "meta.pt"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a sharded checkpoint folder (Lightning's test: a folder with meta.pt)."""
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def staging_folder(path: Path) -> Path:
    """Where the ranks write the folder that replaces ``path``: hidden, beside it."""
    return path.with_name(f".{path.name}.tmp")


def replaced_folder(path: Path) -> Path:
    """Where ``path``'s previous checkpoint waits while the new one is swapped in."""
    return path.with_name(f".{path.name}.old")


def save_swapped(path: Path, save: Callable[[Path], None], barrier: Callable[[], None]) -> None:
    """Every rank ``save``s into the staging folder; once all are done, rank 0 swaps it in for
    ``path``. A job killed mid-write leaves the staging folder, which nothing reads, and ``path``
    as it was: no half-written folder is ever a checkpoint."""
    staging = staging_folder(path)
    rank_zero = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if rank_zero:
        path.parent.mkdir(parents=True, exist_ok=True)  # a file in its way: named here
        remove(staging)  # a killed job's
    barrier()
    save(staging)
    barrier()
    if rank_zero:
        swap_in(staging, path)
    barrier()


def swap_in(staging: Path, path: Path) -> None:
    """Rename ``staging`` to ``path``, the checkpoint there (a folder or a file) moved aside first
    and removed after: a crash between the two renames leaves it as :func:`replaced_folder`."""
    old = replaced_folder(path)
    remove(old)
    if path.exists():
        path.rename(old)
    staging.rename(path)
    remove(old)
    fsync_folder(path.parent)  # the renames survive a power loss


def write_file_over(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """:func:`~lightning_exact.files.write_atomically`, also where a sharded folder of that name is
    (a one-file checkpoint replacing it): written beside it, then swapped in."""
    if not is_sharded_checkpoint(path):
        write_atomically(path, write)
        return
    staging = staging_folder(path)
    remove(staging)
    write_atomically(staging, write)
    swap_in(staging, path)


def remove(path: Path) -> None:
    """A checkpoint folder or file, if there."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def copy_sharded(source: Path, target: Path) -> None:
    """``source`` to ``target`` (a resume into another folder keeps its best), swapped in whole;
    one already there was copied whole before."""
    if not is_sharded_checkpoint(target):
        staging = staging_folder(target)
        remove(staging)
        shutil.copytree(source, staging)
        swap_in(staging, target)


def read_sharded(path: Path, weights: bool = True) -> dict[str, Any]:
    """A sharded folder as the dictionary a one-file checkpoint holds. ``weights=False``: its
    tensors' shapes only (on the ``meta`` device) and each optimizer's state as ``None``, enough
    to check that it fits a job; ``True``: the weights, read whole into this process."""
    saved = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
    metadata = dcp.FileSystemReader(path).read_metadata()
    check_shards(path, metadata.storage_data)
    stored = metadata.state_dict_metadata
    device = "cpu" if weights else "meta"
    state_dict = {
        key.removeprefix("state_dict."): torch.empty(
            item.size, dtype=item.properties.dtype, device=device
        )
        for key, item in stored.items()
        if key.startswith("state_dict.") and isinstance(item, TensorStorageMetadata)
    }
    if weights:
        with warnings.catch_warnings():  # that no process group is used: none is asked for
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load({"state_dict": state_dict}, checkpoint_id=path, no_dist=True)
    optimizers = {key.split(".")[0] for key in stored if key.startswith("optimizer_")}
    return {**saved, "state_dict": state_dict, "optimizer_states": [None] * len(optimizers)}


def check_shards(path: Path, storage: dict[Any, Any]) -> None:
    """Every shard file ``.metadata`` names is there and long enough (a copy cut short, a node
    whose disk the others did not share): said in one line before any tensor is read."""
    ends: dict[str, int] = {}
    for where in storage.values():  # torch's _StorageInfo: file, offset, length (private.py)
        end = where.offset + where.length
        ends[where.relative_path] = max(ends.get(where.relative_path, 0), end)
    for name, end in sorted(ends.items()):
        shard = path / name
        if not shard.is_file():
            raise FileNotFoundError(f"its shard {name} is missing")
        if shard.stat().st_size < end:
            raise ValueError(
                f"its shard {name} is cut short ({shard.stat().st_size} of {end} bytes)"
            )


def consolidate(folder: Path, target: Path) -> None:
    """Write the sharded checkpoint ``folder`` as the one file a job gathered on rank 0 writes
    (weights, optimizer states keyed by parameter number, loops, callbacks, the job): eval,
    predict, the MLflow model, ``weights_from`` and a resume under any strategy take it.
    ``target`` may be ``folder`` itself: the file is swapped in for it."""
    whole = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        dcp_to_torch_save(folder, whole)  # torch's own reader, with no process group
        shards = torch.load(whole, map_location="cpu", mmap=True, weights_only=True)
        checkpoint = torch.load(folder / META_FILE, map_location="cpu", weights_only=True)
        checkpoint["state_dict"] = shards["state_dict"]
        count = sum(1 for key in shards if key.startswith("optimizer_"))
        checkpoint["optimizer_states"] = [
            by_parameter_number(shards[f"optimizer_{index}"]) for index in range(count)
        ]
        write_file_over(target, lambda file: torch.save(checkpoint, file))
    finally:
        whole.unlink(missing_ok=True)


def by_parameter_number(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state keyed by parameter name (a sharded checkpoint's) as
    ``Optimizer.state_dict()`` keys it: by each parameter's place in its groups, in order."""
    groups = state["param_groups"]
    number = {name: n for n, name in enumerate(name for g in groups for name in g["params"])}
    return {
        "state": {number[name]: value for name, value in state["state"].items()},
        "param_groups": [{**g, "params": [number[name] for name in g["params"]]} for g in groups],
    }
