"""The spans of a passage: the answers grounded decoding may write, and whether a run's answers are such spans.

A passage is read as pieces: runs of letters and digits, single punctuation marks, and single CJK characters
(scripts written without spaces). A span starts at a piece and ends at a piece; its text is the passage's text
between them with every run of whitespace written as one space. "River" is a span of "the Vistula River." and
"1887" one of "(1887)", but "ate" is not one of "Kate". An answer is in its passage when its pieces, compared
ignoring case, are a span's pieces with whitespace where the span has it.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from qatune.data.spreadsheet import QARecord

_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_PIECE = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+|[^\w\s]")

AUTO_SHARE = 0.9
"""generate.grounded auto turns grounded decoding on when at least this share of a run's training answers are
spans of their passages or its no-answer text."""


@dataclass(frozen=True)
class Piece:
    start: int
    end: int
    """Character offsets in the passage."""
    spaced: bool
    """Whether whitespace comes before it (False for the first piece)."""


def pieces(text: str) -> list[Piece]:
    """The pieces of ``text``, in order."""
    found = []
    last_end = 0
    for match in _PIECE.finditer(text):
        found.append(Piece(match.start(), match.end(), bool(found) and match.start() > last_end))
        last_end = match.end()
    return found


def in_passage(answer: str, passage: str) -> bool:
    """Whether ``answer`` is a span of ``passage``, ignoring case and the kind and amount of whitespace."""
    wanted = _keys(answer, pieces(answer))
    if not wanted:
        return False
    have = _keys(passage, pieces(passage))
    first = wanted[0][0]
    rest = wanted[1:]
    n = len(wanted)
    return any(have[i][0] == first and have[i + 1 : i + n] == rest for i in range(len(have) - n + 1))


def _keys(text: str, parts: list[Piece]) -> list[tuple[str, bool]]:
    return [(text[p.start : p.end].casefold(), p.spaced) for p in parts]


@dataclass(frozen=True)
class PassageAnswers:
    """How a run's training answers relate to their passages (saved with the run as ``grounding``)."""

    rows: int
    """Training rows with a passage."""
    spans: int
    """Of those, the rows whose answer is a span of the passage."""
    no_answer: str | None = None
    """The fixed answer of the rows whose answer is not in their passage ("unanswerable"), when they share one."""
    no_answer_rows: int = 0
    auto: bool = False
    """What generate.grounded auto decides: on when the spans and no-answer rows are at least AUTO_SHARE."""

    @property
    def share(self) -> float:
        """The share of rows whose answer is a span (0-1)."""
        return self.spans / self.rows if self.rows else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "share": round(self.share, 4)}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> PassageAnswers | None:
        if not data:
            return None
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def describe(self) -> str:
        """One line: the share of spans, the no-answer text, and what auto decides."""
        line = (f"{self.spans} of {self.rows} training answers ({100 * self.share:.1f}%) are spans of their "
                "passage")
        if self.no_answer is not None:
            line += f", {self.no_answer_rows} are the no-answer text {self.no_answer!r}"
        return line + f"; generate.grounded auto: {'on' if self.auto else 'off'}"


def passage_answers(records: list[QARecord]) -> PassageAnswers:
    """Which training answers are spans of their passage; the fixed answer of most of the others (at least 2 rows),
    taken as the no-answer text; and what generate.grounded auto decides from them."""
    with_passage = [r for r in records if r.context and r.answers]
    outside = [r.answer.strip() for r in with_passage if not in_passage(r.answer, r.context or "")]
    spans = len(with_passage) - len(outside)
    counts = Counter(_folded(a) for a in outside)
    no_answer, rows = None, 0
    if counts:
        key, rows = counts.most_common(1)[0]
        if rows >= 2 and 2 * rows >= len(outside):
            no_answer = Counter(a for a in outside if _folded(a) == key).most_common(1)[0][0]  # its usual spelling
        else:
            rows = 0
    auto = bool(with_passage) and spans + rows >= AUTO_SHARE * len(with_passage)
    return PassageAnswers(rows=len(with_passage), spans=spans, no_answer=no_answer, no_answer_rows=rows, auto=auto)


def _folded(text: str) -> str:
    return " ".join(text.split()).casefold()
