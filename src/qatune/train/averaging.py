"""``train.ema_decay``: an exponential moving average of the weights, the model that validation, best/ and final/ see.

After optimizer step ``t`` (1-based) the average is that of the weights after each step ``s <= t`` weighed by
``decay ** (t - s)``, normalised as Adam corrects its moments' bias: each update moves it
``(1 - decay) / (1 - decay ** t)`` of the way to the new weights (all of the way after the first step), so the
weights training started from do not count, however short the run. What is averaged
is what the optimizer updates (the fp32 masters under ``bf16_master_weights``, only the adapters of a LoRA run).
A checkpoint holds the trained weights (its model folder, which an exact resume continues from) and the average
(average.pt). Under train.distributed fsdp each process averages its own shard of the weights (the update is
elementwise, so the shards make up the whole model's average) and a checkpoint keeps the average with the weights'
shards.
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
    """The decay of the update after optimizer step ``step`` (1-based): 0 after the first, toward ``decay``."""
    return 1.0 - (1.0 - decay) / (1.0 - decay**step)


class WeightAverage:
    """An exponential moving average of ``params`` (the tensors the optimizer updates), kept in fp32 beside them."""

    def __init__(self, params: list[torch.Tensor], decay: float, sharded_model: torch.nn.Module | None = None):
        self.params = list(params)
        self.decay = decay
        self.averages = [p.detach().float().clone() for p in self.params]
        self.by_name = self.named(sharded_model) if sharded_model is not None else None
        """A sharded run's averages keyed by their parameters' names, as its checkpoints keep them (named here,
        before any forward: a unit gathered for one holds other tensors under those names)."""

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step ``step``: each average moves ``1 - d`` of the way to its weights."""
        weight = 1.0 - decay_at(self.decay, step)
        torch._foreach_lerp_(self.averages, [p.detach().float() for p in self.params], weight)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The parameters hold the averaged weights while this is entered, the trained ones again afterwards
        (copied in place: a model that shares these tensors sees the average too). An fp32 parameter trades
        values with its average through one tensor's room at a time; one of another dtype is kept aside."""
        with torch.no_grad():
            kept = [None if p.dtype == average.dtype else p.detach().clone()
                    for p, average in zip(self.params, self.averages)]
            for p, average, aside in zip(self.params, self.averages, kept):
                if aside is None:
                    _trade(p, average)
                else:
                    p.copy_(average)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, average, aside in zip(self.params, self.averages, kept):
                    if aside is None:
                        _trade(p, average)
                    else:
                        p.copy_(aside)

    def named(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The averages keyed by their parameters' names in ``model`` (as a sharded checkpoint keeps them)."""
        names = {id(p): name for name, p in model.named_parameters()}
        return {names[id(p)]: average for p, average in zip(self.params, self.averages)}

    def save(self, folder: Path) -> None:
        torch.save(self.averages, folder / FILE)

    def load(self, checkpoint: Path) -> None:
        """The average a checkpoint saved (its shapes checked against this run's parameters)."""
        path = checkpoint / FILE
        if not path.is_file():
            raise RunDirError(f"{checkpoint} holds no {FILE}, the average of its weights that train.ema_decay "
                              "keeps: the checkpoint is incomplete; resume from another one")
        saved = torch.load(path, weights_only=True, map_location="cpu")
        shapes = [tuple(p.shape) for p in self.params]
        if not isinstance(saved, list) or [tuple(t.shape) for t in saved] != shapes:
            raise RunDirError(f"{path} does not match this run's trainable weights ({len(shapes)} tensors); resume "
                              "from a checkpoint of this run")
        with torch.no_grad():
            for average, tensor in zip(self.averages, saved):
                average.copy_(tensor)


def _trade(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchanges two same-dtype tensors' values in place."""
    held = a.clone()
    a.copy_(b)
    b.copy_(held)
