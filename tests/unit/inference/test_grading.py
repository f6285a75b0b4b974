"""A grading run's answers parsed back into their columns: eval's metrics and predictions file, and the graded sheet
generate writes (every input column and row kept, the fields added, unparsed answers shown)."""

import csv
import json

import pytest

from qatune.config import load_config
from qatune.data.grading_fields import FieldSpec, field_spec
from qatune.data.spreadsheet import QARecord
from qatune.evaluation.evaluate import field_summary, metrics_from, write_predictions
from qatune.evaluation.graded_sheets import write_graded
from qatune.inference.generate import run_answer_template
from qatune.model.folder import ModelInfo

INFO = ModelInfo(task="generative", max_length=64, answer_fields={"score": "number", "label": "label",
                                                                  "feedback": "text"},
                 answer_template="Score: {score}\nLabel: {label}\nFeedback: {feedback}")
GOLDS = [{"score": "1", "label": "Correct", "feedback": "Good."},
         {"score": "0.5", "label": "Partially correct", "feedback": "Say why."},
         {"score": "0", "label": "Incorrect", "feedback": "No."}]
PREDICTIONS = ["Score: 1\nLabel: Correct\nFeedback: Good.",
               "Score: 1\nLabel: correct\nFeedback: Say more why.",
               "Score: 0\nLabel: Inc"]  # cut inside its label: the score and the cut label, no feedback


def records():
    template = run_answer_template(INFO)
    return [QARecord(question=f"q{i}", answers=[template.render(gold)], row=i + 2, answer_fields=gold)
            for i, gold in enumerate(GOLDS)]


def test_eval_metrics_add_the_fields_to_exact_match_and_f1():
    metrics = metrics_from(INFO, records(), PREDICTIONS, 6.0, 3)
    assert list(metrics) == ["exact_match", "f1", "loss", "perplexity", "num_examples", "parse_rate", "unparsed",
                             "fields"]
    assert metrics["exact_match"] == pytest.approx(100 / 3) and metrics["loss"] == 2.0
    assert (metrics["parse_rate"], metrics["unparsed"]) == (pytest.approx(200 / 3), 1)
    assert list(metrics["fields"]) == ["score", "label", "feedback"]
    score, label = metrics["fields"]["score"], metrics["fields"]["label"]
    assert (score["mae"], score["exact"], score["scored"], score["rows"]) == (pytest.approx(1 / 6),
                                                                              pytest.approx(200 / 3), 3, 3)
    assert label["accuracy"] == pytest.approx(100 / 3)  # "correct" is not "Partially correct"; "Inc" is wrong
    assert label["confusion"]["labels"] == ["Correct", "Incorrect", "Partially correct", "Inc"]
    assert set(metrics["fields"]["feedback"]) == {"token_f1", "rouge_l", "bleu", "rows", "parse_rate"}
    assert [metrics["fields"][name]["parse_rate"] for name in GOLDS[0]] == [100.0, 100.0, pytest.approx(200 / 3)]
    json.dumps(metrics)  # eval-NAME.json holds it as it is
    plain = ModelInfo(task="generative", max_length=64)
    assert list(metrics_from(plain, records(), PREDICTIONS, 6.0, 3)) == list(metrics)[:5]


def test_the_summary_has_a_line_per_field():
    lines = field_summary(metrics_from(INFO, records(), PREDICTIONS, 6.0, 3))
    assert lines[0] == ("fields: 2 of 3 answers have every field of the answer template (66.7%); a field an answer "
                        "misses counts as wrong")
    assert lines[1] == "  score: MAE 0.167, within 0.125 66.7%, exact 66.7%, Spearman 0.866 (3 rows)"
    assert lines[2] == "  label: accuracy 33.3%, macro F1 22.2 (3 rows)"
    assert lines[3].startswith("  feedback: token F1 ") and lines[3].endswith(" (3 rows, found in 66.7%)")
    assert field_summary({"exact_match": 0.0, "num_examples": 3}) == []


