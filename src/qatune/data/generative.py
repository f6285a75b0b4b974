"""Generative QA: prompt template -> token ids -> padded batches with labels.

A training example is ``prompt tokens + answer tokens + EOS``. Labels copy the input ids and are
IGNORE_INDEX on padding (decided by each row's length, never by comparing ids with pad_token_id, so
an EOS that shares its id with the pad token is still trained) and, unless ``train_on_prompt``, on
the prompt. Prompts are encoded by the same function at training and at generation time.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any

import torch

from qatune.data.spreadsheet import QARecord
from qatune.errors import DataError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PromptTemplate:
    """The text before the answer. The answer follows after ``answer_prefix`` and ends with EOS."""

    template: str = "Question: {question}\nAnswer:"
    answer_prefix: str = " "

    def render(self, question: str, context: str | None = None) -> str:
        return self.template.format(question=question, context=context or "")

    @property
    def uses_context(self) -> bool:
        return any(name == "context" for _, name, _, _ in string.Formatter().parse(self.template))


@dataclass
class Example:
    """One encoded training/evaluation example."""

    input_ids: list[int]
    prompt_length: int
    row: int
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class EncodeStats:
    rows: int = 0
    kept: int = 0
    truncated_rows: list[int] = field(default_factory=list)
    too_long_rows: list[int] = field(default_factory=list)
    max_length: int = 0
    lengths: list[int] = field(default_factory=list)
    """Untruncated token length of every row (prompt + answer + EOS)."""


class PromptEncoder:
    """Turns questions (and answers) into token ids, cutting the question before the answer."""

    def __init__(self, tokenizer: Any, template: PromptTemplate):
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no EOS token; generative QA needs one to end answers")
        self.tokenizer = tokenizer
        self.template = template
        self.eos_id = tokenizer.eos_token_id

    def prompt_ids(self, question: str, context: str | None = None, budget: int | None = None) -> list[int] | None:
        """Token ids of the prompt, at most ``budget`` long (context cut first, then the question).

        Returns None when even an empty question does not fit.
        """
        ids = self._encode_prompt(question, context)
        if budget is None or len(ids) <= budget:
            return ids
        if context and self.template.uses_context:
            kept = self._shrink(context, lambda text: self._encode_prompt(question, text), budget)
            if kept is not None:
                return kept
            context = ""
        return self._shrink(question, lambda text: self._encode_prompt(text, context), budget)

    def answer_ids(self, answer: str) -> list[int]:
        ids = self.tokenizer(self.template.answer_prefix + answer, add_special_tokens=False)["input_ids"]
        return [*ids, self.eos_id]

    def example(self, record: QARecord, max_length: int) -> Example | None:
        answer = self.answer_ids(record.answer)
        prompt = self.prompt_ids(record.question, record.context, budget=max_length - len(answer))
        if prompt is None:
            return None
        full = self._encode_prompt(record.question, record.context)
        return Example(input_ids=prompt + answer, prompt_length=len(prompt), row=record.row,
                       truncated=len(prompt) < len(full))

    def full_length(self, record: QARecord) -> int:
        return len(self._encode_prompt(record.question, record.context)) + len(self.answer_ids(record.answer))

    def _encode_prompt(self, question: str, context: str | None) -> list[int]:
        ids = self.tokenizer(self.template.render(question, context), add_special_tokens=True)["input_ids"]
        # Some tokenizers append EOS to every text; the prompt must not end the sequence.
        while ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        return ids

    def _shrink(self, text: str, encode, budget: int) -> list[int] | None:
        """Longest prefix of ``text`` (in tokens) whose prompt fits ``budget``; binary search."""
        tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        best = None
        lo, hi = 0, len(tokens)
        while lo <= hi:
            mid = (lo + hi) // 2
            ids = encode(self.tokenizer.decode(tokens[:mid]))
            if len(ids) <= budget:
                best, lo = ids, mid + 1
            else:
                hi = mid - 1
        return best


@dataclass
class Seq2SeqExample:
    """Encoder-decoder QA: the prompt is the encoder input, the answer + EOS the decoder target."""

    input_ids: list[int]
    target_ids: list[int]
    row: int
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.input_ids) + len(self.target_ids)


class Seq2SeqEncoder(PromptEncoder):
    """Like PromptEncoder, but the encoder input keeps the tokenizer's EOS and the answer stands alone."""

    def answer_ids(self, answer: str) -> list[int]:
        return [*self.tokenizer(answer, add_special_tokens=False)["input_ids"], self.eos_id]

    def example(self, record: QARecord, max_length: int) -> Seq2SeqExample | None:
        target = self.answer_ids(record.answer)
        source = self.prompt_ids(record.question, record.context, budget=max_length)
        if source is None or len(target) > max_length:
            return None
        full = self._encode_prompt(record.question, record.context)
        return Seq2SeqExample(input_ids=source, target_ids=target, row=record.row, truncated=len(source) < len(full))

    def full_length(self, record: QARecord) -> int:
        return max(len(self._encode_prompt(record.question, record.context)), len(self.answer_ids(record.answer)))

    def _encode_prompt(self, question: str, context: str | None) -> list[int]:
        return self.tokenizer(self.template.render(question, context), add_special_tokens=True)["input_ids"]


