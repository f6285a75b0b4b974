"""Grounded decoding: a generated answer that is a span of the row's passage, then the end token.

Each row's allowed answers are built once, before decoding: every span of the passage (:mod:`qatune.data.spans`)
as the run's tokenizer writes it as an answer (the answer prefix, then the span, as training encoded answers),
also with its first letter's case swapped ("The Rhine" for "the Rhine"), and the run's no-answer text when it
has one, each a path of token ids with the lengths at which it may end. At each step a row's allowed tokens are
the next tokens of the paths its tokens so far follow (found through their first token), never a scan of the
passage. :class:`GroundedLogits` applies them in ``model.generate`` (greedy, sampling or beam search); ``qatune
serve`` applies :meth:`AllowedAnswers.allowed` to its own logits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from qatune.config import GenerateConfig
from qatune.data.spans import PassageAnswers, in_passage, pieces
from qatune.data.spreadsheet import QARecord
from qatune.data.templates import PromptTemplate
from qatune.errors import ConfigError
from qatune.model.folder import ModelInfo
from qatune.tasks import task_kind


class AllowedAnswers:
    """The token sequences a row's answer may be: each candidate a path of tokens and the lengths after which the
    answer may end there. ``stop_ids`` end an answer."""

    def __init__(self, stop_ids: Sequence[int]):
        self.stop_ids = list(stop_ids)
        self.paths: list[tuple[list[int], frozenset[int]]] = []
        self.by_first: dict[int, list[int]] = {}

    def add(self, tokens: Sequence[int], ends: Iterable[int] | None = None) -> None:
        """One path; the answer may end after ``ends`` of its tokens (counts; default: after all of them)."""
        tokens = list(tokens)
        ends = frozenset(e for e in ends if 0 < e <= len(tokens)) if ends is not None else frozenset({len(tokens)})
        if not tokens or not ends:
            return
        self.by_first.setdefault(tokens[0], []).append(len(self.paths))
        self.paths.append((tokens[: max(ends)], ends))

    def allowed(self, generated: Sequence[int]) -> list[int] | None:
        """The tokens that may follow ``generated``; None once the answer has ended or left every path (a finished
        row's padding), and the stop tokens where no path continues (an answer cut at max_new_tokens)."""
        n = len(generated)
        if n == 0:
            return list(self.by_first)
        if any(token in self.stop_ids for token in generated):
            return None
        paths = [self.paths[i] for i in self.by_first.get(generated[0], ())]
        paths = [(tokens, ends) for tokens, ends in paths if len(tokens) >= n and tokens[:n] == list(generated)]
        if not paths:
            return None
        tokens = list({path[n] for path, _ in paths if len(path) > n})
        if not tokens or any(n in ends for _, ends in paths):
            tokens += self.stop_ids
        return tokens

    def answers(self) -> set[tuple[int, ...]]:
        """Every token sequence after which the answer may end (for tests and inspection)."""
        return {tuple(tokens[:end]) for tokens, ends in self.paths for end in ends}


def allowed_answers(tokenizer: Any, passages: Sequence[str | None], prefix: str, stop_ids: Sequence[int],
                    max_tokens: int, no_answer: str | None = None) -> list[AllowedAnswers | None]:
    """The allowed answers of each passage (None for a row without one, which is answered freely). ``prefix``: the
    run's answer prefix (what training put before every answer); answers are at most ``max_tokens`` tokens.

    With a fast tokenizer each passage is tokenized once: a span is the tokens of its first words as an answer
    starts them, then the passage's own tokens from the next word on (a word after a space is tokenized alike
    wherever it stands). Where the passage's tokens do not break at that space, and with a slow tokenizer, the
    spans are tokenized whole."""
    rows = [_Passage(text, prefix, max_tokens) if text and text.strip() else None for text in passages]
    fast = getattr(tokenizer, "is_fast", False)
    texts = [row.texts(fast) if row is not None else [] for row in rows]
    unique = list(dict.fromkeys(text for row_texts in texts for text in row_texts))  # words recur: each once
    encoded = tokenizer(unique, add_special_tokens=False, return_offsets_mapping=fast) if unique else {}
    where = {text: n for n, text in enumerate(unique)}
    extra = _tokenized(tokenizer, [prefix + no_answer] if no_answer else [])
    found: list[AllowedAnswers | None] = []
    for row, row_texts in zip(rows, texts, strict=True):
        if row is None:
            found.append(None)
            continue
        allowed = AllowedAnswers(stop_ids)
        at = [where[text] for text in row_texts]
        row.fill(allowed, tokenizer, [encoded["input_ids"][n] for n in at],
                 [encoded["offset_mapping"][n] for n in at] if fast else [None] * len(at))
        for tokens in extra:
            allowed.add(tokens[:max_tokens])
        found.append(allowed)
    return found


SPLIT_CHARS = 8
"""A span's first word is also allowed as one token of its first 1 to SPLIT_CHARS characters, then the tokens of the
rest: a model that copies "MPEG-2" from " MPEG-2" may start it with "M" where the tokenizer writes "MP"."""


class _Passage:
    """A passage's spans: from each piece, with its first letter as written and with its case swapped."""

    def __init__(self, passage: str, prefix: str, max_tokens: int):
        parts = pieces(passage)
        # the passage with every whitespace run as one space, and each piece's offsets in it
        text = ""
        self.starts: list[int] = []
        self.ends: list[int] = []
        for part in parts:
            text += (" " if part.spaced else "") + passage[part.start : part.end]
            self.starts.append(len(text) - (part.end - part.start))
            self.ends.append(len(text))
        self.text, self.prefix, self.max_tokens = text, prefix, max_tokens
        self.heads: list[tuple[int, int, str]] = []
        """(first piece, the first piece after a space that follows it (or the number of pieces), the answer's
        prefix and first letter)"""
        after_space = len(parts)
        for i in reversed(range(len(parts))):
            self.heads += [(i, after_space, prefix + first) for first in _case_variants(text[self.starts[i]])]
            if parts[i].spaced:
                after_space = i
        self.splits = [(h, k) for h, (i, nxt, _) in enumerate(self.heads)
                       for k in range(1, min(SPLIT_CHARS, self.ends[nxt - 1] - self.starts[i] - 1) + 1)]
        """(head, k): the head's first word group written as its first k characters, then the rest"""

    def span(self, first: int, last: int, lead: str) -> str:
        """The answer text of pieces ``first`` to ``last``, starting with ``lead`` (the prefix and first letter)."""
        return lead + self.text[self.starts[first] + 1 : self.ends[last]]

    def _last(self, first: int) -> int:
        return min(len(self.ends), first + self.max_tokens) - 1  # a piece is at least one token

    def texts(self, fast: bool) -> list[str]:
        """What to tokenize: the passage, each span's first word group and its splits (fast), or every span (slow)."""
        if not fast:
            return [self.span(i, j, lead) for i, _, lead in self.heads for j in range(i, self._last(i) + 1)]
        heads = [self.span(i, nxt - 1, lead) for i, nxt, lead in self.heads]
        cut = len(self.prefix)
        splits = [text for h, k in self.splits for text in (heads[h][: cut + k], heads[h][cut + k :])]
        return [self.text, *heads, *splits]

    def fill(self, allowed: AllowedAnswers, tokenizer: Any, ids: list[list[int]], offsets: list[Any]) -> None:
        if offsets[0] is None:  # a slow tokenizer: every span tokenized whole
            for tokens in ids:
                if len(tokens) <= self.max_tokens:
                    allowed.add(tokens)
            return
        passage = ids[0], _boundaries(offsets[0]), offsets[0]
        whole: list[str] = []
        n = len(self.heads)
        for (i, nxt, lead), head_ids, head_offsets in zip(self.heads, ids[1 : n + 1], offsets[1 : n + 1], strict=True):
            shift = self.starts[i] - len(self.prefix)  # head offsets -> passage offsets
            after = {shift + end: count for end, count in _boundaries(head_offsets).items()}
            spans = [self.span(i, j, lead) for j in range(i, self._last(i) + 1)]
            if not self._add(allowed, i, nxt, list(head_ids), after, passage,
                             lambda j, i=i, spans=spans: whole.append(spans[j - i])):
                whole.extend(spans)  # the passage's tokens do not break at the space: every span tokenized whole
        for index, (h, k) in enumerate(self.splits):
            first, rest = ids[n + 1 + 2 * index], ids[n + 2 + 2 * index]
            if len(first) != 1:
                continue
            i, nxt, _ = self.heads[h]
            at = self.starts[i] + k
            after = {at: 1, **{at + end: 1 + count for end, count in _boundaries(offsets[n + 2 + 2 * index]).items()}}
            self._add(allowed, i, nxt, first + rest, after, passage, lambda j: None)
        for tokens in _tokenized(tokenizer, whole):
            if len(tokens) <= self.max_tokens:
                allowed.add(tokens)

    def _add(self, allowed: AllowedAnswers, i: int, nxt: int, tokens: list[int], after: dict[int, int],
             passage: tuple[list[int], dict[int, int], list[Any]], inside: Any) -> bool:
        """The path of the spans from piece ``i`` that start with ``tokens`` (the first word group, ``after``: its
        token counts by passage offset) and go on with the passage's own tokens; ``inside(j)`` for the span to
        piece j that ends inside a token. False where the passage's tokens do not break at the next space."""
        passage_ids, passage_after, passage_offsets = passage
        last = self._last(i)
        if nxt <= last:
            space = self.starts[nxt] - 1
            joint = passage_after.get(space)
            if joint is None or joint >= len(passage_ids) or passage_offsets[joint][0] not in (space, space + 1):
                return False
            head = len(tokens)
            tokens = tokens + passage_ids[joint : joint + self.max_tokens]
            for end in self.ends[nxt : last + 1]:
                count = passage_after.get(end)
                if count is not None:
                    after[end] = head + count - joint
        ends = []
        for j in range(i, last + 1):
            count = after.get(self.ends[j])
            if count is None:
                inside(j)
            elif count <= self.max_tokens:
                ends.append(count)
        allowed.add(tokens[: self.max_tokens], ends)
        return True


def _boundaries(offsets: list[tuple[int, int]]) -> dict[int, int]:
    """Character offset -> the number of tokens that end there, where a token boundary falls on it (tokens that
    hold parts of one character's bytes all end after that character: only the last of them counts)."""
    found = {}
    for n, (_, end) in enumerate(offsets, 1):
        if n == len(offsets) or offsets[n][0] >= end:
            found[end] = n
    return found


def _case_variants(first: str) -> list[str]:
    """A span's first letter, and that letter with its case swapped (when that is one letter)."""
    swapped = first.swapcase()
    return [first, swapped] if len(swapped) == 1 and swapped != first else [first]


def _tokenized(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


class GroundedLogits:
    """A transformers logits processor: each row's scores outside its allowed tokens set to -inf.

    ``allowed``: one per batch row (None: unconstrained); ``start``: the column of ``input_ids`` where the generated
    tokens begin (a causal LM's padded prompt width; 1 after an encoder-decoder's decoder start token); ``beams``:
    rows per batch row (beam search lays a row's beams side by side)."""

    def __init__(self, allowed: Sequence[AllowedAnswers | None], start: int, beams: int = 1):
        self.allowed = list(allowed)
        self.start = start
        self.beams = beams

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return ground_scores(scores, [answers.allowed(generated) if answers is not None else None
                                      for answers, generated in zip(
                                          (self.allowed[row // self.beams] for row in range(len(input_ids))),
                                          input_ids[:, self.start :].tolist())])


def ground_scores(scores: torch.Tensor, allowed: Sequence[list[int] | None]) -> torch.Tensor:
    """``scores`` (rows x vocabulary) with -inf outside each row's allowed tokens (None: the row is left as is),
    changed in place: the allowed scores kept aside, the rows filled, the kept scores put back."""
    constrained, rows, columns = [], [], []
    for row, tokens in enumerate(allowed):
        if tokens is not None:
            constrained.append(row)
            rows += [row] * len(tokens)
            columns += tokens
    if not constrained:
        return scores
    where = torch.tensor(rows, device=scores.device), torch.tensor(columns, device=scores.device)
    kept = scores[where]
    if len(constrained) == len(scores):
        scores.fill_(float("-inf"))
    else:
        scores.index_fill_(0, torch.tensor(constrained, device=scores.device), float("-inf"))
    scores[where] = kept
    return scores


def can_ground(info: ModelInfo) -> bool:
    """Whether a run writes free-text answers about a passage: generative, with {context}, without answer fields."""
    return (task_kind(info.task).writes and not info.answer_fields
            and PromptTemplate(info.prompt_template).uses_context)


def grounded(info: ModelInfo, generate: GenerateConfig) -> bool:
    """Whether ``generate.grounded`` turns grounded decoding on for the run: ``auto`` as training decided it (runs
    whose training answers are spans of their passages); ``on`` refuses a run that cannot be grounded."""
    setting = generate.grounded
    if setting == "off" or not task_kind(info.task).writes:
        return False  # an extractive run's answers are spans already; a scoring run writes no text
    if setting == "on":
        if not can_ground(info):
            why = ("its answers are a grading sheet's fields" if info.answer_fields
                   else "its prompt has no {context}: it answers from the question alone")
            raise ConfigError(f"generate.grounded on: grounded decoding answers with a span of the passage, and this "
                              f"run has none to take ({why}); use auto or off")
        return True
    answers = PassageAnswers.from_json(info.grounding)
    return can_ground(info) and answers is not None and answers.auto


def no_answer_text(info: ModelInfo) -> str | None:
    """The run's fixed answer for a question its passage does not answer, learned from its training rows."""
    answers = PassageAnswers.from_json(info.grounding)
    return answers.no_answer if answers is not None else None


def with_grounding(generate: GenerateConfig, setting: str | None) -> GenerateConfig:
    """``generate`` with ``generate.grounded`` set to ``setting`` (--grounded), or as it is for None."""
    return generate if setting is None else generate.model_copy(update={"grounded": setting})


def passage_metrics(info: ModelInfo, generate: GenerateConfig, records: Sequence[QARecord],
                    predictions: Sequence[str]) -> dict[str, Any]:
    """For a run that reads a passage and writes its answers: whether decoding was grounded, and the share of answers
    (0-100) that are spans of their passage (or the no-answer text). Empty for other runs."""
    if not can_ground(info):
        return {}
    no_answer = (no_answer_text(info) or "").casefold()
    found = [bool(p.strip()) and (in_passage(p, r.context or "") or p.strip().casefold() == no_answer)
             for p, r in zip(predictions, records, strict=True)]
    return {"grounded": grounded(info, generate),
            "in_passage": round(100 * sum(found) / len(found), 2) if found else None}
