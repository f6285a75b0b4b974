"""Grading sheets end to end: one tiny scratch GPT-2 learns to write a tutor's score, verdict and feedback
(data.answer_columns) from examples/grading, then eval scores each field, generate grades a teacher's workbook and a
CSV (every input column kept, the fields added), and check reports the fields."""

import json
import re
from collections import Counter

import pytest

from qatune.data.grading_fields import format_value
from tests.conftest import cli_ok as invoke
from tests.grading_runs import GRADING, copy_grading_run, read_csv

pytestmark = pytest.mark.slow

FIELDS = ["score", "label", "feedback"]
LABELS = re.compile(r"\b(score|label|feedback)\s*:", re.IGNORECASE)


def feedback_went_astray(answer: str) -> bool:
    """Whether the feedback the model wrote is empty or holds a line of the template, such as a second
    "Feedback:" (a tiny model repeats itself): such an answer is not parsed whole."""
    feedback = re.split(r"\bfeedback\s*:", answer, maxsplit=1, flags=re.IGNORECASE)[1]
    return not feedback.strip() or LABELS.search(feedback) is not None


@pytest.fixture(scope="module")
def copied(grading_run, tmp_path_factory):
    return copy_grading_run(grading_run, tmp_path_factory.mktemp("grading"))


@pytest.fixture(scope="module")
def config(copied):
    return copied[0]


@pytest.fixture(scope="module")
def run_dir(copied):
    return copied[1]


@pytest.fixture(scope="module")
def evaluated(run_dir):
    result = invoke("eval", run_dir, "--data", GRADING / "eval.csv", "--json")
    return json.loads(result.stdout), result.stderr


def test_the_run_stores_the_fields_kinds(run_dir):
    info = json.loads((run_dir / "final" / "qatune.json").read_text(encoding="utf-8"))
    assert info["answer_fields"] == {"score": "number", "label": "label", "feedback": "text"}
    assert info["answer_template"] == "Score: {score}\nLabel: {label}\nFeedback: {feedback}"


def test_eval_scores_each_field_and_counts_what_did_not_parse(run_dir, evaluated):
    metrics, log = evaluated
    assert list(metrics)[:8] == ["exact_match", "f1", "loss", "perplexity", "num_examples", "parse_rate", "unparsed",
                                 "fields"]
    assert list(metrics["fields"]) == FIELDS
    assert set(metrics["fields"]["score"]) == {"mae", "rmse", "exact", "within_tolerance", "tolerance", "spearman",
                                               "scored", "decimal", "rows", "parse_rate"}
    assert set(metrics["fields"]["label"]) == {"accuracy", "macro_f1", "confusion", "rows", "parse_rate"}
    assert set(metrics["fields"]["feedback"]) == {"token_f1", "rouge_l", "bleu", "rows", "parse_rate"}
    assert metrics["num_examples"] == 60 and all(field["rows"] == 60 for field in metrics["fields"].values())
    assert metrics["fields"]["label"]["confusion"]["labels"][:3] == ["Correct", "Incorrect", "Partially correct"]
    # the run's own: a quarter of the 0.125 between the training scores 0.75 and 0.875 (the file's own scores are
    # in steps of 0.25: the tolerance is a property of the run, not of the file evaluated)
    assert metrics["fields"]["score"]["tolerance"] == 0.03125
    assert metrics["fields"]["score"]["tolerance"] == json.loads(
        (run_dir / "final" / "qatune.json").read_text())["field_specs"]["score"]["tolerance"]
    rows = read_csv(run_dir / "predictions-eval.csv")
    assert rows[0] == ["row", "question", "gold", "prediction", "em", "f1", "parsed", "score (gold)",
                       "score (predicted)", "label (gold)", "label (predicted)", "feedback (gold)",
                       "feedback (predicted)"]
    parsed = [row[6] for row in rows[1:]]
    assert len(parsed) == 60 and set(parsed) <= {"true", "false"}
    assert parsed.count("false") == metrics["unparsed"]
    assert metrics["parse_rate"] == pytest.approx(100 * parsed.count("true") / 60)
    # the verdict and the score are chosen from the values training saw: every answer has them; an answer is
    # parsed whole unless its generated feedback went astray, and then the feedback is left empty
    astray = [feedback_went_astray(row[3]) for row in rows[1:]]
    assert parsed == ["false" if gone else "true" for gone in astray]
    assert {row[10] for row in rows[1:]} <= {"Correct", "Incorrect", "Partially correct"}
    train_scores = {row[4] for row in read_csv(GRADING / "train.csv")[1:]}
    assert {row[8] for row in rows[1:]} <= {format_value(float(s)) for s in train_scores} | train_scores
    assert [bool(row[12]) for row in rows[1:]] == [not gone for gone in astray]  # the feedback, generated
    feedback_rate = pytest.approx(100 * astray.count(False) / 60)
    assert [metrics["fields"][name]["parse_rate"] for name in FIELDS] == [100.0, 100.0, feedback_rate]
    golds = read_csv(GRADING / "eval.csv")
    assert [row[9] for row in rows[1:]] == [row[5] for row in golds[1:]]  # the gold labels, row by row
    assert json.loads((run_dir / "eval-eval.json").read_text())["fields"] == metrics["fields"]
    assert "fields: " not in log  # the fields' summary is printed on stdout without --json (test_compare_cli.py)


