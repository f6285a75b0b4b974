"""data.answer_columns, data.answer_template and data.field_kinds: each problem named by its key, all at once."""

import pytest

from qatune.config import load_config
from qatune.data.spreadsheet import answer_template
from qatune.errors import ConfigError

BASE = ["model.name_or_path=gpt2", "data.train_file=grades.csv"]


def problems(*overrides):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, *overrides])
    return str(err.value)


def test_grading_keys_load_with_their_types():
    config = load_config(None, [*BASE, "data.answer_columns=[score, label, feedback]",
                                r"data.answer_template=Score: {score}\nLabel: {label}\nFeedback: {feedback}",
                                "data.field_kinds={score: number}"])
    assert config.data.answer_columns == ["score", "label", "feedback"]
    assert config.data.answer_template == "Score: {score}\nLabel: {label}\nFeedback: {feedback}"
    assert config.data.field_kinds == {"score": "number"}
    assert load_config(None, BASE).data.answer_columns is None


def test_answer_columns_are_for_generative_and_scoring_tasks_only():
    text = problems("task=extractive", "data.context_column=passage", "data.answer_columns=[score]")
    assert text == ("config: --set data.answer_columns: not for task extractive (the answer is a span of the "
                    "context it is given); set task: generative or scoring, or remove data.answer_columns and use "
                    "data.answer_column")


def test_a_scoring_task_needs_answer_columns_and_predicts_no_text():
    assert problems("task=scoring") == ("config: data.answer_columns: required for task scoring; list the "
                                        "label and number columns to predict, e.g. [verdict, score]")
    text = problems("task=scoring", "data.answer_columns=[verdict, feedback]", "data.field_kinds={feedback: text}",
                    "model.lora.r=4", "data.field_weights={verdikt: 2}")
    assert "data.field_kinds: ['feedback'] are text; a scoring model predicts label and number columns only" in text
    assert "model.lora: not for task scoring" in text
    assert ("data.field_weights: 'verdikt' is not one of data.answer_columns ['verdict', 'feedback']; did you mean "
            "'verdict'? give weights only to answer columns") in text
    assert problems("data.answer_columns=[verdict]", "data.field_weights={verdict: -1}") == (
        "config: --set data.field_weights: weights must be 0 or more (got {'verdict': -1.0})")


def test_every_problem_of_the_grading_keys_at_once():
    text = problems("task=extractive", "data.context_column=passage", "data.answer_columns=[score, label, score]",
                    "data.field_kinds={scor: number, feedback: text}")
    assert text.startswith("config has 4 problems:\n")
    assert "  - --set data.answer_columns: not for task extractive" in text
    assert "  - --set data.answer_columns: ['score'] listed more than once; list each column once" in text
    assert ("  - --set data.field_kinds: 'scor' is not one of data.answer_columns ['score', 'label', 'score']; did you "
            "mean 'score'? give kinds only to answer columns") in text
    assert ("  - --set data.field_kinds: 'feedback' is not one of data.answer_columns ['score', 'label', 'score']; "
            "give kinds only to answer columns") in text


def test_template_and_kinds_need_answer_columns():
    text = problems("data.answer_template=Score: {score}", "data.field_kinds={score: number}")
    assert ("--set data.answer_template: only used with data.answer_columns; list the answer columns there, or "
            "remove it") in text
    assert "--set data.field_kinds: only used with data.answer_columns" in text


def test_an_empty_list_and_an_unknown_kind_are_named():
    assert problems("data.answer_columns=[]").endswith("data.answer_columns: empty; list the answer columns, e.g. "
                                                       "[score, label, feedback], or set it to null for "
                                                       "data.answer_column")
    assert "data.field_kinds.score: must be 'number', 'label' or 'text' (got 'numbr')" in problems(
        "data.answer_columns=[score]", "data.field_kinds={score: numbr}")


def test_a_template_that_cannot_be_parsed_back_names_its_key():
    config = load_config(None, [*BASE, "data.answer_columns=[score, label]", "data.answer_template={score}{label}"])
    with pytest.raises(ConfigError, match=r"^data.answer_template '\{score\}\{label\}' cannot be parsed back into "
                                          r"its fields: \{score\}\{label\} have no text between them"):
        answer_template(config.data)
    config = load_config(None, [*BASE, "data.answer_columns=[score, label]", "data.answer_template=Score: {score}"])
    with pytest.raises(ConfigError, match=r"\{label\} is missing"):
        answer_template(config.data)


def test_the_default_template_has_one_line_per_column():
    config = load_config(None, [*BASE, "data.answer_columns=[score, AI_verdict]"])
    assert answer_template(config.data).template == "Score: {score}\nAI Verdict: {AI_verdict}"
