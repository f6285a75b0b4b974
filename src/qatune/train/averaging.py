"""``train.ema_decay``: an exponential moving average of the weights, the model that validation, best/ and final/ see.

After every optimizer step each averaged tensor moves toward the trained one:
``average = d * average + (1 - d) * weights``, with ``d = min(decay, (1 + t) / (10 + t))`` at step ``t`` (1-based),
so the first steps, at a lower decay, are not outweighed by the weights training started from. What is averaged
is what the optimizer updates (the fp32 masters under ``bf16_master_weights``, only the adapters of a LoRA run).
A checkpoint holds the trained weights (its model folder, which an exact resume continues from) and the average
(average.pt).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from qatune.errors import RunDirError

FILE = "average.pt"
"""The average's tensors in a checkpoint, in the order of the optimizer's parameters."""


def decay_at(decay: float, step: int) -> float:
    """The decay of the update after optimizer step ``step`` (1-based)."""
    return min(decay, (1 + step) / (10 + step))


class WeightAverage:
    """An exponential moving average of ``params`` (the tensors the optimizer updates), kept in fp32 beside them."""

    def __init__(self, params: list[torch.Tensor], decay: float):
        self.params = list(params)
        self.decay = decay
        self.averages = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step ``step``: each average moves ``1 - d`` of the way to its weights."""
        weight = 1.0 - decay_at(self.decay, step)
        torch._foreach_lerp_(self.averages, [p.detach().float() for p in self.params], weight)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The parameters hold the averaged weights while this is entered, the trained ones again afterwards
        (copied in place: a model that shares these tensors sees the average too)."""
        with torch.no_grad():
            trained = [p.detach().clone() for p in self.params]
            for p, average in zip(self.params, self.averages):
                p.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, weights in zip(self.params, trained):
                    p.copy_(weights)

    def save(self, folder: Path) -> None:
        torch.save(self.averages, folder / FILE)

    def load(self, checkpoint: Path) -> None:
        """The average a checkpoint saved (its shapes checked against this run's parameters)."""
        path = checkpoint / FILE
        if not path.is_file():
            raise RunDirError(f"{checkpoint} holds no {FILE} (its run was trained without train.ema_decay); resume "
                              "it with the train.ema_decay it was trained with")
        saved = torch.load(path, weights_only=True, map_location="cpu")
        shapes = [tuple(p.shape) for p in self.params]
        if not isinstance(saved, list) or [tuple(t.shape) for t in saved] != shapes:
            raise RunDirError(f"{path} does not match this run's trainable weights ({len(shapes)} tensors); resume "
                              "from a checkpoint of this run")
        with torch.no_grad():
            for average, tensor in zip(self.averages, saved):
                average.copy_(tensor)
