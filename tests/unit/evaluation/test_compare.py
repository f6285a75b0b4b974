"""Two models' answers compared row by row on hand-made cases: which rows flipped and in what order, what decides
a row, the deltas, and the markdown and CSV files."""

import csv
import io

import pytest

from qatune.data.spreadsheet import QARecord
from qatune.evaluation.compare import (
    RIGHT_TO_WRONG,
    SAME,
    WRONG_TO_RIGHT,
    Judge,
    choose_judge,
    compare,
    field_right,
)
from qatune.evaluation.compare_report import render_csv, render_markdown, summary_lines
from qatune.evaluation.evaluate import metrics_from
from qatune.inference.generate import run_answer_template
from qatune.model.folder import ModelInfo

INFO = ModelInfo(task="generative", max_length=64, answer_fields={"score": "number", "label": "label",
                                                                  "feedback": "text"},
                 answer_template="Score: {score}\nLabel: {label}\nFeedback: {feedback}")
GOLDS = [{"score": "1", "label": "Correct", "feedback": "Good."},
         {"score": "0.5", "label": "Partially correct", "feedback": "Say why."},
         {"score": "0", "label": "Incorrect", "feedback": "No."},
         {"score": "1", "label": "Correct", "feedback": "Fine work."},
         {"score": "0", "label": "Incorrect", "feedback": "Wrong unit."}]
RUN = ["Score: 1\nLabel: Correct\nFeedback: Good.",                     # row 2: right
       "Score: 1\nLabel: correct\nFeedback: Say more why.",             # row 3: not "Partially correct"
       "Score: 0\nLabel: Inc",                                          # row 4: stopped early, no feedback
       "Score: 1\nLabel: Correct\nFeedback: Fine.",                     # row 5: right
       "Score: 0\nLabel: incorrect\nFeedback: Wrong."]                  # row 6: right (case is ignored)
OTHER = ["Score: 0\nLabel: Incorrect\nFeedback: No.",                   # row 2: wrong
         "Score: 0.5\nLabel: Partially correct\nFeedback: Say why.",    # row 3: right
         "Score: 0\nLabel: Incorrect\nFeedback: No.",                   # row 4: right
         "I think it is correct",                                       # row 5: does not parse
         "Score: 1\nLabel: Correct\nFeedback: Good."]                   # row 6: wrong


def grading_records():
    template = run_answer_template(INFO)
    return [QARecord(question=f"q{i}", answers=[template.render(gold)], row=i + 2, answer_fields=gold)
            for i, gold in enumerate(GOLDS)]


def graded():
    records = grading_records()
    return compare(records, RUN, OTHER, metrics_from(INFO, records, RUN, 4.0, 4),
                            metrics_from(INFO, records, OTHER, 8.0, 4), INFO.answer_fields, run_answer_template(INFO))


def test_a_grading_comparison_lists_the_flips_in_order_decided_by_the_first_label_field():
    comparison = graded()
    assert comparison.judge == Judge("label", "label", 0.0)
    assert [row.record.row for row in comparison.flips(RIGHT_TO_WRONG)] == [3, 4]
    assert [row.record.row for row in comparison.flips(WRONG_TO_RIGHT)] == [2, 5, 6]
    assert comparison.flips(SAME) == []
    row4 = comparison.rows[2]
    assert row4.run.parsed == {"score": "0", "label": "Inc"} and not row4.run.whole()  # the fields before the cut
    assert row4.run.fields == {"score": True, "label": False, "feedback": False}
    assert row4.other.fields == {"score": True, "label": True, "feedback": True}
    assert comparison.rows[1].run.fields == {"score": False, "label": False, "feedback": True}  # F1 of 0.8 >= 50
    summary = comparison.summary()
    assert summary["counts"] == {"rows": 5, "right": {"run": 3, "other": 2}, "right_to_wrong": 2,
                                 "wrong_to_right": 3, "same": 0, "f1_drops": None,
                                 "unparsed": {"run": 1, "other": 1}}
    assert summary["decided_by"] == {"field": "label", "kind": "label", "tolerance": None,
                                     "rule": "its label is the gold label (ignoring case, spacing and punctuation)"}


