"""A data file on disk -> its header and rows of cells: CSV/TSV, Excel, JSON, JSON lines, parquet.

The only module that uses pandas. Errors name the file and what to change (an encoding, a delimiter, a
sheet), and :func:`clean_cell` turns every cell into the text a spreadsheet program shows (7.0 -> '7', a
date -> its ISO form, blank -> None). :mod:`qatune.data.spreadsheet` makes QA records of the rows.
"""

from __future__ import annotations

import json
import math
import numbers
import re
import zipfile
from datetime import date, datetime, time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qatune.errors import DataError

if TYPE_CHECKING:
    import pandas as pd

TEXT_SUFFIXES = {".csv": ",", ".tsv": "\t", ".txt": ","}
EXCEL_SUFFIXES = {".xlsx", ".xlsm"}
JSON_SUFFIXES = {".json", ".jsonl", ".ndjson"}
SUPPORTED = sorted([*TEXT_SUFFIXES, *EXCEL_SUFFIXES, *JSON_SUFFIXES, ".parquet"])

NOT_FINITE = "\x00not-finite"
"""What :func:`clean_cell` gives an infinite number: not blank, never a valid cell."""


def read_table(path: Path, *, sheet: str | int | None = None, encoding: str | None = None,
               delimiter: str | None = None) -> tuple[list[str], list[list[Any]], int]:
    """Read any supported file into (header, data rows, row number of the first data row)."""
    if not path.exists():
        looked = "" if path.is_absolute() else f" (relative paths are read from the current folder, {Path.cwd()})"
        raise DataError(f"data file {path} not found{looked}; check data.train_file / data.eval_file or the path "
                        "you passed")
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


def location(path: Path, sheet: str | int | None) -> str:
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
        return pd.read_excel(book, sheet_name=choose_sheet(path, book.sheet_names, sheet), header=None,
                             dtype=object, keep_default_na=False, na_filter=False)


def choose_sheet(path: Path, names: list[str], sheet: str | int | None) -> str | int:
    """The sheet data.sheet names among a workbook's ``names``: a name (exact, else ignoring case and spaces) or
    a 0-based index; None is the first sheet (0)."""
    if isinstance(sheet, str) and sheet.strip().isdigit() and not any(
            n.strip().casefold() == sheet.strip().casefold() for n in names):
        sheet = int(sheet)  # "1" from a command line (init --sheet 1): the index, as data.sheet: 1 is
    if sheet is None:
        return 0
    if isinstance(sheet, int):
        if sheet >= len(names):
            raise DataError(f"{path} has no sheet {sheet} (0-based); its sheets are {names}; set data.sheet")
        return sheet
    if sheet in names:
        return sheet
    folded = [n for n in names if n.strip().casefold() == sheet.strip().casefold()]
    if len(folded) != 1:
        raise DataError(f"{path} has no sheet named '{sheet}'; its sheets are {names}; set data.sheet")
    return folded[0]


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
    while rows and all(is_blank(cell) for cell in rows[-1]):
        rows.pop()
    return header, rows


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
            return NOT_FINITE
        return str(int(number)) if number.is_integer() else format(number, ".15g")
    if isinstance(value, datetime):
        return value.date().isoformat() if value.time() == time(0) else value.isoformat(sep=" ")
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    text = str(value).strip()
    return text or None


def is_blank(value: Any) -> bool:
    return clean_cell(value) is None
