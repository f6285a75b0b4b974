"""Generative QA: prompt template -> token ids -> padded batches with labels.

A training example is ``prompt tokens + answer tokens + end token``. Labels copy the input ids and
are IGNORE_INDEX on padding (decided by each row's length, never by comparing ids with pad_token_id,
so an EOS that shares its id with the pad token is still trained) and, unless ``train_on_prompt``, on
the prompt. Prompts are encoded by the same function at training and at generation time; the templates
they come from are in :mod:`qatune.data.templates`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from qatune.data.padding import IGNORE_INDEX, batch_width, round_up
from qatune.data.spreadsheet import QARecord
from qatune.data.templates import PromptTemplate, end_of_turn_id, special_tokens
from qatune.errors import DataError


@dataclass
class Example:
    """One encoded training/evaluation example."""

    input_ids: list[int]
    prompt_length: int
    row: int
    truncated: bool = False
    weights: list[float] | None = None
    """The loss weight of each answer token (data.field_weights), their mean 1; None: all 1."""

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class EncodeStats:
    truncated_rows: list[int] = field(default_factory=list)
    """Rows whose question (or context) was shortened to fit max_length."""
    too_long_rows: list[int] = field(default_factory=list)
    """Rows dropped: they do not fit max_length even with the question cut to nothing."""
    answer_too_long_rows: list[int] = field(default_factory=list)
    """Those of too_long_rows whose answer alone does not fit."""


class PromptEncoder:
    """Turns questions (and answers) into token ids, cutting the context, then the question, before the answer.

    A template that writes special tokens itself (a rendered chat template) is encoded as written;
    otherwise the tokenizer adds its own (a Llama tokenizer's BOS). Answers end with ``end_id``: the
    chat template's end-of-turn token for such a template, else the EOS.
    """

    def __init__(self, tokenizer: Any, template: PromptTemplate):
        if tokenizer.eos_token_id is None:
            raise DataError("the tokenizer has no EOS token; generative QA needs one to end answers")
        self.tokenizer = tokenizer
        self.template = template
        self.eos_id = tokenizer.eos_token_id
        self.writes_special_tokens = any(token in template.template for token in special_tokens(tokenizer))
        turn_end = end_of_turn_id(tokenizer) if self.writes_special_tokens else None
        self.end_id = turn_end if turn_end is not None else self.eos_id
        self._prompts: dict[str, list[int]] = {}
        self._answers: dict[str, list[int]] = {}

    def warm(self, records: list[QARecord]) -> None:
        """Tokenize every row's prompt and answer in two batched calls (a fast tokenizer encodes a batch
        in parallel, in Rust); encoding those rows afterwards looks them up instead of tokenizing each
        text two or three times, one call at a time."""
        texts = list({self.template.render(r.question, r.context, r.fields) for r in records} - self._prompts.keys())
        if texts:
            encoded = self.tokenizer(texts, add_special_tokens=not self.writes_special_tokens)["input_ids"]
            self._prompts.update(zip(texts, (self._without_trailing_eos(ids) for ids in encoded)))
        answers = list({self.template.answer_prefix + r.answer for r in records if r.answers} - self._answers.keys())
        if answers:
            self._answers.update(zip(answers, self.tokenizer(answers, add_special_tokens=False)["input_ids"]))

    @property
    def stop_ids(self) -> list[int]:
        """Token ids that end a generated answer."""
        return sorted({self.eos_id, self.end_id})

    def prompt_ids(self, question: str, context: str | None = None, budget: int | None = None,
                   fields: dict[str, str] | None = None) -> list[int] | None:
        """Token ids of the prompt, at most ``budget`` long (context cut first, then the question).

        ``fields``: values of the other columns the template names. Returns None when even an empty
        question does not fit.
        """
        ids = self._encode_prompt(question, context, fields)
        if budget is None or len(ids) <= budget:
            return ids
        if context and self.template.uses_context:
            kept = self._shrink(context, lambda text: self._encode_prompt(question, text, fields), budget)
            if kept is not None:
                return kept
            context = ""
        return self._shrink(question, lambda text: self._encode_prompt(text, context, fields), budget)

    def answer_ids(self, answer: str) -> list[int]:
        text = self.template.answer_prefix + answer
        ids = self._answers.get(text)
        if ids is None:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [*ids, self.end_id]

    def example(self, record: QARecord, max_length: int) -> Example | None:
        answer = self.answer_ids(record.answer)
        full = self._encode_prompt(record.question, record.context, record.fields)
        budget = max_length - len(answer)
        prompt = full if len(full) <= budget else self.prompt_ids(record.question, record.context, budget=budget,
                                                                   fields=record.fields)
        if prompt is None or (len(prompt) < len(full) and len(prompt) <= self.fixed_length(record)):
            return None  # nothing fits, or a question cut to nothing: no example to learn from
        return Example(input_ids=prompt + answer, prompt_length=len(prompt), row=record.row,
                       truncated=len(prompt) < len(full))

    def fixed_length(self, record: QARecord) -> int:
        """Tokens of a row's prompt without its question and context: the template's own text."""
        return len(self._encode_prompt("", "" if record.context is not None else None, record.fields))

    def answer_too_long(self, record: QARecord, max_length: int) -> bool:
        """Whether the answer alone leaves no room for the prompt in max_length."""
        return len(self.answer_ids(record.answer)) >= max_length

    def full_length(self, record: QARecord) -> int:
        return len(self._encode_prompt(record.question, record.context, record.fields)) + len(
            self.answer_ids(record.answer))

    def _encode_prompt(self, question: str, context: str | None, fields: dict[str, str] | None = None) -> list[int]:
        text = self.template.render(question, context, fields)
        ids = self._prompts.get(text)
        if ids is not None:
            return ids
        return self._without_trailing_eos(self.tokenizer(text, add_special_tokens=not self.writes_special_tokens)[
            "input_ids"])

    def _without_trailing_eos(self, ids: list[int]) -> list[int]:
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

    def warm(self, records: list[QARecord]) -> None:
        """Nothing to prepare: its texts are tokenized one at a time (seq2seq sheets are small here)."""

    def answer_ids(self, answer: str) -> list[int]:
        return [*self.tokenizer(answer, add_special_tokens=False)["input_ids"], self.eos_id]

    def example(self, record: QARecord, max_length: int) -> Seq2SeqExample | None:
        target = self.answer_ids(record.answer)
        source = self.prompt_ids(record.question, record.context, budget=max_length, fields=record.fields)
        if source is None or len(target) > max_length:
            return None
        full = self._encode_prompt(record.question, record.context, record.fields)
        if len(source) < len(full) and len(source) <= self.fixed_length(record):
            return None  # the question cut to nothing: no example to learn from
        return Seq2SeqExample(input_ids=source, target_ids=target, row=record.row, truncated=len(source) < len(full))

    def answer_too_long(self, record: QARecord, max_length: int) -> bool:
        """Whether the answer (the decoder's target) is longer than max_length."""
        return len(self.answer_ids(record.answer)) > max_length

    def full_length(self, record: QARecord) -> int:
        return max(len(self._encode_prompt(record.question, record.context, record.fields)),
                   len(self.answer_ids(record.answer)))

    def _encode_prompt(self, question: str, context: str | None, fields: dict[str, str] | None = None) -> list[int]:
        return self.tokenizer(self.template.render(question, context, fields), add_special_tokens=True)["input_ids"]


@dataclass
class Seq2SeqCollator:
    """Right-pads encoder inputs and decoder targets separately; targets are -100 past their length."""

    pad_token_id: int
    pad_to_multiple_of: int = 1
    max_width: int | None = None
    """The encoder's positions (None: no limit known)."""
    bucketed: bool = False
    """Widths rounded up to one of few sizes (padding.bucket): bf16 on a CPU keeps kernels for every shape."""

    def __call__(self, batch: list[Seq2SeqExample]) -> dict[str, Any]:
        width = batch_width(max(len(e.input_ids) for e in batch), self.pad_to_multiple_of, self.max_width,
                            self.bucketed)
        target_width = round_up(max(len(e.target_ids) for e in batch), self.pad_to_multiple_of)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        labels = torch.full((len(batch), target_width), IGNORE_INDEX, dtype=torch.long)
        for i, example in enumerate(batch):
            input_ids[i, : len(example.input_ids)] = torch.tensor(example.input_ids, dtype=torch.long)
            attention_mask[i, : len(example.input_ids)] = 1
            labels[i, : len(example.target_ids)] = torch.tensor(example.target_ids, dtype=torch.long)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                "row": torch.tensor([e.row for e in batch], dtype=torch.long),
                "n_items": sum(self.supervised(e) for e in batch), "n_tokens": sum(len(e) for e in batch)}

    @staticmethod
    def supervised(example: Seq2SeqExample) -> int:
        return len(example.target_ids)

    @staticmethod
    def last_label(example: Seq2SeqExample) -> int:
        return example.target_ids[-1]


