"""``data.partitions=C``: each rank reads only its share of the shards (MosaicML streaming's
"canonical nodes").

The shards of the training split are grouped into ``C`` canonical partitions (contiguous runs of
whole shards). Every global batch takes ``batch_size / C`` samples from each partition, drawn
from that partition's own permutation of (seed, epoch, partition). Rank ``r`` of ``N`` owns
partitions ``r*C/N .. (r+1)*C/N - 1`` and its share of every global batch is exactly their
samples: the global batch, as a set, is the same for any ``N`` dividing ``C`` (hence the summed
gradient and the metrics), while a rank only ever touches ``1/N`` of the shards.
"""

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from lightning_exact import DataError, GlobalBatchSampler
from torch import Tensor
from torch.utils.data import Dataset


def check_partitions(count: int, world_size: int, global_batch_size: int) -> None:
    """Refuse ``data.partitions=count`` where ``world_size`` ranks cannot each own whole
    partitions, or a global batch cannot take the same share of each: checked at start (also
    for a job resumed on another number of ranks), and by the sampler."""
    if count % world_size:
        raise DataError(
            f"data.partitions={count} must be a multiple of the world size {world_size}: each "
            f"rank reads whole partitions (a job resumed on another number of ranks too)"
        )
    if global_batch_size % count:
        raise DataError(
            f"data.batch_size={global_batch_size} must be a multiple of "
            f"data.partitions={count}: each global batch takes the same share of each"
        )


def chunk_groups(chunk_sizes: Sequence[int], count: int) -> Tensor:
    """The partition of each shard (sample counts ``chunk_sizes``): ``count`` runs of whole
    shards of about equal sample counts."""
    sizes = torch.tensor(chunk_sizes, dtype=torch.long)
    ends = sizes.cumsum(0)
    return (ends - sizes) * count // int(ends[-1])


def partition_rows(chunk_sizes: Sequence[int], count: int, indices: Tensor) -> list[Tensor]:
    """The rows of a split (``indices``: their positions in the shards) in each of ``count``
    groups of contiguous whole shards, of about equal sample counts."""
    if not 1 <= count <= len(chunk_sizes):
        raise DataError(
            f"data.partitions={count} must be between 1 and the {len(chunk_sizes)} shards of "
            "the training split (src.prepare chunk_bytes=... writes smaller shards)"
        )
    group_of_chunk = chunk_groups(chunk_sizes, count)
    if len(set(group_of_chunk.tolist())) != count:
        raise DataError(f"data.partitions={count}: the shards do not split into that many groups")
    chunk_of_row = torch.searchsorted(torch.tensor(chunk_sizes).cumsum(0), indices, right=True)
    group_of_row = group_of_chunk[chunk_of_row]
    return [(group_of_row == group).nonzero().flatten() for group in range(count)]


class PartitionedBatchSampler(GlobalBatchSampler):
    """Global batches of ``global_batch_size / C`` samples from each of the ``C`` partitions;
    this rank's share is its partitions' samples. With ``tag_epoch``, positions come as
    ``(epoch, position)`` for :class:`~src.task.data.augment.AugmentedSplit`."""

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int,
        rank: int,
        global_batch_size: int,
        seed: int,
        parts: list[Tensor],
        tag_epoch: bool = False,
    ) -> None:
        count = len(parts)
        check_partitions(count, num_replicas, global_batch_size)
        super().__init__(dataset, num_replicas, rank, global_batch_size, seed)
        self.parts = parts
        self.tag_epoch = tag_epoch
        self.per_part = global_batch_size // count
        self.num_batches = min(len(part) for part in parts) // self.per_part
        if self.num_batches == 0:
            raise DataError(
                f"data.batch_size={global_batch_size} takes {self.per_part} samples a batch "
                f"from each of {count} partitions, more than the smallest has; lower either"
            )
        self.num_samples = self.num_batches * self.local_batch_size
        self.total_size = self.num_batches * global_batch_size
        share = count // num_replicas
        self.mine = range(rank * share, (rank + 1) * share)

    def part_order(self, part: int) -> Tensor:
        """Partition ``part``'s samples of this epoch as ``[num_batches, per_part]``."""
        state = np.random.SeedSequence([self.seed, self.epoch, part]).generate_state(1)[0]
        generator = torch.Generator().manual_seed(int(state))
        rows = self.parts[part]
        order = torch.randperm(len(rows), generator=generator)[: self.num_batches * self.per_part]
        return rows[order].view(self.num_batches, self.per_part)

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int]]:  # type: ignore[override]
        skip = self.batches_done if self.epoch == self.resume_epoch else 0
        local = torch.cat([self.part_order(part) for part in self.mine], dim=1)
        positions = local[skip:].reshape(-1).tolist()
        if self.tag_epoch:
            epoch = self.epoch
            return ((epoch, i) for i in positions)
        return iter(positions)
