"""Metrics per answer field of a grading sheet (qatune.data.grading_fields): numbers, labels and free text.

Every function returns a JSON-friendly dict with fixed keys; shares are percentages (0-100) of all rows,
and a metric that is undefined (no rows, a constant column) is None. A prediction that is None (its
answer did not have the field, or a number field did not start with a number) counts as wrong
wherever a metric counts rows, and is left out where a metric needs a value (MAE, RMSE, Spearman).
"""

from __future__ import annotations

import math
import re
from itertools import pairwise

import numpy as np

from qatune.data.grading_fields import FIELD_KINDS, FieldSpec, label_key
from qatune.errors import ConfigError
from qatune.inference.metrics import f1

UNPARSED = "(unparsed)"
"""The confusion matrix's name for a label prediction that is None."""

_EXACT = 1e-9
# Without it 1.1 - 0.85 (0.2500000000000001) would miss a tolerance of 0.25 by float rounding.
_SLACK = 1e-9


def number_metrics(predictions: list[float | None], golds: list[float], tolerance: float) -> dict:
    """MAE, RMSE and Spearman over the rows predicted as numbers; exact and within_tolerance over all rows.

    ``exact``: share of rows predicted equal to the gold (within 1e-9); ``within_tolerance``: share with
    |prediction - gold| <= ``tolerance``; ``spearman``: rank correlation, ties given their average rank;
    ``scored``: how many predictions were numbers. None predictions are wrong in the shares.
    """
    pairs = [(p, g) for p, g in zip(predictions, golds, strict=True) if p is not None]
    errors = np.array([p - g for p, g in pairs], dtype=float)
    return {
        "mae": float(np.mean(np.abs(errors))) if pairs else None,
        "rmse": float(np.sqrt(np.mean(errors**2))) if pairs else None,
        "exact": _share(int(np.sum(np.abs(errors) <= _EXACT)), len(golds)),
        "within_tolerance": _share(int(np.sum(np.abs(errors) <= tolerance + _SLACK)), len(golds)),
        "tolerance": tolerance,
        "spearman": _spearman([p for p, _ in pairs], [g for _, g in pairs]),
        "scored": len(pairs),
    }


def label_metrics(predictions: list[str | None], golds: list[str]) -> dict:
    """Accuracy, macro F1 and a confusion matrix; labels compared ignoring case, spacing and punctuation.

    ``macro_f1`` is the mean F1 of the labels that occur in the golds (a label only ever predicted adds
    no F1 of its own; its rows are misses of their gold labels). ``confusion``: ``labels`` are the gold
    labels (their first spelling in the golds), then labels only predicted, each part sorted, then
    "(unparsed)" when a prediction is None; ``matrix[i][j]`` counts rows of gold ``labels[i]`` predicted
    ``labels[j]`` (rows of labels that are never gold are zeros).
    """
    gold_keys = [_label_key(g) for g in golds]
    pred_keys = [None if p is None else _label_key(p) for p in predictions]
    hits = [p == g for p, g in zip(pred_keys, gold_keys, strict=True)]
    gold_set = sorted(set(gold_keys))
    f1s = [_label_f1(label, pred_keys, gold_keys) for label in gold_set]
    return {
        "accuracy": _share(sum(hits), len(golds)),
        "macro_f1": 100.0 * sum(f1s) / len(f1s) if f1s else None,
        "confusion": _confusion(predictions, golds, pred_keys, gold_keys),
    }


def text_metrics(predictions: list[str | None], golds: list[str]) -> dict:
    """Token F1 (SQuAD's, :func:`qatune.inference.metrics.f1`), ROUGE-L F-measure (words of any script:
    :class:`AnyScriptTokenizer`) and corpus BLEU, all 0-100.

    A None prediction scores as the empty text: 0 F1 and ROUGE-L, and no n-grams for BLEU.
    """
    # Imported here: only free-text fields need them, and rouge_score loads nltk.
    import sacrebleu
    from rouge_score.rouge_scorer import RougeScorer

    if not golds:
        return {"token_f1": None, "rouge_l": None, "bleu": None}
    texts = ["" if p is None else p for p in predictions]
    scorer = RougeScorer(["rougeL"], tokenizer=AnyScriptTokenizer())
    rouge = [scorer.score(target=g, prediction=p)["rougeL"].fmeasure for p, g in zip(texts, golds, strict=True)]
    return {
        "token_f1": 100.0 * sum(f1(p, g) for p, g in zip(texts, golds)) / len(golds),
        "rouge_l": 100.0 * sum(rouge) / len(rouge),
        "bleu": sacrebleu.corpus_bleu(texts, [golds]).score,
    }


