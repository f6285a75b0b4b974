"""metrics.py against the numbers of the official SQuAD v1.1 evaluation script (evaluate-v1.1.py).

The expected values below were produced by that script's normalize_answer / exact_match_score /
f1_score / metric_max_over_ground_truths on these hand-made cases.
"""

import pytest

from qatune.inference.metrics import best_scores, corpus_scores, normalize_answer

CASES = [
    # prediction, gold answers, official EM, official F1
    ("the Eiffel Tower", ["Eiffel Tower"], 1.0, 1.0),
    ("Paris, France", ["Paris"], 0.0, 2 / 3),
    ("in 1727", ["1727", "the year 1727"], 0.0, 2 / 3),
    ("a", ["the"], 1.0, 0.0),                      # both normalise to nothing: EM 1 but F1 0 in v1.1
    ("", ["something"], 0.0, 0.0),
    ("Café Müller!", ["cafe muller"], 0.0, 0.0),   # accents are not folded
    ("two two three", ["two three three"], 0.0, 2 / 3),
    ("New York City", ["new york", "NYC"], 0.0, 0.8),
    ("an apple a day", ["apple day"], 1.0, 1.0),
    ("U.S.", ["US", "United States"], 1.0, 1.0),
]


@pytest.mark.parametrize(("prediction", "golds", "em", "f1"), CASES)
def test_each_case_matches_the_official_script(prediction, golds, em, f1):
    assert best_scores(prediction, golds) == (em, pytest.approx(f1, abs=1e-12))


def test_corpus_scores_match_the_official_totals():
    scores = corpus_scores([c[0] for c in CASES], [c[1] for c in CASES])
    assert scores == {"exact_match": pytest.approx(40.0), "f1": pytest.approx(58.0)}


def test_normalisation_order_is_the_official_one():
    # punctuation goes before articles: "the-end" -> "theend" keeps its article-like prefix
    assert normalize_answer("The-End, a  story!") == "theend story"
    assert normalize_answer("An\tAnswer") == "answer"
