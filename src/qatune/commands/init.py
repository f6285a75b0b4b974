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
from qatune.data.spreadsheet import column_key, resolve_column
from qatune.data.tables import clean_cell, read_table, with_sheets_hint
from qatune.errors import DataError, QatuneError
from qatune.tasks import TASK_KINDS, guessed_task, model_does, task_kind

QUESTION_NAMES = ("question", "questions", "query", "prompt", "q", "ask", "input", "instruction")
ANSWER_NAMES = ("answer", "answers", "response", "reply", "a", "target", "output", "solution", "label",
                "reference answer", "expected answer")
CONTEXT_NAMES = ("context", "passage", "paragraph", "document", "article", "text", "content", "source")
DEFAULT_MODELS = {"generative": "gpt2", "extractive": "bert-base-uncased"}
SAMPLE_ROWS = 500
MIN_ROWS_FOR_VALIDATION = 20
"""Fewer rows than this: nothing is held out (a 2-row sheet would lose half its rows)."""
MODEL_TRAIN_SETTINGS = {
    # configs/smollm2-qa.yaml's recipe (bench/quality/smollm2_qa.py): the learning rate decaying by steps. Two epochs:
    # a third at this rate overfits a sheet of a few hundred rows (bench/quality/init_recipe.py).
    "smollm2-135m-instruct": {"epochs": 2, "learning_rate": 1.0e-4, "warmup_steps": 10,
                              "scheduler": {"step_size": 25, "gamma": 0.8, "interval": "step"}},
    # SmolLM2's recipe, not tuned for Gemma 3 270M: on smollm2-qa.yaml's rows it trails SmolLM2 there
    # (bench/quality/gemma3_qa.py, bench/results/epyc-avx512-bf16/grounded_qa_gemma3.json).
    "gemma3-270m": {"epochs": 2, "learning_rate": 1.0e-4, "warmup_steps": 10,
                    "scheduler": {"step_size": 25, "gamma": 0.8, "interval": "step"}},
}


@dataclass
class Guess:
    column: str | None
    reason: str


INIT_FLAGS = {"sheet": "--sheet NAME", "delimiter": "--delimiter", "question_column": "--question COLUMN",
              "answer_column": "--answer COLUMN", "context_column": "--context COLUMN"}
"""The init flag of each data key the readers' messages name."""


@dataclass
class Inspection:
    task: str
    question: Guess
    answer: Guess
    context: Guess
    answer_in_context: float | None
    rows: int
    sheet: str | int | None
    delimiter: str | None = None


def inspect(path: Path, sheet: str | int | None = None, task: str = "auto", question_column: str | None = None,
            answer_column: str | None = None, context_column: str | None = None,
            delimiter: str | None = None) -> Inspection:
    """Guess the columns (those given are taken as they are) and the task."""
    try:
        header, rows, _ = read_table(path, sheet=sheet, delimiter=delimiter)
        try:
            found = _guess(path, header, rows, sheet, task, question_column, answer_column, context_column)
        except DataError as exc:
            raise with_sheets_hint(exc, path, sheet, "pass --sheet NAME") from None
    except DataError as exc:  # the hints of the readers name config keys; init has flags for them
        message = str(exc)
        for key, flag in INIT_FLAGS.items():
            message = message.replace(f"set data.{key}", f"pass {flag}")
        raise DataError(message) from None
    found.delimiter = delimiter
    return found


def _guess(path: Path, header: list[str], rows: list[list[Any]], sheet: str | int | None, task: str,
           question_column: str | None, answer_column: str | None, context_column: str | None) -> Inspection:
    if not rows:
        raise DataError(f"{path} has a header but no data rows")
    sample = rows[:SAMPLE_ROWS]
    columns = {name: [clean_cell(row[i]) if i < len(row) else None for row in sample]
               for i, name in enumerate(header) if name.strip()}
    stats = {name: _stats(values) for name, values in columns.items()}
    given = {role: _given(header, name, role, path) for role, name in
             (("question", question_column), ("answer", answer_column), ("context", context_column)) if name}
    question = given.get("question") or _by_name(columns, QUESTION_NAMES)
    taken = {g.column for g in given.values()}
    if question.column is None:
        question = _best({n: s for n, s in stats.items() if n not in taken}, "question_marks",
                         "ends with '?' most often")
    if question.column is None:
        raise DataError(_cannot_tell("questions", path, columns))
    taken.add(question.column)
    answer = given.get("answer") or _by_name(columns, ANSWER_NAMES, taken)
    if answer.column:
        taken.add(answer.column)
    context = given.get("context") or _by_name(columns, CONTEXT_NAMES, taken)
    if context.column is None:
        long_text = {n: s for n, s in stats.items() if n not in taken and s["mean_length"] >= 200}
        context = _best(long_text, "mean_length", "long passages (mean length {value:.0f} characters)")
    if context.column:
        taken.add(context.column)
    if answer.column is None:
        texts = {n: s for n, s in stats.items() if n not in taken and s["filled"] > 0.5}
        answer = _best(texts, "shortness", "the shortest filled text column")
    if answer.column is None:
        raise DataError(_cannot_tell("answers", path, columns))
    for role, guess in (("question", question), ("answer", answer), ("context", context)):
        if guess.column is not None:
            resolve_column(header, guess.column, f"{role}_column", path.name)  # two columns of that name: refused
    share = None
    if context.column:
        pairs = [(c, a) for c, a in zip(columns[context.column], columns[answer.column]) if c and a]
        share = sum(locate_answer(c, a) is not None for c, a in pairs) / len(pairs) if pairs else 0.0
    if task not in TASK_KINDS:  # auto
        task = guessed_task(share)
    if task_kind(task).context == "required" and context.column is None:
        raise DataError(f"--task extractive needs a context column and none was found in {path.name} "
                        f"(columns: {header})")
    if task_kind(task).writes and context.column and "context" not in given:
        # Generative QA reads the passage too (the prompt puts it before the question; configs/smollm2-qa.yaml).
        context = Guess(context.column, context.reason + "; the prompt puts it before the question")
    return Inspection(task=task, question=question, answer=answer, context=context, answer_in_context=share,
                      rows=len(rows), sheet=sheet)


