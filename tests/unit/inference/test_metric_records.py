"""The metric records (qatune.inference.metric_records): the one place a metric's name, digits, unit and direction
are said; eval's printout and --compare's tables read them."""

from qatune.inference.metric_records import ANSWER, METRICS, metrics_of


def test_a_comparison_shows_each_kinds_metrics_in_one_order_and_leaves_perplexity_out():
    assert metrics_of(ANSWER) == ("exact_match", "f1", "loss", "perplexity")
    assert metrics_of(ANSWER, compared=True) == ("exact_match", "f1", "loss")
    assert metrics_of("number") == ("mae", "within_tolerance", "exact", "spearman")
    assert metrics_of("label") == ("accuracy", "macro_f1")
    assert metrics_of("text") == ("token_f1", "rouge_l", "bleu")


def test_a_value_is_shown_with_its_digits_unit_and_sign_and_a_heading_says_which_way_is_better():
    assert METRICS["mae"].shown(-0.4) == "-0.400" and METRICS["mae"].shown(0.4, sign=True) == "+0.400"
    assert METRICS["accuracy"].shown(66.666) == "66.7" and METRICS["accuracy"].shown(66.666, unit=True) == "66.7%"
    assert METRICS["f1"].shown(None) == "n/a"
    assert METRICS["loss"].heading == "loss (lower is better)"
    assert METRICS["within_tolerance"].heading == "within tolerance (%)"
    assert METRICS["f1"].heading == "F1"
