"""Answers for every row of a spreadsheet (``qatune generate RUN --file``): a table of the questions, their
other columns and the answers, or, for a run with answer fields (a grading sheet's), the input sheet graded."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qatune.config import DataConfig, column_key, with_reading_overrides
from qatune.data.grading_fields import AnswerTemplate, FieldSpec
from qatune.data.numbers import parse_number
from qatune.data.spreadsheet import QARecord
from qatune.errors import DataError
from qatune.inference.generate import generate_config, run_answer_template, seed_sampling, uses_context
from qatune.kinds import answer_questions
from qatune.runs.atomic import atomic_write_bytes, atomic_write_text

log = logging.getLogger("qatune")


ANSWER_FORMATS = (".csv", ".tsv", ".xlsx", ".json", ".jsonl")
"""What ``generate --file`` writes, chosen by the suffix of --output."""


def answer_file(run_dir: str | Path, data_file: str | Path, output: str | Path | None = None, which: str = "final",
                options: dict[str, Any] | None = None, seed: int | None = None,
                reading: list[str] | tuple[str, ...] = (), with_runs: list[str] | tuple[str, ...] = ()) -> Path:
    """Answer every row of a spreadsheet and return the path of the answers (``reading``: ``key=value``
    changes to how the file is read, over config.READING_KEYS, for a file laid out unlike the training file).

    The answers file has the columns row, question, the input's other columns (in their order) and
    answer, in the format its suffix names (ANSWER_FORMATS; default RUN/answers-NAME.csv). A run with answer
    fields (a grading sheet's) writes a graded sheet instead (:func:`write_graded`); ``with_runs``: other grading
    runs that answer the same rows, each adding the columns no run before it gives (a scorer's verdict and score,
    a generative grader's feedback).
    """
    from qatune.inference.run_model import read_run

    path = _answers_path(run_dir, data_file, output)
    config, info = read_run(run_dir, which)  # the data file is read before the model loads
    template = run_answer_template(info)
    if with_runs and template is None:
        raise DataError(f"--with adds the columns of other grading runs to a graded sheet; {run_dir} has no answer "
                        "columns (data.answer_columns) to grade with")
    if template is not None and not output:  # a graded sheet is written in the format it was read in
        path = _answers_path(run_dir, data_file, output, keep_format=True)
    data = with_reading_overrides(config, reading).data if reading else config.data
    others = [(other, *read_run(other, which)) for other in with_runs]  # every run is read before any model loads
    graders = []
    taken = list(template.columns) if template is not None else []
    for other, _, other_info in others:
        adds = [name for name in (other_info.answer_fields or {}) if name not in taken]
        if not adds:
            raise DataError(f"--with {other}: it gives no column the runs before it do not (its columns: "
                            f"{list(other_info.answer_fields or {}) or 'none'}); leave it out")
        taken += adds
    records, answers = _answer_rows(run_dir, which, data, Path(data_file), info, options, seed)
    if template is None:
        names, rows = _input_table(data, Path(data_file), records)
        path.parent.mkdir(parents=True, exist_ok=True)
        _write_table(path, [*names, "answer"], [[*row, answer] for row, answer in zip(rows, answers, strict=True)])
        return path
    graders.append(Grader(template, info.specs() or {}, {r.row: a for r, a in zip(records, answers, strict=True)},
                          list(template.columns)))
    given = set(template.columns)
    for other, other_config, other_info in others:
        other_data = with_reading_overrides(other_config, reading).data if reading else other_config.data
        other_records, other_answers = _answer_rows(other, which, other_data, Path(data_file), other_info, options,
                                                    seed)
        other_template = run_answer_template(other_info)
        adds = [name for name in other_template.columns if name not in given]
        given.update(adds)
        graders.append(Grader(other_template, other_info.specs() or {},
                              {r.row: a for r, a in zip(other_records, other_answers, strict=True)}, adds))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_graded_by(path, Path(data_file), data, graders)
    return path


def _answer_rows(run_dir: str | Path, which: str, data: DataConfig, data_file: Path, info: Any,
                 options: dict[str, Any] | None, seed: int | None) -> tuple[list[QARecord], list[str]]:
    """A run's answers to the rows of a file, read as its config says."""
    from qatune.data.spreadsheet import load_from_config
    from qatune.inference.run_model import load_run_model

    records, _ = load_from_config(data, data_file, with_answers=False, with_context=uses_context(info))
    loaded = load_run_model(run_dir, which)
    seed_sampling(seed)
    generate = generate_config(loaded.config.generate, options)
    answers = answer_questions(loaded.model, loaded.tokenizer, loaded.info, [r.question for r in records],
                               [r.context for r in records], generate, loaded.config.train.eval_batch_size,
                               progress=True, fields=[r.fields for r in records])
    return records, answers


@dataclass
class Grader:
    """One run's answers to a sheet's rows (by row number), and the answer columns it adds to the graded sheet."""

    template: AnswerTemplate
    specs: dict[str, FieldSpec]
    answers: dict[int, str]
    adds: list[str]


def write_graded(path: Path, data_file: Path, data: DataConfig, template: AnswerTemplate,
                 specs: dict[str, FieldSpec], answers: dict[int, str]) -> None:
    """The input sheet with the model's answer fields added, written atomically; ``answers``: the model's text by
    the row number of the row it answers.

    Every input column and row stays, in its order. After them come one column per answer field (named after it,
    or "FIELD (model)" when the input has a column of that name; a number as a number, a label as the class it
    names), "parsed" (yes; partly where the answer has some of the fields; no where it has none) and "model
    output" (the answer as written, on the rows not parsed whole). A workbook written as .xlsx is a copy of the
    input with only the graded sheet changed, its other sheets kept.
    """
    write_graded_by(path, data_file, data, [Grader(template, specs, answers, list(template.columns))])


def write_graded_by(path: Path, data_file: Path, data: DataConfig, graders: list[Grader]) -> None:
    """:func:`write_graded` with the columns of several runs: each grader's own, in order; "parsed" is yes where
    every run's answer was parsed whole, no where none was parsed at all, else partly; "model output" holds the
    answers not parsed whole, one per line."""
    from qatune.data.tables import EXCEL_SUFFIXES, read_table

    header, cells, first_row = read_table(data_file, sheet=data.sheet, encoding=data.encoding,
                                          delimiter=data.delimiter)
    added = _graded_names(header, [name for grader in graders for name in grader.adds])
    rows_answered = sorted({row for grader in graders for row in grader.answers})
    graded = {row: _merged_cells(graders, row) for row in rows_answered}
    unparsed = sum(values[-2] != "yes" for values in graded.values())
    log.info("graded %d rows: %d answers do not have every field of the answer template (%s: partly or no)",
             len(graded), unparsed, added[-2])
    if data_file.suffix.lower() in EXCEL_SUFFIXES and path.suffix.lower() == ".xlsx":
        atomic_write_bytes(path, _graded_workbook(data_file, data.sheet, len(header), added, graded))
        return
    rows = []
    for offset, line in enumerate(cells):
        line = [*line, *[None] * (len(header) - len(line))]
        new = graded.get(first_row + offset, [None] * len(added))
        rows.append([*(_plain(cell) for cell in line), *new])
    _write_table(path, [*header, *added], rows)


def _merged_cells(graders: list[Grader], row: int) -> list[Any]:
    values, statuses, texts = [], [], []
    for grader in graders:
        answer = grader.answers.get(row)
        if answer is None:
            values += [None] * len(grader.adds)
            statuses.append("no")
            continue
        fields, status = _graded_fields(grader.template, grader.specs, answer)
        values += [fields.get(name) for name in grader.adds]
        statuses.append(status)
        if status != "yes":
            texts.append(answer)
    status = "yes" if set(statuses) == {"yes"} else "no" if set(statuses) == {"no"} else "partly"
    return [*values, status, "\n".join(texts) if texts else None]


def _graded_names(header: list[str], columns: list[str]) -> list[str]:
    """The added columns' names: each field's own, then parsed and model output; "NAME (model)" when the input
    has a column of that name (compared as columns are matched: ignoring case, spaces, _ and -)."""
    taken = {column_key(str(name)) for name in header}
    names = []
    for name in [*columns, "parsed", "model output"]:
        if column_key(name) in taken:
            name = f"{name} (model)"
        taken.add(column_key(name))
        names.append(name)
    return names


def _graded_fields(template: AnswerTemplate, specs: dict[str, FieldSpec], answer: str) -> tuple[dict[str, Any], str]:
    """One answer's fields (a number field's value as a number when it is only a number, a label field's as the
    class it names) and whether it was parsed: yes, partly or no."""
    parsed = template.parse(answer)
    if parsed is None:
        return {}, "no"
    values: dict[str, Any] = {}
    for name, value in parsed.items():
        spec = specs.get(name)
        if value and spec is not None and spec.kind == "number":
            number = parse_number(value, spec.decimal, whole=True)
            if number is not None:
                value = int(number) if number.is_integer() and abs(number) < 1e15 else number
        elif value and spec is not None and spec.kind == "label":
            value = spec.label(value)
        values[name] = value if value != "" else None
    return values, "yes" if template.complete(parsed) else "partly"


def _graded_workbook(data_file: Path, sheet: str | int | None, width: int, added: list[str],
                     graded: dict[int, list[Any]]) -> bytes:
    """The input workbook with the added columns after its ``width`` columns on the graded sheet."""
    from openpyxl import load_workbook

    from qatune.data.tables import choose_sheet

    book = load_workbook(data_file)
    chosen = choose_sheet(data_file, book.sheetnames, sheet)
    worksheet = book.worksheets[chosen] if isinstance(chosen, int) else book[chosen]
    for row, values in [(1, added), *graded.items()]:
        for offset, value in enumerate(values):
            _set_cell(worksheet.cell(row=row, column=width + 1 + offset), value)
    buffer = io.BytesIO()
    book.save(buffer)
    return buffer.getvalue()


def _set_cell(cell: Any, value: Any) -> None:
    from openpyxl.cell.cell import ILLEGAL_CHARACTERS_RE

    cell.value = ILLEGAL_CHARACTERS_RE.sub("", value) if isinstance(value, str) else value
    if isinstance(cell.value, str) and cell.value.startswith("="):
        cell.data_type = "s"  # an answer that looks like a formula stays text


def _answers_path(run_dir: str | Path, data_file: str | Path, output: str | Path | None,
                  keep_format: bool = False) -> Path:
    """Where the answers go, checked before any work: a format we write, and not the questions file.
    ``keep_format``: by default, the format of the questions file (.csv when it is none we write)."""
    suffix = ".csv"
    if keep_format:
        given = Path(data_file).suffix.lower()
        suffix = ".xlsx" if given in (".xlsx", ".xlsm") else given if given in ANSWER_FORMATS else ".csv"
    if output:
        path = Path(output)
    elif Path(run_dir).is_file():  # a .gguf file: beside it, named after it
        path = Path(run_dir).parent / f"answers-{Path(run_dir).stem}-{Path(data_file).stem}{suffix}"
    else:
        path = Path(run_dir) / f"answers-{Path(data_file).stem}{suffix}"
    if path.suffix.lower() not in ANSWER_FORMATS:
        raise DataError(f"--output {path}: cannot write '{path.suffix or '(no suffix)'}' files; end the name with "
                        f"one of {', '.join(ANSWER_FORMATS)}")
    questions = Path(data_file)
    if path.resolve() == questions.resolve() or (path.exists() and questions.exists() and path.samefile(questions)):
        raise DataError(f"--output {path} is the questions file itself; writing the answers there would overwrite "
                        "the questions file; pick another name, e.g. answers" + path.suffix)
    if path.is_dir():
        raise DataError(f"--output {path} is a directory; name a file, e.g. {path / 'answers.csv'}")
    return path


def _input_table(data: DataConfig, data_file: Path, records: list[QARecord]) -> tuple[list[str], list[list[Any]]]:
    """row, question and the input's other columns as they are in the file, one row per record (read once,
    before any answer is generated; the answer column is added after)."""
    from qatune.data.spreadsheet import resolve_column
    from qatune.data.tables import read_table

    header, cells, first_row = read_table(data_file, sheet=data.sheet, encoding=data.encoding,
                                          delimiter=data.delimiter)
    question = resolve_column(header, data.question_column, "question_column", data_file.name)
    others = [i for i in range(len(header)) if i != question]
    names = ["row", "question"]
    for i in others:
        names.append(_free_name(str(header[i]).strip() or f"column {i + 1}", [*names, "answer"]))
    rows = []
    for record in records:
        line = cells[record.row - first_row]
        rows.append([record.row, record.question, *(_plain(line[i] if i < len(line) else None) for i in others)])
    return names, rows


def _free_name(name: str, taken: list[str]) -> str:
    """``name``, or ``name (input)`` when the answers file already has such a column (row, question, answer)."""
    candidate, n = name, 1
    while candidate in taken:
        candidate = f"{name} (input)" if n == 1 else f"{name} (input {n})"
        n += 1
    return candidate


def _plain(value: Any) -> Any:
    """An input cell as the answers file holds it: text, numbers and booleans as they are, blanks empty,
    anything else (dates, lists) as the text training reads."""
    from qatune.data.tables import clean_cell

    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if value is None or isinstance(value, str | bool | int | float):
        return value
    return clean_cell(value)


def _write_table(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    """Write ``rows`` in the format ``path``'s suffix names, atomically (a temporary sibling, then a rename)."""
    suffix = path.suffix.lower()
    if suffix == ".xlsx":
        atomic_write_bytes(path, _xlsx_bytes(header, rows))
        return
    if suffix in (".json", ".jsonl"):
        records = [dict(zip(header, row)) for row in rows]
        if suffix == ".json":
            text = json.dumps(records, ensure_ascii=False, indent=2) + "\n"
        else:
            text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    else:
        buffer = io.StringIO()
        writer = csv.writer(buffer, delimiter="\t" if suffix == ".tsv" else ",")
        writer.writerow(header)
        writer.writerows(rows)
        text = buffer.getvalue()
    atomic_write_text(path, text)


def _xlsx_bytes(header: list[str], rows: list[list[Any]]) -> bytes:
    from openpyxl import Workbook
    from openpyxl.cell.cell import ILLEGAL_CHARACTERS_RE

    book = Workbook()
    sheet = book.active
    sheet.title = "answers"
    for line in [header, *rows]:
        sheet.append([ILLEGAL_CHARACTERS_RE.sub("", v) if isinstance(v, str) else v for v in line])
        for cell in sheet[sheet.max_row]:
            if isinstance(cell.value, str) and cell.value.startswith("="):
                cell.data_type = "s"  # an answer that looks like a formula stays text
    buffer = io.BytesIO()
    book.save(buffer)
    return buffer.getvalue()
