"""The Sheet step: a sheet's columns (its cell separator read from its header line where that is not the file's
own) with the guesses ``qatune init`` makes and why, the tasks and models the page offers for the columns chosen and
the one it recommends, and the config the page's choices make (``init``'s config for the same choices, with what the
page changed on top)."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, field_validator

from qatune.commands.init import MIN_ROWS_FOR_VALIDATION, Guess, Inspection, inspect, write_config
from qatune.config import Config, delimiter_character, validate_config
from qatune.data.tables import EXCEL_SUFFIXES, TEXT_SUFFIXES, clean_cell, read_table
from qatune.errors import DataError, QatuneError
from qatune.model.packaged import PACKAGED_MODELS
from qatune.tasks import guessed_task, model_does, task_kind
from qatune.ui import PageError
from qatune.ui.offers import SCRATCH, model_choices, task_choices
from qatune.ui.workspace import RUNS, SHEETS, Workspace

CONFIGS = "configs"
WRITTEN_BY = "# Written by qatune ui"
"""The first line of every config the page writes: it replaces only configs that start so."""
SCRATCH_MODEL = {"n_layer": 2, "n_embd": 256, "n_head": 4, "vocab_size": 2000, "n_positions": 512}
"""The page's model from scratch: configs/tiny-gpt2.yaml's GPT-2 (it learns examples/data/faq.csv by heart)."""
SCRATCH_TRAIN = {"epochs": 40, "batch_size": 16, "learning_rate": 1.0e-3, "weight_decay": 0.0, "warmup_steps": 20}
CURVE_POINTS = 200
"""About this many metrics.jsonl lines per run: train.logging_steps is set from the run's steps to give them."""
DELIMITERS = {",": "comma", ";": "semicolon", "\t": "tab", "|": "'|'"}
"""The cell separators the Sheet step offers for a text sheet (besides auto: the file's own, as read_table reads
it, or the one its header line shows)."""


class Choices(BaseModel):
    """What the Sheet step sends: the columns, the held-out share, the model, and the run's name."""

    sheet: str
    sheet_name: str | None = None
    question: str
    answers: list[str] = Field(min_length=1)
    """One column, or several (a grading sheet's fields, trained as one answer and parsed back)."""
    context: str | None = None
    task: Literal["generative", "extractive"] | None = None
    """generative (reading comprehension where there is a context) or extractive (span extraction); None: what
    ``qatune init`` guesses for these columns (generative without a context)."""
    delimiter: str | None = None
    """The cell separator of a text sheet (``,``, ``;``, ``tab``, ``|``); None: the file's own."""
    prompt_columns: list[str] = []
    """Other columns the prompt shows the model besides the question (a grading sheet's student answer)."""
    held_out: float = Field(0.1, ge=0.0, le=0.5)
    model: str
    """A packaged model's name, ``scratch``, a hub id, or a folder inside the workspace."""
    epochs: int | None = Field(None, ge=1, le=1000)
    run: str
    trust_remote_code: bool = False
    """Refused when true (refuse_remote_code): named so that a request asking for it is told why, not ignored."""

    @field_validator("delimiter", mode="before")
    @classmethod
    def _delimiter(cls, value: Any) -> Any:
        return delimiter_choice(value)


def delimiter_choice(value: Any) -> str | None:
    """The page's choice of cell separator as the character it is (None: auto)."""
    if value in (None, "", "auto"):
        return None
    try:
        character = delimiter_character(str(value))
    except ValueError:
        character = None
    if character not in DELIMITERS:
        raise ValueError(f"the cell separator is one of auto, {', '.join(DELIMITERS.values())} (got {value!r})")
    return character


