"""Answer templates of grading sheets: rendering, parsing back, validation, numbers and field kinds."""

import re

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from qatune.data.grading_fields import (
    AnswerTemplate,
    FieldSpec,
    default_template,
    field_spec,
    format_value,
    infer_kind,
    label_key,
    likely_same,
)
from qatune.data.numbers import DecimalSeparator, decimal_separator, parse_number
from qatune.errors import ConfigError, DataError

COLUMNS = ["score", "label", "feedback"]
SHEET = AnswerTemplate.make(COLUMNS)


def test_default_template_has_one_titled_line_per_column():
    assert default_template(COLUMNS) == "Score: {score}\nLabel: {label}\nFeedback: {feedback}"
    assert default_template(["total_marks", "AI_verdict"]) == "Total Marks: {total_marks}\nAI Verdict: {AI_verdict}"


def test_render_writes_whole_floats_without_their_point():
    text = SHEET.render({"score": 2.0, "label": "pass", "feedback": "Fine.", "unused": 1})
    assert text == "Score: 2\nLabel: pass\nFeedback: Fine."
    assert [format_value(v) for v in (0.5, 2.0, -3.0, 7, True, "2.0")] == ["0.5", "2", "-3", "7", "True", "2.0"]


def test_render_names_missing_columns():
    with pytest.raises(DataError, match=r"needs the columns \['feedback'\]"):
        SHEET.render({"score": 1, "label": "pass"})


@pytest.mark.parametrize("values", [
    {"score": "1,5", "label": "partial", "feedback": "Half the steps."},
    {"score": "2.5 points", "label": "pass", "feedback": "ok"},
    {"score": "1,000", "label": "pass", "feedback": "Line one.\nLine two.\n\nLine four."},
    {"score": "0", "label": "fail", "feedback": "A higher score would need the proof; the subscores: fine."},
])
def test_tricky_values_round_trip(values):
    text = SHEET.render(values)
    assert SHEET.parse(text) == values
    assert SHEET.parse(f" \n{text}\n\n ") == values  # whitespace around what the model generated


def test_values_are_stripped():
    assert SHEET.parse("Score:  2 \nLabel: pass  \nFeedback:   good  ") == {"score": "2", "label": "pass",
                                                                            "feedback": "good"}


@pytest.mark.parametrize(("text", "found"), [
    ("Score: 2\nLabel: pass", {"score": "2", "label": "pass"}),            # stopped before the feedback
    ("Score: 2\nLabel: pass\nFeedb", {"score": "2", "label": "pass"}),     # stopped inside its name
    ("Score: 2\nLab", {"score": "2"}),
    ("Score: 2", {"score": "2"}),
    ("score: 2\nlabel: pass\nfeedback: good", {"score": "2", "label": "pass", "feedback": "good"}),  # any case
    ("SCORE :3\n  Label:Correct.\nFeedback :  fine", {"score": "3", "label": "Correct.", "feedback": "fine"}),
    ("Score: 2 Label: pass\nFeedback: ok", {"score": "2", "label": "pass", "feedback": "ok"}),  # a space for a break
    ("Sure. Score: 2\nLabel: pass\nFeedback: good", {"score": "2", "label": "pass", "feedback": "good"}),
])
def test_parsing_forgives_case_spaces_and_a_cut_answer(text, found):
    parsed = SHEET.parse(text)
    assert parsed == found
    assert SHEET.complete(parsed) == (len(found) == 3)


@pytest.mark.parametrize("text", ["", "The answer is 2 and it passes.", "Grade: 2"])
def test_text_without_the_first_field_parses_to_none(text):
    assert SHEET.parse(text) is None and not SHEET.complete(None)


GRADER = AnswerTemplate.make(["label", "score", "feedback"], "Verdict: {label}\nScore: {score}\nFeedback: {feedback}")


@pytest.mark.parametrize(("text", "found"), [
    # the model began another answer inside its feedback: the verdicts disagree, so the feedback is not read
    ("Verdict: Incorrect\nScore: 0\nFeedback: 0.5\nVerdict: Correct", {"label": "Incorrect", "score": "0"}),
    ("Verdict: Correct\nScore: 2\nFeedback: Good.\nVerdict: Correct\nScore: 2\nFeedback: Good.",
     {"label": "Correct", "score": "2"}),
    ("Verdict: Correct\nScore: 2\nFeedback: Good. verdict : Correct", {"label": "Correct", "score": "2"}),
    ("Verdict: Correct\nScore: 2\nFeedback: Score: 2.5.", {"label": "Correct", "score": "2"}),  # a label repeated
    ("Verdict: Correct\nScore: 2\nFeedback: ", {"label": "Correct", "score": "2"}),  # nothing written
    ("Verdict: Correct\nScore: \nFeedback: Good.", {"label": "Correct"}),  # what follows an unread field is not read
    ("Verdict: Correct\nScore: 2\nVerdict: Incorrect\nScore: 0\nFeedback: Wrong.", {"label": "Correct"}),
    ("Verdict: \nScore: 2\nFeedback: Good.", None),
    ("Verdict: Feedback: Good.", None),
])
def test_a_value_that_is_empty_or_holds_the_templates_labels_is_not_read(text, found):
    parsed = GRADER.parse(text)
    assert parsed == found
    assert not GRADER.complete(parsed)


