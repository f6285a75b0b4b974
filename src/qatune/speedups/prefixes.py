"""Prompt prefixes that rows share, found from their token ids on the host (for ``shared_prefix``,
``prefix_groups`` and ``gpt2_supervised_rows``, and for the batches of ``train.group_by_prefix``).

A spreadsheet of reading-comprehension QA asks several questions about each context, and a template that
puts the context first (``{context}\\n\\nQuestion: {question}``, qatune's default) gives those rows one long
common prefix: the system prompt and the context are most of each row.
A causal model's states on a prefix do not depend on what follows it, so a prefix that several rows of a
batch share needs computing once (its keys and values reach each row through the model's cache, and their
gradients add up over the rows the same way). This module decides, with no model, what to share:

* :func:`families`: examples whose prompts share a long prefix beyond what every prompt shares (the same
  context), which the sampler keeps together so that they land in the same batches;
* :func:`shared_prefix`: the leading tokens every row of a batch has in common (a system prompt);
* :func:`plan`: groups of a batch's rows, each with its own common prefix, when computing each group's
  prefix once costs fewer token positions than the batch's single common prefix does;
* :class:`PrefixPlanner`: a causal collator's batches with those plans added, for the loss to use.

No prefix reaches a row's first supervised position (the one that predicts its first answer token).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qatune.data.padding import round_up

MIN_FAMILY_PREFIX = 16
"""Tokens beyond the prefix every prompt shares that examples must have in common to be batched together."""


def common_length(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """Leading tokens ``a`` and ``b`` have in common, at most ``limit``."""
    length = 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        length += 1
    return length


def shared_prefix(rows: Sequence[Sequence[int]], limits: Sequence[int]) -> int:
    """Leading tokens common to every row, at most each row's limit (0 for fewer than two rows)."""
    if len(rows) < 2:
        return 0
    first, limit = rows[0], min(limits)
    return min(common_length(first, row, limit) for row in rows[1:])


def families(prompts: Sequence[Sequence[int]]) -> list[list[int]] | None:
    """Indices of prompts that share a long prefix, in families (every index in one; most alone).

    Two prompts are of a family when they share at least half of what follows the prefix common to all
    prompts in the shorter of them, and at least MIN_FAMILY_PREFIX tokens of it: rows about one context,
    not questions that begin alike. None when no two prompts are of a family."""
    if len(prompts) < 2:
        return None
    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i]))
    common = common_length(prompts[order[0]], prompts[order[-1]], len(prompts[order[0]]))
    found, current = [], [order[0]]
    for before, index in itertools.pairwise(order):
        a, b = prompts[before], prompts[index]
        shorter = min(len(a), len(b))
        beyond = common_length(a, b, shorter) - common
        if beyond >= MIN_FAMILY_PREFIX and 2 * beyond >= shorter - common:
            current.append(index)
        else:
            found.append(current)
            current = [index]
    found.append(current)
    if all(len(family) == 1 for family in found):
        return None
    return sorted(sorted(family) for family in found)


def plan(rows: Sequence[Sequence[int]], limits: Sequence[int], width: int, multiple: int = 1
         ) -> dict[str, torch.Tensor | int] | None:
    """How a batch's rows share prompt prefixes by group, or None where the single common prefix costs less.

    ``rows``: each row's tokens (its length is what the forward reads of it, at most ``width``, the batch's
    width); ``limits``: each row's position that predicts its first supervised token (no prefix reaches it);
    ``multiple``: what widths are rounded up to (``width_rounding``). The cost of a layout is the
    token positions the model computes: with one common prefix of length p, ``p + rows * (width - p)``; by
    groups, every group's prefix (padded to the longest) and every row's rest (padded to the longest).

    Returns ``rows`` (a row of each group: whose tokens its prefix is), ``lengths`` (each group's prefix),
    ``group`` (each row's group), and the padded ``prefix_width`` and ``suffix_width``."""
    count = len(rows)
    if count < 2:
        return None
    order = sorted(range(count), key=lambda i: list(rows[i][:limits[i]]))
    adjacent = [common_length(rows[a], rows[b], min(limits[a], limits[b])) for a, b in itertools.pairwise(order)]
    common = min(adjacent)
    best, chosen = common + count * (width - common), None
    for threshold in sorted(set(adjacent)):
        if threshold <= common:
            continue
        runs = _split(order, adjacent, threshold)
        shared = [(members, min(adjacent[start:start + len(members) - 1])) for start, members in _starts(runs)
                  if len(members) > 1]
        longest = max(length for _, length in shared)
        alone = [members[0] for members in runs if len(members) == 1]
        # Rows in no run: each its own prefix (as long as the others'), or all of them one group (their common one).
        layouts = [shared + [([i], min(limits[i], longest)) for i in alone]]
        if len(alone) > 1:
            layouts.append([*shared, (alone, shared_prefix([rows[i] for i in alone], [limits[i] for i in alone]))])
        for layout in layouts:
            prefix_width = min(round_up(max(length for _, length in layout), multiple), width)
            suffix_width = round_up(max(len(rows[i]) - length for members, length in layout for i in members),
                                    multiple)
            cost = len(layout) * prefix_width + count * suffix_width
            if cost < best:
                best, chosen = cost, (layout, prefix_width, suffix_width)
    if chosen is None:
        return None
    layout, prefix_width, suffix_width = chosen
    layout = sorted((sorted(members), length) for members, length in layout)  # in the order of their first rows
    groups, lengths = [members for members, _ in layout], [length for _, length in layout]
    group = [0] * count
    for k, members in enumerate(groups):
        for i in members:
            group[i] = k
    return {"rows": torch.tensor([g[0] for g in groups]), "lengths": torch.tensor(lengths),
            "group": torch.tensor(group), "prefix_width": prefix_width, "suffix_width": suffix_width}


def _split(order: list[int], adjacent: list[int], threshold: int) -> list[list[int]]:
    """``order`` cut wherever two neighbours share fewer than ``threshold`` tokens."""
    groups = [[order[0]]]
    for index, shared in zip(order[1:], adjacent):
        if shared >= threshold:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def _starts(groups: list[list[int]]) -> list[tuple[int, list[int]]]:
    """Each group with the position of its first member in the sorted order (where its neighbours' shared
    lengths start in ``adjacent``)."""
    out, start = [], 0
    for members in groups:
        out.append((start, members))
        start += len(members)
    return out


@dataclass
class PrefixPlanner:
    """A causal collator whose batches also say which prompt prefixes the loss may compute once:
    ``shared_prefix`` (the leading tokens every row shares) and ``prefix_groups`` (:func:`plan`). Neither
    reaches a row's first supervised position; with the prompt trained on too there is nothing to share."""

    collator: Any
    """The causal collator (:class:`qatune.data.generative.CausalCollator`)."""
    shared: bool
    groups: bool

    def __call__(self, examples: list[Any]) -> dict[str, Any]:
        batch = self.collator(examples)
        if self.collator.train_on_prompt:
            return batch
        limits = [e.prompt_length - 1 for e in examples]
        if self.shared:
            batch["shared_prefix"] = shared_prefix([e.input_ids for e in examples], limits)
        if self.groups:
            cut = self.collator.uncounted_columns  # what the forward reads of each row and of the batch
            width = batch["input_ids"].shape[1] - cut
            batch["prefix_groups"] = plan([e.input_ids[:len(e) - cut] for e in examples], limits, width,
                                          self.collator.pad_to_multiple_of)
        return batch
