"""Grading sheets: several answer columns (a score, a verdict label, a feedback) written as one answer text.

A model answers one text, so the columns are rendered into it through an answer template such as
``"Score: {score}\\nLabel: {label}\\nFeedback: {feedback}"`` and parsed back out of what it generates.
``{{`` and ``}}`` are literal braces. Each field's kind (number, label or free text) decides how it is
scored (:mod:`qatune.inference.field_metrics`).
"""

from __future__ import annotations

import math
import numbers
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

from qatune.data.numbers import decimal_separator, parse_number
from qatune.errors import ConfigError, DataError

FIELD_KINDS = ("number", "label", "text")
"""How a field is scored: as a number, as one of a few labels, or as free text."""

_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
"""{name} is a field, {{ and }} are literal braces; a lone brace is an error."""

_LABEL_MAX_DISTINCT = 20

NUMBER_SHARE = 0.9
"""The least share of a column's values that must be numbers for it to be taken as a number column."""


def default_template(columns: list[str]) -> str:
    """One line per column, ``Total Marks: {total_marks}``: the name with _ as a space, words capitalised."""
    lines = []
    for column in columns:
        title = " ".join(word[:1].upper() + word[1:] for word in column.replace("_", " ").split())
        lines.append(f"{title}: {{{column}}}")
    return "\n".join(lines)


def format_value(value: object) -> str:
    """A cell as answer text: whole floats without their ``.0`` (spreadsheets read 2 as 2.0), else str()."""
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        number = float(value)
        if math.isfinite(number) and number.is_integer() and abs(number) < 1e16:
            return str(int(number))
        return str(number)
    return str(value)


@dataclass(frozen=True)
class AnswerTemplate:
    """An answer template over ``columns`` that renders their values into one text and parses them back.

    Constructing one validates it (:meth:`make` fills in the default template): every column appears
    exactly once, no other name does, and literal text separates the fields, so parsing is unambiguous.
    """

    template: str
    columns: tuple[str, ...]

    @classmethod
    def make(cls, columns: list[str] | tuple[str, ...], template: str | None = None) -> AnswerTemplate:
        return cls(default_template(list(columns)) if template is None else template, tuple(columns))

    def __post_init__(self) -> None:
        problems = _problems(self.template, self.columns)
        if problems:
            example = default_template(list(self.columns)) if self.columns else "Score: {score}\nFeedback: {feedback}"
            raise ConfigError(f"data.answer_template {self.template!r} cannot be parsed back into its fields: "
                              f"{'; '.join(problems)}; for example {example!r}")

    def render(self, values: Mapping[str, object]) -> str:
        """The answer text for one row (columns missing from ``values`` raise DataError; extra keys are ignored)."""
        missing = [name for name in self.columns if name not in values]
        if missing:
            raise DataError(f"the answer template needs the columns {missing}; the row has {sorted(values)}")
        literals, fields = self._parts
        parts = [literals[0]]
        for name, literal in zip(fields, literals[1:]):
            parts += [format_value(values[name]), literal]
        return "".join(parts)

    def pieces(self) -> tuple[list[str], list[str]]:
        """The template's own texts around the fields (one more than the fields), and the field names in order."""
        return self._parts

    def spans(self, values: Mapping[str, object]) -> dict[str, tuple[int, int]]:
        """Where each column's value lies in :meth:`render`'s text: (start, end) character offsets."""
        literals, fields = self._parts
        spans, position = {}, len(literals[0])
        for name, literal in zip(fields, literals[1:]):
            text = format_value(values[name])
            spans[name] = (position, position + len(text))
            position += len(text) + len(literal)
        return spans

    def parse(self, text: str) -> dict[str, str] | None:
        """The stripped value of each column read from ``text``, in the template's order; None when not even the
        first field is read. :meth:`complete` tells whether every column was.

        The template's text is matched forgiving what does not matter: letters in any case, any run of spaces
        where it has spaces, spaces before punctuation ("score :  3" for "Score: {score}"). A field ends at the
        first occurrence of the template text after it; the last field runs to the end, where the template's
        closing text (if any) may be missing, as when generation stopped at its end token. An answer cut before
        its last field gives the fields before the cut, the one it cut into without the start of the next
        field's text.

        A value that is empty, or that holds the text the template writes before a field ("Verdict:" in
        "0.5\nVerdict: Correct", the model starting its answer again), is not read, nor is any field after it:
        the answer went astray there, and a stray line cut off would leave a fragment that looks like a value.
        So parse(render(values)) == values for values without surrounding whitespace, none empty and none
        holding those texts.
        """
        found: dict[str, str] = {}
        for name, value in self._split(text).items():
            if not value or any(label.search(value) for label in self._label_patterns):
                break
            found[name] = value
        return found or None

    def _split(self, text: str) -> dict[str, str]:
        """The stripped text between the template's texts, for each column found in order (none found: {})."""
        literals, names = self._parts
        found: dict[str, str] = {}
        start = self._literal_patterns[0].search(text)
        if start is None:
            return found
        position = start.end()
        for index, name in enumerate(names):
            following = literals[index + 1]
            if index == len(names) - 1:
                value = text[position:]
                closing = self._closing_pattern.search(value) if following.strip() else None
                found[name] = (value[:closing.start()] if closing else value).strip()
                break
            match = self._literal_patterns[index + 1].search(text, position)
            if match is None:  # the answer stops inside this field (or inside the next field's text)
                found[name] = _without_cut_text(text[position:], following).strip()
                break
            found[name] = text[position:match.start()].strip()
            position = match.end()
        return found

    def complete(self, parsed: Mapping[str, str] | None) -> bool:
        """Whether a :meth:`parse` result holds every column."""
        return parsed is not None and len(parsed) == len(self.columns)

    @cached_property
    def _parts(self) -> tuple[list[str], list[str]]:
        """The literal texts around the fields (one more than the fields) and the field names in order."""
        literals, fields, _ = _tokens(self.template)
        return literals, fields

    @cached_property
    def _literal_patterns(self) -> list[re.Pattern[str]]:
        literals = self._parts[0]
        first = literals[0] if literals[0].strip() else ""  # spaces before the first field: any, or none
        return [re.compile(_forgiving(literal), re.IGNORECASE) for literal in [first, *literals[1:]]]

    @cached_property
    def _label_patterns(self) -> list[re.Pattern[str]]:
        """The texts the template writes before its fields, each from its last line ("Verdict:", "<label>"), as
        whole words; texts of spaces and punctuation only cannot be told from a value's own and are left out."""
        labels = {literal.rsplit("\n", 1)[-1].strip() or literal.strip() for literal in self._parts[0][:-1]}
        return [re.compile(r"\b" * label[0].isalnum() + _forgiving(label) + r"\b" * label[-1].isalnum(), re.IGNORECASE)
                for label in sorted(labels) if any(c.isalnum() for c in label)]

    @cached_property
    def _closing_pattern(self) -> re.Pattern[str]:
        """The closing text (after the last field), then only spaces."""
        return re.compile(_forgiving(self._parts[0][-1]) + r"\s*\Z", re.IGNORECASE)


