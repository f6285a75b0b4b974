"""The order of training examples: shuffled batches of similar length, resumable mid-epoch."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import torch


class LengthGroupedBatches(torch.utils.data.Sampler):
    """Shuffled batches of similar-length examples: less padding, still a new order every epoch.

    Indices are shuffled, cut into mega-batches of 50 batches, each sorted by length and cut into
    batches; then the batch order is shuffled. ``group=False`` gives plain shuffled batches.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int, group: bool = True, mega: int = 50):
        self.lengths = lengths
        self.batch_size = batch_size
        self.seed = seed
        self.group = group
        self.mega = mega
        self.epoch = 0
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, batches: int) -> None:
        """Leave out the first ``batches`` batches of the next pass (resuming inside an epoch)."""
        self._skip = batches

    def __iter__(self) -> Iterator[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        if self.group:
            size = self.batch_size * self.mega
            order = [i for start in range(0, len(order), size)
                     for i in sorted(order[start : start + size], key=lambda j: -self.lengths[j])]
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.group:
            rng.shuffle(batches)
        skip, self._skip = self._skip, 0
        return iter(batches[skip:])

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)
