"""qatune eval on a held-out file laid out unlike the training file: --set says how to read it."""

import csv
import json

import pytest
from click.testing import CliRunner
from openpyxl import Workbook
from tests.conftest import FIXTURES

from qatune.cli import cli

pytestmark = pytest.mark.slow


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


def test_eval_reads_another_layout_with_set(serve_run, held_out_workbook):
    data = str(held_out_workbook)
    plain = CliRunner().invoke(cli, ["eval", str(serve_run), "--data", data])
    assert plain.exit_code == 1
    assert "set data.question_column" in plain.stderr and "['Notes', 'Held out']" in plain.stderr
    result = CliRunner().invoke(cli, ["eval", str(serve_run), "--data", data, "--json", "--set", "data.sheet=Held out",
                                      "--set", "data.question_column=Q", "--set", "data.answer_column=Reply"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.stdout)
    assert metrics["num_examples"] == 5 and metrics["rows_dropped"] == 0
    # The run's own saved config is untouched by --set.
    assert "question_column: question" in (serve_run / "config.yaml").read_text()


def test_eval_set_takes_only_how_the_file_is_read(serve_run, held_out_workbook):
    result = CliRunner().invoke(cli, ["eval", str(serve_run), "--data", str(held_out_workbook),
                                      "--set", "train.epochs=3"])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: --set train.epochs: a run is evaluated with its own saved config; --set "
                                    "may change only how the held-out file is read: data.sheet, ")