def test_a_grading_comparison_gives_each_fields_main_metrics_for_both_and_the_difference():
    deltas = graded().deltas
    assert list(deltas) == ["parse_rate", "fields"]
    assert deltas["parse_rate"] == {"run": 80.0, "other": 80.0, "delta": 0.0}
    assert list(deltas["fields"]) == ["score", "label", "feedback"]
    assert list(deltas["fields"]["score"]) == ["mae", "within_tolerance", "exact", "spearman"]
    assert list(deltas["fields"]["label"]) == ["accuracy", "macro_f1"]
    assert list(deltas["fields"]["feedback"]) == ["token_f1", "rouge_l", "bleu"]
    # scores within 0.125 (a quarter of the 0.5 between the gold scores): run rows 2, 4 (cut after its score), 5, 6;
    # other rows 3, 4
    assert deltas["fields"]["score"]["within_tolerance"] == pytest.approx({"run": 80.0, "other": 40.0, "delta": 40.0})
    assert deltas["fields"]["score"]["mae"] == pytest.approx({"run": 0.1, "other": 0.5, "delta": -0.4})
    assert deltas["fields"]["label"]["accuracy"] == pytest.approx({"run": 60.0, "other": 40.0, "delta": 20.0})


def test_the_deciding_field_is_the_first_label_else_number_else_text_field():
    assert choose_judge({"feedback": "text", "score": "number", "label": "label"}) == Judge("label", "label")
    assert choose_judge({"feedback": "text", "score": "number"}, {"score": 0.25}) == Judge("score", "number", 0.25)
    assert choose_judge({"feedback": "text", "note": "text"}) == Judge("feedback", "text")
    assert choose_judge(None) == Judge() and Judge().describe() == "its answer is an exact match of a gold answer"


def test_a_number_field_is_right_within_its_tolerance_and_an_unparsed_one_is_wrong():
    assert field_right("number", "1.1", "0.85", 0.25) is True  # not missed by float rounding
    assert field_right("number", "1.2", "0.85", 0.25) is False
    assert field_right("number", "2.5 points", "2,5") is True
    assert field_right("number", None, "1") is False and field_right("number", "1", "n/a") is None
    assert field_right("label", " correct ", "Correct") is True and field_right("label", None, "Correct") is False
    assert field_right("text", "the answer is good", "good answer") is True  # token F1 2/3
    assert field_right("text", "no", "good answer") is False and field_right("text", "x", " ") is None


def test_a_row_decided_by_a_number_field_uses_the_tolerance_of_the_metrics():
    info = ModelInfo(task="generative", max_length=64, answer_fields={"score": "number", "feedback": "text"},
                     answer_template="Score: {score}\nFeedback: {feedback}")
    template = run_answer_template(info)
    golds = [{"score": "1", "feedback": "a"}, {"score": "2", "feedback": "b"}]
    records = [QARecord(question="q", answers=[template.render(g)], row=i + 2, answer_fields=g)
               for i, g in enumerate(golds)]
    ours, theirs = ["Score: 1.2\nFeedback: a", "Score: 2\nFeedback: b"], ["Score: 1\nFeedback: a", "Score: 3"]
    comparison = compare(records, ours, theirs, metrics_from(info, records, ours, 0.0, 0),
                         metrics_from(info, records, theirs, 0.0, 0), info.answer_fields, template)
    assert comparison.judge == Judge("score", "number", 0.25)  # a quarter of the gap between 1 and 2
    assert [row.change for row in comparison.rows] == [SAME, WRONG_TO_RIGHT]
    assert "its score is within 0.25 of the gold value" in render_markdown(comparison, "r", "o", "x.csv")


ANSWERS = [("paris", "Paris", "london"),                    # row 2: wrong -> right
           ("blue whale", "whale", "blue whale"),           # row 3: right -> wrong
           ("new york city", "york", "new york"),           # row 4: F1 50 after 80
           ("red", "red", "red"),                           # row 5: right on both
           ("the big dog", "cat", "big cat"),               # row 6: F1 0 after 50
           ("seven", "eight", "six")]                       # row 7: wrong on both, F1 0 on both


def answered():
    plain = ModelInfo(task="generative", max_length=64)
    records = [QARecord(question=f"q{i}", answers=[gold], row=i + 2) for i, (gold, _, _) in enumerate(ANSWERS)]
    ours, theirs = [a for _, a, _ in ANSWERS], [b for _, _, b in ANSWERS]
    return compare(records, ours, theirs, metrics_from(plain, records, ours, 6.0, 6),
                   metrics_from(plain, records, theirs, 12.0, 6))


def test_a_comparison_of_single_answers_flips_on_exact_match_and_lists_f1_drops_largest_first():
    comparison = answered()
    assert comparison.judge == Judge() and comparison.fields == ()
    assert [row.record.row for row in comparison.flips(RIGHT_TO_WRONG)] == [3]
    assert [row.record.row for row in comparison.flips(WRONG_TO_RIGHT)] == [2]
    assert [row.record.row for row in comparison.flips(SAME)] == [4, 5, 6, 7]
    assert [(row.record.row, row.run.f1, row.other.f1) for row in comparison.f1_drops()] == [(6, 0.0, 50.0),
                                                                                           (4, 50.0, 80.0)]
    assert list(comparison.deltas) == ["exact_match", "f1", "loss"]
    assert comparison.deltas["exact_match"] == pytest.approx({"run": 200 / 6, "other": 200 / 6, "delta": 0.0})
    assert comparison.deltas["loss"] == {"run": 1.0, "other": 2.0, "delta": -1.0}
    counts = comparison.summary()["counts"]
    assert (counts["right"], counts["f1_drops"], counts["unparsed"]) == ({"run": 2, "other": 2}, 2, None)


