"""The order of training examples: shuffled batches of similar length, resumable mid-epoch, and the windows of
micro-batches each update takes."""

from __future__ import annotations

import collections
import itertools
import math
import random
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from qatune.data.generative import Example
from qatune.speedups import prefixes


class LengthGroupedBatches(torch.utils.data.Sampler):
    """Shuffled batches of similar-length examples: less padding, still a new order every epoch.

    Indices are shuffled, cut into mega-batches of 50 batches, each sorted by length and cut into
    batches; then the batch order is shuffled, and the heaviest batch (rows x its longest example) is moved to the
    end. Every epoch meets its peak memory there, once the steps before it have made what every later step holds
    besides its batch: AdamW's moments, the moving average of the weights, and the kernels built for each batch shape
    the epoch trains (under bf16 on a CPU, oneDNN's and PyTorch's caches of them keep several MB per shape). The
    first epoch's peak is then what every later epoch's is, rather than an earlier peak that later epochs exceed
    (transformers' LengthGroupedSampler puts its longest batch first, before any of that exists).
    ``group=False`` gives plain shuffled batches.

    ``families`` (lists of indices, every index in one): examples kept next to each other (rows that share a
    long prompt prefix, so that they share batches and the model computes the prefix once per batch);
    families are shuffled as units, sorted by their longest example, and batches filled with whole families
    where one of the next few fits (a family is split across two batches only where none does). With none
    of them larger than one, the order is the same as without.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int, group: bool = True, mega: int = 50,
                 families: list[list[int]] | None = None):
        self.lengths = lengths
        self.batch_size = batch_size
        self.seed = seed
        self.group = group
        self.mega = mega
        self.families = families if families is not None else [[i] for i in range(len(lengths))]
        self.pack = any(len(family) > 1 for family in self.families)
        self.epoch = 0
        self._skip = 0

    def prefix_batches(self, train_cfg: Any, prefix_groups: bool) -> str | None:
        """What train.group_by_prefix did to the batches (None when it is off); ``prefix_groups``: whether the
        speed path that computes each group's prefix once per batch is on."""
        if self.pack:
            kept = [family for family in self.families if len(family) > 1]
            how = ("each group's prefix computed once per batch" if prefix_groups
                   else "this model's path computes only a batch's common prefix once")
            return (f"{sum(map(len, kept))} of {len(self.lengths)} rows in {len(kept)} groups that share a long "
                    f"prompt prefix (one context) kept together, {how} (train.group_by_prefix)")
        if train_cfg.group_by_prefix:
            why = ("the prompts are trained on too (train.train_on_prompt)" if train_cfg.train_on_prompt
                   else "no rows share a long prompt prefix (one context)")
            return f"train.group_by_prefix keeps no rows together: {why}"
        return None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, batches: int) -> None:
        """Leave out the first ``batches`` batches of the next pass (resuming inside an epoch)."""
        self._skip = batches

    def __iter__(self) -> Iterator[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        units = list(self.families)
        rng.shuffle(units)
        if self.pack:
            units = [rng.sample(unit, len(unit)) if len(unit) > 1 else unit for unit in units]
        if self.group:
            units = self._by_length(units)
        order = _packed(units, self.batch_size) if self.pack else [i for unit in units for i in unit]
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.group and batches:
            rng.shuffle(batches)
            weight = [len(batch) * max(self.lengths[i] for i in batch) for batch in batches]
            batches.append(batches.pop(weight.index(max(weight))))
        skip, self._skip = self._skip, 0
        return iter(batches[skip:])

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)

    def _by_length(self, units: list[list[int]]) -> list[list[int]]:
        """Mega-batches of about ``batch_size * mega`` examples (whole units, each sorted by length), each
        sorted by its units' longest example."""
        size = self.batch_size * self.mega
        if not self.pack:
            chunks = [units[start : start + size] for start in range(0, len(units), size)]
        else:
            chunks, filled = [[]], 0
            for unit in units:
                if filled >= size:
                    chunks.append([])
                    filled = 0
                chunks[-1].append(sorted(unit, key=lambda j: -self.lengths[j]))
                filled += len(unit)
        return [unit for chunk in chunks for unit in sorted(chunk, key=lambda u: -self.lengths[u[0]])]


LOOK_AHEAD = 16
"""How many of the next families a batch may take one from, to be filled without splitting one."""


def _packed(units: list[list[int]], batch_size: int) -> list[int]:
    """The units' indices in an order that, cut every ``batch_size``, splits few units: each batch starts
    with the next unit (the rest of one split before it, if any), then takes the largest of the next
    LOOK_AHEAD units that fits whole in what is left of it (the first of those), and splits the next unit only
    where none does. Units of one index keep their order."""
    pending, order, room = collections.deque(units), [], batch_size
    while pending:
        window = itertools.islice(pending, 1 if room == batch_size else LOOK_AHEAD)  # a batch starts in order
        fits = [(len(unit), -k) for k, unit in enumerate(window) if len(unit) <= room]
        if not fits:
            unit = pending[0]
            order += unit[:room]
            pending[0], room = unit[room:], batch_size
            continue
        pick = -max(fits)[1]  # the largest that fits, the first of those
        unit = pending[pick]
        del pending[pick]
        order += unit
        room = room - len(unit) or batch_size
    return order


def training_batches(dataset: Any, config: Any) -> LengthGroupedBatches:
    """The batch order a run trains in: length-grouped as train.group_by_length says, with rows that share a
    long prompt prefix kept together as train.group_by_prefix says (generative rows, trained on the answer)."""
    train_cfg = config.train
    families = None
    if train_cfg.group_by_prefix and not train_cfg.train_on_prompt:
        families = prompt_families(dataset)
    return LengthGroupedBatches(dataset.lengths, train_cfg.batch_size, config.seed, group=train_cfg.group_by_length,
                                families=families)


_FAMILIES: weakref.WeakKeyDictionary[Any, list[list[int]] | None] = weakref.WeakKeyDictionary()


def prompt_families(dataset: Any) -> list[list[int]] | None:
    """Examples of a dataset whose prompts share a long prefix, such as rows about one context
    (:func:`qatune.speedups.prefixes.families`; found once per dataset); None when there are none, or for
    examples that are not a causal LM's."""
    if dataset not in _FAMILIES:
        items = dataset.items
        causal = bool(items) and all(type(item) is Example for item in items)
        prompts = [item.input_ids[:item.prompt_length] for item in items] if causal else []
        _FAMILIES[dataset] = prefixes.families(prompts) if causal else None
    return _FAMILIES[dataset]


def windows(loader: Any, accum: int) -> Iterator[tuple[list[dict[str, torch.Tensor]], bool]]:
    """Groups of ``accum`` micro-batches (the last group of an epoch may be shorter), each with whether it is the
    epoch's last."""
    window: list[dict[str, torch.Tensor]] = []
    ready: list[dict[str, torch.Tensor]] | None = None
    for batch in loader:
        window.append(batch)
        if len(window) == accum:
            if ready is not None:
                yield ready, False
            ready, window = window, []
    if window:
        if ready is not None:
            yield ready, False
        ready = window
    if ready is not None:
        yield ready, True
