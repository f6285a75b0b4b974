"""Field metrics against values worked out by hand in each test (not by the libraries that compute them)."""

import math

import pytest

from qatune.data.grading_fields import AnswerTemplate, FieldSpec
from qatune.errors import ConfigError
from qatune.inference.field_metrics import (
    default_tolerance,
    field_metrics,
    grading_metrics,
    label_metrics,
    number_metrics,
    text_metrics,
)

# --- numbers --------------------------------------------------------------------------------------------------

# Row 3 is unparsed. The others: errors 0, 1, -2, -3.
NUMBER_PREDICTIONS = [1.0, 3.0, None, 2.0, 2.0]
NUMBER_GOLDS = [1.0, 2.0, 3.0, 4.0, 5.0]
# Spearman over the 4 scored rows: predictions 1, 3, 2, 2 rank 1, 4, 2.5, 2.5 (a tie shares its average rank);
# golds 1, 2, 4, 5 rank 1, 2, 3, 4. Both rank means are 2.5: deviations (-1.5, 1.5, 0, 0) and
# (-1.5, -0.5, 0.5, 1.5); covariance sum 2.25 - 0.75 = 1.5; squares 4.5 and 5; rho = 1.5 / sqrt(22.5).
HAND_SPEARMAN = 1.5 / math.sqrt(22.5)


def test_number_metrics_by_hand():
    metrics = number_metrics(NUMBER_PREDICTIONS, NUMBER_GOLDS, tolerance=1.0)
    assert metrics == {
        "mae": pytest.approx((0 + 1 + 2 + 3) / 4),
        "rmse": pytest.approx(math.sqrt((0 + 1 + 4 + 9) / 4)),
        "exact": pytest.approx(100 * 1 / 5),             # the unparsed row counts as wrong
        "within_tolerance": pytest.approx(100 * 2 / 5),  # errors 0 and 1
        "tolerance": 1.0,
        "spearman": pytest.approx(HAND_SPEARMAN),
        "scored": 4,
    }


def test_number_metrics_without_any_number():
    metrics = number_metrics([None, None], [1.0, 2.0], tolerance=0.5)
    assert metrics == {"mae": None, "rmse": None, "exact": 0.0, "within_tolerance": 0.0, "tolerance": 0.5,
                       "spearman": None, "scored": 0}


def test_number_metrics_undefined_cases():
    assert number_metrics([2.0, 2.0, 2.0], [1.0, 2.0, 3.0], 0.0)["spearman"] is None  # constant predictions
    assert number_metrics([2.0], [1.0], 0.0)["spearman"] is None                       # one pair
    assert number_metrics([], [], 0.0)["exact"] is None


def test_tolerance_is_inclusive_despite_float_rounding():
    assert 1.1 - 0.85 > 0.25
    assert number_metrics([1.1], [0.85], tolerance=0.25)["within_tolerance"] == 100.0


def test_default_tolerance_is_a_quarter_of_the_smallest_gold_step():
    assert default_tolerance([0.0, 0.5, 2.0, 2.0]) == 0.125
    assert default_tolerance([3.0, 3.0]) == 0.0


def test_number_field_reads_texts_and_leaves_out_blank_golds():
    predictions = ["1", "3 points", "n/a", "2", "2,0", "9"]
    golds = ["1", "2", "3", "4", "5", " "]
    metrics = field_metrics("number", predictions, golds)
    assert metrics["rows"] == 5 and metrics["scored"] == 4
    assert metrics["tolerance"] == 0.25  # golds in steps of 1
    assert metrics["within_tolerance"] == pytest.approx(20.0)  # only the exact row is within 0.25
    assert metrics["mae"] == pytest.approx(1.5)
    assert metrics["spearman"] == pytest.approx(HAND_SPEARMAN)
    assert field_metrics(FieldSpec("number", tolerance=1.0), predictions, golds)["within_tolerance"] == \
        pytest.approx(40.0)
    assert metrics["parse_rate"] == pytest.approx(80.0)  # "n/a" is no number


def test_unknown_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="answer field kind 'score' is not one of number, label, text"):
        field_metrics("score", ["1"], ["1"])


# --- labels ---------------------------------------------------------------------------------------------------

def test_label_metrics_by_hand():
    golds = ["Pass", "pass", "fail", "fail", "partial", "pass"]
    predictions = ["PASS ", "fail", "fail", None, "partial", "great"]
    metrics = label_metrics(predictions, golds)
    # Right: rows 1, 3 and 5 of 6.
    assert metrics["accuracy"] == pytest.approx(50.0)
    # pass: 1 true positive, 0 false positives, 2 misses -> 2/4; fail: 1, 1, 1 -> 2/4; partial: 1, 0, 0 -> 1.
    assert metrics["macro_f1"] == pytest.approx(100 * (0.5 + 0.5 + 1) / 3)
    assert metrics["confusion"] == {
        "labels": ["fail", "partial", "Pass", "great", "(unparsed)"],
        "matrix": [
            [1, 0, 0, 0, 1],  # gold fail: predicted fail, unparsed
            [0, 1, 0, 0, 0],  # gold partial
            [1, 0, 1, 1, 0],  # gold pass: fail, pass, great
            [0, 0, 0, 0, 0],
            [0, 0, 0, 0, 0],
        ],
    }


def test_label_metrics_all_right_and_nothing_extra():
    metrics = label_metrics(["a", "b"], ["a", "b"])
    assert metrics == {"accuracy": 100.0, "macro_f1": 100.0,
                       "confusion": {"labels": ["a", "b"], "matrix": [[1, 0], [0, 1]]}}
    assert label_metrics([], [])["accuracy"] is None