def _given(header: list[str], name: str, role: str, path: Path) -> Guess:
    index = resolve_column(header, name, f"{role}_column", path.name)
    return Guess(header[index], f"--{role} {name!r}")


def _cannot_tell(what: str, path: Path, columns: dict[str, list[str | None]]) -> str:
    lines = [(f"cannot tell which column of {path.name} holds the {what}; pass the columns, e.g. "
              f"qatune init {path} --question COLUMN --answer COLUMN (and --context COLUMN for passages). "
              "Its columns:")]
    for name, values in columns.items():
        sample = next((v for v in values if v), "")
        sample = sample if len(sample) <= 60 else sample[:57] + "..."
        lines.append(f"  {name!r:24} e.g. {sample!r}")
    separator = next((typed for sep, typed in ((";", "';'"), ("\t", "tab"), ("|", "'|'"))
                      if len(columns) == 1 and sep in next(iter(columns))), None)
    if separator:
        lines.append(f"  (the header looks {separator}-separated: pass --delimiter {separator})")
    if len(columns) >= 3:  # a question may be several of them
        lines.append("  (more than one column in the prompt: set data.prompt_template in the config it writes, "
                     "e.g. \"Marks: {Total Marks}\\nAnswer: {Coding}\\nFeedback:\")")
    return "\n".join(lines)


def choose_model(task: str, given: str | None) -> Guess:
    """--model; else the usual hub model, or an installed packaged model when the hub is not reachable."""
    from qatune.model.packaged import PACKAGED_MODELS, installed_packaged_models
    from qatune.model.sources import hub_reachable

    if given in PACKAGED_MODELS and not model_does(PACKAGED_MODELS[given].task, task):
        other = PACKAGED_MODELS[given].task
        needs = " (the sheet needs a context column)" if task_kind(other).context == "required" else ""
        raise QatuneError(f"--model {given} does {other} QA only, and this sheet is set up for {task} QA; pass "
                          f"--task {other}{needs} or a {task} model")
    if given:
        return Guess(given, "--model" + _terms(given))
    if hub_reachable():
        return Guess(DEFAULT_MODELS[task], "from the Hugging Face hub")
    installed = [name for name in installed_packaged_models() if model_does(PACKAGED_MODELS[name].task, task)]
    if installed:
        others = "".join(f"; also installed: --model {name}{_terms(name, ', ')}" for name in installed[1:])
        return Guess(installed[0], "the Hugging Face hub is not reachable; this one is installed for offline use"
                                   f"{_terms(installed[0])}{others}")
    offline = [f"{name} ({p.install}{_terms(name)})" for name, p in PACKAGED_MODELS.items()
               if model_does(p.task, task)]
    return Guess(DEFAULT_MODELS[task], "the Hugging Face hub is not reachable, so training will fail until it is; "
                                       f"or install a model for offline use: {', '.join(offline)}")


def _terms(model: str, separator: str = "; ") -> str:
    """The terms of use a packaged model comes under, after ``separator`` (nothing for other models)."""
    from qatune.model.packaged import PACKAGED_MODELS

    terms = PACKAGED_MODELS[model].terms if model in PACKAGED_MODELS else ""
    return separator + terms if terms else ""


def write_config(path: Path, data_file: Path, found: Inspection, model: str | None, output_dir: str | None,
                 force: bool) -> dict[str, Any]:
    if path.exists() and not force:
        raise QatuneError(f"{path} already exists; pass --force to replace it or choose another --output")
    model = model or DEFAULT_MODELS[found.task]
    kind = task_kind(found.task)
    train = {"epochs": 3, "batch_size": 8, "learning_rate": kind.init_learning_rate,
             "max_grad_norm": 1.0, "warmup_steps": 20, **MODEL_TRAIN_SETTINGS.get(model, {})}
    raw: dict[str, Any] = {
        "task": found.task,
        "seed": 42,
        "output_dir": output_dir or f"runs/{_slug(data_file.stem)}",
        "model": {"name_or_path": model},
        "data": {
            "train_file": str(data_file),
            "eval_file": None,
            "validation_fraction": 0.1 if found.rows >= MIN_ROWS_FOR_VALIDATION else 0.0,
            "question_column": found.question.column,
            "answer_column": found.answer.column,
            "context_column": found.context.column,
            "sheet": found.sheet,
            **({"delimiter": found.delimiter} if found.delimiter else {}),
            "max_length": kind.init_max_length,
        },
        "train": train,
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
    for wanted in names:
        for column in columns:
            if column not in taken and column_key(column) == wanted:
                return Guess(column, f"its name ({column!r})")
    for wanted in names:
        if len(wanted) < 4:
            continue
        for column in columns:
            if column not in taken and wanted in column_key(column).split():
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
    validation = ("10% of the questions held out" if found.rows >= MIN_ROWS_FOR_VALIDATION
                  else f"none held out (only {found.rows} rows; add data.eval_file to measure)")
    lines.append(f"  {'validation:':17} {validation}")
    return "\n".join(lines)
