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
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from qatune.errors import ConfigError, DataError

FIELD_KINDS = ("number", "label", "text")
"""How a field is scored: as a number, as one of a few labels, or as free text."""

_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
"""{name} is a field, {{ and }} are literal braces; a lone brace is an error."""

# The first number at the start of a text. Thousands separators only in groups of exactly three digits
# after a first group without a leading 0 ("1,000", "1.000,5"); otherwise a comma is a decimal comma
# ("2,5", "0,500"). (?!\d) keeps "1,0001" out of the thousands forms, so it reads as the decimal 1.0001.
_NUMBER = re.compile(r"""\s*(?P<sign>[-+]?)(?:
      (?P<comma_thousands>[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?)(?!\d)
    | (?P<dot_thousands>[1-9]\d{0,2}(?:\.\d{3})+,\d+)(?!\d)
    | (?P<plain>\d+(?:[.,]\d+)?|[.,]\d+)
)""", re.VERBOSE)

_LABEL_MAX_DISTINCT = 20


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

    def parse(self, text: str) -> dict[str, str] | None:
        """The stripped value of each column in ``text``, or None when the text does not follow the template.

        A field ends at the first occurrence of the template text after it; the last field runs to the end,
        where the template's closing text (if any) may be missing, as when generation stopped at its end
        token. A text that stops before its last field gives None. So parse(render(values)) == values for
        values without surrounding whitespace where no value but the last contains the text that follows it.
        """
        match = self._pattern.fullmatch(text)
        if match is None:
            return None
        return {name: value.strip() for name, value in zip(self._parts[1], match.groups())}

    @cached_property
    def _parts(self) -> tuple[list[str], list[str]]:
        """The literal texts around the fields (one more than the fields) and the field names in order."""
        literals, fields, _ = _tokens(self.template)
        return literals, fields

    @cached_property
    def _pattern(self) -> re.Pattern[str]:
        # Groups are positional: a column name need not be a valid group name.
        literals = self._parts[0]
        pattern = r"\s*" + re.escape(literals[0])
        for literal in literals[1:-1]:
            pattern += "(.*?)" + re.escape(literal)
        # The last field is lazy too, but anchored at the end: it stops only before an optional closing text
        # and trailing whitespace, so it keeps everything else, as a greedy field would.
        closing = f"(?:{re.escape(literals[-1])})?" if literals[-1] else ""
        return re.compile(pattern + "(.*?)" + closing + r"\s*", re.DOTALL)


def parse_number(text: str) -> float | None:
    """The number a text starts with, units or "/3" after it allowed; None when it does not start with one.

    "2,5" is 2.5 (a decimal comma), "1,000" is 1000.0 and "1,000.5" 1000.5 (thousands: groups of three
    digits), "1.000,5" is 1000.5; "2.5 points" and "2.5/3" are 2.5.
    """
    match = _NUMBER.match(text)
    if match is None:
        return None
    if match["comma_thousands"]:
        digits = match["comma_thousands"].replace(",", "")
    elif match["dot_thousands"]:
        digits = match["dot_thousands"].replace(".", "").replace(",", ".")
    else:
        digits = match["plain"].replace(",", ".")
    return float(match["sign"] + digits)


def infer_kind(values: list[str]) -> str:
    """The kind of a column from its values (blank ones left out), one of FIELD_KINDS.

    "number" when every value parses as a number (:func:`parse_number`); else "label" when values repeat
    enough to be classes: at most 20 distinct values (compared stripped and case-insensitively) and at most
    half as many distinct values as values, so at least one repeats; else "text". No values: "text".
    """
    filled = [value.strip() for value in values if value.strip()]
    if filled and all(parse_number(value) is not None for value in filled):
        return "number"
    distinct = len({value.casefold() for value in filled})
    if filled and distinct <= _LABEL_MAX_DISTINCT and 2 * distinct <= len(filled):
        return "label"
    return "text"


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