def _forgiving(literal: str) -> str:
    """A pattern for a template's text: letters in any case (the caller's flag), any run of spaces where it has
    spaces (none needed at its end, before the value), optional spaces before punctuation."""
    if not literal.strip():
        return r"\s+" if literal else ""
    pattern = ""
    pieces = re.findall(r"\s+|\w+|[^\w\s]", literal)
    for index, piece in enumerate(pieces):
        if piece.isspace():
            # at its end, before the value: spaces it may lack; a line break is left to the value (then stripped)
            pattern += r"[ \t]*" if index == len(pieces) - 1 else r"\s+"
        elif re.fullmatch(r"\w+", piece):
            pattern += re.escape(piece)
        else:
            pattern += r"[ \t]*" + re.escape(piece)
    return pattern


def _without_cut_text(value: str, following: str) -> str:
    """A value the answer stopped in, without the start of the template text that was to follow it."""
    folded, wanted = value.casefold(), following.casefold()
    for size in range(min(len(value), len(following)), 0, -1):
        if wanted.startswith(folded[-size:]) and folded[-size:].strip():
            return value[:-size]
    return value


def label_key(label: str) -> str:
    """A label as labels are compared: case, spacing and punctuation do not matter ("correct." is "Correct")."""
    return " ".join(re.sub(r"[\W_]+", " ", label.casefold()).split())


def infer_kind(values: list[str]) -> str:
    """The kind of a column from its values (blank ones left out), one of FIELD_KINDS.

    "number" when at least 9 in 10 values are numbers (:func:`qatune.data.numbers.parse_number`; the others are
    cells to fix, which ``qatune check`` names); else "label" when values repeat enough to be classes: at most 20
    distinct values (compared by :func:`label_key`) and at most half as many distinct values as values, so at
    least one repeats; else "text". No values: "text".
    """
    filled = [value.strip() for value in values if value.strip()]
    numbers_read = sum(parse_number(value) is not None for value in filled)
    if filled and numbers_read >= NUMBER_SHARE * len(filled):
        return "number"
    distinct = len({label_key(value) for value in filled})
    if filled and distinct <= _LABEL_MAX_DISTINCT and 2 * distinct <= len(filled):
        return "label"
    return "text"