def choose_max_length(lengths: list[int], setting: int | str, model_limit: int | None) -> int:
    """``auto``: the longest training example, capped by the model's positions."""
    limit = model_limit or 1024
    if setting == "auto":
        return max(8, min(max(lengths, default=8), limit))
    if model_limit is not None and int(setting) > model_limit:
        raise DataError(f"data.max_length={setting} is more than the model's {model_limit} positions; "
                        f"set data.max_length to at most {model_limit} (or auto)")
    return int(setting)


def encode_examples(encoder: PromptEncoder, records: list[QARecord],
                    max_length: int) -> tuple[list[Example], EncodeStats]:
    stats = EncodeStats()
    examples = []
    for record in records:
        example = encoder.example(record, max_length)
        if example is None:
            stats.too_long_rows.append(record.row)
            if encoder.answer_too_long(record, max_length):
                stats.answer_too_long_rows.append(record.row)
            continue
        if example.truncated:
            stats.truncated_rows.append(record.row)
        examples.append(example)
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
    """Round the width up to a multiple of this (fewer distinct shapes where each new one costs a kernel build)."""
    max_width: int | None = None
    """The model's positions: no width past them (None: no limit known)."""
    uncounted_columns: int = 0
    """Trailing columns the model does not compute (1 where the loss leaves the last column out): the width
    rounded up is the one computed."""
    bucketed: bool = False
    """Widths rounded up to one of few sizes (padding.bucket): bf16 on a CPU keeps kernels for every shape."""

    def __call__(self, batch: list[Example]) -> dict[str, torch.Tensor]:
        longest = max(len(example) for example in batch)
        cut = self.uncounted_columns
        width = cut + batch_width(longest - cut, self.pad_to_multiple_of, self.max_width and self.max_width - cut,
                                  self.bucketed)
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
        n_items = sum(self.supervised(e) for e in batch)
        n_tokens = sum(len(e) for e in batch)
        out = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "row": rows,
               "n_items": n_items, "n_tokens": n_tokens}
        if any(example.weights is not None for example in batch):
            weights = torch.ones((len(batch), width), dtype=torch.float32)
            for i, example in enumerate(batch):
                if example.weights is not None:
                    weights[i, example.prompt_length:len(example)] = torch.tensor(example.weights)
            out["label_weights"] = weights
        return out

    def supervised(self, example: Example) -> int:
        """Positions of ``example`` whose next token is trained on (its labels after the shift)."""
        return len(example) - max(1 if self.train_on_prompt else example.prompt_length, 1)

    @staticmethod
    def last_label(example: Example) -> int:
        """The last trained token: the answer's end (EOS or end of turn)."""
        return example.input_ids[-1]