def test_a_value_holding_another_fields_tag_is_not_read():
    template = AnswerTemplate.make(["score", "label"], "<score>{score}</score><label>{label}</label>")
    assert template.parse("<score>2</score><label>pass</label><score>3</score>") == {"score": "2"}
    assert template.parse("<score>2</score><label></label>") == {"score": "2"}


def test_closing_text_may_be_missing_when_generation_stopped_early():
    template = AnswerTemplate.make(["score", "label"], "<score>{score}</score><label>{label}</label>")
    assert template.parse("<score>2</score><label>pass</label>\n") == {"score": "2", "label": "pass"}
    assert template.parse("<score>2</score><label>pass") == {"score": "2", "label": "pass"}
    assert template.parse("<score>2</score><lab") == {"score": "2"}
    assert template.parse("<score>2</sc") == {"score": "2"}


def test_escaped_braces_are_literal_text():
    template = AnswerTemplate.make(["score", "label"], "{{score}}={score}, {{label}}={label}")
    text = template.render({"score": 3, "label": "ok"})
    assert text == "{score}=3, {label}=ok"
    assert template.parse(text) == {"score": "3", "label": "ok"}


@pytest.mark.parametrize(("columns", "template", "found"), [
    (COLUMNS, "Score: {score}\nLabel: {label}", "{feedback} is missing"),
    (COLUMNS, "Score: {score} {label}\nLabel: {label}\nFeedback: {feedback}", "{label} appears 2 times, not once"),
    (COLUMNS, "Grade: {grade}\nScore: {score}\nLabel: {label}\nFeedback: {feedback}",
     "{grade} is not among the columns ['score', 'label', 'feedback']"),
    (COLUMNS, "Score: {score}{label}\nFeedback: {feedback}",
     "{score}{label} have no text between them to tell where one ends"),
    (["feedback"], "{feedback}", "{feedback} has no text before it to find it by"),
    (COLUMNS, "Score: {score\nLabel: {label}\nFeedback: {feedback}", "it has a lone { or }"),
    (["score", "score"], "Score: {score}", "the columns ['score', 'score'] repeat a name"),
])
def test_template_errors_name_the_setting_what_was_found_and_a_fix(columns, template, found):
    with pytest.raises(ConfigError) as error:
        AnswerTemplate.make(columns, template)
    message = str(error.value)
    assert message.startswith(f"data.answer_template {template!r} cannot be parsed back into its fields: ")
    assert found in message
    assert message.endswith(f"for example {default_template(columns)!r}")


def test_template_errors_come_all_at_once():
    with pytest.raises(ConfigError) as error:
        AnswerTemplate.make(COLUMNS, "{score}{label} {grade}")
    assert str(error.value) == (
        "data.answer_template '{score}{label} {grade}' cannot be parsed back into its fields: {grade} is not among "
        "the columns ['score', 'label', 'feedback']; {feedback} is missing; {score}{label} have no text between "
        "them to tell where one ends; for example 'Score: {score}\\nLabel: {label}\\nFeedback: {feedback}'")


# Values as the property allows them (not empty, no surrounding whitespace), often holding words of the template.
pieces = st.sampled_from(["Score", "score 3", "Label -", "Feedback", "x: y", "\n", " ", "1,5"])
values = st.lists(st.one_of(pieces, st.text(max_size=8)), min_size=1, max_size=6).map("".join).map(str.strip)
LABELS = re.compile(r"\b(score|label|feedback)\s*:", re.IGNORECASE)


@given(values, values, values, st.sampled_from(["", " ", "\n \n"]))
def test_parse_inverts_render(score, label, feedback, around):
    # The property's condition: every value is written and none holds one of the template's labels.
    assume(all(value and not LABELS.search(value) for value in (score, label, feedback)))
    row = {"score": score, "label": label, "feedback": feedback}
    assert SHEET.parse(around + SHEET.render(row) + around) == row


@given(st.lists(st.sampled_from(["Score: ", "\nLabel: ", "\nFeedback: ", "Score:", "\n", " ", "x", "1,5"]),
                max_size=12).map("".join))
def test_parse_never_fails_on_template_like_text(text):
    parsed = SHEET.parse(text)
    assert parsed is None or (list(parsed) == COLUMNS[:len(parsed)]
                              and all(v and v == v.strip() and not LABELS.search(v) for v in parsed.values()))