@dataclass(frozen=True)
class FieldSpec:
    """One answer column as training saw it, saved with the run so that every evaluation reads it alike.

    ``values``: labels: the classes (each spelling trained, the most frequent first); numbers: the distinct
    values, ascending, each as most often written. ``counts``: the training rows of each. Numbers also have
    their ``decimal`` separator, their training range ``low``..``high`` and the ``tolerance`` a prediction is
    right within (a quarter of the smallest step between training values, so it is nearer its own value than
    any other; 0 for a single value)."""

    kind: str
    values: tuple[str, ...] = ()
    counts: tuple[int, ...] = ()
    decimal: str = "."
    tolerance: float | None = None
    low: float | None = None
    high: float | None = None

    def number(self, text: str | None) -> float | None:
        return None if text is None else parse_number(text, self.decimal)

    def label(self, text: str | None) -> str | None:
        """A predicted label as the class it names (compared by :func:`label_key`), else as written; None if blank."""
        if text is None or not text.strip():
            return None
        key = label_key(text)
        return next((value for value in self.values if label_key(value) == key), text.strip())

    def to_json(self) -> dict:
        return {"kind": self.kind, "values": list(self.values), "counts": list(self.counts), "decimal": self.decimal,
                "tolerance": self.tolerance, "low": self.low, "high": self.high}

    @classmethod
    def from_json(cls, data: Mapping) -> FieldSpec:
        return cls(data["kind"], tuple(data.get("values", ())), tuple(data.get("counts", ())),
                   data.get("decimal", "."), data.get("tolerance"), data.get("low"), data.get("high"))


def field_spec(kind: str, cells: list[str]) -> FieldSpec:
    """The spec of a column of ``kind`` from its training cells (blank ones left out)."""
    filled = [cell.strip() for cell in cells if cell.strip()]
    if kind == "label":
        counts = Counter(filled)
        order = sorted(counts, key=lambda v: (-counts[v], v))
        return FieldSpec(kind, tuple(order), tuple(counts[v] for v in order))
    if kind != "number":
        return FieldSpec(kind)
    decimal = decimal_separator(filled).separator
    spellings: dict[float, Counter[str]] = {}
    for cell in filled:
        number = parse_number(cell, decimal)
        if number is not None:
            spellings.setdefault(number, Counter())[cell] += 1
    numbers = sorted(spellings)
    gaps = [b - a for a, b in pairwise(numbers)]
    return FieldSpec(kind, tuple(spellings[n].most_common(1)[0][0] for n in numbers),
                     tuple(sum(spellings[n].values()) for n in numbers), decimal,
                     0.25 * min(gaps) if gaps else 0.0, numbers[0] if numbers else None,
                     numbers[-1] if numbers else None)


def likely_same(labels: list[str]) -> list[list[str]]:
    """Groups of two or more spellings that differ only in case, spacing or punctuation, each group ordered
    by how often its spellings occur (the most frequent first)."""
    counts = Counter(label.strip() for label in labels if label.strip())
    groups: dict[str, list[str]] = {}
    for spelling in sorted(counts, key=lambda v: (-counts[v], v)):
        groups.setdefault(label_key(spelling), []).append(spelling)
    return [group for group in groups.values() if len(group) > 1]


def _problems(template: str, columns: tuple[str, ...]) -> list[str]:
    """What keeps ``template`` from being rendered and parsed back over ``columns``, each with its fix."""
    literals, fields, unbalanced = _tokens(template)
    problems = []
    if unbalanced:
        problems.append("it has a lone { or }: write {{ and }} for literal braces")
    if not columns:
        problems.append("there are no answer columns to write")
    if len(set(columns)) != len(columns):
        problems.append(f"the columns {list(columns)} repeat a name")
    unknown = sorted({name for name in fields if name not in columns})
    if unknown:
        names = ", ".join("{" + name + "}" for name in unknown)
        problems.append(f"{names} {'is' if len(unknown) == 1 else 'are'} not among the columns {list(columns)}")
    for name in columns:
        count = fields.count(name)
        if count != 1:
            problems.append(f"{{{name}}} is missing" if count == 0 else f"{{{name}}} appears {count} times, not once")
    touching = [f"{{{a}}}{{{b}}}" for a, b, between in zip(fields, fields[1:], literals[1:-1]) if not between]
    if touching:
        problems.append(f"{', '.join(touching)} have no text between them to tell where one ends")
    if len(fields) == 1 and not literals[0].strip():
        problems.append(f"{{{fields[0]}}} has no text before it to find it by")
    return problems


def _tokens(template: str) -> tuple[list[str], list[str], bool]:
    """Literal texts (braces unescaped) around the fields, the field names, and whether a brace is alone."""
    literals, fields, unbalanced, start = [""], [], False, 0
    for token in _TOKEN.finditer(template):
        literals[-1] += template[start:token.start()]
        start = token.end()
        text, name = token.group(0), token.group(1)
        if text in ("{{", "}}"):
            literals[-1] += text[0]
        elif name is None:
            unbalanced = True
        else:
            fields.append(name)
            literals.append("")
    literals[-1] += template[start:]
    return literals, fields, unbalanced
