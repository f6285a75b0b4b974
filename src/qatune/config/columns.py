"""How a config names a sheet's columns: column names matched loosely, and the {placeholders} of a template.

Both the config's checks and the data reader match names this way, so the rule lives here, below both.
"""

from __future__ import annotations

import re


def column_key(name: str) -> str:
    """A column name as matched: case, surrounding spaces, runs of spaces and _/- do not matter."""
    return " ".join(re.sub(r"[_\-]", " ", name).casefold().split())


PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
"""A prompt template's syntax: {name} is a placeholder (any text but braces), {{ and }} are literal braces."""


def template_fields(template: str) -> list[str] | None:
    """The placeholder names of a template, in order, without repeats (None: unbalanced braces)."""
    names: list[str] = []
    for match in PLACEHOLDER.finditer(template):
        if match.group(0) in ("{", "}"):
            return None
        name = match.group(1)
        if name is not None and name not in names:
            names.append(name)
    return names
