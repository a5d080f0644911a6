"""``python -m src.consolidate CHECKPOINT_FOLDER [--output FILE]``: one file from a sharded one.

A job under ``strategy=fsdp`` writes each checkpoint as a folder where every rank wrote its shard
(see lib/lightning_exact/training/sharded.py). eval, predict and an FSDP resume take the folder as
it is; this makes it the one file a gathered checkpoint is (weights, optimizer states, loops, the
job), for a resume under DDP or on one process, ``weights_from=``, or to hand the model on. It reads
the shards in this one process: the whole state must fit its memory."""

import argparse
import sys
from pathlib import Path

from lightning_exact.checkpoints.checkpoint import CheckpointError, read_checkpoint
from lightning_exact.training.sharded import consolidate, is_sharded_checkpoint


def consolidated(folder: Path, output: Path | None) -> Path:
    """Write ``folder`` as one file (by default ``<name>.consolidated.ckpt`` beside it)."""
    if not folder.exists():
        raise CheckpointError(f"{folder}: no such folder")
    if not is_sharded_checkpoint(folder):
        if folder.is_file():
            raise CheckpointError(
                f"{folder} is one file already: eval, predict and resume take it as it is"
            )
        raise CheckpointError(
            f"{folder} is not a sharded checkpoint folder (one with meta.pt, written under "
            "strategy=fsdp); pass outputs/train/runs/<time>/checkpoints/<name>.ckpt"
        )
    target = output or folder.with_name(f"{folder.stem}.consolidated.ckpt")
    if target.exists():
        raise CheckpointError(f"{target} exists; remove it or choose another with --output FILE")
    try:  # one line for a folder it cannot read
        read_checkpoint(str(folder), weights=False)
    except CheckpointError as error:
        raise CheckpointError(str(error).replace(f"ckpt_path={folder}", str(folder))) from None
    consolidate(folder, target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m src.consolidate",
        description="Write a sharded checkpoint folder (strategy=fsdp) as one .ckpt file.",
    )
    parser.add_argument(
        "folder", type=Path, help="the sharded checkpoint: .../checkpoints/last.ckpt"
    )
    parser.add_argument(
        "--output", type=Path, help="the file to write (default: <name>.consolidated.ckpt)"
    )
    args = parser.parse_args(argv)
    try:
        target = consolidated(args.folder, args.output)
    except CheckpointError as error:
        print(f"Error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {target}: eval, predict, weights_from= and a resume under any strategy take it")
    return 0
