"""The kinds of QA: one class per record, each owning what differs; a multiple-choice sheet's rows read as its
kind reads them."""

import pytest

from qatune.config import load_config
from qatune.data.spreadsheet import LoadReport, QARecord, prompt_columns
from qatune.data.templates import resolve_template
from qatune.errors import ConfigError
from qatune.kinds import KINDS, kind_of
from qatune.kinds.multiple_choice import NOT_A_CHOICE, chosen
from qatune.tasks import TASK_KINDS, model_does


def test_every_task_record_has_its_kind_and_every_kind_its_record():
    assert set(KINDS) == set(TASK_KINDS)
    assert all(kind.record is TASK_KINDS[name] for name, kind in KINDS.items())


@pytest.mark.parametrize(("task", "whole", "perplexity"), [("generative", False, True), ("extractive", False, False),
                                                            ("scoring", True, False), ("multiple-choice", True, True)])
def test_what_each_kind_says_of_its_answers(task, whole, perplexity):
    kind = kind_of(task)
    assert kind.answers_whole is whole
    assert (kind.perplexity(0.0) == 1.0) is perplexity
    assert (kind.vocabulary_logits(2, 10, 3, False) == 6) is perplexity  # a language model's head, on 3 per row
    assert (kind.gguf_refusal(_info(task)) is None) is (task in ("generative", "multiple-choice"))


def _info(task):
    from qatune.model.folder import ModelInfo

    return ModelInfo(task=task, max_length=8)


CHOICES = {"A": "Paris", "B": "Lyon", "Option C": "Nice"}


@pytest.mark.parametrize(("cell", "choice"), [("Paris", "Paris"), (" lyon ", "Lyon"), ("B", "Lyon"), ("c)", "Nice"),
                                              ("option c", "Nice"), ("D", None), ("Marseille", None)])
def test_an_answer_cell_names_a_choice_by_its_text_letter_or_column(cell, choice):
    assert chosen(cell, CHOICES) == choice


def test_rows_whose_answer_names_no_choice_are_left_out_and_counted():
    records = [QARecord("q1", ["B"], row=2, fields=dict(CHOICES)), QARecord("q2", ["Marseille"], row=3,
                                                                            fields=dict(CHOICES))]
    report = LoadReport(file="x.csv", rows_read=2, kept=2)
    kept = kind_of("multiple-choice").settle_rows(records, report)
    assert [(r.question, r.answers) for r in kept] == [("q1", ["Lyon"])]
    assert report.dropped == {NOT_A_CHOICE: [3]} and report.kept == 1
    assert kind_of("generative").settle_rows(records) is records  # other kinds read rows as loaded


def test_a_multiple_choice_config_lists_its_choices_in_the_default_prompt():
    config = load_config(None, ["task=multiple-choice", "data.train_file=x.csv", "model.name_or_path=gpt2",
                                "data.choice_columns=[A, B, Option C]"])
    assert resolve_template(config.data).template == "Question: {question}\nA. {A}\nB. {B}\nC. {Option C}\nAnswer:"
    assert prompt_columns(config.data) == ["A", "B", "Option C"]
    plain = load_config(None, ["data.train_file=x.csv", "model.name_or_path=gpt2"])
    assert resolve_template(plain.data).template == "Question: {question}\nAnswer:"


@pytest.mark.parametrize(("sets", "message"), [
    (["task=multiple-choice"], "data.choice_columns: task multiple-choice needs at least two, one column per choice"),
    (["task=multiple-choice", "data.choice_columns=[A]"], "needs at least two"),
    (["task=multiple-choice", "data.choice_columns=[A, A]"], "['A'] listed more than once"),
    (["data.choice_columns=[A, B]"], "data.choice_columns: only for task multiple-choice"),
    (["task=multiple-choice", "data.choice_columns=[A, B]", "data.answer_columns=[x]"],
     "data.answer_columns: not for task multiple-choice"),
])
def test_choice_columns_are_asked_of_multiple_choice_only(sets, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        load_config(None, ["data.train_file=x.csv", "model.name_or_path=gpt2", *sets])


def test_a_packaged_causal_lm_does_multiple_choice_as_it_does_generative_qa():
    assert model_does("generative", "multiple-choice") and not model_does("extractive", "multiple-choice")