def describe(workspace: Workspace, name: str, sheet: str | None = None, delimiter: str | None = None
             ) -> dict[str, Any]:
    """A sheet as the page shows it: its sheets (a workbook), its cell separator (a text sheet), columns with a
    sample, ``init``'s guesses and why, and the tasks and models the page offers for them (task_choices).
    ``delimiter``: a text sheet's cell separator; None: the file's own, or the one its header line shows."""
    path = workspace.sheet(name)
    sheets = workbook_sheets(path)
    chosen = sheet if sheet not in (None, "") else None
    text = path.suffix.lower() in TEXT_SUFFIXES
    note = None
    if not text:
        delimiter = None
    elif delimiter in (None, "", "auto"):
        delimiter, note = sniff_delimiter(path)
    else:
        delimiter = _page_delimiter(delimiter)
    if text and delimiter == TEXT_SUFFIXES[path.suffix.lower()]:
        delimiter = None  # the file's own: nothing to set
    description: dict[str, Any] = {
        "sheet": name, "sheets": sheets, "sheet_name": chosen if chosen is not None else (sheets or [None])[0],
        "delimiter": (delimiter or TEXT_SUFFIXES[path.suffix.lower()]) if text else None, "delimiter_note": note,
        "rows": 0, "columns": [], "message": None, "task": guessed_task(None), "guesses": None,
        "tasks": task_choices(None, False), "models": model_choices(guessed_task(None)),
        "held_out": 0.1, "run": workspace.free_name(RUNS, _slug(Path(name).stem)),
    }
    try:
        header, rows, _ = read_table(path, sheet=chosen, delimiter=delimiter)
        if not rows:
            raise DataError(f"{name} has a header but no data rows")
    except DataError as exc:
        if len(sheets) < 2:
            raise
        return {**description, "message": f"{exc}; choose another sheet"}  # the picker leads to the data
    columns = [{"name": column, "sample": _sample(rows, i)} for i, column in enumerate(header) if column.strip()]
    description.update(rows=len(rows), columns=columns,
                       held_out=0.1 if len(rows) >= MIN_ROWS_FOR_VALIDATION else 0.0)
    try:
        found = inspect(path, sheet=chosen, delimiter=delimiter)
    except DataError as exc:  # the columns are shown all the same: the person picks them
        description.update(message=f"qatune init cannot tell the columns apart: {exc}; choose them below")
        return description
    guesses = {role: {"column": guess.column, "reason": guess.reason}
               for role, guess in (("question", found.question), ("answer", found.answer), ("context", found.context))}
    guesses["task"] = {"column": found.task, "reason": _share_reason(found)}
    tasks = task_choices(found, found.context.column is not None)
    description.update(task=found.task, guesses=guesses, tasks=tasks,
                       models=next(t["models"] for t in tasks["tasks"] if t["value"] == tasks["recommended"]))
    return description


def sniff_delimiter(path: Path) -> tuple[str | None, str | None]:
    """The cell separator a text sheet's header line shows where it is not the file's own (a semicolon-separated
    .csv, as a spreadsheet set to a European language saves it), with the page's note saying so; (None, None) when
    the file's own separator is in it, or none is."""
    own = TEXT_SUFFIXES[path.suffix.lower()]
    try:
        with open(path, "rb") as f:
            head = f.read(65536).decode("utf-8", errors="replace").lstrip("\ufeff")
    except OSError:
        return None, None
    first = re.sub(r'"[^"]*"', "", head.splitlines()[0] if head else "")  # a separator inside quotes is text
    counts = {separator: first.count(separator) for separator in DELIMITERS if separator != own}
    separator = max(counts, key=lambda c: counts[c]) if any(counts.values()) else None
    if own in first or separator is None:
        return None, None
    return separator, (f"read as {DELIMITERS[separator]}-separated: its header line has no {DELIMITERS[own]} but "
                       f"{counts[separator]} {DELIMITERS[separator]}{'s' if counts[separator] > 1 else ''}")


def _page_delimiter(value: str | None) -> str | None:
    try:
        return delimiter_choice(value)
    except ValueError as exc:
        raise PageError(str(exc)) from None


def _share_reason(found: Inspection) -> str:
    return (f"{100 * found.answer_in_context:.0f}% of answers occur in their context"
            if found.answer_in_context is not None else "no context column")


def sheet_tasks(workspace: Workspace, name: str, sheet: str | None, delimiter: str | None, question: str,
                answer: str, context: str | None) -> dict[str, Any]:
    """task_choices for columns the person chose on the page (the Sheet step asks again as they change)."""
    path = workspace.sheet(name)
    if not context:
        return task_choices(None, False)
    found = inspect(path, sheet=sheet or None, question_column=question or None, answer_column=answer or None,
                    context_column=context, delimiter=_page_delimiter(delimiter))
    return task_choices(found, True)


def workbook_sheets(path: Path) -> list[str]:
    """The sheet names of a workbook (none for other files)."""
    if path.suffix.lower() not in EXCEL_SUFFIXES:
        return []
    from openpyxl import load_workbook

    try:
        book = load_workbook(path, read_only=True)
    except Exception as exc:  # openpyxl raises many kinds on a damaged workbook
        raise DataError(f"{path.name} cannot be opened as an Excel workbook: {exc}") from None
    try:
        return list(book.sheetnames)
    finally:
        book.close()


