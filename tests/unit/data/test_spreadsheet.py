import json

import pytest
from openpyxl import Workbook

from qatune.data.spreadsheet import load_records, split_validation
from qatune.errors import DataError
from tests.conftest import notes_then_data_workbook


def write_xlsx(path, rows, sheet="Sheet1", extra_sheets=()):
    book = Workbook()
    ws = book.active
    ws.title = sheet
    for row in rows:
        ws.append(row)
    for name in extra_sheets:
        book.create_sheet(name).append(["x"])
    book.save(path)
    return path


def test_csv_with_messy_headers_bom_blank_rows_and_none_answers(tmp_path):
    path = tmp_path / "faq.csv"
    path.write_bytes(
        "\ufeff Question ,ANSWER \r\n"
        "What is 2+2? , 4\r\n"
        "\r\n"
        "Is there a fee?,None\r\n"
        "Empty answer,   \r\n"
        ",orphan answer\r\n"
        "Is it NA?,NA\r\n".encode("utf-8")
    )
    records, report = load_records(path)
    assert [(r.question, r.answers, r.row) for r in records] == [
        ("What is 2+2?", ["4"], 2),
        ("Is there a fee?", ["None"], 4),
        ("Is it NA?", ["NA"], 7),
    ]
    assert report.rows_read == 6
    assert report.kept == 3
    assert report.dropped == {"empty row": [3], "blank answer": [5], "blank question": [6]}
    assert report.columns == {"question_column": " Question ", "answer_column": "ANSWER "}


def test_tsv_and_numeric_column_become_clean_text(tmp_path):
    path = tmp_path / "marks.tsv"
    path.write_text("question\tTotal Marks\nQ1\t7.0\nQ2\t8.5\nQ3\t10.00\n", encoding="utf-8")
    records, _ = load_records(path, answer_column="total marks")
    assert [r.answer for r in records] == ["7", "8.5", "10"]


def test_decimal_text_in_a_text_column_is_left_alone(tmp_path):
    path = tmp_path / "v.csv"
    path.write_text("question,answer\nWhich version?,1.0\nWho?,Ada\nZip?,007\n", encoding="utf-8")
    records, _ = load_records(path)
    assert [r.answer for r in records] == ["1.0", "Ada", "007"]


def test_xlsx_sheet_by_name_and_index_with_numbers_and_formulas(tmp_path):
    path = write_xlsx(
        tmp_path / "sheet.xlsx",
        [[" Question", "Answer ", "Total Marks"], ["How many?", 7.0, 7.0], ["Half?", 0.5, 0.5],
         [None, None, None], ["Formula?", "=1+1", 2], ["Text None", "None", 1]],
        sheet="Marks", extra_sheets=["Notes"],
    )
    by_name, report = load_records(path, sheet="marks")
    by_index, _ = load_records(path, sheet=0)
    assert [r.answers for r in by_name] == [r.answers for r in by_index]
    # The formula cell has no cached value (openpyxl never computes it): it is read as blank, never evaluated.
    assert [(r.question, r.answer, r.row) for r in by_name] == [
        ("How many?", "7", 2), ("Half?", "0.5", 3), ("Text None", "None", 6)]
    assert report.dropped == {"empty row": [4], "blank answer": [5]}
    marks, _ = load_records(path, sheet="Marks", answer_column="total_marks")
    assert [r.answer for r in marks] == ["7", "0.5", "2", "1"]


def test_xlsx_wrong_sheet_names_the_sheets(tmp_path):
    path = write_xlsx(tmp_path / "s.xlsx", [["question", "answer"], ["q", "a"]], sheet="Data", extra_sheets=["Notes"])
    with pytest.raises(DataError,
                       match=r"no sheet named 'Answers'; its sheets are \['Data', 'Notes'\]; set data.sheet"):
        load_records(path, sheet="Answers")
    with pytest.raises(DataError, match=r"no sheet 5"):
        load_records(path, sheet=5)


def test_column_missing_on_the_first_of_several_sheets_names_the_others(tmp_path):
    notes_then_data_workbook(tmp_path / "two.xlsx", "q?", "a")
    with pytest.raises(DataError) as error:
        load_records(tmp_path / "two.xlsx")
    assert str(error.value) == ("column 'question' not found in two.xlsx (first sheet); columns are ['notes']; set "
                                "data.question_column (that was the first sheet of ['Notes', 'Data']: if the data is "
                                "on another one, set data.sheet)")
    assert [r.answer for r in load_records(tmp_path / "two.xlsx", sheet="Data")[0]] == ["a"]
    one = write_xlsx(tmp_path / "one.xlsx", [["notes"], ["x"]])
    with pytest.raises(DataError, match=r"set data.question_column$"):
        load_records(one)


