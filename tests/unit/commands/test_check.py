"""qatune check's rendering of what a row trains."""

from qatune.train import prepare
from tests.conftest import MIXED_ROWS, one_epoch_config


def test_check_shows_a_rows_tokens_without_the_padding_a_rounded_width_adds(tmp_path):
    from qatune.commands.check import render_trained_tokens

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