@dataclass
class Seq2SeqCollator:
    """Right-pads encoder inputs and decoder targets separately; targets are -100 past their length."""

    pad_token_id: int
    pad_to_multiple_of: int = 1

    def __call__(self, batch: list[Seq2SeqExample]) -> dict[str, Any]:
        width = _round_up(max(len(e.input_ids) for e in batch), self.pad_to_multiple_of)
        target_width = _round_up(max(len(e.target_ids) for e in batch), self.pad_to_multiple_of)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), target_width), IGNORE_INDEX, dtype=torch.long)
        for i, example in enumerate(batch):
            input_ids[i, : len(example.input_ids)] = torch.tensor(example.input_ids, dtype=torch.long)
            attention_mask[i, : len(example.input_ids)] = 1
            labels[i, : len(example.target_ids)] = torch.tensor(example.target_ids, dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                "row": torch.tensor([e.row for e in batch], dtype=torch.long),
                "n_items": sum(len(e.target_ids) for e in batch), "n_tokens": sum(len(e) for e in batch)}


def choose_max_length(lengths: list[int], setting: int | str, model_limit: int | None) -> int:
    """``auto``: the longest training example, capped by the model's positions."""
    limit = model_limit or 1024
    if setting == "auto":
        return max(8, min(max(lengths, default=8), limit))
    if model_limit is not None and int(setting) > model_limit:
        raise DataError(f"data.max_length={setting} is more than the model's {model_limit} positions; "
                        f"set data.max_length to at most {model_limit} (or auto)")
    return int(setting)


def encode_examples(encoder: PromptEncoder, records: list[QARecord], max_length: int) -> tuple[list[Example], EncodeStats]:
    stats = EncodeStats(rows=len(records), max_length=max_length)
    examples = []
    for record in records:
        stats.lengths.append(encoder.full_length(record))
        example = encoder.example(record, max_length)
        if example is None:
            stats.too_long_rows.append(record.row)
            continue
        if example.truncated:
            stats.truncated_rows.append(record.row)
        examples.append(example)
    stats.kept = len(examples)
    return examples, stats


class ExampleDataset(torch.utils.data.Dataset):
    """Encoded examples (or extractive features); ``lengths`` feeds the length-grouped sampler."""

    def __init__(self, items: list[Any]):
        self.items = items
        self.lengths = [len(item) for item in items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]


@dataclass
class CausalCollator:
    """Right-pads a batch to its own longest row and builds labels from each row's length."""

    pad_token_id: int
    train_on_prompt: bool = False
    pad_to_multiple_of: int = 1
    """Round the batch width up (on a GPU a few distinct shapes beat many: each new one costs warm-up)."""

    def __call__(self, batch: list[Example]) -> dict[str, torch.Tensor]:
        width = _round_up(max(len(example) for example in batch), self.pad_to_multiple_of)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        for i, example in enumerate(batch):
            ids = torch.tensor(example.input_ids, dtype=torch.long)
            n = len(ids)
            input_ids[i, :n] = ids
            attention_mask[i, :n] = 1
            first = 0 if self.train_on_prompt else example.prompt_length
            labels[i, first:n] = ids[first:]
        rows = torch.tensor([example.row for example in batch], dtype=torch.long)
        # Counts known on the host, so the loop never waits for the device to learn them.
        n_items = sum(len(e) - max(1 if self.train_on_prompt else e.prompt_length, 1) for e in batch)
        n_tokens = sum(len(e) for e in batch)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "row": rows,
                "n_items": n_items, "n_tokens": n_tokens, "shared_prefix": self.shared_prefix(batch)}

    def shared_prefix(self, batch: list[Example]) -> int:
        """Leading tokens common to every row and before every row's first supervised position (the
        position that predicts the first answer token): the model may compute them once per batch."""
        if len(batch) < 2 or self.train_on_prompt:
            return 0
        limit = min(e.prompt_length for e in batch) - 1
        first = batch[0].input_ids
        length = 0
        while length < limit and all(e.input_ids[length] == first[length] for e in batch):
            length += 1
        return length


def _round_up(width: int, multiple: int) -> int:
    return -(-width // multiple) * multiple


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask for batched generation."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        if prompt:
            input_ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            attention_mask[i, width - len(prompt):] = 1
    return input_ids, attention_mask


def right_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask (encoder inputs)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[i, : len(prompt)] = 1
    return input_ids, attention_mask


def percentile(values: list[int], q: float) -> int:
    """Nearest-rank percentile of integer lengths (q in 0..100)."""
    ordered = sorted(values)
    if not ordered:
        return 0
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]