@pytest.mark.parametrize(("text", "number"), [
    ("2.5", 2.5), ("2,5", 2.5), ("1,5", 1.5), ("0,500", 0.5), ("1,000", 1000.0), ("1,000.5", 1000.5),
    ("12,345,678", 12345678.0), ("1.000,5", 1000.5), ("1,0001", 1.0001), ("2.5 points", 2.5), ("2.5/3", 2.5),
    ("-1", -1.0), ("+0.25", 0.25), (" 3 ", 3.0), (".5", 0.5), ("3.", 3.0), ("7 out of 10", 7.0),
    ("\u22122.5", -2.5), ("50%", 50.0), ("1.000", 1.0),
    ("", None), ("   ", None), ("pass", None), ("about 3", None), ("-", None), ("n/a", None), ("nan", None),
    # dates, times, ranges, ordinals and versions are not numbers
    ("2024-01-05", None), ("5/1/2024", None), ("05.01.2024", None), ("10:30", None), ("3-4", None), ("1st", None),
    ("22nd", None), ("3rd", None), ("4th place", None), ("1.2.3", None), ("v1.2", None),
])
def test_parse_number(text, number):
    assert parse_number(text) == number


@pytest.mark.parametrize(("text", "point", "comma"), [
    ("1,500", 1500.0, 1.5), ("1.500", 1.5, 1500.0),          # either way: the column decides
    ("1,5", 1.5, 1.5), ("1.000,5", 1000.5, 1000.5), ("1,000,000", 1e6, 1e6), ("0,500", 0.5, 0.5),  # the form decides
])
def test_a_columns_decimal_separator_reads_the_forms_that_could_be_either(text, point, comma):
    assert parse_number(text, ".") == point and parse_number(text, ",") == comma


def test_the_decimal_separator_is_decided_per_column_from_its_values():
    german = decimal_separator(["1,500", "2,25", "3", "0,5"])
    assert german.separator == "," and german.evidence == "2,25" and german.describe() == "decimal comma (as in '2,25')"
    assert decimal_separator(["1,500", "3", "2"]) == DecimalSeparator(".")  # nothing proves a comma
    mixed = decimal_separator(["2.5", "1,75", "0.25"])
    assert mixed.separator == "." and mixed.against == 1
    spec = field_spec("number", ["1,500", "2,25", "1,500", "n/a"])
    assert spec.decimal == "," and spec.values == ("1,500", "2,25") and spec.counts == (2, 1)
    assert (spec.low, spec.high, spec.tolerance) == (1.5, 2.25, 0.1875)


def test_whole_reads_only_a_cell_that_is_nothing_but_a_number():
    assert parse_number("2.5", whole=True) == 2.5 and parse_number(" 2.5 ", whole=True) == 2.5
    assert parse_number("2.5 points", whole=True) is None and parse_number("2.5 points") == 2.5


def test_label_spellings_that_differ_only_in_case_spacing_or_punctuation():
    assert label_key(" Partially-correct. ") == label_key("partially correct") == "partially correct"
    assert likely_same(["Correct", "correct.", "Correct", "Incorrect", "CORRECT", "incorrect"]) == [
        ["Correct", "CORRECT", "correct."], ["Incorrect", "incorrect"]]
    spec = field_spec("label", ["Correct", "Incorrect", "Correct"])
    assert spec.values == ("Correct", "Incorrect") and spec.counts == (2, 1)
    assert spec.label("correct.") == "Correct" and spec.label("Maybe") == "Maybe" and spec.label(" ") is None
    assert FieldSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(("values", "kind"), [
    (["1", "2.5", "", "0,5", "3 points"], "number"),
    (["pass", "fail", "Pass ", "fail"], "label"),        # 2 distinct of 4 (case and spaces ignored)
    (["pass", "fail", "partial", "pass", "", "fail", "partial"], "label"),  # 3 distinct of 6 non-blank: half
    (["pass", "fail", "partial", "pass", "fail"], "text"),  # 3 distinct of 5: more than half
    (["pass", "fail", "partial"], "text"),                # no value repeats
    (["good work", "needs more detail", "good work"], "text"),  # 2 distinct of 3: more than half
    ([f"label {i}" for i in range(21)] * 3, "text"),      # 21 distinct: too many for labels
    ([f"label {i}" for i in range(20)] * 3, "label"),
    (["1", "two"], "text"),
    ([*[str(i) for i in range(9)], "n/a"], "number"),       # 9 in 10 are numbers: n/a is a cell to fix
    ([*[str(i) for i in range(8)], "n/a", "-"], "text"),    # 8 in 10 are not enough
    (["Correct", "correct.", "Incorrect", "incorrect"], "label"),  # 2 distinct of 4: spellings count as one
    ([], "text"),
    (["", " "], "text"),
])
def test_infer_kind(values, kind):
    assert infer_kind(values) == kind
