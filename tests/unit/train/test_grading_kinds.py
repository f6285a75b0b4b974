"""A grading run stores its answer columns' kinds (configured or inferred from the training rows) and its answer
template in qatune.json, where eval, generate and serve read them."""

import csv
import json

from qatune.config import load_config
from qatune.model.folder import ModelInfo
from qatune.train import prepare, train
from tests.conftest import TINY_MODEL

ROWS = [(f"question {i}", f"{i % 3}.5", ["Correct", "Incorrect"][i % 2], f"feedback number {i}") for i in range(12)]


def grading_config(tmp_path, *overrides):
    path = tmp_path / "grades.csv"
    with open(path, "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([("question", "score", "label", "feedback"), *ROWS])
    return load_config(None, [f"data.train_file={path}", *TINY_MODEL, "train.epochs=1",
                              "data.answer_columns=[score, label, feedback]", *overrides])


def test_kinds_are_inferred_from_the_training_rows_and_saved_in_qatune_json(tmp_path):
    run = train(grading_config(tmp_path), output_dir=tmp_path / "run", progress=False)
    saved = json.loads((run / "final" / "qatune.json").read_text(encoding="utf-8"))
    assert saved["answer_fields"] == {"score": "number", "label": "label", "feedback": "text"}
    assert list(saved["answer_fields"]) == ["score", "label", "feedback"]  # the answer's order
    assert saved["answer_template"] == "Score: {score}\nLabel: {label}\nFeedback: {feedback}"
    assert ModelInfo.load(run / "final").answer_fields == saved["answer_fields"]


def test_configured_kinds_win_and_a_run_without_answer_columns_has_none(tmp_path):
    config = grading_config(tmp_path, "data.field_kinds={score: label}",
                            r"data.answer_template=<{label}> {score}\n{feedback}")
    info = prepare(config, with_model=False).info
    assert info.answer_fields == {"score": "label", "label": "label", "feedback": "text"}
    assert info.answer_template == "<{label}> {score}\n{feedback}"
    plain = prepare(grading_config(tmp_path, "data.answer_columns=null", "data.answer_column=label"),
                    with_model=False).info
    assert (plain.answer_fields, plain.answer_template) == (None, None)
