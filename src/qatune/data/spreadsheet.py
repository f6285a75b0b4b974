"""Spreadsheet -> list of QA records plus a report of what was kept and dropped.

The only module that uses pandas. Row numbers are the ones a spreadsheet program shows (the header
is row 1, the first data row is row 2; for JSON and parquet files the first record is row 1), so a message
about row 17 sends the user to row 17 of their sheet.
"""

from __future__ import annotations

import json
import math
import numbers
import random
import re
import zipfile
from dataclasses import asdict, dataclass, field
from datetime import date, datetime, time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qatune.errors import DataError, row_list

if TYPE_CHECKING:
    import pandas as pd

    from qatune.config import DataConfig

TEXT_SUFFIXES = {".csv": ",", ".tsv": "\t", ".txt": ","}
EXCEL_SUFFIXES = {".xlsx", ".xlsm"}
JSON_SUFFIXES = {".json", ".jsonl", ".ndjson"}
SUPPORTED = sorted([*TEXT_SUFFIXES, *EXCEL_SUFFIXES, *JSON_SUFFIXES, ".parquet"])

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
) -> tuple[list[QARecord], LoadReport]:
    """Read a spreadsheet into QA records. ``answer_column=None`` reads questions only (for generate).

    ``fields``: other columns the prompt template names; each must exist, and its cells go into
    ``QARecord.fields`` under the template's name.
    """
    path = Path(path)
    header, rows, first_row = read_table(path, sheet=sheet, encoding=encoding, delimiter=delimiter)
    report = LoadReport(file=path.name, rows_read=len(rows))
    if not rows:
        raise with_sheets_hint(DataError(f"{path} has a header but no data rows; add rows below the header {header}"),
                               path, sheet, "set data.sheet")

    where = _where(path, sheet)
    wanted = {"question_column": question_column, "answer_column": answer_column, "context_column": context_column}
    try:
        index = {key: resolve_column(header, name, key, where) for key, name in wanted.items() if name is not None}
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
    except DataError as exc:
        raise with_sheets_hint(exc, path, sheet, "set data.sheet") from None
    report.columns = {key: header[i] for key, i in index.items() if key in wanted}

    columns = {key: _column_cells(rows, i) for key, i in index.items()}
    starts = _column_cells(rows, start_index) if start_index is not None else [None] * len(rows)
    records: list[QARecord] = []
    seen: set[tuple] = set()
    for offset in range(len(rows)):
        row_number = first_row + offset
        cells = {key: values[offset] for key, values in columns.items()}
        if all(value is None for value in cells.values()):
            report.drop("empty row", row_number)
            continue
        reason = _problem(cells, max_cell_chars)
        if reason:
            report.drop(reason, row_number)
            continue
        answers: list[str] = []
        if "answer_column" in cells:
            answers = _split_answers(cells["answer_column"], answer_separator)
            if not answers:
                report.drop("blank answer", row_number)
                continue
        record = QARecord(
            question=cells["question_column"],
            answers=answers,
            context=cells.get("context_column"),
            answer_start=_as_offset(starts[offset]),
            row=row_number,
            fields={name: cells[name] for name in fields},
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
    """``load_records`` with the column settings of a config's data section."""
    use_context = data.context_column is not None if with_context is None else with_context
    return load_records(
        path,
        question_column=data.question_column,
        answer_column=data.answer_column if with_answers else None,
        context_column=data.context_column if use_context else None,
        answer_start_column=data.answer_start_column if use_context else None,
        sheet=data.sheet,
        encoding=data.encoding,
        delimiter=data.delimiter,
        answer_separator=data.answer_separator,
        drop_duplicates=data.drop_duplicates,
        max_cell_chars=data.max_cell_chars,
        fields=prompt_columns(data),
    )


def prompt_columns(data: DataConfig) -> list[str]:
    """Columns the prompt names besides the question and context columns (``{Total Marks}``)."""
    from qatune.config import template_fields

    templates = [data.user_template] if data.prompt_template in ("auto", "chat") else [data.prompt_template]
    roles = {column_key(name) for name in ("question", "context", data.question_column, data.context_column) if name}
    names: list[str] = []
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


def read_table(path: Path, *, sheet: str | int | None = None, encoding: str | None = None,
               delimiter: str | None = None) -> tuple[list[str], list[list[Any]], int]:
    """Read any supported file into (header, data rows, row number of the first data row)."""
    if not path.exists():
        raise DataError(f"data file {path} not found; check data.train_file / data.eval_file or the path you passed")
    if path.is_dir():
        raise DataError(f"data path {path} is a directory; give the spreadsheet file inside it")
    suffix = path.suffix.lower()
    if path.stat().st_size == 0:
        raise DataError(f"data file {path} is empty; it needs a header row and at least one data row")
    if suffix in TEXT_SUFFIXES:
        frame = _read_text_table(path, encoding, delimiter or TEXT_SUFFIXES[suffix])
        return (*_header_and_rows(frame, path), 2)
    if suffix in EXCEL_SUFFIXES:
        frame = _read_excel(path, sheet)
        return (*_header_and_rows(frame, path), 2)
    if suffix in JSON_SUFFIXES:
        header, rows = _read_json(path, encoding, lines=suffix != ".json")
        return header, rows, 1
    if suffix == ".parquet":
        frame = _read_parquet(path)
        return [str(c) for c in frame.columns], frame.astype(object).values.tolist(), 1
    if suffix == ".xls":
        raise DataError(f"{path}: old .xls workbooks are not supported; open it and save it as .xlsx")
    raise DataError(f"{path}: unsupported file type '{suffix or '(none)'}'; use one of {', '.join(SUPPORTED)}")


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
    if key == "answer_start_column":
        hint = " to the offsets' column, or to null (each answer is then found by searching its context)" + hint
    raise DataError(f"column '{name}' not found in {where}; columns are {header}; set data.{key}{hint}")


def _find_column(header: list[str], name: str) -> int | None:
    matches = [i for i, column in enumerate(header) if column_key(column) == column_key(name)]
    return matches[0] if len(matches) == 1 else None


def column_key(name: str) -> str:
    """A column name as matched: case, surrounding spaces, runs of spaces and _/- do not matter."""
    return " ".join(re.sub(r"[_\-]", " ", name).casefold().split())


def _where(path: Path, sheet: str | int | None) -> str:
    if path.suffix.lower() in EXCEL_SUFFIXES:
        return f"{path.name} (sheet {sheet!r})" if sheet is not None else f"{path.name} (first sheet)"
    return path.name


def _read_text_table(path: Path, encoding: str | None, delimiter: str) -> pd.DataFrame:
    import pandas as pd

    head = path.read_bytes()[:8192]
    _check_text_head(path, head, encoding)
    try:
        return pd.read_csv(
            path, header=None, dtype=str, keep_default_na=False, na_filter=False, sep=delimiter,
            encoding=encoding or "utf-8-sig", skip_blank_lines=False, engine="c",
        )
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not valid {encoding or 'UTF-8'} text (byte {exc.object[exc.start]:#04x} at offset "
            f"{exc.start}); set data.encoding to the file's encoding, e.g. cp1252 or latin-1, or re-save it as UTF-8"
        ) from None
    except LookupError:
        raise DataError(f"data.encoding '{encoding}' is not a known encoding; try utf-8, cp1252 or latin-1") from None
    except pd.errors.EmptyDataError:
        raise DataError(f"data file {path} has no rows; it needs a header row and at least one data row") from None
    except pd.errors.ParserError as exc:
        detail = str(exc).strip().splitlines()[-1]
        match = re.search(r"Expected (\d+) fields in line (\d+), saw (\d+)", detail)
        if match:
            expected, line, saw = match.groups()
            first = head.decode(encoding or "utf-8", errors="replace").lstrip("\ufeff").splitlines()[0] if head else ""
            other = next((label for sep, label in ((";", "';'"), ("\t", "tab"), ("|", "'|'"))
                          if sep != delimiter and sep in first), None)
            hint = (f"; the header looks {other}-separated, set data.delimiter" if expected == "1" and other
                    else f"; quote cells that contain {delimiter!r} or fix that row")
            raise DataError(f"{path} line {line} has {saw} cells but the header has {expected}{hint}") from None
        raise DataError(f"{path} cannot be parsed as a {delimiter!r}-separated table: {detail}") from None
    except ValueError as exc:  # (after ParserError, one too) a separator pandas cannot use: longer than one character
        raise DataError(f"{path} cannot be read with the cell separator {delimiter!r}: {exc}") from None


def _check_text_head(path: Path, head: bytes, encoding: str | None) -> None:
    if encoding:
        return
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DataError(f"{path} is UTF-16 text; set data.encoding: utf-16 (or re-save the file as UTF-8)")
    if head.startswith(b"PK\x03\x04"):
        raise DataError(f"{path} is a zip archive (an Excel workbook?); rename it to .xlsx or export it as CSV")
    if b"\x00" in head:
        raise DataError(f"{path} contains binary data (NUL bytes), not a text table; export the sheet as CSV")


def with_sheets_hint(error: DataError, path: Path, sheet: str | int | None, how: str) -> DataError:
    """A column not found on a workbook's first sheet: the error, plus the workbook's other sheets, where
    the data may be (unchanged when a sheet was named, or the file is no workbook or has one sheet)."""
    if sheet is not None or path.suffix.lower() not in EXCEL_SUFFIXES:
        return error
    from openpyxl import load_workbook

    try:
        book = load_workbook(path, read_only=True)
        names = book.sheetnames
        book.close()
    except Exception:  # it was read a moment ago: a hint is not worth a second error
        return error
    if len(names) < 2:
        return error
    text = str(error)
    hint = f"that was the first sheet of {names}: if the data is on another one, {how}"
    return DataError(f"{text}\n{hint}" if "\n" in text else f"{text} ({hint})")


def _read_excel(path: Path, sheet: str | int | None) -> pd.DataFrame:
    import pandas as pd

    if not zipfile.is_zipfile(path):
        raise DataError(f"{path} is not an Excel workbook (it looks like plain text); rename it to .csv")
    try:
        book = pd.ExcelFile(path, engine="openpyxl")
    except Exception as exc:  # openpyxl raises many kinds on a corrupt workbook
        raise DataError(f"{path} cannot be opened as an Excel workbook: {exc}") from None
    with book:
        names = book.sheet_names
        if isinstance(sheet, str) and sheet.strip().isdigit() and not any(
                n.strip().casefold() == sheet.strip().casefold() for n in names):
            sheet = int(sheet)  # "1" from a command line (init --sheet 1): the index, as data.sheet: 1 is
        if sheet is None:
            chosen: str | int = 0
        elif isinstance(sheet, int):
            if sheet >= len(names):
                raise DataError(f"{path} has no sheet {sheet} (0-based); its sheets are {names}; set data.sheet")
            chosen = sheet
        elif sheet in names:
            chosen = sheet
        else:
            folded = [n for n in names if n.strip().casefold() == sheet.strip().casefold()]
            if len(folded) != 1:
                raise DataError(f"{path} has no sheet named '{sheet}'; its sheets are {names}; set data.sheet")
            chosen = folded[0]
        return pd.read_excel(book, sheet_name=chosen, header=None, dtype=object, keep_default_na=False,
                             na_filter=False)


def _read_json(path: Path, encoding: str | None, lines: bool) -> tuple[list[str], list[list[Any]]]:
    _check_text_head(path, path.read_bytes()[:8192], encoding)
    try:
        text = path.read_text(encoding=encoding or "utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not valid {encoding or 'UTF-8'} text (offset {exc.start}); "
            "set data.encoding or re-save as UTF-8"
        ) from None
    if lines:
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path} line {number} is not valid JSON: {exc.msg}; "
                                "each line must be one JSON object") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} is not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
        records = _json_records(data, path)
    if not records:
        raise DataError(f"{path} holds no records; "
                        "it needs a list of objects like {\"question\": ..., \"answer\": ...}")
    bad = next((i for i, record in enumerate(records) if not isinstance(record, dict)), None)
    if bad is not None:
        raise DataError(f"{path} record {bad + 1} is a {type(records[bad]).__name__}, not an object with named fields")
    header: list[str] = []
    for record in records:
        header.extend(key for key in record if key not in header)
    return header, [[record.get(key) for key in header] for record in records]


