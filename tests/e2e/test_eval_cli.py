"""qatune eval on a held-out file laid out unlike the training file: --set says how to read it."""

import csv
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from openpyxl import Workbook

from qatune.cli import cli
from tests.conftest import FIXTURES

pytestmark = pytest.mark.slow


@pytest.fixture
def run(serve_run, tmp_path):
    """A copy of the session's tiny run: eval writes its results into the run directory."""
    return Path(shutil.copytree(serve_run, tmp_path / "run"))


@pytest.fixture
def held_out_workbook(tmp_path):
    """Five training questions on the second sheet of a workbook, under other column names."""
    with open(FIXTURES / "faq100.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))[:5]
    book = Workbook()
    book.active.title = "Notes"
    book.active.append(["exported from the help desk"])
    book.active.append(["May"])
    sheet = book.create_sheet("Held out")
    sheet.append(["Q", "Reply"])
    for row in rows:
        sheet.append([row["question"], row["answer"]])
    book.save(tmp_path / "held.xlsx")
    return tmp_path / "held.xlsx"


def test_eval_reads_another_layout_with_set(run, held_out_workbook):
    data = str(held_out_workbook)
    plain = CliRunner().invoke(cli, ["eval", str(run), "--data", data])
    assert plain.exit_code == 1
    assert "set data.question_column" in plain.stderr and "['Notes', 'Held out']" in plain.stderr
    result = CliRunner().invoke(cli, ["eval", str(run), "--data", data, "--json", "--set", "data.sheet=Held out",
                                      "--set", "data.question_column=Q", "--set", "data.answer_column=Reply"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)
    assert metrics["num_examples"] == 5 and metrics["rows_dropped"] == 0
    assert metrics["model"] == str(run / "final") and len(metrics["model_id"]) == 16
    # The run's own saved config is untouched by --set.
    assert "question_column: question" in (run / "config.yaml").read_text()
    answers = CliRunner().invoke(cli, ["generate", str(run), "--file", data, "--output", str(run / "a.csv"),
                                       "--set", "data.sheet=1", "--set", "data.question_column=Q"])
    assert answers.exit_code == 0, answers.output
    with open(run / "a.csv", encoding="utf-8") as f:
        assert next(csv.reader(f)) == ["row", "question", "Reply", "answer"]


def test_eval_set_takes_only_how_the_file_is_read(run, held_out_workbook):
    result = CliRunner().invoke(cli, ["eval", str(run), "--data", str(held_out_workbook),
                                      "--set", "train.epochs=3"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: --set train.epochs: a trained run keeps its own saved config; --set "
                                    "may change only how the file is read: data.sheet, ")


def test_results_of_another_file_of_the_same_name_are_replaced_with_a_warning(run, tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "held.csv").write_text("question,answer\nwhat is item 1?,x\n", encoding="utf-8")
    first = CliRunner().invoke(cli, ["eval", str(run), "--data", str(tmp_path / "a" / "held.csv")])
    again = CliRunner().invoke(cli, ["eval", str(run), "--data", str(tmp_path / "a" / "held.csv")])
    other = CliRunner().invoke(cli, ["eval", str(run), "--data", str(tmp_path / "b" / "held.csv")])
    assert first.exit_code == again.exit_code == other.exit_code == 0
    assert "replacing" not in again.stderr
    assert f"replacing eval-held.json, the results of {tmp_path / 'a' / 'held.csv'}" in other.stderr
    assert json.loads((run / "eval-held.json").read_text())["data_file"] == str(tmp_path / "b" / "held.csv")
    assert (run / "predictions-held.csv").read_text(encoding="utf-8").startswith("row,question,gold,")


def test_a_wrong_set_or_column_fails_before_the_model_loads(run, held_out_workbook, monkeypatch):
    import qatune.evaluation.evaluate

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the file was read")

    monkeypatch.setattr(qatune.evaluation.evaluate, "load_run_model", no_loading)
    result = CliRunner().invoke(cli, ["eval", str(run), "--data", str(held_out_workbook), "--set", "data.sheet=1"])
    assert result.exit_code == 1 and "column 'question' not found" in result.stderr, result.output
