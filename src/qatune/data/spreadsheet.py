"""Spreadsheet -> list of QA records plus a report of what was kept and dropped.

Files are read by :mod:`qatune.data.tables`. Row numbers are the ones a spreadsheet program shows (the
header is row 1, the first data row is row 2; for JSON and parquet files the first record is row 1), so a
message about row 17 sends the user to row 17 of their sheet.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qatune.config.columns import column_key, template_fields
from qatune.data.grading_fields import AnswerTemplate, infer_kind
from qatune.data.tables import NOT_FINITE, clean_cell, location, read_table, with_sheets_hint
from qatune.errors import DataError, row_list

if TYPE_CHECKING:
    from qatune.config import DataConfig

_DECIMAL = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)$")
_INTEGRAL_DECIMAL = re.compile(r"^([+-]?\d+)\.0+$")


@dataclass
class QARecord:
    """One question with its gold answers (and, for extractive QA, its context)."""

    question: str
    answers: list[str]
    context: str | None = None
    answer_start: int | None = None
    row: int = 0
    """Row number in the source file, as a spreadsheet shows it."""
    fields: dict[str, str] = field(default_factory=dict)
    """Other columns the prompt template names ({Total Marks}), by the name the template uses."""
    answer_fields: dict[str, str] = field(default_factory=dict)
    """With data.answer_columns: the gold value of each answer column, by its name there (the answer is their
    rendering through the answer template); empty otherwise."""

    @property
    def answer(self) -> str:
        """The answer trained on: the first gold answer."""
        return self.answers[0]


@dataclass
class LoadReport:
    """What happened to each row of one file."""

    file: str
    rows_read: int = 0
    kept: int = 0
    duplicates: int = 0
    dropped: dict[str, list[int]] = field(default_factory=dict)
    columns: dict[str, str] = field(default_factory=dict)

    def drop(self, reason: str, row: int) -> None:
        self.dropped.setdefault(reason, []).append(row)

    def drop_kept(self, reason: str, row: int) -> None:
        """A row that was read and kept, dropped later (when it is encoded)."""
        self.drop(reason, row)
        self.kept -= 1

    @property
    def dropped_total(self) -> int:
        return sum(len(rows) for rows in self.dropped.values())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        parts = [f"{self.file}: {self.rows_read} rows read, {self.kept} kept"]
        for reason, rows in self.dropped.items():
            parts.append(f"{len(rows)} dropped ({reason}: rows {row_list(rows)})")
        if self.duplicates:
            parts.append(f"{self.duplicates} duplicate rows")
        return ", ".join(parts)


def load_records(
    path: str | Path,
    *,
    question_column: str = "question",
    answer_column: str | None = "answer",
    context_column: str | None = None,
    answer_start_column: str | None = None,
    sheet: str | int | None = None,
    encoding: str | None = None,
    delimiter: str | None = None,
    answer_separator: str | None = None,
    drop_duplicates: bool = False,
    max_cell_chars: int = 100_000,
    fields: list[str] | tuple[str, ...] = (),
    answer_template: AnswerTemplate | None = None,
) -> tuple[list[QARecord], LoadReport]:
    """Read a spreadsheet into QA records. ``answer_column=None`` reads questions only (for generate).

    ``fields``: other columns the prompt template names; each must exist, and its cells go into
    ``QARecord.fields`` under the template's name. ``answer_template``: several answer columns (a grading
    sheet's) instead of ``answer_column``; each must exist, a row with a blank one is dropped ("blank
    COLUMN"), and the answer is their rendering (``QARecord.answer_fields`` holds the cells).
    """
    path = Path(path)
    header, rows, first_row = read_table(path, sheet=sheet, encoding=encoding, delimiter=delimiter)
    report = LoadReport(file=path.name, rows_read=len(rows))
    if not rows:
        raise with_sheets_hint(DataError(f"{path} has a header but no data rows; add rows below the header {header}"),
                               path, sheet, "set data.sheet")

    where = location(path, sheet)
    wanted = {"question_column": question_column, "answer_column": answer_column, "context_column": context_column}
    try:
        index = {key: resolve_column(header, name, key, where) for key, name in wanted.items() if name is not None}
        _distinct_roles(index, header, where)
        start_index = None
        if answer_start_column is not None:
            start_index = resolve_column(header, answer_start_column, "answer_start_column", where)
        elif context_column is not None:
            start_index = _find_column(header, "answer_start")
        for name in fields:
            if _find_column(header, name) is None and name not in header:
                raise DataError(f"data.prompt_template names the column '{name}', which is not in {where}; columns "
                                f"are {header}; fix the name in the template (case, spaces, _ and - do not matter)")
            index[name] = resolve_column(header, name, "prompt_template", where)
        answer_index = {name: resolve_column(header, name, "answer_columns", where)
                        for name in (answer_template.columns if answer_template else ())}
    except DataError as exc:
        raise with_sheets_hint(exc, path, sheet, "set data.sheet") from None
    report.columns = {key: header[i] for key, i in index.items() if key in wanted}

    columns = {key: _column_cells(rows, i) for key, i in index.items()}
    answer_cells = {name: _column_cells(rows, i) for name, i in answer_index.items()}
    starts = _column_cells(rows, start_index) if start_index is not None else [None] * len(rows)
    records: list[QARecord] = []
    seen: set[tuple] = set()
    for offset in range(len(rows)):
        row_number = first_row + offset
        cells = {key: values[offset] for key, values in columns.items()}
        gold_fields = {name: values[offset] for name, values in answer_cells.items()}
        if all(value is None for value in [*cells.values(), *gold_fields.values()]):
            report.drop("empty row", row_number)
            continue
        reason = _problem(cells, max_cell_chars) or _problem(gold_fields, max_cell_chars)
        if reason:
            report.drop(reason, row_number)
            continue
        answers: list[str] = []
        if "answer_column" in cells:
            answers = _split_answers(cells["answer_column"], answer_separator)
            if not answers:
                report.drop("blank answer", row_number)
                continue
        if answer_template is not None:
            answers = [answer_template.render(gold_fields)]
        record = QARecord(
            question=cells["question_column"],
            answers=answers,
            context=cells.get("context_column"),
            answer_start=_as_offset(starts[offset]),
            row=row_number,
            fields={name: cells[name] for name in fields},
            answer_fields=gold_fields,
        )
        key = (record.question, tuple(record.answers), record.context, tuple(record.fields.values()))
        if key in seen:
            report.duplicates += 1
            if drop_duplicates:
                report.drop("duplicate", row_number)
                continue
        seen.add(key)
        records.append(record)
    report.kept = len(records)
    if not records:
        raise DataError(f"{path} has no usable rows: {report.summary()}; check the column names and cell contents")
    return records, report


def load_from_config(data: DataConfig, path: str | Path, *, with_answers: bool = True,
                     with_context: bool | None = None) -> tuple[list[QARecord], LoadReport]:
    """``load_records`` with the column settings of a config's data section (``with_answers=False``: questions
    only, the answer columns need not be there)."""
    use_context = data.context_column is not None if with_context is None else with_context
    template = answer_template(data)  # a bad template fails before the file is read
    return load_records(
        path,
        question_column=data.question_column,
        answer_column=data.answer_column if with_answers and template is None else None,
        context_column=data.context_column if use_context else None,
        answer_start_column=data.answer_start_column if use_context else None,
        sheet=data.sheet,
        encoding=data.encoding,
        delimiter=data.delimiter,
        answer_separator=data.answer_separator,
        drop_duplicates=data.drop_duplicates,
        max_cell_chars=data.max_cell_chars,
        fields=prompt_columns(data),
        answer_template=template if with_answers else None,
    )


def answer_template(data: DataConfig) -> AnswerTemplate | None:
    """The answer template of data.answer_columns (data.answer_template, or the default one); None without them.
    Raises ConfigError, naming data.answer_template, when it cannot be parsed back into its columns."""
    if not data.answer_columns:
        return None
    return AnswerTemplate.make(data.answer_columns, data.answer_template)


def answer_kinds(data: DataConfig, records: list[QARecord]) -> dict[str, str] | None:
    """How each answer column is scored: data.field_kinds where given, else inferred from the records' gold
    values (:func:`qatune.data.grading_fields.infer_kind`); None without data.answer_columns."""
    if not data.answer_columns:
        return None
    given = data.field_kinds or {}
    return {name: given.get(name) or infer_kind([r.answer_fields.get(name, "") for r in records])
            for name in data.answer_columns}


def prompt_columns(data: DataConfig) -> list[str]:
    """Columns the prompt names besides the question and context columns (``{Total Marks}``), a multiple-choice
    sheet's choices among them."""
    templates = [data.user_template] if data.prompt_template in ("auto", "chat") else [data.prompt_template]
    roles = {column_key(name) for name in ("question", "context", data.question_column, data.context_column) if name}
    names: list[str] = list(data.choice_columns or [])  # the default prompt lists them
    for template in templates:
        for name in template_fields(template or "") or []:
            if column_key(name) not in roles and name not in names:
                names.append(name)
    return names


