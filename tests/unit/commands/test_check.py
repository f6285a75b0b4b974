"""qatune check's rendering of what a row trains."""

import pytest

from qatune.train import prepare
from tests.conftest import MIXED_ROWS, one_epoch_config


def test_check_shows_a_rows_tokens_without_the_padding_a_rounded_width_adds(tmp_path):
    from qatune.kinds.generative import render_trained_tokens

    prepared = prepare(one_epoch_config(tmp_path, MIXED_ROWS))
    example = prepared.dataset[0]
    plain = render_trained_tokens(prepared, example)
    prepared.collator.pad_to_multiple_of = len(example) + 7
    assert render_trained_tokens(prepared, example) == plain


def test_a_question_asked_again_with_another_student_answer_is_not_leakage(tmp_path):
    """A grading sheet asks each question of many students: only the same question with the same answer leaks."""
    from qatune.commands.check import run_check
    from qatune.config import load_config

    header = "question,student,answer\n"
    (tmp_path / "train.csv").write_text(header + "what is tcp?,a protocol,ok\nwhat is udp?,datagrams,ok\n")
    (tmp_path / "eval.csv").write_text(header + "what is tcp?,a cable,wrong\nwhat is udp?,Datagrams,ok\n")
    config = load_config(None, [f"data.train_file={tmp_path / 'train.csv'}",
                                f"data.eval_file={tmp_path / 'eval.csv'}", "data.prompt_template=Q: {question} "
                                "A: {student}\nGrade:", "model.scratch.n_layer=1", "model.scratch.n_embd=16",
                                "model.scratch.n_head=2", "model.scratch.vocab_size=300"])
    report = run_check(config)
    assert report["leakage"] == {"count": 1, "examples": ["what is udp?"]}


def grading_check(tmp_path, train_rows, eval_rows, *overrides):
    from qatune.commands.check import render_report, run_check
    from qatune.config import load_config

    header = "question,student,score,verdict\n"
    (tmp_path / "train.csv").write_text(header + "".join(f"{r}\n" for r in train_rows), encoding="utf-8")
    (tmp_path / "eval.csv").write_text(header + "".join(f"{r}\n" for r in eval_rows), encoding="utf-8")
    config = load_config(None, [f"data.train_file={tmp_path / 'train.csv'}", f"data.eval_file={tmp_path / 'eval.csv'}",
                                "data.answer_columns=[score, verdict]", "data.prompt_template=Q: {question} A: "
                                "{student}\nGrade:", "model.scratch.n_layer=1", "model.scratch.n_embd=16",
                                "model.scratch.n_head=2", "model.scratch.vocab_size=300", *overrides])
    report = run_check(config)
    return report, render_report(report)


# a German grading sheet: decimal commas; row 5 holds "n/a" where a score belongs (1 cell in 12: still a number
# column), row 7 "correct." beside "Correct"
GERMAN = ['what is tcp?,a protocol,"1,500",Correct', 'what is udp?,datagrams,"0,5",Partially correct',
          'what is ip?,addresses,"1,500",Correct', 'what is dns?,names,n/a,Incorrect',
          'what is arp?,macs,"1,5",Correct', 'what is tls?,crypto,"0,75",correct.', 'what is ssh?,shell,0,Incorrect',
          *[f'what is port {i}?,a number,"0,5",Partially correct' for i in range(5)]]


def test_check_names_a_number_cell_that_is_no_number_and_drops_its_row(tmp_path):
    report, text = grading_check(tmp_path, GERMAN, ['what is tcp?,a cable,"0,25",Incorrect'])
    score = report["fields"]["columns"]["score"]
    assert score["kind"] == "number" and score["not_numbers"] == [{"row": 5, "cell": "n/a"}]
    assert report["files"]["train_file"]["dropped"] == {"score is not a number": [5]}
    found = next(f for f in report["findings"] if f["code"] == "field-not-a-number")
    assert found["message"] == ("score: 1 training rows hold no number ('n/a' in row 5): they are dropped from "
                                "training; to keep them as written, set data.field_kinds: {score: label} (or text), "
                                "or fix the cells")
    assert "    dropped, no number: rows 5" in text


def test_check_decides_the_decimal_separator_per_column_and_prints_the_tolerance(tmp_path):
    report, text = grading_check(tmp_path, GERMAN, ['what is tcp?,a cable,"1,500",Incorrect'])
    score = report["fields"]["columns"]["score"]
    # "1,500" is 1.5 in a column whose "0,5" and "0,75" prove decimal commas: 0, 0.5, 0.75, 1.5 (steps of 0.25)
    assert score["decimal"] == "decimal comma (as in '0,5')"
    assert score["range"] == [0.0, 1.5] and score["tolerance"] == 0.0625
    assert score["counts"] == {"0": 1, "0,5": 6, "0,75": 1, "1,500": 3}  # 1.5 as most often written
    assert score["out_of_range_rows"] == [] and score["eval_only"] == []
    assert "    read with a decimal comma (as in '0,5'); right within 0.0625 of the gold value" in text