def test_jsonl_and_json_records(tmp_path):
    jsonl = tmp_path / "qa.jsonl"
    jsonl.write_text('{"Question": "a?", "answer": 3}\n\n{"Question": "b?", "answer": "x | y"}\n', encoding="utf-8")
    records, _ = load_records(jsonl, answer_separator="|")
    assert [(r.question, r.answers, r.row) for r in records] == [("a?", ["3"], 1), ("b?", ["x", "y"], 2)]
    js = tmp_path / "qa.json"
    js.write_text(json.dumps({"data": [{"question": "c?", "answer": "z"}]}), encoding="utf-8")
    assert load_records(js)[0][0].answers == ["z"]


def test_multi_answer_cells_keep_every_gold_answer(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("question,answer\nCapital?,\" Paris | paris, France |\"\nNone?,|\n", encoding="utf-8")
    records, report = load_records(path, answer_separator="|")
    assert records[0].answers == ["Paris", "paris, France"]
    assert report.dropped == {"blank answer": [3]}


def test_duplicates_are_counted_and_dropped_when_asked(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("question,answer\nq,a\nq,a\nq,b\n", encoding="utf-8")
    records, report = load_records(path)
    assert (len(records), report.duplicates) == (3, 1)
    records, report = load_records(path, drop_duplicates=True)
    assert [r.row for r in records] == [2, 4]
    assert report.dropped == {"duplicate": [3]}


def test_missing_column_names_the_available_ones(tmp_path):
    path = tmp_path / "faq.csv"
    path.write_text("Question,Reply\nq,a\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        load_records(path)
    assert str(err.value) == ("column 'answer' not found in faq.csv; columns are ['Question', 'Reply']; "
                              "set data.answer_column")


def test_ambiguous_columns_are_refused(tmp_path):
    path = tmp_path / "dup.csv"
    path.write_text("question,Answer,answer \nq,a,b\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"column 'ANSWER' is ambiguous .* matches \['Answer', 'answer '\]"):
        load_records(path, answer_column="ANSWER")
    path.write_text("question,answer,answer\nq,a,b\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"columns \[2, 3\] are all named 'answer'; rename all but one of them"):
        load_records(path)


def test_a_missing_answer_start_column_says_it_can_be_null(tmp_path):
    path = tmp_path / "squad.csv"
    path.write_text("question,context,answer\nwho?,Ada wrote it.,Ada\n", encoding="utf-8")
    with pytest.raises(DataError) as error:
        load_records(path, context_column="context", answer_start_column="answer_start")
    assert str(error.value).endswith("set data.answer_start_column to the offsets' column, or to null (each answer "
                                     "is then found by searching its context)")


def test_wrong_delimiter_gets_a_hint(tmp_path):
    path = tmp_path / "semi.csv"
    path.write_text("question;answer\nq;a\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"';'-separated, set data\.delimiter"):
        load_records(path)
    assert load_records(path, delimiter=";")[0][0].answer == "a"
    path.write_text("question;answer\nq;a\nwho, then?;me\n", encoding="utf-8")  # a comma in a cell
    with pytest.raises(DataError, match=r"line 3 has 2 cells but the header has 1; the header looks ';'-separated, "
                                        r"set data\.delimiter$"):
        load_records(path)


def test_non_utf8_names_the_encoding_option(tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes("question,answer\ncafé?,crème\n".encode("cp1252"))
    with pytest.raises(DataError, match=r"set data\.encoding"):
        load_records(path)
    assert load_records(path, encoding="cp1252")[0][0].answer == "crème"


def test_utf16_is_recognised(tmp_path):
    path = tmp_path / "u16.csv"
    path.write_text("question,answer\nq,a\n", encoding="utf-16")
    with pytest.raises(DataError, match=r"UTF-16 text; set data\.encoding: utf-16"):
        load_records(path)
    assert load_records(path, encoding="utf-16")[0][0].answer == "a"


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"question,answer\n", "header but no data rows"),
    (b"question,answer\nq,a\nq,a,extra\n", "line 3 has 3 cells but the header has 2"),
    (b"\x00\x01\x02garbage\xff" * 10, "binary data"),
])
def test_bad_text_files(tmp_path, content, message):
    path = tmp_path / "bad.csv"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_records(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_records(tmp_path / "nope.csv")
    with pytest.raises(DataError, match="is a directory"):
        load_records(tmp_path)


def test_a_relative_path_not_found_names_the_folder_it_was_read_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as err:
        load_records("data/faq.csv")
    assert str(err.value) == (f"data file data/faq.csv not found (relative paths are read from the current folder, "
                              f"{tmp_path}); check data.train_file / data.eval_file or the path you passed")


def test_a_title_row_above_the_header_gets_a_hint(tmp_path):
    path = write_xlsx(tmp_path / "titled.xlsx", [["My FAQ export 2024"], ["question", "answer"], ["q", "a"]])
    with pytest.raises(DataError) as err:
        load_records(path)
    assert str(err.value).endswith("set data.question_column; the first row looks like a title, not a header: the "
                                   "column names must be in the file's first row (delete the rows above them)")


def test_csv_renamed_to_xlsx(tmp_path):
    path = tmp_path / "fake.xlsx"
    path.write_text("question,answer\nq,a\n")
    with pytest.raises(DataError, match=r"not an Excel workbook .* rename it to \.csv"):
        load_records(path)


def test_context_and_answer_start(tmp_path):
    path = tmp_path / "ex.csv"
    path.write_text("question,context,answer,answer_start\nq,The cat sat.,cat,4\nr,A dog.,dog,\n", encoding="utf-8")
    records, _ = load_records(path, context_column="context")
    assert [(r.context, r.answer_start) for r in records] == [("The cat sat.", 4), ("A dog.", None)]


def test_infinite_numbers_and_long_cells_are_dropped(tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_text('{"question": "q1", "answer": Infinity}\n{"question": "q2", "answer": "ok"}\n'
                    '{"question": "q3", "answer": "%s"}\n' % ("x" * 50), encoding="utf-8")
    records, report = load_records(path, max_cell_chars=20)
    assert [r.question for r in records] == ["q2"]
    assert report.dropped == {"answer is an infinite number": [1],
                              "answer longer than 20 characters (data.max_cell_chars)": [3]}


def test_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = tmp_path / "qa.parquet"
    pd.DataFrame({"question": ["q"], "answer": [7.0]}).to_parquet(path)
    assert load_records(path)[0][0].answer == "7"


def test_validation_split_keeps_questions_on_one_side():
    from qatune.data.spreadsheet import QARecord

    records = [QARecord(question=f"q{i % 10}", answers=[str(i)], row=i) for i in range(40)]
    train, val = split_validation(records, 0.2, seed=1)
    assert len(train) + len(val) == 40
    assert {r.question for r in train}.isdisjoint({r.question for r in val})
    assert len({r.question for r in val}) == 2
    assert split_validation(records, 0.2, seed=1) == (train, val)
    with pytest.raises(DataError, match="leaves no training rows"):
        split_validation(records[:1], 0.5, seed=1)


def test_shipped_example_workbook_loads(fixtures):
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "data" / "grading.xlsx"
    records, report = load_records(path, sheet="Marks", answer_column="Total Marks")
    assert report.kept == 40 and report.dropped == {"empty row": [12]}
    assert records[0].answer == "2.5"


GRADING = [["Student ID", "Total Marks", "Coding", "Feedback"],
           [101, 3.0, "uses a for loop", "Good."],
           [102, None, "recursion", "Check the base case."],
           [103, 1.5, "while True", "It never stops."]]


def test_columns_the_prompt_names_travel_with_each_record(tmp_path):
    path = write_xlsx(tmp_path / "marks.xlsx", GRADING)
    records, report = load_records(path, question_column="Coding", answer_column="Feedback",
                                   fields=["total marks", "Student ID"])
    assert [(r.question, r.fields) for r in records] == [
        ("uses a for loop", {"total marks": "3", "Student ID": "101"}),
        ("while True", {"total marks": "1.5", "Student ID": "103"}),
    ]
    assert report.dropped == {"blank total marks": [3]}


def test_a_column_the_prompt_names_must_exist(tmp_path):
    path = write_xlsx(tmp_path / "marks.xlsx", GRADING)
    with pytest.raises(DataError) as caught:
        load_records(path, question_column="Coding", answer_column="Feedback", fields=["Total Markz"])
    assert str(caught.value) == (
        "data.prompt_template names the column 'Total Markz', which is not in marks.xlsx (first sheet); columns are "
        "['Student ID', 'Total Marks', 'Coding', 'Feedback']; fix the name in the template (case, spaces, _ and - "
        "do not matter)")


def test_prompt_columns_come_from_the_template_without_the_question_and_context():
    from qatune.config import DataConfig
    from qatune.data.spreadsheet import prompt_columns

    plain = DataConfig(train_file="x", question_column="Coding",
                       prompt_template="Marks: {Total Marks}\nAnswer: {coding}\n{question} {{literal}}")
    assert prompt_columns(plain) == ["Total Marks"]
    chat = DataConfig(train_file="x", prompt_template="chat", user_template="{Student ID}: {question}")
    assert prompt_columns(chat) == ["Student ID"]
    assert prompt_columns(DataConfig(train_file="x")) == []


def test_spreadsheet_formulas_and_dde_payloads_stay_text(tmp_path):
    path = tmp_path / "f.csv"
    path.write_text("question,answer\n\"=cmd|' /C calc'!A0\",=1+1\n", encoding="utf-8")
    records, _ = load_records(path)
    assert (records[0].question, records[0].answer) == ("=cmd|' /C calc'!A0", "=1+1")
