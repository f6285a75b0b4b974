"""``qatune generate``: the options checked against each other, then one answer or a whole answered file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qatune.errors import QatuneError


def run_generate(run_dir: str, question: str | None, context: str | None, context_file: str | None,
                 data_file: str | None, fields: tuple[str, ...], output: str | None, overrides: tuple[str, ...],
                 which: str, options: dict[str, Any], seed: int | None, with_runs: tuple[str, ...] = ()) -> str | Path:
    """The answer to QUESTION, or with --file the path of the answered file (``with_runs``: --with)."""
    from qatune.evaluation.asking import answer_one
    from qatune.evaluation.graded_sheets import answer_file

    if data_file is not None:
        if question is not None:
            raise QatuneError("give either a QUESTION or --file, not both")
        given = [flag for flag, value in (("--context", context), ("--context-file", context_file),
                                          ("--field", fields)) if value]
        if given:
            raise QatuneError(f"{given[0]} goes with a single QUESTION; with --file, passages and other columns "
                              "come from the file's columns")
        return answer_file(run_dir, data_file, output, which, options, seed, reading=overrides, with_runs=with_runs)
    if with_runs:
        raise QatuneError("--with goes with --file: each run grades the file's rows and adds its own columns")
    if overrides:
        raise QatuneError("--set goes with --file (how the file is read); a single QUESTION needs none")
    if question is None or not question.strip():
        raise QatuneError("the question is empty; pass a question in quotes, e.g. "
                          "qatune generate RUN \"Who wrote it?\"")
    return answer_one(run_dir, question, context, context_file, which, options, seed, fields=field_values(fields))


def field_values(fields: tuple[str, ...]) -> dict[str, str]:
    """--field NAME=VALUE options as a dict."""
    values = {}
    for item in fields:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise QatuneError(f"--field {item!r}: expected NAME=VALUE, e.g. --field 'Total Marks=3'")
        values[name.strip()] = value
    return values