# --- free text ------------------------------------------------------------------------------------------------

MAT = "the cat sat on the mat"


def test_identical_text_scores_100_and_disjoint_text_0():
    assert text_metrics([MAT], [MAT]) == {"token_f1": 100.0, "rouge_l": pytest.approx(100.0),
                                          "bleu": pytest.approx(100.0)}
    assert text_metrics(["dogs bark loudly"], [MAT]) == {"token_f1": 0.0, "rouge_l": 0.0, "bleu": 0.0}


def test_rouge_l_follows_the_longest_common_subsequence():
    metrics = text_metrics(["mat the cat"], [MAT])
    # LCS "the cat" = 2 tokens (a bag of words would find 3): precision 2/3, recall 2/6, F = 4/9.
    assert metrics["rouge_l"] == pytest.approx(100 * 4 / 9)
    # SQuAD F1 drops "the": "mat cat" against "cat sat on mat": 2 shared, precision 1, recall 1/2 -> 2/3.
    assert metrics["token_f1"] == pytest.approx(100 * 2 / 3)


def test_bleu_of_a_short_exact_prefix_is_its_brevity_penalty():
    metrics = text_metrics(["the cat sat on"], [MAT])
    # Every n-gram of the 4 tokens is in the reference of 6: precisions 1, brevity penalty exp(1 - 6/4).
    assert metrics["bleu"] == pytest.approx(100 * math.exp(1 - 6 / 4))
    assert metrics["rouge_l"] == pytest.approx(100 * 0.8)   # LCS 4: precision 1, recall 4/6
    assert metrics["token_f1"] == pytest.approx(100 * 6 / 7)  # "cat sat on" in "cat sat on mat": 1 and 3/4


def test_a_none_prediction_is_the_empty_text():
    metrics = text_metrics([MAT, None], [MAT, "a b"])
    assert metrics["token_f1"] == pytest.approx(50.0)
    assert metrics["rouge_l"] == pytest.approx(50.0)
    # Corpus BLEU: all 6 predicted tokens' n-grams match; 6 predicted tokens against 8 reference tokens.
    assert metrics["bleu"] == pytest.approx(100 * math.exp(1 - 8 / 6))


# --- a whole grading sheet ------------------------------------------------------------------------------------

def test_grading_metrics_over_parsed_answers():
    sheet = AnswerTemplate.make(["score", "label", "feedback"])
    kinds = {"score": "number", "label": "label", "feedback": "text"}
    golds = [{"score": "2", "label": "pass", "feedback": "clear proof"},
             {"score": "1", "label": "fail", "feedback": "missing step"},
             {"score": "0", "label": "fail", "feedback": "wrong"}]
    answers = ["Score: 2\nLabel: pass\nFeedback: clear proof", "Score: 1.5\nLabel: pass\nFeedback: a missing step",
               "I think this deserves a 0."]
    metrics = grading_metrics(kinds, [sheet.parse(a) for a in answers], golds)
    assert metrics["parse_rate"] == pytest.approx(100 * 2 / 3) and metrics["unparsed"] == 1
    score, label, feedback = (metrics["fields"][name] for name in kinds)
    # Scores 2, 1.5 against 2, 1 (steps of 1: tolerance 0.25); the unparsed row is wrong.
    assert score["mae"] == pytest.approx(0.25) and score["rmse"] == pytest.approx(math.sqrt(0.125))
    assert score["exact"] == score["within_tolerance"] == pytest.approx(100 / 3)
    assert score["spearman"] == pytest.approx(1.0) and score["scored"] == 2 and score["rows"] == 3
    # Labels pass, pass, (unparsed) against pass, fail, fail: F1 of pass 2/3, of fail 0.
    assert label["accuracy"] == pytest.approx(100 / 3) and label["macro_f1"] == pytest.approx(100 / 3)
    assert feedback["token_f1"] == pytest.approx(100 * 2 / 3)  # "a missing step" normalises to the gold
    assert grading_metrics(kinds, [], [])["parse_rate"] is None


def test_grading_metrics_uses_the_specs_tolerance():
    golds = [{"score": "2"}, {"score": "1"}]
    metrics = grading_metrics({"score": FieldSpec("number", tolerance=0.5)}, [{"score": "2.4"}, {"score": "1"}], golds)
    assert metrics["fields"]["score"]["within_tolerance"] == 100.0
    assert metrics["fields"]["score"]["tolerance"] == 0.5


def test_rouge_l_reads_words_of_any_script():
    from qatune.inference.field_metrics import AnyScriptTokenizer

    words = AnyScriptTokenizer().tokenize
    assert words("Die Antwort ist größtenteils richtig.") == ["die", "antwort", "ist", "grösstenteils", "richtig"]
    assert words("答案正确，abc") == ["答", "案", "正", "确", "abc"]  # a Chinese character is a word of its own
    assert words("Ответ верный") == ["ответ", "верный"]
    german = text_metrics(["Die Antwort ist fast richtig"], ["Die Antwort ist richtig"])["rouge_l"]
    french = text_metrics(["La réponse est très incomplète"], ["La réponse est incomplète"])["rouge_l"]
    chinese = text_metrics(["答案部分正确"], ["答案正确"])["rouge_l"]
    # LCS of 4 of 5 and 4 words: F = 2 * (4/5 * 4/4) / (4/5 + 4/4); of 4 of 6 and 4 characters likewise
    assert german == pytest.approx(100 * 8 / 9) and french == pytest.approx(100 * 8 / 9)
    assert chinese == pytest.approx(100 * 0.8)
    assert text_metrics(["Ответ верный"], ["Ответ неверный"])["rouge_l"] == pytest.approx(50.0)
