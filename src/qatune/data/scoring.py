"""Rows of a scoring run (``task: scoring``) as model inputs: the row's text (its prompt template with the columns
filled in) as token ids, and one target per head (:class:`qatune.model.scoring.HeadLayout`), padded into batches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from qatune.data.padding import batch_width
from qatune.data.spreadsheet import QARecord
from qatune.data.templates import PromptTemplate


@dataclass
class ScoringExample:
    input_ids: list[int]
    targets: list[float]
    row: int = 0
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class ScoringEncodeStats:
    truncated_rows: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)


class ScoringEncoder:
    """A row's text as token ids, cut at ``max_length`` (its end is lost: check warns), with the model's own
    special tokens ([CLS] and [SEP] of a BERT-like encoder)."""

    def __init__(self, tokenizer: Any, template: PromptTemplate):
        self.tokenizer = tokenizer
        self.template = template

    def text(self, record: QARecord) -> str:
        return self.template.render(record.question, record.context, record.fields)

    def ids(self, records: list[QARecord]) -> list[list[int]]:
        return self.tokenizer([self.text(r) for r in records], add_special_tokens=True)["input_ids"]

    def encode(self, records: list[QARecord], targets: list[list[float]], max_length: int
               ) -> tuple[list[ScoringExample], ScoringEncodeStats]:
        stats = ScoringEncodeStats()
        examples = []
        for record, ids, target in zip(records, self.ids(records), targets, strict=True):
            stats.lengths.append(len(ids))
            truncated = len(ids) > max_length
            if truncated:
                stats.truncated_rows.append(record.row)
                ids = self._cut(ids, max_length)
            examples.append(ScoringExample(ids, target, record.row, truncated))
        return examples, stats

    def _cut(self, ids: list[int], max_length: int) -> list[int]:
        """The first ``max_length`` ids, ending in the special token the full row ended in ([SEP])."""
        last = ids[-1]
        if last in self.tokenizer.all_special_ids:
            return [*ids[: max_length - 1], last]
        return ids[:max_length]


@dataclass
class ScoringCollator:
    """Right-pads a batch to its longest row: input_ids, attention_mask, targets (rows x heads), and the rows'
    count (what the loop divides the loss by) and row numbers."""

    pad_token_id: int
    pad_to_multiple_of: int = 1
    max_width: int | None = None
    """The model's positions: no width past them (None: no limit known)."""
    bucketed: bool = False
    """Widths rounded up to one of few sizes (padding.bucket): bf16 on a CPU keeps kernels for every shape."""

    def __call__(self, examples: list[ScoringExample]) -> dict[str, torch.Tensor]:
        width = batch_width(max(len(e) for e in examples), self.pad_to_multiple_of, self.max_width, self.bucketed)
        ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(examples), width), dtype=torch.long)
        for i, example in enumerate(examples):
            ids[i, : len(example)] = torch.tensor(example.input_ids)
            mask[i, : len(example)] = 1
        return {"input_ids": ids, "attention_mask": mask,
                "targets": torch.tensor([e.targets for e in examples], dtype=torch.float32),
                "n_items": torch.tensor(len(examples)), "row": torch.tensor([e.row for e in examples])}