def _json_records(data: Any, path: Path) -> list[Any]:
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        lists = [value for value in data.values() if isinstance(value, list)]
        if len(lists) == 1 and all(isinstance(item, dict) for item in lists[0]):
            return lists[0]
        if len(lists) == len(data) and len({len(v) for v in lists}) == 1:
            return [dict(zip(data, values)) for values in zip(*lists)]
    raise DataError(f"{path} must hold a list of records (or an object of equal-length column lists)")


def _read_parquet(path: Path) -> pd.DataFrame:
    import pandas as pd

    try:
        return pd.read_parquet(path)
    except ImportError:
        raise DataError("reading .parquet needs pyarrow: pip install 'qatune[parquet]'") from None
    except Exception as exc:  # pyarrow raises its own error kinds on a corrupt file
        raise DataError(f"{path} cannot be read as parquet: {exc}") from None


def _header_and_rows(frame: pd.DataFrame, path: Path) -> tuple[list[str], list[list[Any]]]:
    values = frame.astype(object).values.tolist()
    if not values:
        raise DataError(f"data file {path} has no rows; it needs a header row and at least one data row")
    header = [cell if isinstance(cell, str) else clean_cell(cell) or "" for cell in values[0]]
    if not any(name.strip() for name in header):
        raise DataError(f"{path}: the first row is blank; the first row must name the columns (question, answer ...)")
    rows = values[1:]
    # Trailing blank lines of a text file are not rows anybody sees.
    while rows and all(_is_blank(cell) for cell in rows[-1]):
        rows.pop()
    return header, rows