def weigh_answer_tokens(encoder: PromptEncoder, example: Example, record: QARecord, template: Any,
                        weights: dict[str, float]) -> None:
    """Set ``example.weights``: each answer token weighs as the column whose value it is part of
    (``weights``, 1 for a column left out and for the template's own text and the end token), scaled so that
    their mean is 1 (the loss stays a mean over the answer's tokens: a one-token verdict weighed 3 counts as
    much as three tokens of feedback). ``template``: the run's AnswerTemplate."""
    prefix = encoder.template.answer_prefix
    text = prefix + record.answer
    offsets = encoder.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    spans = {name: (start + len(prefix), end + len(prefix))
             for name, (start, end) in template.spans(record.answer_fields).items()}
    raw = []
    for start, end in offsets:
        inside = [name for name, (low, high) in spans.items() if start < high and end > low]
        raw.append(weights.get(inside[0], 1.0) if inside else 1.0)
    raw.append(1.0)  # the end token
    if len(raw) != len(example) - example.prompt_length:  # a tokenizer whose offsets do not match its ids
        return
    total = sum(raw)
    example.weights = [w * len(raw) / total for w in raw] if total > 0 else None


def percentile(values: list[int], q: float) -> int:
    """Nearest-rank percentile of integer lengths (q in 0..100)."""
    ordered = sorted(values)
    if not ordered:
        return 0
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]
