"""The process's memory while it trains: few batch shapes under bf16 on a CPU, freed memory handed back before it
piles up, and a warning when it climbs.

Under bf16 on a CPU, oneDNN builds kernels for each matrix shape it meets and keeps a few MB of each, whatever its
primitive cache holds (measured: ~1.4-3 MB for every new width of two linear layers, none for a width met before).
Batches of every length meet new shapes epoch after epoch, so :func:`few_shapes` rounds their widths up to one of a
few sizes (at most an eighth longer: data/padding.bucket), whatever train.speedups says; the speed paths that run
a layer on a batch's real tokens round those rows up too (speedups/shapes.rows_multiple).

glibc's malloc keeps the blocks a step frees in its heaps for the next allocation. Batches of many widths (rows of
every length, grouped by length) free blocks of ever other sizes; the holes they leave fit the next width's blocks
badly, so each width never met before takes fresh memory and the resident set climbs with every new width, epoch
after epoch, whatever the precision and whether or not ``malloc_reuse`` is on (bench/results/*/memory_epochs*.json;
the memory is free, not leaked: ``malloc_trim`` returns it). A fixed set of widths does not climb.

:class:`Heap` reads the resident set after every update (``/proc/self/statm``, microseconds) and trims glibc's heaps
when it exceeds, by ``TRIM_SLACK``, the most an ordinary step has held after a trim: memory stays near what the widest
batch needs, and a run that does not fragment never trims (a trim costs the next step its page faults). A step whose
batch is the epoch's largest so far does not count: it leaves larger blocks freed, and measured against it, later
epochs would hold more freed memory between steps than the first epoch's peak. After the first epoch, the most an
ordinary step of it left the process holding is a limit too (``EPOCH_SLACK`` over it).

A step peaks at what the process holds when it starts plus what it cannot take from that. A step whose batch is
larger than any before it in the epoch needs blocks larger than any the heap holds, so they are new memory on top of
it: such a step starts on a trimmed heap (:meth:`Heap.before_step`; a few steps an epoch, its heaviest, the last,
among them). Otherwise, where the first epoch met its widest batches on a heap trimmed by chance, a later epoch met
them on a full one and peaked ~10% higher (SmolLM2 under bf16: bench/results/*/memory_epochs.json).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from qatune.speedups.malloc_reuse import glibc, hand_back_freed_memory
from qatune.train.memory_estimate import resident_bytes

log = logging.getLogger("qatune")


def few_shapes(collator: Any, precision: str, device_type: str) -> bool:
    """Have the collator pad batches to few widths where each new shape keeps memory (bf16 on a CPU); whether it
    does."""
    if precision != "bf16" or device_type != "cpu" or not hasattr(collator, "bucketed"):
        return False
    collator.bucketed = True
    return True


TRIM_SLACK = 0.08
"""Freed memory kept beyond what a settled step held, as a share of it, before it is handed back."""
EPOCH_SLACK = 0.02
"""After the first epoch, freed memory kept beyond the most an ordinary step of the first epoch held, as a share of
it, before it is handed back."""
EPOCH_GROWTH_WARNING = 0.25
"""The resident set's growth from one epoch to the next (the same rows) that the log warns of."""
MIB = 2**20
TRIM_EVERY_STEP = "QATUNE_TRIM_EVERY_STEP"
"""Set to 1 in the environment, the heap is trimmed after every update, not only when freed memory piles up: every
step starts from what is alive, so no later epoch's peak passes the first's, and every step faults its pages in again
(slower: docs/performance.md)."""


