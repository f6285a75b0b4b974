"""Answers for questions: batched as alone, the inference precision, `qatune generate` with a passage or a
prompt's other columns, and `--file QUESTIONS --output ANSWERS` in the format its suffix names (atomically,
never over the questions file)."""

import csv
import io
import json

import pytest
import torch
from click.testing import CliRunner

from qatune.cli import cli
from qatune.kinds import answer_questions
from qatune.model.folder import ModelInfo, load_model_folder
from tests.conftest import cli_ok
from tests.prompt_runs import context_run, score_run


def test_batched_left_padded_generation_equals_one_at_a_time(scratch_gpt2):
    model, tokenizer = scratch_gpt2
    info = ModelInfo(task="generative", max_length=64)
    questions = ["what is item 1?", "what is it?", "what is item 12 or item 13 or item 14?", "x"]
    together = answer_questions(model, tokenizer, info, questions, batch_size=4)
    alone = [answer_questions(model, tokenizer, info, [q], batch_size=1)[0] for q in questions]
    assert together == alone
    assert any(together)


def test_generate_precision_bf16_runs_inference_under_bf16_autocast(scratch_gpt2):
    from qatune.config import GenerateConfig
    from qatune.inference.batches import inference_precision

    with inference_precision("bf16", torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with inference_precision("fp32", torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    model, tokenizer = scratch_gpt2
    info = ModelInfo(task="generative", max_length=64)
    computed = {}  # precision -> the dtypes of the head's logits at its decoding steps
    for precision in ("bf16", "fp32"):
        seen = computed.setdefault(precision, [])
        hook = model.lm_head.register_forward_hook(lambda module, args, out, seen=seen: seen.append(out.dtype))
        try:
            answers = answer_questions(model, tokenizer, info, ["what is item 1?", "x"], generate=GenerateConfig(
                precision=precision, max_new_tokens=4))
        finally:
            hook.remove()
        assert len(answers) == 2 and all(isinstance(answer, str) for answer in answers)
    assert set(computed["bf16"]) == {torch.bfloat16} and set(computed["fp32"]) == {torch.float32}
    assert 1 <= len(computed["bf16"]) <= 4  # one head call per new token, at most max_new_tokens


@pytest.mark.parametrize("native", [True, False])
def test_generate_precision_auto_takes_bf16_only_where_it_is_native(monkeypatch, native):
    from qatune.config import GenerateConfig
    from qatune.inference.batches import inference_precision
    from qatune.model import precision as device

    monkeypatch.setattr(device, "bf16_native", lambda where, unknown=True: native)
    assert GenerateConfig(precision="auto").precision == "auto"
    with inference_precision("auto", torch.device("cpu")):
        assert torch.is_autocast_enabled("cpu") == native


# --- `qatune generate RUN "question"` and the passage: a run whose prompt reads a {context} needs one, a run whose
# prompt does not refuses one; neither is silently dropped or invented.

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


def forbid_loading(monkeypatch, message):
    """Loading a run's model raises ``message`` until the test ends, wherever generate loads it: one question
    (qatune.evaluation.asking, which holds its own name for it: imported first, so that the name it keeps is the
    real one once the test has ended) or a file (which looks it up as it loads)."""
    import qatune.evaluation.asking
    import qatune.inference.run_model

    def no_loading(*args, **kwargs):
        raise AssertionError(message)

    for module in (qatune.evaluation.asking, qatune.inference.run_model):
        monkeypatch.setattr(module, "load_run_model", no_loading)


def test_a_missing_passage_or_field_is_refused_before_the_model_loads(with_context, without_context, monkeypatch):
    forbid_loading(monkeypatch, "the model was loaded before the request was checked")
    one_line_error(generate(with_context, QUESTION), NEEDS)
    one_line_error(generate(without_context, QUESTION, "--context", PASSAGE), REFUSES)
    for fields in ([], ["--field", "score= "]):  # its prompt needs {score}; a blank value is none
        result = generate(without_context, QUESTION, *fields)
        assert result.exit_code == 1 and "AssertionError" not in result.output
        assert "needs the column(s) ['score']" in result.stderr


def test_a_file_without_the_passage_column_is_refused_before_the_model_loads(with_context, tmp_path, monkeypatch):
    forbid_loading(monkeypatch, "the model was loaded before the file was read")
    questions = tmp_path / "q.csv"
    questions.write_text(f"question\n{QUESTION}\n", encoding="utf-8")
    result = generate(with_context, "--file", questions)
    assert result.exit_code == 1 and "column 'context' not found in q.csv" in result.stderr, result.output


# --- `qatune generate --file QUESTIONS --output ANSWERS`: the answers file is in the format its suffix names, keeps
# the input's other columns, is written atomically, and never replaces the questions file.

QUESTIONS = [  # id, question, score (the prompt's column), answer (a gold answer), notes
    ["7", "what is item 1?", "1", "thing 1", "=1+1"],
    ["8", "what is item 2?", "2", "thing 2", ""],
]

COLUMNS = ["row", "question", "id", "score", "answer (input)", "notes", "answer"]


@pytest.fixture(scope="module")
def run(without_context):
    """The run the answers files come from: its prompt reads a score column."""
    return without_context


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


def error_line_says(result, says):
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: ") and says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.parametrize("name", ["answers.txt", "answers.xls", "answers"])
def test_an_unknown_suffix_is_refused_before_any_work(questions, tmp_path, name):
    # The run does not exist: the suffix is checked before the model is looked for.
    result = CliRunner().invoke(cli, ["generate", str(tmp_path / "no-run"), "--file", str(questions),
                                      "--output", str(tmp_path / name)])
    error_line_says(result, "cannot write")
    assert ".csv, .tsv, .xlsx, .json, .jsonl" in result.stderr
    assert not (tmp_path / name).exists()


def test_the_questions_file_is_never_overwritten(run, questions, tmp_path):
    before = questions.read_bytes()
    (tmp_path / "sub").mkdir()
    for spelled in (questions, tmp_path / "sub" / ".." / "questions.csv"):
        result = CliRunner().invoke(cli, ["generate", str(run), "--file", str(questions), "--output", str(spelled)])
        error_line_says(result, "would overwrite the questions file")
    assert questions.read_bytes() == before


def test_without_output_the_answers_go_to_a_csv_in_the_run(run, expected, questions):
    result = cli_ok("generate", run, "--file", questions)
    assert result.stdout.strip() == str(run / "answers-questions.csv")
    assert [r["answer"] for r in read_answers(run / "answers-questions.csv")] == expected


@pytest.mark.parametrize("flags", [["--context", "a passage"], ["--field", "score=1"], ["--context-file", "p.txt"]])
def test_single_question_flags_are_refused_with_file(questions, tmp_path, flags):
    result = CliRunner().invoke(cli, ["generate", str(tmp_path / "no-run"), "--file", str(questions), *flags])
    error_line_says(result, f"{flags[0]} goes with a single QUESTION; with --file, passages and other columns come "
                           "from the file's columns")
