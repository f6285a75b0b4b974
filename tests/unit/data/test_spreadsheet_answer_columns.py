"""Reading a grading sheet: several answer columns rendered into one answer, their gold values kept per column."""

import csv

import pytest

from qatune.config import load_config
from qatune.data.spreadsheet import answer_kinds, load_from_config
from qatune.errors import ConfigError, DataError

ROWS = [
    ["question", "student_answer", "score", "label", "feedback"],
    ["What is TCP?", "a protocol", "1.0", "Correct", "Good."],
    ["What is UDP?", "a datagram protocol", "0.5", "Partially correct", "Name a property.\nOne more line."],
    ["What is IP?", "", "0", "Incorrect", "No answer."],
    ["What is ARP?", "address resolution", "0.5", "", "Says what it stands for."],
    ["", "", "", "", ""],
    ["What is DNS?", "names", "1", "Correct", "Good."],
]


def sheet(tmp_path, rows=ROWS):
    path = tmp_path / "grades.csv"
    with open(path, "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows(rows)
    return path


def data_config(tmp_path, *overrides, rows=ROWS):
    return load_config(None, ["model.name_or_path=gpt2", f"data.train_file={sheet(tmp_path, rows)}",
                              "data.answer_columns=[score, label, feedback]",
                              "data.prompt_template=Q: {question}\nStudent: {student_answer}\nGrade:",
                              *overrides]).data


def test_the_answer_is_the_rendered_columns_and_the_gold_values_are_kept(tmp_path):
    data = data_config(tmp_path)
    records, report = load_from_config(data, data.train_file)
    assert [r.row for r in records] == [2, 3, 7]
    assert records[0].answers == ["Score: 1\nLabel: Correct\nFeedback: Good."]  # the column of numbers reads 1.0 as 1
    assert records[1].answer == "Score: 0.5\nLabel: Partially correct\nFeedback: Name a property.\nOne more line."
    assert records[1].answer_fields == {"score": "0.5", "label": "Partially correct",
                                        "feedback": "Name a property.\nOne more line."}
    assert records[0].fields == {"student_answer": "a protocol"}
    # A blank answer field drops its row like a blank answer, named after the column; a blank prompt column too.
    assert report.dropped == {"blank student_answer": [4], "blank label": [5], "empty row": [6]}
    assert (report.rows_read, report.kept) == (6, 3)


def test_the_answer_template_is_used_as_written(tmp_path):
    data = data_config(tmp_path, r"data.answer_template=[{label}] {score} points\n{feedback}")
    records, _ = load_from_config(data, data.train_file)
    assert records[0].answer == "[Correct] 1 points\nGood."


def test_a_missing_answer_column_is_named_with_its_key(tmp_path):
    rows = [[("Label" if name == "label" else "grade" if name == "score" else name) for name in ROWS[0]], *ROWS[1:]]
    data = data_config(tmp_path, rows=rows)
    with pytest.raises(DataError) as err:
        load_from_config(data, data.train_file)
    assert str(err.value) == ("column 'score' not found in grades.csv; columns are ['question', 'student_answer', "
                              "'grade', 'Label', 'feedback']; set data.answer_columns")


def test_questions_only_need_no_answer_columns(tmp_path):
    rows = [[name for name in ROWS[0] if name in ("question", "student_answer")]]
    rows += [[row[0], row[1] or "-"] for row in ROWS[1:] if row[0]]
    data = data_config(tmp_path, rows=rows)
    records, report = load_from_config(data, data.train_file, with_answers=False)
    assert [(r.question, r.answers, r.answer_fields) for r in records][:2] == [("What is TCP?", [], {}),
                                                                               ("What is UDP?", [], {})]
    assert report.kept == 5


def test_a_bad_template_fails_before_the_file_is_read(tmp_path):
    data = data_config(tmp_path, "data.answer_template=Score: {score}")
    with pytest.raises(ConfigError, match=r"^data.answer_template 'Score: \{score\}' cannot be parsed back"):
        load_from_config(data, tmp_path / "not-there.csv")


def test_field_kinds_are_inferred_unless_configured(tmp_path):
    data = data_config(tmp_path)
    records, _ = load_from_config(data, data.train_file)
    assert answer_kinds(data, records) == {"score": "number", "label": "text", "feedback": "text"}
    more = records * 2  # labels repeat: at most half as many distinct values as values
    assert answer_kinds(data, more) == {"score": "number", "label": "label", "feedback": "label"}
    configured = data_config(tmp_path, "data.field_kinds={feedback: text, score: label}")
    assert answer_kinds(configured, more) == {"score": "label", "label": "label", "feedback": "text"}
    assert answer_kinds(load_config(None, ["model.name_or_path=gpt2", "data.train_file=x.csv"]).data, records) is None
