"""Deterministic data sharding: the same global batches whatever the number of processes."""
from __future__ import annotations

import copy
from typing import Iterator, List, Optional

import torch
from torch.utils.data import Sampler

# the batch split check is the config's (the config, the launcher, the trainer and the sampler call it)
from gnetmdk.config.overrides import check_batch_split  # noqa: F401


class GlobalBatchSampler(Sampler[List[int]]):
    """Yields this rank's part of each global batch.

    Each epoch draws one permutation from ``torch.Generator().manual_seed(seed + epoch)`` (or keeps
    index order without shuffling); global batch i is ``perm[i*B:(i+1)*B]`` and rank r takes the
    contiguous slice ``[r*b:(r+1)*b]`` of it (b = B / world_size). So concatenating the ranks' batches
    in rank order gives exactly the batch one process would see. An incomplete last global batch is
    dropped (every rank must take the same number of steps).

    Args:
        num_samples: dataset length.
        global_batch: B (must be divisible by world_size).
        rank, world_size: this process and the process count.
        shuffle, seed: permutation control.
        start_batch: skip the first global batches of the epoch set next (resume mid-epoch).
        accumulate: A micro-batches per optimizer step: this rank's slice of each global batch is
            yielded as A consecutive micro-batches of b / A images (gradient accumulation), so A
            accumulated micro-batches see exactly the images of one batch of B.
        virtual: V virtual ranks in this process (gnetmdk.dist.virtual): the process's slice is V
            rank slices, and its micro-batch k is the concatenation of every one of its ranks'
            micro-batch k, which the trainer cuts into V chunks: each virtual rank sees what the process
            of its rank sees in a run of world_size x V processes.
    Raises:
        ConfigError (a ValueError): B does not split over the processes and micro-batches
            (check_batch_split); ValueError: fewer samples than one global batch.
    """

    def __init__(self, num_samples: int, global_batch: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0, accumulate: int = 1, virtual: int = 1):
        check_batch_split(global_batch, world_size * virtual, accumulate)
        if num_samples < global_batch:
            raise ValueError(f"the training set has {num_samples} images, fewer than one batch of "
                             f"{global_batch}: lower batch_size")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.local_batch = global_batch // world_size
        self.rank = rank
        self.world_size = world_size
        self.accumulate = int(accumulate)
        self.virtual = int(virtual)
        self.rank_batch = self.local_batch // self.virtual
        self.micro_batch = self.local_batch // self.accumulate
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start_batch = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch whose permutation the next iteration draws, and skip its first ``start_batch``
        global batches (resume mid-epoch)."""
        self.epoch = int(epoch)
        self.start_batch = int(start_batch)

    def __len__(self) -> int:
        return (self.num_samples // self.global_batch - self.start_batch) * self.accumulate

    def global_order(self) -> List[int]:
        """This epoch's order of all sample indices: ``torch.randperm`` seeded with ``seed + epoch`` (the same
        on every rank), or 0 .. num_samples - 1 without shuffling."""
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def __iter__(self) -> Iterator[List[int]]:
        perm = self.global_order()
        for i in range(self.start_batch, self.num_samples // self.global_batch):
            start = i * self.global_batch + self.rank * self.local_batch
            per_rank = self.rank_batch // self.accumulate          # one rank's micro-batch
            for k in range(self.accumulate):
                yield [j for v in range(self.virtual)
                       for j in perm[start + v * self.rank_batch + k * per_rank:
                                     start + v * self.rank_batch + (k + 1) * per_rank]]


class ShardSampler(Sampler[int]):
    """Evaluation sharding: rank r takes indices r, r + W, r + 2W, ...; every image exactly once."""

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1):
        self.indices = list(range(rank, num_samples, world_size))

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self):
        return iter(self.indices)


class EpochBatches:
    """Batch sampler wrapper: each index of ``sampler``'s batches becomes ``(index, epoch, batch)``, with
    ``batch`` the index of its global batch in the epoch.

    The epoch is read from ``sampler.epoch`` when an epoch's iteration starts, in the loader's main
    process. Datasets that accept such keys then draw that epoch's augmentation even in persistent
    workers, whose dataset copies never see ``set_epoch``, and a per-batch choice (PP-YOLO's
    multi-scale size) from (seed, epoch, batch): the same on every rank and in a replay.

    ``chain_to``: None (one epoch per iteration of the loader), or an epoch E: the iteration started
    next goes on through the following epochs up to E - 1 (each from its first batch), the batches
    each epoch would give on its own, one after the other, so that the loader's workers prefetch
    across epoch boundaries (the trainer's chained loading). The value is read when ``iter`` is called;
    the iteration works on copies of ``sampler``, whose own epoch is left as it was.
    """

    def __init__(self, sampler: GlobalBatchSampler):
        self.sampler = sampler
        self.chain_to: Optional[int] = None

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        return self._batches(copy.copy(self.sampler), self.chain_to)   # chain_to read now, not at the first batch

    @staticmethod
    def _batches(sampler: GlobalBatchSampler, chain_to: Optional[int]):
        while True:
            epoch = int(sampler.epoch)
            first, per = int(sampler.start_batch), int(sampler.accumulate)
            for k, batch in enumerate(sampler):
                b = first + k // per
                yield [(i, epoch, b) for i in batch]
            if chain_to is None or epoch + 1 >= chain_to:
                return
            sampler = copy.copy(sampler)
            sampler.set_epoch(epoch + 1, 0)
