"""Exact match and F1 as in the official SQuAD v1.1 evaluation script, max over all gold answers (0-100)."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, drop punctuation and articles (a, an, the), collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str) -> float:
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    common = Counter(pred_tokens) & Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:  # also when either side normalises to nothing ("a" vs "the": EM 1, F1 0, as in v1.1)
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def best_scores(prediction: str, golds: list[str]) -> tuple[float, float]:
    """(exact match, F1) of one prediction, each the max over the gold answers."""
    if not golds:
        return 0.0, 0.0
    return max(exact_match(prediction, g) for g in golds), max(f1(prediction, g) for g in golds)


def corpus_scores(predictions: list[str], golds: list[list[str]]) -> dict[str, float]:
    """Mean exact match and F1 in 0-100."""
    if not predictions:
        return {"exact_match": 0.0, "f1": 0.0}
    pairs = [best_scores(p, g) for p, g in zip(predictions, golds, strict=True)]
    return {
        "exact_match": 100.0 * sum(em for em, _ in pairs) / len(pairs),
        "f1": 100.0 * sum(f for _, f in pairs) / len(pairs),
    }
