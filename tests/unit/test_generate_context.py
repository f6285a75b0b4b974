"""`qatune generate RUN "question"` and the passage: a run whose prompt reads a {context} needs one, a run whose
prompt does not refuses one; neither is silently dropped or invented."""

import csv

import pytest
from click.testing import CliRunner

from qatune.cli import cli
from qatune.inference.generate import answer_questions
from qatune.model.folder import load_model_folder
from tests.conftest import cli_ok
from tests.prompt_runs import context_run, score_run

QUESTION, PASSAGE = "what is item 3?", "item 3 is thing 3."


@pytest.fixture(scope="module")
def with_context(tmp_path_factory):
    return context_run(tmp_path_factory.mktemp("context"))


@pytest.fixture(scope="module")
def without_context(tmp_path_factory):
    return score_run(tmp_path_factory.mktemp("no-context"))


def generate(*args):
    return CliRunner().invoke(cli, ["generate", *map(str, args)])


def one_line_error(result, message):
    assert result.exit_code == 1, result.output
    assert result.stderr.strip() == f"error: {message}"


NEEDS = "this run's prompt uses a context ({context}): pass the passage with --context TEXT or --context-file FILE"
REFUSES = "this run's prompt has no {context}: it answers from the question alone; leave out --context/--context-file"


def test_a_prompt_with_a_context_needs_one(with_context, tmp_path):
    one_line_error(generate(with_context, QUESTION), NEEDS)
    one_line_error(generate(with_context, QUESTION, "--context", "   "), NEEDS)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n", encoding="utf-8")
    one_line_error(generate(with_context, QUESTION, "--context-file", blank), NEEDS)


def test_a_prompt_with_a_context_answers_with_the_passage_given(with_context, tmp_path):
    loaded = load_model_folder(with_context, device="cpu")
    expected = answer_questions(loaded.model, loaded.tokenizer, loaded.info, [QUESTION], [PASSAGE],
                                loaded.config.generate)[0]
    assert cli_ok("generate", with_context, QUESTION, "--context", PASSAGE).stdout == expected + "\n"
    passage = tmp_path / "passage.txt"
    passage.write_text(PASSAGE, encoding="utf-8")
    assert cli_ok("generate", with_context, QUESTION, "--context-file", passage).stdout == expected + "\n"


def test_a_prompt_without_a_context_refuses_one(without_context, tmp_path):
    one_line_error(generate(without_context, QUESTION, "--field", "score=1", "--context", PASSAGE), REFUSES)
    passage = tmp_path / "passage.txt"
    passage.write_text(PASSAGE, encoding="utf-8")
    one_line_error(generate(without_context, QUESTION, "--field", "score=1", "--context-file", passage), REFUSES)
    assert cli_ok("generate", without_context, QUESTION, "--field", "score=1").exit_code == 0


def test_a_file_without_the_context_column_is_refused(with_context, tmp_path):
    questions = tmp_path / "questions.csv"
    with open(questions, "w", encoding="utf-8", newline="") as f:
        csv.writer(f).writerows([["question"], [QUESTION]])
    result = generate(with_context, "--file", questions)
    assert result.exit_code == 1 and "context" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_a_missing_passage_or_field_is_refused_before_the_model_loads(with_context, without_context, monkeypatch):
    import qatune.inference.loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the request was checked")

    monkeypatch.setattr(qatune.inference.loading, "load_run_model", no_loading)
    one_line_error(generate(with_context, QUESTION), NEEDS)
    one_line_error(generate(without_context, QUESTION, "--context", PASSAGE), REFUSES)
    for fields in ([], ["--field", "score= "]):  # its prompt needs {score}; a blank value is none
        result = generate(without_context, QUESTION, *fields)
        assert result.exit_code == 1 and "AssertionError" not in result.output
        assert "needs the column(s) ['score']" in result.stderr


def test_a_file_without_the_passage_column_is_refused_before_the_model_loads(with_context, tmp_path, monkeypatch):
    import qatune.inference.loading

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the file was read")

    monkeypatch.setattr(qatune.inference.loading, "load_run_model", no_loading)
    questions = tmp_path / "q.csv"
    questions.write_text(f"question\n{QUESTION}\n", encoding="utf-8")
    result = generate(with_context, "--file", questions)
    assert result.exit_code == 1 and "column 'context' not found in q.csv" in result.stderr, result.output
