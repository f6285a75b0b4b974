"""prepare(): which rows are kept, which dropped and why, before anything is trained."""

import logging

import pytest

from qatune.errors import DataError
from qatune.train import prepare
from tests.conftest import SPAN_ROWS, tiny_config


def test_rows_whose_answer_is_not_in_the_context_are_no_longer_counted_as_kept(tmp_path, caplog):
    rows = [*SPAN_ROWS, ("what colour is thing 9?", "thing 9 is grey.", "purple"),
            ("what colour is thing 8?", "thing 8 is pink.", "orange")]
    config = tiny_config(tmp_path, rows, "task=extractive", "data.context_column=context",
                         "data.max_length=64", "data.doc_stride=16")
    with caplog.at_level(logging.INFO, logger="qatune"):
        report = prepare(config, with_model=False).reports["train_file"]
    assert (report["rows_read"], report["kept"], report["dropped"]) == (7, 5, {"answer not in context": [7, 8]})
    assert "data: qa.csv: 7 rows read, 5 kept, 2 dropped (answer not in context: rows 7, 8)" in caplog.messages


LONG_QUESTIONS = [(f"what is item number {i} in the long list?", f"thing {i}") for i in range(12)]


def test_rows_that_fit_only_with_no_question_left_are_dropped_and_said_so(tmp_path):
    rows = [(f"q{i}?", f"a{i}") for i in range(8)] + [(q, "thing thing thing") for q, _ in LONG_QUESTIONS[:4]]
    prepared = prepare(tiny_config(tmp_path, rows, "data.max_length=10"), with_model=False)
    dropped = [f for f in prepared.findings if f.code == "rows-too-long"]
    assert [f.level for f in dropped] == ["warning"]
    # The long rows would fit with an empty question (the template's 6 tokens + the answer): not worth training.
    assert dropped[0].message.startswith("4 of 12 rows dropped: they do not fit max_length=10 even with the question "
                                         "cut to nothing; the prompt's own text is 6 tokens (rows 10, 11, 12, 13)")
    assert [example.row for example in prepared.dataset.items] == list(range(2, 10))
    assert all(example.prompt_length > 6 for example in prepared.dataset.items)
    report = prepared.reports["train_file"]
    assert (report["kept"], report["dropped"]) == (8, {"does not fit max_length=10": [10, 11, 12, 13]})


def test_most_rows_not_fitting_is_an_error_not_a_warning(tmp_path):
    rows = [(q, " ".join(["word"] * 12) if i < 8 else a) for i, (q, a) in enumerate(LONG_QUESTIONS)]
    prepared = prepare(tiny_config(tmp_path, rows, "data.max_length=12"), with_model=False)
    dropped = [f for f in prepared.findings if f.code == "rows-too-long"]
    assert [f.level for f in dropped] == ["error"]
    assert dropped[0].message.startswith("most rows cannot be trained: 8 of 12 rows dropped: the answer alone does "
                                         "not fit max_length=12 (rows 2, 3, 4, 5, 6, 7, 8, 9)")


def test_seq2seq_rows_whose_question_would_be_cut_to_nothing_are_dropped(tmp_path):
    rows = [(f"q{i}?", f"a{i}") for i in range(8)] + [(q, "thing thing thing") for q, _ in LONG_QUESTIONS[:4]]
    overrides = ("model.scratch.architecture=t5",)
    kept = prepare(tiny_config(tmp_path, rows, *overrides, "data.max_length=18"), with_model=False)
    fixed = kept.dataset.items[0].input_ids  # every source cut to the template and one token of its question
    assert len(fixed) == 18 and len(kept.dataset.items) == 12
    with pytest.raises(DataError, match=r"12 of 12 rows dropped: they do not fit max_length=17 even with the "
                                        r"question cut to nothing; the prompt's own text is 17 tokens"):
        prepare(tiny_config(tmp_path, rows, *overrides, "data.max_length=17"), with_model=False)
