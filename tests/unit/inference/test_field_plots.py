"""The pictures of a grading run's answer fields: a confusion matrix per label field and predicted against gold per
number field, written by eval beside its results and by the training report for the validation rows."""

import json

from qatune.evaluation.evaluate import metrics_from, write_predictions, write_results
from qatune.inference.field_plots import draw_field_pictures, picture_path
from qatune.model.folder import ModelInfo
from qatune.train.report import write_report
from tests.unit.evaluation.test_compare import INFO, RUN, grading_records

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_picture_per_label_and_number_field_in_the_order_of_the_fields():
    metrics = metrics_from(INFO, grading_records(), RUN, 6.0, 3)
    golds = {name: [r.answer_fields[name] for r in grading_records()] for name in INFO.answer_fields}
    predicted = {name: ["1", "1", None, "0", "1"] for name in INFO.answer_fields}
    pictures = draw_field_pictures(metrics["fields"], golds, predicted)
    assert [(kind, field) for kind, field, _ in pictures] == [("scores", "score"), ("confusion", "label")]
    assert all(png.startswith(PNG) for _, _, png in pictures)


def test_a_field_name_is_made_safe_for_a_file_name(tmp_path):
    assert picture_path(tmp_path, "scores", "eval", "Total Marks/10") == tmp_path / "scores-eval-Total_Marks_10.png"


def test_eval_writes_the_pictures_beside_its_results(tmp_path):
    metrics = metrics_from(INFO, grading_records(), RUN, 6.0, 3)
    paths = write_results(tmp_path, "data/held out.csv", metrics, grading_records(), RUN, "model-", INFO)
    assert paths["confusion label"] == tmp_path / "confusion-model-held out-label.png"
    assert paths["scores score"] == tmp_path / "scores-model-held out-score.png"
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["confusion-model-held out-label.png",
                                                             "scores-model-held out-score.png"]
    assert all(path.read_bytes().startswith(PNG) for path in tmp_path.glob("*.png"))
    plain = ModelInfo(task="generative", max_length=64)
    (tmp_path / "plain").mkdir()
    assert set(write_results(tmp_path / "plain", "x.csv", metrics_from(plain, grading_records(), RUN, 6.0, 3),
                             grading_records(), RUN, info=plain)) == {"metrics", "predictions"}


def test_the_report_of_a_grading_run_shows_its_fields_on_the_last_validation(tmp_path):
    metrics = metrics_from(INFO, grading_records(), RUN, 6.0, 3)
    lines = [{"event": "train", "step": 1, "loss": 2.0, "lr": 1e-3},
             {"event": "eval", "epoch": 1, "step": 1, **metrics_from(INFO, grading_records(), ["x"] * 5, 9.0, 3)},
             {"event": "eval", "epoch": 2, "step": 2, **metrics}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    write_predictions(tmp_path / "predictions-validation.csv", grading_records(), RUN, INFO)
    report = write_report(tmp_path).read_text(encoding="utf-8")
    section = report.split("## Answer fields\n")[1].split("\n## ")[0]
    assert "On the last validation (epoch 2, step 2):" in section
    assert ("- fields: 4 of 5 answers have every field of the answer template (80.0%); a field an answer misses "
            "counts as wrong") in section
    assert "- label: accuracy 60.0%, macro F1 " in section
    assert "![score: predicted against gold](scores-validation-score.png)" in section
    assert "![label: confusion matrix](confusion-validation-label.png)" in section
    for name in ("scores-validation-score.png", "confusion-validation-label.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text(json.dumps({"event": "eval", "epoch": 1, "step": 1, **{
        k: v for k, v in metrics.items() if k not in ("parse_rate", "unparsed", "fields")}}) + "\n")
    assert "## Answer fields" not in write_report(plain).read_text() and not list(plain.glob("*.png"))
