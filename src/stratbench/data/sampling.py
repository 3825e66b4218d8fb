"""Which samples each rank reads, in which order: evaluation shards padded to equal length, a resumable
training sampler that orders each step as data-parallel ranks would split it."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler

from stratbench.core.errors import ConfigError


class ShardSampler(Sampler[int]):
    """Evaluation sampler: rank r takes indices r, r+N, ..., so every sample is seen exactly once overall
    (``DistributedSampler`` would pad with repeats that count twice). Ranks with fewer samples are padded with
    -1 (weight 0 in ``PaddedEval``), so that every rank runs the same number of batches: sharded methods
    gather parameters in each forward, a collective every rank must join."""

    def __init__(self, length: int, rank: int, world_size: int) -> None:
        self.indices = list(range(rank, length, world_size))
        self.indices += [-1] * (math.ceil(length / world_size) - len(self.indices))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class PaddedEval(Dataset):
    """(x, y, valid) with valid=0 for the padding index -1."""

    def __init__(self, ds: Dataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        x, y = self.ds[max(i, 0)]
        return x, y, torch.tensor(0.0 if i < 0 else 1.0)


def virtual_rank_order(n: int, step_samples: int, chunks: int) -> list[int]:
    """Positions 0..n-1 of one rank's sample stream, reordered within each step's ``step_samples`` so that the
    step's ``chunks`` consecutive micro-batches are the shares that ``chunks`` data-parallel ranks would take of
    it: micro-batch k holds the step's samples k, k + chunks, k + 2 x chunks, ... (DistributedSampler's split).

    So one device accumulating A micro-batches (``--grad-accum A``, or a pipeline's M micro-batches) computes on
    exactly the micro-batches of A ranks, and its summed gradients equal the ranks' all-reduced ones bit for bit
    (two-operand sums, power-of-two scaling): ``single --grad-accum 2`` reproduces 2-rank ``ddp`` in any
    precision, on any CPU. The set of samples in each step is unchanged; a last, partial step keeps its order."""
    if chunks <= 1 or step_samples <= chunks:
        return list(range(n))
    if step_samples % chunks:
        raise ConfigError(
            f"a step of {step_samples} samples per rank does not split into {chunks} micro-batches"
        )
    order: list[int] = []
    full = n - n % step_samples
    for base in range(0, full, step_samples):
        order += [base + j for k in range(chunks) for j in range(k, step_samples, chunks)]
    return order + list(range(full, n))


class SkipSampler(Sampler[int]):
    """Wraps a sampler: drops its first ``skip`` indices (resuming in the middle of an epoch; whole steps) and
    orders each step's indices as ``chunks`` data-parallel ranks would split them (``virtual_rank_order``)."""

    def __init__(self, sampler: DistributedSampler, step_samples: int = 1, chunks: int = 1) -> None:
        self.sampler = sampler
        self.skip = 0
        self.step_samples, self.chunks = step_samples, chunks

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        indices = list(self.sampler)[self.skip :]
        return iter([indices[i] for i in virtual_rank_order(len(indices), self.step_samples, self.chunks)])

    def __len__(self) -> int:
        return len(self.sampler) - self.skip