def test_predictions_file_has_each_field_gold_and_predicted_and_whether_it_parsed(tmp_path):
    write_predictions(tmp_path / "p.csv", records(), PREDICTIONS, INFO)
    with open(tmp_path / "p.csv", encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["row", "question", "gold", "prediction", "em", "f1", "parsed", "score (gold)",
                       "score (predicted)", "label (gold)", "label (predicted)", "feedback (gold)",
                       "feedback (predicted)"]
    assert rows[2][6:] == ["true", "0.5", "1", "Partially correct", "correct", "Say why.", "Say more why."]
    assert rows[3][3] == "Score: 0\nLabel: Inc" and rows[3][6:] == ["false", "0", "0", "Incorrect", "Inc", "No.", ""]
    write_predictions(tmp_path / "plain.csv", records(), PREDICTIONS)
    assert (tmp_path / "plain.csv").read_text().splitlines()[0] == "row,question,gold,prediction,em,f1"


SHEET = [["Student", "question", "score", "notes"], ["S1", "q0", "", "x"], ["S2", "", "", "blank question"],
         ["S3", "q2", "", "=1+1"], ["S4", "q3", "", ""]]
SPECS = {"score": field_spec("number", ["1", "0,5", "0"]), "label": field_spec("label", ["Correct", "Incorrect"]),
         "feedback": field_spec("text", [])}


def data(tmp_path, path):
    return load_config(None, ["model.name_or_path=gpt2", f"data.train_file={path}",
                              "data.answer_columns=[score, label, feedback]"]).data


def test_a_graded_csv_keeps_every_column_and_row_and_adds_the_fields(tmp_path):
    path = tmp_path / "in.csv"
    with open(path, "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows(SHEET)
    write_graded(tmp_path / "out.csv", path, data(tmp_path, path), run_answer_template(INFO), SPECS,
                 {2: PREDICTIONS[1], 4: PREDICTIONS[2], 5: "nonsense"})
    with open(tmp_path / "out.csv", encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["Student", "question", "score", "notes", "score (model)", "label", "feedback", "parsed",
                       "model output"]
    assert rows[1] == ["S1", "q0", "", "x", "1", "Correct", "Say more why.", "yes", ""]  # the class it names
    assert rows[2] == ["S2", "", "", "blank question", "", "", "", "", ""]  # a row nobody answered stays
    assert rows[3] == ["S3", "q2", "", "=1+1", "0", "Inc", "", "partly", "Score: 0\nLabel: Inc"]
    assert rows[4] == ["S4", "q3", "", "", "", "", "", "no", "nonsense"]


def test_a_graded_workbook_is_a_copy_with_its_other_sheets(tmp_path):
    from openpyxl import Workbook, load_workbook

    book = Workbook()
    book.active.title = "notes"
    book.active["A1"] = "read me"
    answers = book.create_sheet("answers")
    for line in SHEET:
        answers.append(line)
    book.save(tmp_path / "in.xlsx")
    config = data(tmp_path, tmp_path / "in.xlsx").model_copy(update={"sheet": "answers"})
    write_graded(tmp_path / "out.xlsx", tmp_path / "in.xlsx", config, run_answer_template(INFO),
                 SPECS, {2: "Score: 2,5\nLabel: Correct\nFeedback: =SUM(A1)", 4: "nonsense"})
    graded = load_workbook(tmp_path / "out.xlsx")
    assert graded.sheetnames == ["notes", "answers"] and graded["notes"]["A1"].value == "read me"
    rows = [list(row) for row in graded["answers"].iter_rows(values_only=True)]
    assert rows[0] == ["Student", "question", "score", "notes", "score (model)", "label", "feedback", "parsed",
                       "model output"]
    assert rows[1] == ["S1", "q0", None, "x", 2.5, "Correct", "=SUM(A1)", "yes", None]  # a number (decimal comma)
    assert graded["answers"]["G2"].data_type == "s"
    assert rows[2] == ["S2", None, None, "blank question", None, None, None, None, None]
    assert rows[3] == ["S3", "q2", None, "=1+1", None, None, None, "no", "nonsense"]


def test_a_runs_field_specs_decide_the_decimal_separator_and_the_tolerance():
    specs = {"score": FieldSpec("number", ("0", "1,500"), (1, 1), ",", 0.5, 0.0, 1.5).to_json(),
             "label": field_spec("label", ["Correct", "Incorrect"]).to_json(), "feedback": FieldSpec("text").to_json()}
    info = ModelInfo(task="generative", max_length=64, answer_fields=INFO.answer_fields,
                     answer_template=INFO.answer_template, field_specs=specs)
    golds = [{"score": "1,500", "label": "Correct", "feedback": "Good."}, {"score": "0", "label": "Incorrect",
                                                                          "feedback": "No."}]
    template = run_answer_template(info)
    rows = [QARecord(question="q", answers=[template.render(g)], row=2, answer_fields=g) for g in golds]
    metrics = metrics_from(info, rows, ["Score: 1,5\nLabel: correct.\nFeedback: Good.",
                                        "Score: 0,4\nLabel: Incorrect\nFeedback: No."], 1.0, 1)
    score = metrics["fields"]["score"]
    assert (score["mae"], score["tolerance"], score["within_tolerance"], score["decimal"]) == (
        pytest.approx(0.2), 0.5, 100.0, ",")  # "1,500" is 1.5 in this column, and 0.4 is within 0.5 of 0
    assert metrics["fields"]["label"]["accuracy"] == 100.0  # "correct." is "Correct"