class Heap:
    """The loop calls :meth:`before_step` before every step, :meth:`after_update` after every update and
    :meth:`end_epoch` at every epoch's end; ``trims`` counts the hand-backs."""

    def __init__(self, enabled: bool | None = None, resident: Callable[[], int] = resident_bytes,
                 trim: Callable[[], object] = hand_back_freed_memory, every_step: bool | None = None):
        self.enabled = glibc() if enabled is None else enabled
        self.every_step = os.environ.get(TRIM_EVERY_STEP) == "1" if every_step is None else every_step
        """Trim after every update: each step starts on a heap that holds no freed memory."""
        self.resident, self.trim = resident, trim
        self.settled = 0
        """The most the resident set held after an ordinary step that followed a trim (or the run's first step)."""
        self.fresh = True
        """The next ordinary step settles: the heap was trimmed since the last one."""
        self.trimmed = True
        """No step has run since the heap was last trimmed: it holds no freed memory."""
        self.largest_step = False
        """The update under way is the epoch's largest so far (its heaviest, the last, among them): the memory it
        leaves freed is no measure of an ordinary step's, and settled on it, the slack would let freed memory pile
        up past the epoch's peak."""
        self.trims = 0
        self.largest = 0
        """The most tokens a step of this epoch has had so far."""
        self.first_epoch = 0
        """The most the resident set held after an ordinary step of the first epoch; 0 while it runs."""
        self.ordinary_high = 0
        """The most the resident set has held after an ordinary step so far (at the first epoch's end:
        ``first_epoch``)."""
        self.epoch_highs: list[int] = []
        self.high = 0

    def after_update(self) -> float:
        """Trim if freed memory piled up; returns the resident set in MiB (after any trim), for the log."""
        rss = self.resident()
        self.high, self.trimmed = max(self.high, rss), False
        if self.enabled and self.every_step:
            self.trim()
            self.trims, self.trimmed = self.trims + 1, True
            return round(self.resident() / MIB, 1)
        if self.largest_step:  # what it leaves freed is trimmed by the next step's slack, or the epoch's end
            self.largest_step, self.fresh = False, self.fresh and not self.settled
            return round(rss / MIB, 1)
        self.ordinary_high = max(self.ordinary_high, rss)
        if self.fresh:
            self.settled, self.fresh = max(self.settled, rss), False
        elif self.enabled and rss > self.limit():
            self.trim()
            self.trims += 1
            self.fresh = self.trimmed = True
            rss = self.resident()
        return round(rss / MIB, 1)

    def limit(self) -> float:
        """The resident set past which freed memory is handed back after a step."""
        limit = self.settled * (1 + TRIM_SLACK)
        if self.first_epoch:
            limit = min(limit, max(self.settled, self.first_epoch) * (1 + EPOCH_SLACK))
        return limit

    def before_step(self, tokens: int, heaviest: bool = False) -> None:
        """Hand freed memory back before a step whose batch (``tokens``, padding included) is the epoch's largest so
        far, and always before its ``heaviest`` (the last: sampler.py): its blocks then take pages of their own
        rather than add to the holes earlier widths left."""
        self.largest_step, self.largest = heaviest or tokens > self.largest, max(self.largest, tokens)
        if self.enabled and self.largest_step and (heaviest or not self.trimmed):
            self.trim()
            self.trims, self.trimmed = self.trims + 1, True

    def end_epoch(self, epoch: int, step: int = 0, metrics_log: Any = None) -> str | None:
        """Compare this epoch's highest resident set with the last one's: a warning when it grew by more than
        EPOCH_GROWTH_WARNING (the same rows should need the same memory), logged and written to ``metrics_log``
        (metrics.jsonl), and returned. Validation's memory is trimmed too."""
        self.largest_step, self.largest = False, 0
        if self.enabled:
            self.trim()
            self.fresh = self.trimmed = True
        self.first_epoch = self.first_epoch or self.ordinary_high
        previous = self.epoch_highs[-1] if self.epoch_highs else None
        self.epoch_highs.append(self.high)
        self.high = 0
        if not previous or self.epoch_highs[-1] <= previous * (1 + EPOCH_GROWTH_WARNING):
            return None
        grown = (f"memory grew from {previous / MIB:.0f} MB in epoch {epoch - 1} to {self.epoch_highs[-1] / MIB:.0f}"
                 f" MB in epoch {epoch}, which saw the same rows: something keeps memory from one step to the next "
                 "(please report it with this run's metrics.jsonl)")
        log.warning("warning: %s", grown)
        if metrics_log is not None:
            metrics_log.write({"event": "memory_warning", "step": step, "epoch": epoch, "message": grown})
        return grown