def _column_cells(rows: list[list[Any]], index: int) -> list[str | None]:
    cells = [clean_cell(row[index] if index < len(row) else None) for row in rows]
    present = [cell for cell in cells if cell is not None]
    # A column of numbers written by a spreadsheet ('7.0', '8.5') reads as clean text ('7', '8.5').
    if present and all(_DECIMAL.match(cell) for cell in present):
        cells = [_INTEGRAL_DECIMAL.sub(r"\1", cell) if cell is not None else None for cell in cells]
    return cells


def clean_cell(value: Any) -> str | None:
    """Cell -> stripped text, or None when blank. Numbers become clean text (7.0 -> '7')."""
    if value is None:
        return None
    if isinstance(value, str):
        return value.strip() or None
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isnan(number):
            return None
        if math.isinf(number):
            return _NOT_FINITE
        return str(int(number)) if number.is_integer() else format(number, ".15g")
    if isinstance(value, datetime):
        return value.date().isoformat() if value.time() == time(0) else value.isoformat(sep=" ")
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    text = str(value).strip()
    return text or None


_NOT_FINITE = "\x00not-finite"


def _is_blank(value: Any) -> bool:
    return clean_cell(value) is None


def _problem(cells: dict[str, str | None], max_chars: int) -> str | None:
    for key, value in cells.items():
        name = key.removesuffix("_column")
        if value == _NOT_FINITE:
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
    if value is None or value == _NOT_FINITE:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if number.is_integer() and number >= 0 else None
