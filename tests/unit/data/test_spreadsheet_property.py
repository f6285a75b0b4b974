"""Property: arbitrary cell contents never crash the loader; they load or give a clean DataError."""

import csv
import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qatune.data.spreadsheet import load_records
from qatune.errors import DataError

cells = st.one_of(st.text(max_size=40), st.sampled_from(["None", "NA", "nan", "", "  ", "7.0", "1e309", "=1+1",
                                                          "\ufeff", "a,b", '"', "\r\n", "|"]))
json_cells = st.one_of(cells, st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True),
                       st.lists(st.integers(), max_size=3))


def check(path, **kwargs):
    try:
        records, report = load_records(path, **kwargs)
    except DataError as exc:
        assert str(exc)
        return
    assert report.kept == len(records) <= report.rows_read
    for record in records:
        assert record.question and record.question == record.question.strip()
        assert record.answers and all(a and a == a.strip() for a in record.answers)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(cells, cells), max_size=12), separator=st.sampled_from([None, "|"]))
def test_csv_cells(rows, separator):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.csv"
        with open(path, "w", encoding="utf-8", newline="") as f:
            csv.writer(f).writerows([("question", "answer"), *rows])
        check(path, answer_separator=separator)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.fixed_dictionaries({"question": json_cells, "answer": json_cells}), max_size=12))
def test_jsonl_cells(rows):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        check(path)


@settings(max_examples=100, deadline=None)
@given(blob=st.binary(max_size=300))
def test_arbitrary_bytes(blob):
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("data.csv", "data.xlsx", "data.jsonl"):
            path = Path(tmp) / name
            path.write_bytes(blob)
            check(path)