def describe_validation(validation: dict[str, Any]) -> str:
    """One line on a run's validation rows (``validation``: what prepare records under reports["validation"])."""
    if not validation.get("rows"):
        return "none (no validation loss, no best/ model, no early stopping; set data.eval_file or " \
               "data.validation_fraction)"
    if validation.get("file"):
        return f"{validation['rows']} rows of {validation['file']}"
    return (f"{validation['rows']} rows held out of the training file "
            f"(data.validation_fraction={validation['fraction']}; the same question never on both sides)")


def split_validation(records: list[QARecord], fraction: float, seed: int) -> tuple[list[QARecord], list[QARecord]]:
    """Hold out ``fraction`` of the questions. Rows with the same question stay on one side."""
    if fraction <= 0:
        return records, []
    groups: dict[str, list[QARecord]] = {}
    for record in records:
        groups.setdefault(normalize_question(record.question), []).append(record)
    keys = list(groups)
    random.Random(seed).shuffle(keys)
    n_val = max(1, round(fraction * len(keys)))
    if n_val >= len(keys):
        raise DataError(
            f"data.validation_fraction={fraction} leaves no training rows ({len(keys)} distinct questions); "
            "lower it or provide data.eval_file"
        )
    held_out = set(keys[:n_val])
    train = [r for r in records if normalize_question(r.question) not in held_out]
    val = [r for r in records if normalize_question(r.question) in held_out]
    return train, val


