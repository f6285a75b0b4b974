"""Evaluating a sharded model with each process on its own rows.

A sharded (FSDP) model gathers each block's weights from every process inside its forward, so the processes
must call that forward equally often. When each evaluates its own share of the rows, one may have fewer
batches than another (rows dropped as too long, an uneven split, longer windows): :class:`Lockstep` agrees on
the largest number of batches, and a process that runs out repeats a batch whose output it throws away.
Generation goes on until every process's batch has finished (``synced_gpus`` of transformers' generate).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

import torch

T = TypeVar("T")


class Lockstep:
    """The processes of one sharded model, evaluating their own rows."""

    def __init__(self, device: torch.device):
        self.device = device

    def most(self, count: int) -> int:
        """The largest ``count`` among the processes."""
        import torch.distributed as dist

        value = torch.tensor([count], dtype=torch.long, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def batches(self, chunks: list[T], spare: T) -> Iterator[tuple[T, bool]]:
        """``(chunk, mine)`` for as many batches as the process with the most: this process's chunks
        (``mine`` true), then its last one (or ``spare`` when it has none) again, whose results are thrown away."""
        rounds = self.most(len(chunks))
        for i in range(rounds):
            if i < len(chunks):
                yield chunks[i], True
            else:
                yield (chunks[-1] if chunks else spare), False


def in_step(chunks: list[T], lockstep: Lockstep | None, spare: T) -> Iterator[tuple[T, bool]]:
    """``chunks`` each with ``mine`` true, or, with a ``lockstep``, padded to the processes' largest count."""
    if lockstep is None:
        return ((chunk, True) for chunk in chunks)
    return lockstep.batches(chunks, spare)