def test_generate_grades_a_workbook_and_keeps_its_other_sheets(run_dir, tmp_path):
    from openpyxl import load_workbook

    result = invoke("generate", run_dir, "--file", GRADING / "answers.xlsx", "--out", tmp_path / "graded.xlsx")
    assert result.stdout.strip() == str(tmp_path / "graded.xlsx")
    given, graded = load_workbook(GRADING / "answers.xlsx"), load_workbook(tmp_path / "graded.xlsx")
    assert graded.sheetnames == ["answers", "notes"]
    assert graded["notes"]["A1"].value == given["notes"]["A1"].value
    before = [list(row) for row in given["answers"].iter_rows(values_only=True)]
    after = [list(row) for row in graded["answers"].iter_rows(values_only=True)]
    assert after[0] == ["Student", "question_id", "question", "reference_answer", "student_answer", "score", "label",
                        "feedback", "parsed", "model output"]
    assert len(after) == 11 and [row[:5] for row in after] == before  # every row and cell, in its order
    # chosen fields: every answer has a verdict and a score; its feedback unless the model's went astray
    for row in after[1:]:
        assert (row[8], row[7] is None) == (("partly", True) if row[9] and feedback_went_astray(row[9]) else
                                            ("yes", False)), row
    assert all(row[6] in ("Correct", "Incorrect", "Partially correct") for row in after[1:])
    assert all(isinstance(row[5], int | float) for row in after[1:])  # the score written as a number
    partly = sum(row[8] == "partly" for row in after[1:])
    assert f"graded 10 rows: {partly} answers do not have every field of the answer template" in result.stderr


def test_generate_grades_a_csv_as_a_csv(run_dir, evaluated, tmp_path):
    invoke("generate", run_dir, "--file", GRADING / "eval.csv", "--output", tmp_path / "graded.csv")
    given, graded = read_csv(GRADING / "eval.csv"), read_csv(tmp_path / "graded.csv")
    # eval.csv has its own score, label and feedback columns: the model's are named apart from them.
    assert graded[0] == [*given[0], "score (model)", "label (model)", "feedback (model)", "parsed", "model output"]
    assert [row[:7] for row in graded] == given
    predictions = read_csv(run_dir / "predictions-eval.csv")[1:]
    # The same answers as eval's: parsed where eval parsed them, into the same values.
    assert [row[10] == "yes" for row in graded[1:]] == [row[6] == "true" for row in predictions]
    assert [row[8] for row in graded[1:]] == [row[10] for row in predictions]
    assert [row[11] for row in graded[1:]] == [row[3] if row[6] == "false" else "" for row in predictions]


def test_check_reports_the_fields(config):
    report = json.loads(invoke("check", "--config", config, "--json").stdout)
    train, held = read_csv(GRADING / "train.csv"), read_csv(GRADING / "eval.csv")
    fields = report["fields"]
    assert list(fields) == ["template", "columns", "answer_tokens"]
    assert list(fields["columns"]) == FIELDS
    assert {name: (c["kind"], c["kind_from"]) for name, c in fields["columns"].items()} == {
        "score": ("number", "inferred"), "label": ("label", "inferred"), "feedback": ("text", "inferred")}
    label, score = fields["columns"]["label"], fields["columns"]["score"]
    assert label["counts"] == dict(Counter(row[5] for row in train[1:]))
    assert sum(label["counts"].values()) == 240 and len(label["counts"]) == 3
    assert score["counts"] == dict(Counter(format_value(float(row[4])) for row in train[1:]))
    assert label["eval_only"] == sorted({row[5] for row in held[1:]} - {row[5] for row in train[1:]})
    train_scores = [float(row[4]) for row in train[1:]]
    assert score["range"] == [min(train_scores), max(train_scores)]
    low, high = score["range"]
    assert score["out_of_range_rows"] == [i for i, row in enumerate(held[1:], start=2)
                                         if not low <= float(row[4]) <= high]
    assert fields["columns"]["feedback"]["counts"] is None
    tokens = fields["answer_tokens"]
    assert 0 < tokens["min"] <= tokens["median"] <= tokens["max"]
    # max_new_tokens 64 cuts the longest feedback: check says so, with the number that fits.
    cut = [f for f in report["findings"] if f["code"] == "answers-cut"]
    assert len(cut) == 1 and f"at least {tokens['max'] + 1}" in cut[0]["message"]
    human = invoke("check", "--config", config, "--set", "data.field_kinds={feedback: label}").stdout
    assert "Answer fields\n" in human
    assert "  label: label (inferred), 3 distinct values\n" in human
    assert "  feedback: label (configured), " in human