def normalize_question(text: str) -> str:
    return " ".join(text.casefold().split())


def _distinct_roles(index: dict[str, int], header: list[str], where: str) -> None:
    """A column read as two things (the question and the answer) teaches the model to repeat its input."""
    keys = list(index)
    for i, first in enumerate(keys):
        for second in keys[i + 1:]:
            if index[first] == index[second]:
                column = header[index[first]]
                alone = (f"{where} has one column ({column!r}); a question and its answer need a column each"
                         + (", or the file's cells are split by another character: set data.delimiter"
                            if any(sep in column for sep in ";\t|") else "")
                         if len(header) == 1 else f"columns are {header}")
                effect = ("the model would learn to repeat the question" if {first, second} ==
                          {"question_column", "answer_column"} else "the model would read the answer in its input")
                raise DataError(f"data.{first} and data.{second} both name the column {column!r} of {where}: "
                                f"{effect}; {alone}; name another column for data.{second}")


def resolve_column(header: list[str], name: str, key: str, where: str) -> int:
    """Index of the column ``name``; exact match first, then ignoring case, spaces and _/-."""
    exact = [i for i, column in enumerate(header) if column == name]
    candidates = exact or [i for i, column in enumerate(header) if column_key(column) == column_key(name)]
    if len(candidates) == 1:
        return candidates[0]
    if len(candidates) > 1:
        found = [header[i] for i in candidates]
        positions = [i + 1 for i in candidates]
        if len(set(found)) == 1:
            raise DataError(f"column '{name}' is ambiguous in {where}: columns {positions} are all named "
                            f"'{found[0]}'; rename all but one of them in the file")
        raise DataError(
            f"column '{name}' is ambiguous in {where}: it matches {found} (columns {positions}); "
            f"rename the duplicates or set data.{key} to the exact name"
        )
    hint = ""
    if len(header) == 1:
        for sep, label in ((";", "';'"), ("\t", "tab"), ("|", "'|'"), (",", "','")):
            if sep in header[0]:
                hint = f"; the header looks {label}-separated, set data.delimiter"
                break
    named = [column for column in header if column.strip() and not column.startswith("Unnamed: ")]
    if len(header) > 1 and len(named) <= 1:
        hint = ("; the first row looks like a title, not a header: the column names must be in the file's first "
                "row (delete the rows above them)")
    if key == "answer_start_column":
        hint = " to the offsets' column, or to null (each answer is then found by searching its context)" + hint
    raise DataError(f"column '{name}' not found in {where}; columns are {header}; set data.{key}{hint}")


def _find_column(header: list[str], name: str) -> int | None:
    matches = [i for i, column in enumerate(header) if column_key(column) == column_key(name)]
    return matches[0] if len(matches) == 1 else None


def _column_cells(rows: list[list[Any]], index: int) -> list[str | None]:
    cells = [clean_cell(row[index] if index < len(row) else None) for row in rows]
    present = [cell for cell in cells if cell is not None]
    # A column of numbers written by a spreadsheet ('7.0', '8.5') reads as clean text ('7', '8.5').
    if present and all(_DECIMAL.match(cell) for cell in present):
        cells = [_INTEGRAL_DECIMAL.sub(r"\1", cell) if cell is not None else None for cell in cells]
    return cells


def _problem(cells: dict[str, str | None], max_chars: int) -> str | None:
    for key, value in cells.items():
        name = key.removesuffix("_column")
        if value == NOT_FINITE:
            return f"{name} is an infinite number"
        if value is None and key != "answer_column":
            return f"blank {name}"
        if value is not None and len(value) > max_chars:
            return f"{name} longer than {max_chars} characters (data.max_cell_chars)"
    return None


def _split_answers(cell: str | None, separator: str | None) -> list[str]:
    if cell is None:
        return []
    parts = cell.split(separator) if separator else [cell]
    return [part.strip() for part in parts if part.strip()]


def _as_offset(value: str | None) -> int | None:
    if value is None or value == NOT_FINITE:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if number.is_integer() and number >= 0 else None
