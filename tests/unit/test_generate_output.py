"""`qatune generate --file QUESTIONS --output ANSWERS`: the answers file is in the format its suffix names, keeps
the input's other columns, is written atomically, and never replaces the questions file."""

import csv
import io
import json

import pytest
from click.testing import CliRunner

from qatune.cli import cli
from qatune.inference.generate import answer_questions
from qatune.model.folder import load_model_folder
from tests.conftest import cli_ok
from tests.prompt_runs import score_run

QUESTIONS = [  # id, question, score (the prompt's column), answer (a gold answer), notes
    ["7", "what is item 1?", "1", "thing 1", "=1+1"],
    ["8", "what is item 2?", "2", "thing 2", ""],
]
COLUMNS = ["row", "question", "id", "score", "answer (input)", "notes", "answer"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return score_run(tmp_path_factory.mktemp("output"))


@pytest.fixture(scope="module")
def expected(run):
    loaded = load_model_folder(run, device="cpu")
    return answer_questions(loaded.model, loaded.tokenizer, loaded.info, [q[1] for q in QUESTIONS],
                            generate=loaded.config.generate, fields=[{"score": q[2]} for q in QUESTIONS])


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "questions.csv"
    with open(path, "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([["id", "question", "score", "answer", "notes"], *QUESTIONS])
    return path


def read_answers(path):
    """The answers file read back by the reader of the format its suffix names, every cell as text."""
    suffix = path.suffix.lower()
    if suffix == ".xlsx":
        from openpyxl import load_workbook

        sheet = load_workbook(path).active
        lines = [[cell.value for cell in line] for line in sheet.iter_rows()]
        records = [dict(zip(lines[0], line)) for line in lines[1:]]
    elif suffix == ".json":
        records = json.loads(path.read_text(encoding="utf-8"))
    elif suffix == ".jsonl":
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    else:
        text = path.read_text(encoding="utf-8")
        assert ("\t" in text.splitlines()[0]) == (suffix == ".tsv")
        records = list(csv.DictReader(io.StringIO(text), delimiter="\t" if suffix == ".tsv" else ","))
    return [{key: "" if value is None else str(value) for key, value in record.items()} for record in records]


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".xlsx", ".json", ".jsonl", ".JSON"])
def test_the_answers_file_has_the_format_its_suffix_names_and_the_input_columns(run, expected, questions, tmp_path,
                                                                                suffix):
    out = tmp_path / "out" / f"answers{suffix}"
    out.parent.mkdir()
    out.write_text("an older answers file", encoding="utf-8")
    result = cli_ok("generate", run, "--file", questions, "--output", out)
    assert result.stdout.strip() == str(out)
    rows = read_answers(out)
    assert list(rows[0]) == COLUMNS
    wanted = [[str(row), question, id_, *rest, answer]
              for row, (id_, question, *rest), answer in zip([2, 3], QUESTIONS, expected)]
    assert [list(r.values()) for r in rows] == wanted
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # replaced, no temporary file left


def test_an_answer_that_looks_like_a_formula_stays_text_in_xlsx(run, questions, tmp_path):
    from openpyxl import load_workbook

    cli_ok("generate", run, "--file", questions, "--output", tmp_path / "answers.xlsx")
    sheet = load_workbook(tmp_path / "answers.xlsx").active
    notes = sheet.cell(row=2, column=COLUMNS.index("notes") + 1)
    assert notes.value == "=1+1" and notes.data_type == "s"


def one_line_error(result, says):
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: ") and says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.parametrize("name", ["answers.txt", "answers.xls", "answers"])
def test_an_unknown_suffix_is_refused_before_any_work(questions, tmp_path, name):
    # The run does not exist: the suffix is checked before the model is looked for.
    result = CliRunner().invoke(cli, ["generate", str(tmp_path / "no-run"), "--file", str(questions),
                                      "--output", str(tmp_path / name)])
    one_line_error(result, "cannot write")
    assert ".csv, .tsv, .xlsx, .json, .jsonl" in result.stderr
    assert not (tmp_path / name).exists()


def test_the_questions_file_is_never_overwritten(run, questions, tmp_path):
    before = questions.read_bytes()
    (tmp_path / "sub").mkdir()
    for spelled in (questions, tmp_path / "sub" / ".." / "questions.csv"):
        result = CliRunner().invoke(cli, ["generate", str(run), "--file", str(questions), "--output", str(spelled)])
        one_line_error(result, "would overwrite the questions file")
    assert questions.read_bytes() == before


def test_without_output_the_answers_go_to_a_csv_in_the_run(run, expected, questions):
    result = cli_ok("generate", run, "--file", questions)
    assert result.stdout.strip() == str(run / "answers-questions.csv")
    assert [r["answer"] for r in read_answers(run / "answers-questions.csv")] == expected


@pytest.mark.parametrize("flags", [["--context", "a passage"], ["--field", "score=1"], ["--context-file", "p.txt"]])
def test_single_question_flags_are_refused_with_file(questions, tmp_path, flags):
    result = CliRunner().invoke(cli, ["generate", str(tmp_path / "no-run"), "--file", str(questions), *flags])
    one_line_error(result, f"{flags[0]} goes with a single QUESTION; with --file, passages and other columns come "
                           "from the file's columns")
