"""Extractive QA: (question, context, answer) -> token windows with start/end positions.

Positions come from the tokenizer's offset mapping: the answer's character span is located in the
context, and the window tokens whose character offsets cover it become the start/end labels.
Windows of a long context that do not hold the whole answer point at the CLS token. The span audit
decodes every labelled span and compares it with the answer text.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any

import torch

from qatune.data.padding import IGNORE_INDEX, batch_width
from qatune.data.spreadsheet import QARecord
from qatune.errors import ConfigError, DataError, ModelError

MAX_QUESTION_TOKENS = 64


@dataclass
class Feature:
    """One window of (question, context) tokens."""

    input_ids: list[int]
    token_type_ids: list[int] | None
    offsets: list[tuple[int, int] | None]
    """Character span in the context of each context token; None for question and special tokens."""
    example: int
    """Index of the source record in the list that was encoded."""
    row: int
    start_position: int = IGNORE_INDEX
    end_position: int = IGNORE_INDEX
    has_answer: bool = False
    answer_text: str | None = None
    """The answer as it stands in the context, for windows that hold it."""

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class SpanStats:
    rows: int = 0
    kept: int = 0
    not_found_rows: list[int] = field(default_factory=list)
    """Rows whose answer does not occur in the context (dropped from training)."""
    windows: int = 0
    windows_without_answer: int = 0
    unreachable_rows: list[int] = field(default_factory=list)
    """Rows whose answer is in the context but in no window as a whole (answer longer than a window)."""
    audit_checked: int = 0
    audit_matched: int = 0
    """Labelled spans that decode exactly to the answer."""
    audit_boundary: int = 0
    """Spans that cover the answer but run on to a token boundary (the answer ends inside a token)."""
    audit_mismatches: list[dict[str, Any]] = field(default_factory=list)
    """Spans that do not cover the answer: a bug (at most 20 kept)."""
    audit_boundary_examples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def audit_share(self) -> float:
        return self.audit_matched / self.audit_checked if self.audit_checked else 1.0


def locate_answer(context: str, answer: str, answer_start: int | None = None) -> tuple[int, int] | None:
    """Character span [start, end) of ``answer`` in ``context``, or None when it is not there.

    Exact matches first, then ignoring case and runs of whitespace. With several matches, the one at
    (or nearest to) ``answer_start`` wins, else the first.
    """
    if not answer:
        return None
    spans = [(m.start(), m.start() + len(answer)) for m in re.finditer(re.escape(answer), context)]
    if not spans:
        spans = _loose_matches(context, answer)
    if not spans:
        return None
    if answer_start is None:
        return spans[0]
    return min(spans, key=lambda span: abs(span[0] - answer_start))


def _loose_matches(context: str, answer: str) -> list[tuple[int, int]]:
    folded, origin = _fold(context)
    needle, _ = _fold(answer.strip())
    spans = []
    start = folded.find(needle)
    while needle and start != -1:
        end = start + len(needle) - 1
        spans.append((origin[start], origin[end] + 1))
        start = folded.find(needle, start + 1)
    return spans


def _fold(text: str) -> tuple[str, list[int]]:
    """Casefold and collapse whitespace runs, remembering each output char's index in ``text``."""
    chars: list[str] = []
    origin: list[int] = []
    for i, char in enumerate(text):
        if char.isspace():
            if chars and chars[-1] == " ":
                continue
            chars.append(" ")
            origin.append(i)
            continue
        for folded in char.casefold():
            chars.append(folded)
            origin.append(i)
    return "".join(chars), origin