def write_page_config(workspace: Workspace, choices: Choices) -> dict[str, Any]:
    """Write the config of the page's choices to configs/RUN.yaml: ``init``'s for the same columns, task, cell
    separator and model, with the page's changes on top. Returns its path, text, the ``qatune init`` command that
    writes the same (``--task`` where the choice is not init's guess), what the page changed, and notes on the
    choices (nothing held out)."""
    run = _run_name(choices.run)
    if choices.trust_remote_code:
        raise PageError(remote_code_message(f"{CONFIGS}/{run}.yaml", choices.model,
                                            f"qatune init sheets/{choices.sheet} --model {choices.model}"), 403)
    path = workspace.sheet(choices.sheet)
    sheet = choices.sheet_name if choices.sheet_name not in (None, "") else None
    if choices.delimiter == TEXT_SUFFIXES.get(path.suffix.lower(), choices.delimiter):  # the file's own, or no text
        choices = choices.model_copy(update={"delimiter": None})
    _refuse_degenerate_columns(path, sheet, choices)
    question, answer = choices.question, choices.answers[0]
    guessed = inspect(path, sheet=sheet, question_column=question, answer_column=answer,
                      context_column=choices.context, delimiter=choices.delimiter)
    task = choices.task or (guessed.task if choices.context else guessed_task(None))
    found = guessed if task == guessed.task else inspect(
        path, sheet=sheet, task=task, question_column=question, answer_column=answer, context_column=choices.context,
        delimiter=choices.delimiter)
    dropped_context = found.context.column if choices.context is None else None  # init's guess, (none) on the page
    if dropped_context is not None:
        found.context = Guess(None, "none chosen on the page")
    model, scratch = _model(workspace, choices.model, task)
    config_path = workspace.folder(CONFIGS) / f"{run}.yaml"
    if config_path.exists() and not config_path.read_text(encoding="utf-8").startswith(WRITTEN_BY):
        raise PageError(f"{CONFIGS}/{run}.yaml exists and was not written by the page; choose another run name")
    data_file = Path(SHEETS) / choices.sheet
    raw = write_config(config_path, data_file, found, model, f"{RUNS}/{run}", force=True)
    changed = _page_changes(raw, choices, found.rows, scratch, dropped_context)
    validate_config(raw, str(config_path))
    command = init_command(choices, data_file, model, run, task if task != guessed.task else None)
    text = (f"{WRITTEN_BY} from {data_file}: {found.rows} rows, {raw['task']} QA.\n"
            f"# The same as: {command}\n"
            + (f"# then, on the page: {'; '.join(changed)}\n" if changed else "")
            + f"# Check it with: qatune check --config {CONFIGS}/{run}.yaml\n"
            + yaml.safe_dump(raw, sort_keys=False, allow_unicode=True))
    config_path.write_text(text, encoding="utf-8")
    return {"config": f"{CONFIGS}/{run}.yaml", "yaml": text, "run": f"{RUNS}/{run}", "task": raw["task"],
            "command": command, "changed": changed, "notes": _notes(raw, found.rows)}


def _refuse_degenerate_columns(path: Path, sheet: str | None, choices: Choices) -> None:
    """Columns that cannot make questions and answers: none chosen, one column in two roles (the model would learn
    to repeat its question), span extraction without a passage or with several answer fields."""
    if not choices.question.strip() or not choices.answers[0].strip():
        raise PageError("choose the question column and the answer column")
    roles = [("question", choices.question), ("answer", choices.answers[0])]
    if choices.context:
        roles.append(("context", choices.context))
    for i, (role, column) in enumerate(roles):
        for other, same in roles[:i]:
            if same == column:
                why = ("the model would learn to repeat the question" if {role, other} == {"question", "answer"}
                       else "the passage would be the " + other)
                raise PageError(f"{other} and {role} are both the column {column!r}: {why}; choose another column "
                                f"for the {role}" + _one_column_hint(path, sheet, choices.delimiter))
    kind = task_kind(choices.task) if choices.task else None
    if kind is not None and kind.context == "required" and not choices.context:
        raise PageError(f"{kind.label} answers with {kind.answer_said}: choose the context column, or a task that "
                        "writes the answer")
    if kind is not None and kind.answer_columns == "refused" and len(choices.answers) > 1:
        raise PageError(f"{kind.label} answers with {kind.answer_said}, one answer column: choose one, or a task that "
                        "writes the answer for several answer fields")


