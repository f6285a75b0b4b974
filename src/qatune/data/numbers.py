"""Numbers as a grader writes them in a sheet's cells and a model writes them in its answers: the one parser.

A number is digits with at most one decimal separator and thousands separators in groups of three. Where
the form alone decides ("2,5", "1.000,5", "1,000,000", "0,500") it is read that way; "1,500" and "1.500" read
either way, and the column's decimal separator (:func:`decimal_separator`, decided from its training values)
decides them. Dates ("2024-01-05", "5/1/2024"), times ("10:30"), ranges ("3-4"), ordinals ("1st") and version
strings ("1.2.3") are not numbers. A Unicode minus (U+2212) is a minus.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

SEPARATORS = (".", ",")

_MINUSES = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
_START = re.compile(r"\s*(?P<sign>[-+]?)\s*(?P<body>\d[\d.,]*\d|\d|[.,]\d+)")
# What may not follow a number: a separator and a digit makes a date, time, range or version; letters an ordinal.
_NOT_AFTER = re.compile(r"[:\-]\d|/\d+/\d|(?:st|nd|rd|th)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Reading:
    """A number read from a text: its value, and the decimal separator its form proves (None: it proves none)."""

    value: float
    proves: str | None


def read_number(text: str, decimal: str = ".", whole: bool = False) -> Reading | None:
    """The number ``text`` starts with (units or "/3" after it allowed; ``whole``: nothing but spaces), or None.

    ``decimal`` ("." or ",") reads the forms that could be either ("1,500" is 1500 with ".", 1.5 with ",")."""
    text = text.translate(_MINUSES)
    match = _START.match(text)
    if match is None:
        return None
    rest = text[match.end():]
    if (whole and rest.strip()) or _NOT_AFTER.match(rest):
        return None
    body = match["body"]
    reading = _value(body, decimal)
    if reading is None:
        return None
    sign = -1.0 if match["sign"] == "-" else 1.0
    return Reading(sign * reading.value, reading.proves)


def parse_number(text: str, decimal: str = ".", whole: bool = False) -> float | None:
    """:func:`read_number`'s value."""
    reading = read_number(text, decimal, whole)
    return None if reading is None else reading.value


def _value(body: str, decimal: str) -> Reading | None:
    groups = re.split(r"[.,]", body)
    seps = [c for c in body if c in SEPARATORS]
    if not seps:
        return Reading(float(body), None)
    if body[0] in SEPARATORS:  # ".5", ",5"
        return Reading(float("0." + groups[1]), body[0]) if len(seps) == 1 else None
    kinds = set(seps)
    if len(kinds) == 2:  # "1,000.5" / "1.000,5": the last separator is the decimal one, once
        point = seps[-1]
        thousands = "," if point == "." else "."
        head, tail = body.rsplit(point, 1)
        if point in head or not _thousands(head.split(thousands)):
            return None
        return Reading(float(head.replace(thousands, "") + "." + tail), point)
    sep = seps[0]
    if len(seps) > 1:  # "1,000,000" (thousands) or "1.2.3" (a version)
        return Reading(float("".join(groups)), "," if sep == "." else ".") if _thousands(groups) else None
    if _thousands(groups):  # "1,500": the column decides
        return Reading(float(groups[0] + "." + groups[1]) if sep == decimal else float("".join(groups)), None)
    return Reading(float(groups[0] + "." + groups[1]), sep)


def _thousands(groups: list[str]) -> bool:
    """Whether digit groups split at a separator are a thousands form: 1-3 digits without a leading 0, then 3s."""
    head, rest = groups[0], groups[1:]
    return bool(rest) and 1 <= len(head) <= 3 and head[0] != "0" and all(len(g) == 3 for g in rest)


@dataclass(frozen=True)
class DecimalSeparator:
    """A column's decimal separator and why: ``evidence`` a value whose form proves it (None: no value does, and
    the point is taken); ``against``: how many values prove the other one."""

    separator: str
    evidence: str | None = None
    against: int = 0

    def describe(self) -> str:
        name = "decimal comma" if self.separator == "," else "decimal point"
        if self.evidence is None:
            return f"{name} (no value shows a decimal comma)"
        return f"{name} (as in {self.evidence!r})" + (f"; {self.against} values read the other way" if self.against
                                                      else "")


def decimal_separator(values: list[str]) -> DecimalSeparator:
    """The decimal separator of a column: the one most of its values prove by their form; "." when none does."""
    proofs: Counter[str] = Counter()
    first: dict[str, str] = {}
    for value in values:
        reading = read_number(value)
        if reading is not None and reading.proves is not None:
            proofs[reading.proves] += 1
            first.setdefault(reading.proves, value.strip())
    if not proofs:
        return DecimalSeparator(".")
    separator = "," if proofs[","] > proofs["."] else "."
    other = "." if separator == "," else ","
    return DecimalSeparator(separator, first[separator], proofs[other])