def squash(text: str) -> str:
    """Comparison form for the span audit: no accents, no case, no whitespace."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(c for c in decomposed if not unicodedata.combining(c) and not c.isspace()).casefold()


AUTO_WINDOW = 384
"""``data.max_length: auto`` for extractive QA: windows of this many tokens (or the model's positions, if fewer)."""


def window_length(setting: int | str, model_limit: int | None) -> int:
    """A window's length in tokens from ``data.max_length`` and the model's positions."""
    length = min(AUTO_WINDOW, model_limit or AUTO_WINDOW) if setting == "auto" else int(setting)
    if model_limit is not None and length > model_limit:
        raise ConfigError(f"data.max_length={length} is more than the model's {model_limit} positions; lower it")
    return length


def check_window(max_length: int, doc_stride: int) -> int:
    """Longest question (in tokens) that leaves room for the stride; raises on impossible settings."""
    question_tokens = min(MAX_QUESTION_TOKENS, (max_length - 3) // 2)
    if doc_stride >= max_length - 3 - question_tokens:
        raise DataError(
            f"data.doc_stride={doc_stride} is too large for data.max_length={max_length}: windows would not move; "
            f"set data.doc_stride below {max_length - 3 - question_tokens}"
        )
    return question_tokens


def prepare_features(
    tokenizer: Any,
    records: list[QARecord],
    max_length: int,
    doc_stride: int,
    *,
    train: bool,
) -> tuple[list[Feature], SpanStats, list[QARecord]]:
    """Encode records into windows. With ``train``, rows whose answer is not in the context are dropped.

    Returns the features, the statistics with the span audit, and the records that were kept (each
    feature's ``example`` indexes this list).
    """
    question_tokens = check_window(max_length, doc_stride)
    stats = SpanStats(rows=len(records))
    kept: list[QARecord] = []
    spans: list[tuple[int, int] | None] = []
    for record in records:
        span = locate_answer(record.context or "", record.answer, record.answer_start) if record.answers else None
        if span is None and record.answers and train:
            stats.not_found_rows.append(record.row)
            continue
        kept.append(record)
        spans.append(span)
    stats.kept = len(kept)
    if not kept:
        return [], stats, kept

    questions = [_cut_question(tokenizer, r.question, question_tokens) for r in kept]
    contexts = [r.context or "" for r in kept]
    encoded = tokenizer(
        questions, contexts, truncation="only_second", max_length=max_length, stride=doc_stride,
        return_overflowing_tokens=True, return_offsets_mapping=True, padding=False,
    )
    cls_id = tokenizer.cls_token_id
    features: list[Feature] = []
    labelled_rows: set[int] = set()
    for i, input_ids in enumerate(encoded["input_ids"]):
        example = encoded["overflow_to_sample_mapping"][i]
        sequence_ids = encoded.sequence_ids(i)
        offsets = [tuple(o) if s == 1 else None for o, s in zip(encoded["offset_mapping"][i], sequence_ids)]
        feature = Feature(
            input_ids=list(input_ids),
            token_type_ids=list(encoded["token_type_ids"][i]) if "token_type_ids" in encoded else None,
            offsets=offsets,
            example=example,
            row=kept[example].row,
        )
        span = spans[example]
        if span is not None:
            positions = _token_span(offsets, span)
            if positions is None:
                cls_index = input_ids.index(cls_id) if cls_id in input_ids else 0
                feature.start_position = feature.end_position = cls_index
                stats.windows_without_answer += 1
            else:
                feature.start_position, feature.end_position = positions
                feature.has_answer = True
                feature.answer_text = (kept[example].context or "")[span[0] : span[1]]
                labelled_rows.add(example)
                _audit(tokenizer, feature, kept[example], span, stats)
        features.append(feature)
    stats.windows = len(features)
    _check_coverage(tokenizer, features, kept)
    stats.unreachable_rows = [kept[i].row for i, span in enumerate(spans)
                              if span is not None and i not in labelled_rows]
    return features, stats, kept


def _check_coverage(tokenizer: Any, features: list[Feature], records: list[QARecord]) -> None:
    """Every context must be covered by its windows up to its last token.

    tokenizers 0.23.1-0.23.2 stop tokenizing a truncated text early and return too few overflow
    windows (huggingface/tokenizers#2091): the end of long contexts silently disappears.
    """
    covered: dict[int, int] = {}
    for feature in features:
        ends = [o[1] for o in feature.offsets if o is not None]
        if ends:
            covered[feature.example] = max(covered.get(feature.example, 0), max(ends))
    for example, record in enumerate(records):
        context = record.context or ""
        tail = context[covered.get(example, 0):]
        if tail.strip() and tokenizer(tail, add_special_tokens=False)["input_ids"]:
            import tokenizers

            raise ModelError(
                f"the tokenizer left the end of a long context out of every window (row {record.row}: windows cover "
                f"{covered.get(example, 0)} of {len(context)} characters); tokenizers {tokenizers.__version__} has "
                "this bug (huggingface/tokenizers#2091): pip install -U 'tokenizers>=0.23.3'"
            )


def _cut_question(tokenizer: Any, question: str, limit: int) -> str:
    encoded = tokenizer(question, add_special_tokens=False, return_offsets_mapping=True)
    if len(encoded["input_ids"]) <= limit:
        return question
    return question[: encoded["offset_mapping"][limit - 1][1]]


def _token_span(offsets: list[tuple[int, int] | None], span: tuple[int, int]) -> tuple[int, int] | None:
    """First and last context token covering the character span, if the window holds all of it."""
    start_char, end_char = span
    context_tokens = [i for i, o in enumerate(offsets) if o is not None and o[1] > o[0]]
    if not context_tokens:
        return None
    first, last = context_tokens[0], context_tokens[-1]
    if offsets[first][0] > start_char or offsets[last][1] < end_char:
        return None
    start = next(i for i in context_tokens if offsets[i][1] > start_char)
    end = next(i for i in reversed(context_tokens) if offsets[i][0] < end_char)
    return start, end


def _audit(tokenizer: Any, feature: Feature, record: QARecord, span: tuple[int, int], stats: SpanStats) -> None:
    decoded = tokenizer.decode(feature.input_ids[feature.start_position : feature.end_position + 1])
    decoded = decoded.removeprefix("##")  # a WordPiece span may start inside a word
    answer_text = (record.context or "")[span[0] : span[1]]
    stats.audit_checked += 1
    example = {"row": record.row, "answer": answer_text, "labelled_tokens": decoded}
    if squash(decoded) == squash(answer_text):
        stats.audit_matched += 1
    elif squash(answer_text) in squash(decoded) or (tokenizer.unk_token and tokenizer.unk_token in decoded):
        # The answer ends inside a token, or holds characters the tokenizer cannot represent.
        stats.audit_boundary += 1
        if len(stats.audit_boundary_examples) < 20:
            stats.audit_boundary_examples.append(example)
    elif len(stats.audit_mismatches) < 20:
        stats.audit_mismatches.append(example)


@dataclass
class SpanCollator:
    """Right-pads windows to the longest in the batch; start/end labels go along unchanged."""

    pad_token_id: int
    pad_to_multiple_of: int = 1
    max_width: int | None = None
    """The model's positions: no width past them (None: no limit known)."""
    bucketed: bool = False
    """Widths rounded up to one of few sizes (padding.bucket): bf16 on a CPU keeps kernels for every shape."""

    def __call__(self, batch: list[Feature]) -> dict[str, torch.Tensor]:
        width = batch_width(max(len(feature) for feature in batch), self.pad_to_multiple_of, self.max_width,
                            self.bucketed)
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        with_types = batch[0].token_type_ids is not None
        token_type_ids = torch.zeros((len(batch), width), dtype=torch.long)
        for i, feature in enumerate(batch):
            n = len(feature)
            input_ids[i, :n] = torch.tensor(feature.input_ids, dtype=torch.long)
            attention_mask[i, :n] = 1
            if with_types:
                token_type_ids[i, :n] = torch.tensor(feature.token_type_ids, dtype=torch.long)
        out = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "start_positions": torch.tensor([f.start_position for f in batch], dtype=torch.long),
            "end_positions": torch.tensor([f.end_position for f in batch], dtype=torch.long),
            "row": torch.tensor([f.row for f in batch], dtype=torch.long),
            "n_items": sum(f.start_position != IGNORE_INDEX for f in batch),
            "n_tokens": sum(len(f) for f in batch),
        }
        if with_types:
            out["token_type_ids"] = token_type_ids
        return out


def best_span(
    features: list[Feature],
    start_logits: list[torch.Tensor],
    end_logits: list[torch.Tensor],
    context: str,
    n_best: int,
    max_answer_length: int,
) -> tuple[str, float]:
    """Highest-scoring valid span over all windows of one example, cut from the original context."""
    start, end, score = best_span_offsets(features, start_logits, end_logits, n_best, max_answer_length)
    return context[start:end], score


def best_span_offsets(
    features: list[Feature],
    start_logits: list[torch.Tensor],
    end_logits: list[torch.Tensor],
    n_best: int,
    max_answer_length: int,
) -> tuple[int, int, float]:
    """Character span [start, end) in the context of the highest-scoring valid span, and its score
    (start + end logit); (0, 0, -inf) when no window has a valid span."""
    best = (0, 0, float("-inf"))
    for feature, starts, ends in zip(features, start_logits, end_logits):
        n = len(feature)
        in_context = torch.tensor([o is not None for o in feature.offsets], dtype=torch.bool)
        starts = starts[:n].float().masked_fill(~in_context, float("-inf"))
        ends = ends[:n].float().masked_fill(~in_context, float("-inf"))
        k = min(n_best, int(in_context.sum()))
        if k == 0:
            continue
        top_starts, start_index = starts.topk(k)
        top_ends, end_index = ends.topk(k)
        scores = top_starts[:, None] + top_ends[None, :]
        length = end_index[None, :] - start_index[:, None]
        scores = scores.masked_fill((length < 0) | (length >= max_answer_length), float("-inf"))
        flat = int(scores.argmax())
        score = float(scores.flatten()[flat])
        if score > best[2]:
            s = int(start_index[flat // k])
            e = int(end_index[flat % k])
            best = (feature.offsets[s][0], feature.offsets[e][1], score)
    return best