def _one_column_hint(path: Path, sheet: str | None, delimiter: str | None) -> str:
    """For a sheet read as one column: why, and what the page's cell separator would change."""
    try:
        header, _, _ = read_table(path, sheet=sheet, delimiter=delimiter)
    except DataError:
        return ""
    if len([c for c in header if c.strip()]) != 1:
        return ""
    hint = f" ({path.name} has one column, {header[0]!r}: a question and its answer need a column each"
    separator = next((label for c, label in DELIMITERS.items() if c in header[0] and c != delimiter), None)
    return hint + (f"; its header looks {separator}-separated: choose that cell separator above)" if separator
                   else ")")


def _notes(raw: dict[str, Any], rows: int) -> list[str]:
    """What the choices mean for later steps, said where they are made."""
    data = raw["data"]
    if data.get("eval_file") or data.get("validation_fraction", 0) > 0:
        return []
    few = f" (only {rows} rows)" if rows < MIN_ROWS_FOR_VALIDATION else ""
    return [f"nothing is held out{few}: no validation scores after each epoch, and Compare needs a sheet with the "
            "same columns that training did not see (choose or upload one on the Compare step)"]


def save_edited_config(workspace: Workspace, name: str, text: str) -> dict[str, Any]:
    """A config the page wrote, as the person edited it on the page: every problem at once, or saved."""
    path = workspace.existing(name, "config")
    if path.parent != workspace.root / CONFIGS or path.suffix != ".yaml":
        raise PageError(f"{name}: the page edits only the configs it wrote ({CONFIGS}/*.yaml)")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PageError(f"{name} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise PageError(f"{name} must be a YAML mapping of sections (task, model, data, train, ...)")
    config = validate_config(raw, name)
    refuse_remote_code(config, name)
    check_paths(workspace, config, name)
    if not text.startswith(WRITTEN_BY):
        text = f"{WRITTEN_BY}, edited on the page.\n{text}"
    path.write_text(text, encoding="utf-8")
    return {"config": name, "yaml": text}


def refuse_remote_code(config: Config, name: str, command: str | None = None) -> None:
    """The page never runs a model's own Python code: a config with model.trust_remote_code is for the command line,
    where the person who runs it decides to trust that code."""
    if config.model.trust_remote_code:
        model = config.model.name_or_path or config.model.gguf_file or "the model"
        raise PageError(remote_code_message(name, model, command or f"qatune train --config {name}"), 403)


def remote_code_message(name: str, model: str, command: str) -> str:
    return (f"{name}: model.trust_remote_code is true, which runs the Python code that comes with {model} on this "
            "machine; the page never does (any web page could ask it to). If you trust that code, run it from the "
            f"command line: {command}")


def check_paths(workspace: Workspace, config: Config, name: str) -> None:
    """Refuse a config whose files lie outside the workspace: the page reads and writes only inside it."""
    for key, value in (("data.train_file", config.data.train_file), ("data.eval_file", config.data.eval_file),
                       ("model.gguf_file", config.model.gguf_file), ("output_dir", config.output_dir)):
        if value is not None and not _inside(workspace, value):
            raise PageError(f"{name}: {key} {value!r} is not a path inside the workspace ({workspace.root}); "
                            "name it relative to the workspace, e.g. sheets/NAME.csv")
    if not workspace.path(config.output_dir).parent == workspace.root / RUNS:
        raise PageError(f"{name}: output_dir {config.output_dir!r}: the page trains into {RUNS}/NAME")
    if config.model.name_or_path is not None and not _inside(workspace, config.model.name_or_path):
        raise PageError(f"{name}: model.name_or_path {config.model.name_or_path!r}: a folder must lie inside the "
                        f"workspace ({workspace.root}); name it relative to it, or give a hub id")


def _inside(workspace: Workspace, value: str) -> bool:
    try:
        workspace.path(value)
    except PageError:
        return False
    return True


def init_command(choices: Choices, data_file: Path, model: str | None, run: str, task: str | None = None) -> str:
    """The ``qatune init`` command that makes the same guesses and writes the same config (less the page's
    changes, listed beside it). ``task``: passed as --task where it is not what init guesses."""
    args = ["qatune", "init", data_file.as_posix(), "--question", choices.question, "--answer", choices.answers[0]]
    if choices.context is not None:
        args += ["--context", choices.context]
    if task is not None:
        args += ["--task", task]
    if choices.sheet_name not in (None, ""):
        args += ["--sheet", str(choices.sheet_name)]
    if choices.delimiter is not None:
        args += ["--delimiter", "tab" if choices.delimiter == "\t" else choices.delimiter]
    if model is not None:
        args += ["--model", model]
    return shlex.join([*args, "--output", f"{CONFIGS}/{run}.yaml", "--output-dir", f"{RUNS}/{run}", "--force"])


def _page_changes(raw: dict[str, Any], choices: Choices, rows: int, scratch: bool,
                  dropped_context: str | None = None) -> list[str]:
    """Apply to ``raw`` what the page sets beyond ``init``; the keys changed, as ``key: value`` lines.
    ``dropped_context``: the context column init guesses, which the page's choice of (none) left out."""
    data, train = raw["data"], raw["train"]
    changed: dict[str, Any] = {}
    if dropped_context is not None:
        changed["data.context_column"] = None

    def put(section: dict[str, Any], key: str, value: Any, name: str) -> None:
        if section.get(key) != value:
            section[key] = value
            changed[name] = value

    if scratch:
        raw["model"] = {"scratch": dict(SCRATCH_MODEL)}
        changed["model"] = raw["model"]
        for key, value in SCRATCH_TRAIN.items():
            put(train, key, value, f"train.{key}")
    put(data, "validation_fraction", round(choices.held_out, 4), "data.validation_fraction")
    if len(choices.answers) > 1:
        data.pop("answer_column", None)
        put(data, "answer_columns", list(choices.answers), "data.answer_columns")
    extra = [c for c in choices.prompt_columns if c not in (choices.question, choices.context, *choices.answers)]
    if extra:
        lines = ([f"Context: {{{choices.context}}}"] if choices.context else []) + ["Question: {question}"]
        lines += [f"{column.strip()}: {{{column}}}" for column in extra]
        put(data, "prompt_template", "\n".join(lines) + "\nAnswer:", "data.prompt_template")
    if choices.epochs is not None:
        put(train, "epochs", choices.epochs, "train.epochs")
    steps = math.ceil(rows * (1 - choices.held_out) / train["batch_size"]) * train["epochs"]
    put(train, "logging_steps", max(1, steps // CURVE_POINTS), "train.logging_steps")
    return [f"{name}: {json.dumps(value, ensure_ascii=False)}" for name, value in changed.items()]


def _model(workspace: Workspace, given: str, task: str) -> tuple[str | None, bool]:
    """(model.name_or_path, whether it is the page's model from scratch). A folder must lie in the workspace; any
    other name is a packaged model or a hub id."""
    given = given.strip()
    if given == SCRATCH:
        if not task_kind(task).writes:
            raise PageError(f"the page's model from scratch is a GPT-2, which writes its answers, and the task chosen "
                            f"is {task}; choose a task that writes the answer, or a pretrained {task} model")
        return None, True
    if not given:
        raise PageError("choose a model: an installed one, one from scratch, a hub id or a folder in the workspace")
    if given in PACKAGED_MODELS:
        if not model_does(PACKAGED_MODELS[given].task, task):
            raise PageError(f"{given} does {PACKAGED_MODELS[given].task} QA only, and the task chosen is {task}; "
                            f"choose the task {PACKAGED_MODELS[given].task} for it, or another model")
        return given, False
    if given.startswith("~") or re.match(r"^[A-Za-z]:", given) or not _inside(workspace, given):
        raise PageError(f"model {given!r}: a folder must lie inside the workspace ({workspace.root}); name it "
                        "relative to it, e.g. models/my-model, or give a hub id like HuggingFaceTB/SmolLM2-135M")
    path = workspace.path(given)
    if path.exists():
        return workspace.relative(path), False
    if not re.fullmatch(r"[\w.\-]+(/[\w.\-]+)?", given):
        raise PageError(f"model {given!r} is neither a folder in the workspace nor a hub id (owner/name)")
    return given, False


def _sample(rows: list[list[Any]], index: int) -> str:
    for row in rows[:50]:
        value = clean_cell(row[index]) if index < len(row) else None
        if value:
            return value if len(value) <= 80 else value[:77] + "..."
    return ""


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.casefold()).strip("-") or "run"


def _run_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][\w.\-]{0,80}", name or "") or name.endswith("."):
        raise PageError(f"run name {name!r}: use letters, digits, '.', '_' and '-' (it names runs/NAME and "
                        f"{CONFIGS}/NAME.yaml)")
    return name


def read_error_message(exc: Exception, name: str) -> str:
    """A sheet that cannot be read, in one line for the page (a library's own error kinds included)."""
    if isinstance(exc, QatuneError):
        return str(exc)
    return f"{name} cannot be read: {type(exc).__name__}: {exc}"
