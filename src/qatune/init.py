"""``qatune init``: look at a spreadsheet, guess its question/answer/context columns, write a config.

It asks nothing: it prints each guess and why, and the config it writes is validated before it is
written, so ``qatune check --config`` can run on it at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from qatune.config import validate_config
from qatune.data.extractive import locate_answer
from qatune.data.spreadsheet import _clean_cell, read_table
from qatune.errors import DataError, QatuneError

QUESTION_NAMES = ("question", "questions", "query", "prompt", "q", "ask", "input", "instruction")
ANSWER_NAMES = ("answer", "answers", "response", "reply", "a", "target", "output", "solution", "label",
                "reference answer", "expected answer")
CONTEXT_NAMES = ("context", "passage", "paragraph", "document", "article", "text", "content", "source")
DEFAULT_MODELS = {"generative": "gpt2", "extractive": "bert-base-uncased"}
SAMPLE_ROWS = 500


@dataclass
class Guess:
    column: str | None
    reason: str


@dataclass
class Inspection:
    task: str
    question: Guess
    answer: Guess
    context: Guess
    answer_in_context: float | None
    rows: int
    sheet: str | int | None


def inspect(path: Path, sheet: str | int | None = None, task: str = "auto") -> Inspection:
    header, rows, _ = read_table(path, sheet=sheet)
    if not rows:
        raise DataError(f"{path} has a header but no data rows")
    sample = rows[:SAMPLE_ROWS]
    columns = {name: [_clean_cell(row[i]) if i < len(row) else None for row in sample]
               for i, name in enumerate(header) if name.strip()}
    stats = {name: _stats(values) for name, values in columns.items()}
    question = _by_name(columns, QUESTION_NAMES)
    if question.column is None:
        question = _best(stats, "question_marks", "ends with '?' most often")
    if question.column is None:
        raise DataError(f"cannot tell which column of {path.name} holds the questions (columns: {header}); "
                        "name it 'question' or write the config by hand")
    taken = {question.column}
    answer = _by_name(columns, ANSWER_NAMES, taken)
    if answer.column:
        taken.add(answer.column)
    context = _by_name(columns, CONTEXT_NAMES, taken)
    if context.column is None:
        long_text = {n: s for n, s in stats.items() if n not in taken and s["mean_length"] >= 200}
        context = _best(long_text, "mean_length", "long passages (mean length {value:.0f} characters)")
    if context.column:
        taken.add(context.column)
    if answer.column is None:
        texts = {n: s for n, s in stats.items() if n not in taken and s["filled"] > 0.5}
        answer = _best(texts, "shortness", "the shortest filled text column")
    if answer.column is None:
        raise DataError(f"cannot tell which column of {path.name} holds the answers (columns: {header}); "
                        "name it 'answer' or write the config by hand")
    share = None
    if context.column:
        pairs = [(c, a) for c, a in zip(columns[context.column], columns[answer.column]) if c and a]
        share = sum(locate_answer(c, a) is not None for c, a in pairs) / len(pairs) if pairs else 0.0
    if task == "auto":
        task = "extractive" if share is not None and share >= 0.5 else "generative"
    if task == "extractive" and context.column is None:
        raise DataError(f"--task extractive needs a context column and none was found in {path.name} "
                        f"(columns: {header})")
    if task == "generative":
        context = Guess(None, context.reason + "; not used by generative QA" if context.column else context.reason)
    return Inspection(task=task, question=question, answer=answer, context=context, answer_in_context=share,
                      rows=len(rows), sheet=sheet)


def write_config(path: Path, data_file: Path, found: Inspection, model: str | None, output_dir: str | None,
                 force: bool) -> dict[str, Any]:
    if path.exists() and not force:
        raise QatuneError(f"{path} already exists; pass --force to replace it or choose another --output")
    raw: dict[str, Any] = {
        "task": found.task,
        "seed": 42,
        "output_dir": output_dir or f"runs/{_slug(data_file.stem)}",
        "model": {"name_or_path": model or DEFAULT_MODELS[found.task]},
        "data": {
            "train_file": str(data_file),
            "eval_file": None,
            "validation_fraction": 0.1,
            "question_column": found.question.column,
            "answer_column": found.answer.column,
            "context_column": found.context.column,
            "sheet": found.sheet,
            "max_length": "auto" if found.task == "generative" else 384,
        },
        "train": {"epochs": 3, "batch_size": 8, "learning_rate": 5.0e-5 if found.task == "generative" else 3.0e-5,
                  "max_grad_norm": 1.0, "warmup_steps": 20},
    }
    validate_config(raw, str(path))
    header = (f"# Written by 'qatune init {data_file}': {found.rows} rows, {found.task} QA.\n"
              f"# Check it with: qatune check --config {path}\n")
    path.write_text(header + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return raw


def _stats(values: list[str | None]) -> dict[str, float]:
    filled = [v for v in values if v]
    n = max(len(filled), 1)
    mean_length = sum(len(v) for v in filled) / n
    numeric = sum(bool(re.fullmatch(r"[+-]?\d+(\.\d+)?", v)) for v in filled) / n
    return {
        "filled": len(filled) / max(len(values), 1),
        "mean_length": mean_length,
        "question_marks": sum(v.rstrip().endswith("?") for v in filled) / n,
        "shortness": (1.0 / (1.0 + mean_length)) * (1.0 - numeric) if filled else 0.0,
    }


def _by_name(columns: dict[str, list], names: tuple[str, ...], taken: set[str] = frozenset()) -> Guess:
    def key(name: str) -> str:
        return " ".join(re.sub(r"[_\-]", " ", name).casefold().split())

    for wanted in names:
        for column in columns:
            if column not in taken and key(column) == wanted:
                return Guess(column, f"its name ({column!r})")
    for wanted in names:
        if len(wanted) < 4:
            continue
        for column in columns:
            if column not in taken and wanted in key(column).split():
                return Guess(column, f"its name ({column!r})")
    return Guess(None, "no column with a telling name")


def _best(stats: dict[str, dict[str, float]], field: str, reason: str) -> Guess:
    candidates = [(s[field], name) for name, s in stats.items() if s[field] > 0]
    if not candidates:
        return Guess(None, "no candidate column")
    value, name = max(candidates)
    return Guess(name, f"{reason.format(value=value)} ({name!r})")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.casefold()).strip("-") or "run"


def describe(found: Inspection, data_file: Path) -> str:
    lines = [f"{data_file}: {found.rows} rows" + (f", sheet {found.sheet!r}" if found.sheet is not None else "")]
    for role, guess in (("question", found.question), ("answer", found.answer), ("context", found.context)):
        lines.append(f"  {role + ' column:':17} {guess.column!r:24} ({guess.reason})")
    task_reason = (f"{100 * found.answer_in_context:.0f}% of answers occur in their context"
                   if found.answer_in_context is not None else "no context column")
    lines.append(f"  {'task:':17} {found.task!r:24} ({task_reason})")
    return "\n".join(lines)