def field_metrics(spec: FieldSpec | str, predictions: list[str | None], golds: list[str]) -> dict:
    """The metrics of one field's answers by its kind, plus ``rows``: how many were scored, and ``parse_rate``:
    the share of them whose prediction has the field (for a number field: a number).

    ``spec``: the field as training saw it (:class:`qatune.data.grading_fields.FieldSpec`), or only its kind.
    Rows whose gold is blank (or, for a number field, not a number) are left out: they have nothing to score
    against. Numbers are read with the spec's decimal separator and judged within its tolerance; without one
    (a spec of a kind only), a quarter of the smallest gap between distinct gold values (0.125 for scores in
    steps of 0.5), so a prediction within it is always nearer its own gold than any other; 0 for a single value.
    """
    spec = FieldSpec(spec) if isinstance(spec, str) else spec
    if spec.kind not in FIELD_KINDS:
        raise ConfigError(f"answer field kind {spec.kind!r} is not one of {', '.join(FIELD_KINDS)}")
    read = spec.number if spec.kind == "number" else _blank_is_none
    rows = [(p, read(g)) for p, g in zip(predictions, golds, strict=True)]
    predictions, gold_values = [p for p, g in rows if g is not None], [g for _, g in rows if g is not None]
    if spec.kind == "label":
        predicted = [spec.label(p) for p in predictions]
        metrics = label_metrics(predicted, gold_values)
    elif spec.kind == "text":
        predicted = predictions
        metrics = text_metrics(predicted, gold_values)
    else:
        tolerance = default_tolerance(gold_values) if spec.tolerance is None else spec.tolerance
        predicted = [spec.number(p) for p in predictions]
        metrics = {**number_metrics(predicted, gold_values, tolerance), "decimal": spec.decimal}
    return {**metrics, "rows": len(gold_values), "parse_rate": _share(sum(p is not None for p in predicted),
                                                                        len(gold_values))}


def grading_metrics(specs: dict[str, FieldSpec | str], predictions: list[dict[str, str] | None],
                    golds: list[dict[str, str]]) -> dict:
    """How many answers have every field, and :func:`field_metrics` of each field in ``specs``.

    ``parse_rate``: share of predictions with every field; ``unparsed``: how many miss one or more. A field a
    prediction misses is None for that field only (an answer cut before its last field keeps the others).
    """
    fields = {}
    for name, spec in specs.items():
        values = [None if p is None else p.get(name) for p in predictions]
        fields[name] = field_metrics(spec, values, [g[name] for g in golds])
    unparsed = sum(p is None or len(p) < len(specs) for p in predictions)
    return {"parse_rate": _share(len(predictions) - unparsed, len(predictions)), "unparsed": unparsed,
            "fields": fields}


class AnyScriptTokenizer:
    """ROUGE's words in any script: rouge-score's own tokenizer keeps only [a-z0-9], so feedback in German,
    French or Chinese scores near 0. Words are runs of letters and digits of any script, lower-cased; a
    character of a script written without spaces (Chinese, Japanese, Thai...) is a word of its own; English
    words are stemmed as rouge-score's own tokenizer stems them."""

    def __init__(self) -> None:
        from nltk.stem import porter  # rouge-score's own dependency and stemmer

        self._stemmer = porter.PorterStemmer()

    def tokenize(self, text: str) -> list[str]:
        words = []
        for word in _WORDS.findall(text.casefold()):
            if _UNSPACED.match(word):
                words.extend(word)
            else:
                words.append(self._stemmer.stem(word) if word.isascii() and len(word) > 3 else word)
        return words


_UNSPACED_RANGES = "\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_UNSPACED = re.compile(f"[{_UNSPACED_RANGES}]")
_WORDS = re.compile(f"[{_UNSPACED_RANGES}]+|[^\\W_{_UNSPACED_RANGES}]+")


def default_tolerance(golds: list[float]) -> float:
    """A quarter of the smallest non-zero gap between distinct gold values; 0 for a single value."""
    distinct = sorted(set(golds))
    gaps = [b - a for a, b in pairwise(distinct)]
    return 0.25 * min(gaps) if gaps else 0.0


def _share(count: int, total: int) -> float | None:
    return 100.0 * count / total if total else None


def _spearman(predictions: list[float], golds: list[float]) -> float | None:
    import pandas as pd  # pandas ranks ties by their average rank, as Spearman's rho needs

    if len(predictions) < 2:
        return None
    rho = pd.DataFrame({"p": predictions, "g": golds}).corr(method="spearman").loc["p", "g"]
    return None if math.isnan(rho) else float(rho)  # NaN: a constant side has no ranks to correlate


def _blank_is_none(text: str) -> str | None:
    return text if text.strip() else None


def _label_key(label: str) -> str:
    return label_key(label)


def _label_f1(label: str, predictions: list[str | None], golds: list[str]) -> float:
    true_pos = sum(p == label and g == label for p, g in zip(predictions, golds))
    false_pos = sum(p == label and g != label for p, g in zip(predictions, golds))
    false_neg = sum(p != label and g == label for p, g in zip(predictions, golds))
    return 2 * true_pos / (2 * true_pos + false_pos + false_neg)  # label is a gold one: never 0/0


def _confusion(predictions: list[str | None], golds: list[str], pred_keys: list[str | None],
               gold_keys: list[str]) -> dict:
    spelling: dict[str, str] = {}
    for key, text in [*zip(gold_keys, golds), *zip(pred_keys, predictions)]:
        if key is not None:
            spelling.setdefault(key, text.strip())  # golds come first, so a gold label keeps the gold spelling
    gold_set = sorted(set(gold_keys))
    keys = gold_set + sorted(set(pred_keys) - set(gold_set) - {None}) + ([None] if None in pred_keys else [])
    index = {key: i for i, key in enumerate(keys)}
    matrix = [[0] * len(keys) for _ in keys]
    for p, g in zip(pred_keys, gold_keys):
        matrix[index[g]][index[p]] += 1
    return {"labels": [UNPARSED if key is None else spelling[key] for key in keys], "matrix": matrix}