def test_check_names_labels_that_differ_only_in_spelling_and_merges_them_when_asked(tmp_path):
    report, text = grading_check(tmp_path, GERMAN, ['what is tcp?,a cable,"0,25",Incorrect'])
    verdict = report["fields"]["columns"]["verdict"]
    assert verdict["likely_same"] == [["Correct", "correct."]] and verdict["merged"] is False
    found = next(f for f in report["findings"] if f["code"] == "labels-likely-same")
    assert found["message"] == ("verdict: 'Correct' (3 rows) and 'correct.' (1 rows) differ only in case, spacing or "
                                "punctuation: likely the same label, trained as different ones; set "
                                "data.merge_label_spellings: true to train each group as its first spelling")
    merged, text = grading_check(tmp_path, GERMAN, ['what is tcp?,a cable,"0,25",Incorrect'],
                                 "data.merge_label_spellings=true")
    verdict = merged["fields"]["columns"]["verdict"]
    assert verdict["counts"] == {"Partially correct": 6, "Correct": 4, "Incorrect": 1}
    assert not any(f["code"] == "labels-likely-same" for f in merged["findings"])
    assert "    'correct.' merged into 'Correct'" in text
    rare = next(f for f in merged["findings"] if f["code"] == "label-too-rare")
    assert rare["message"] == ("verdict: labels with fewer than 10 training rows are too rare to learn, the model "
                               "will rarely if ever give them: 'Partially correct' (6 rows), 'Correct' (4 rows), "
                               "'Incorrect' (1 rows); add rows of "
                               "them, or merge them into another label")


def test_check_warns_that_a_models_own_code_will_run(tmp_path):
    """model.trust_remote_code lets a model folder or hub repository run its Python code: check names whose."""
    from qatune.commands.check import render_report, run_check
    from qatune.config import load_config
    from tests.conftest import chat_tokenizer, tiny_config, tiny_llama

    folder = tmp_path / "their-model"
    tokenizer = chat_tokenizer()
    tiny_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = [(f"what is item {i}?", f"thing {i * 7}") for i in range(12)]
    data = tiny_config(tmp_path, rows).data.train_file
    config = load_config(None, [f"data.train_file={data}", f"model.name_or_path={folder}",
                                "model.trust_remote_code=true"])
    report = run_check(config)
    found = [f for f in report["findings"] if f["code"] == "remote-code"]
    assert len(found) == 1 and found[0]["level"] == "warning"
    assert found[0]["message"] == (f"model.trust_remote_code is true: check, train, eval, generate and serve run the "
                                   f"Python code that comes with {folder}, with your permissions on this machine; "
                                   "keep it only for a model whose authors you trust, and pin the code you read with "
                                   "model.revision")
    assert "[remote-code]" in render_report(report)
    plain = run_check(load_config(None, [f"data.train_file={data}", f"model.name_or_path={folder}"]))
    assert not [f for f in plain["findings"] if f["code"] == "remote-code"]


@pytest.mark.parametrize("sheet, columns, message", [
    ("question,answer\nwhat is 1+1?,two\nwhat is 2+2?,four\n", ("question", "question"),
     "data.question_column and data.answer_column both name the column 'question' of sheet.csv: the model would "
     "learn to repeat the question; columns are ['question', 'answer']; name another column for data.answer_column"),
    ("text\nwhat is 1+1? two\nwhat is 2+2? four\n", ("text", "text"),
     "data.question_column and data.answer_column both name the column 'text' of sheet.csv: the model would learn "
     "to repeat the question; sheet.csv has one column ('text'); a question and its answer need a column each; name "
     "another column for data.answer_column"),
    ("question;answer\nwhat is 1+1?;two\nwhat is 2+2?;four\n", ("question", "answer"),
     "column 'question' not found in sheet.csv; columns are ['question;answer']; set data.question_column; the "
     "header looks ';'-separated, set data.delimiter"),
])
def test_check_refuses_a_sheet_whose_columns_cannot_make_questions_and_answers(tmp_path, sheet, columns, message):
    """What a newcomer's sheet does by mistake: the same column as question and answer (a one-column sheet makes
    any choice so), or cells split by semicolons read as one column; check names it, and how to fix it."""
    from click.testing import CliRunner

    from qatune.cli import cli

    (tmp_path / "sheet.csv").write_text(sheet, encoding="utf-8")
    config = tmp_path / "c.yaml"
    config.write_text(f"data: {{train_file: {tmp_path / 'sheet.csv'}, question_column: {columns[0]}, "
                      f"answer_column: {columns[1]}}}\nmodel: {{scratch: {{n_layer: 1, n_embd: 16, n_head: 2}}}}\n",
                      encoding="utf-8")
    result = CliRunner().invoke(cli, ["check", "--config", str(config)])
    assert result.exit_code == 1
    assert result.stderr.strip() == f"error: {message}"