def test_the_markdown_names_both_models_and_shows_right_to_wrong_before_wrong_to_right():
    comparison = graded()
    text = render_markdown(comparison, "runs/grading/final", "gpt2 (base, not fine-tuned)", "eval.csv",
                           ["the two models are asked with different prompts"])
    assert text.startswith("# Comparison on eval.csv\n")
    assert "- **run**: runs/grading/final\n- **other**: gpt2 (base, not fine-tuned)\n" in text
    assert ("- a row is right when its label is the gold label (ignoring case, spacing and punctuation) (the first "
            "label field decides)") in text
    assert "- the two models are asked with different prompts" in text
    assert "| label: accuracy (%) | 60.0 | 40.0 | +20.0 |" in text
    assert "| score: MAE (lower is better) | 0.100 | 0.500 | -0.400 |" in text
    worse, better = text.index("## Right -> wrong (2)"), text.index("## Wrong -> right (3)")
    assert worse < better and "## F1 fell" not in text
    tables = [[line.split(" | ")[0].strip("| ") for line in part.splitlines() if line.startswith("| ")][1:]
              for part in (text[worse:better], text[better:])]
    assert tables == [["3", "4"], ["2", "5", "6"]]
    row4 = next(line for line in text.splitlines() if line.startswith("| 4 |"))
    assert row4 == ("| 4 | q2 | Score: 0<br>Label: Incorrect<br>Feedback: No. | Score: 0<br>Label: Inc *(misses "
                    "fields of the answer template)* | Score: 0<br>Label: Incorrect<br>Feedback: No. |")
    plain = render_markdown(answered(), "a", "b", "faq.csv")
    assert "## F1 fell, exact match unchanged (2)" in plain and "| exact match | 33.3 | 33.3 | +0.0 |" in plain
    assert "| 6 | q4 | the big dog | cat | big cat | 0 | 50 |" in plain


def test_the_csv_has_a_line_per_row_with_both_answers_each_fields_rightness_and_the_change():
    comparison = graded()
    rows = list(csv.reader(io.StringIO(render_csv(comparison))))
    assert rows[0] == ["row", "question", "gold", "answer (run)", "answer (other)", "em (run)", "em (other)",
                       "f1 (run)", "f1 (other)", "parsed (run)", "parsed (other)",
                       "score (gold)", "score (run)", "score (other)", "score right (run)", "score right (other)",
                       "label (gold)", "label (run)", "label (other)", "label right (run)", "label right (other)",
                       "feedback (gold)", "feedback (run)", "feedback (other)", "feedback right (run)",
                       "feedback right (other)", "right (run)", "right (other)", "change"]
    assert [row[0] for row in rows[1:]] == ["2", "3", "4", "5", "6"]
    assert [row[-1] for row in rows[1:]] == ["wrong->right", "right->wrong", "right->wrong", "wrong->right",
                                             "wrong->right"]
    assert rows[3][3:5] == [RUN[2], OTHER[2]]
    assert rows[3][9:] == ["false", "true", "0", "0", "0", "true", "true", "Incorrect", "Inc", "Incorrect", "false",
                           "true", "No.", "", "No.", "false", "true", "false", "true", "right->wrong"]
    plain = list(csv.reader(io.StringIO(render_csv(answered()))))
    assert plain[0] == ["row", "question", "gold", "answer (run)", "answer (other)", "em (run)", "em (other)",
                        "f1 (run)", "f1 (other)", "right (run)", "right (other)", "change"]
    assert plain[1] == ["2", "q0", "paris", "Paris", "london", "100", "0", "100.0", "0.0", "true", "false",
                        "wrong->right"]


def test_the_printed_summary_says_whom_and_how_much():
    summary = {"other": "gpt2 (base, not fine-tuned)", **answered().summary()}
    assert summary_lines(summary) == [
        "compared with gpt2 (base, not fine-tuned): a row is right when its answer is an exact match of a gold answer",
        "  right: run 2 of 6, other 2; right -> wrong 1, wrong -> right 1; F1 fell on 2 rows of unchanged exact match",
        "  exact match: run 33.3, other 33.3 (+0.0)",
        "  F1: run 52.8, other 55.0 (-2.2)",
        "  loss (lower is better): run 1.000, other 2.000 (-1.000)",
    ]
