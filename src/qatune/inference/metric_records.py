"""Every metric qatune reports, described once: its key in the metrics JSON, how people read it, its digits, whether
higher is better and what it applies to (a run's whole answer, or an answer field of a kind). eval's printout,
``--compare``'s table and markdown, the training log and report, and the page read these records; the functions
that compute the values live with their kind (metrics.py: exact match and F1; field_metrics.py: the fields').

Adding a metric: compute it where its kind's are computed, and add its record here.
"""

from __future__ import annotations

from dataclasses import dataclass

ANSWER, FIELDS = "answer", "fields"
"""What the metrics of a run's whole answer apply to, and those of a grading run's answer as a whole (its fields'
apply to their kind: number, label or text)."""


@dataclass(frozen=True)
class Metric:
    name: str
    """Its key in the metrics JSON (eval --json, metrics.jsonl, eval-NAME.json)."""
    label: str
    digits: int
    higher_is_better: bool
    applies_to: tuple[str, ...]
    """ANSWER, or the answer field kinds it is computed for."""
    unit: str = ""
    """"%" for a share in 0-100."""
    compared: bool = True
    """Shown in a comparison of two models (--compare) and the page's."""

    def shown(self, value: float | None, sign: bool = False, unit: bool = False) -> str:
        """The value as people read it, with its digits; n/a for none; ``sign``: a difference's + or -; ``unit``:
        followed by its unit (a table's heading says it instead)."""
        if value is None:
            return "n/a"
        return (f"{value:+.{self.digits}f}" if sign else f"{value:.{self.digits}f}") + (self.unit if unit else "")

    @property
    def heading(self) -> str:
        """Its label with its unit and direction, for a table's row."""
        unit = " (%)" if self.unit == "%" else ""
        return f"{self.label}{unit}" + ("" if self.higher_is_better else " (lower is better)")


METRICS = {metric.name: metric for metric in (
    Metric("exact_match", "exact match", 1, True, (ANSWER,)),
    Metric("f1", "F1", 1, True, (ANSWER,)),
    Metric("loss", "loss", 3, False, (ANSWER,)),
    Metric("perplexity", "perplexity", 2, False, (ANSWER,), compared=False),
    Metric("parse_rate", "answers that parse", 1, True, (FIELDS,), unit="%"),
    Metric("mae", "MAE", 3, False, ("number",)),
    Metric("within_tolerance", "within tolerance", 1, True, ("number",), unit="%"),
    Metric("exact", "exact", 1, True, ("number",), unit="%"),
    Metric("spearman", "Spearman", 3, True, ("number",)),
    Metric("accuracy", "accuracy", 1, True, ("label",), unit="%"),
    Metric("macro_f1", "macro F1", 1, True, ("label",)),
    Metric("token_f1", "token F1", 1, True, ("text",)),
    Metric("rouge_l", "ROUGE-L", 1, True, ("text",)),
    Metric("bleu", "BLEU", 1, True, ("text",)),
)}


def metrics_of(kind: str, compared: bool = False) -> tuple[str, ...]:
    """The names of the metrics of a field kind (or ANSWER), in their order here; ``compared``: only those a
    comparison shows."""
    return tuple(name for name, metric in METRICS.items()
                 if kind in metric.applies_to and (metric.compared or not compared))



VALIDATED = ("loss", "exact_match", "f1")
"""What validation after each epoch reports of a run's whole answer, in this order: the training log, report.md's
table and the page's read it (a grading run's fields have their own section)."""


def said(values: dict, names: tuple[str, ...] = VALIDATED) -> str:
    """``loss 1.234, exact match 48.7, F1 57.6``: the metrics ``names`` of ``values`` (a metrics dict), each as its
    record shows it."""
    return ", ".join(f"{METRICS[name].label} {METRICS[name].shown(values.get(name), unit=True)}" for name in names)


def columns(names: tuple[str, ...] = VALIDATED) -> list[dict]:
    """The metrics ``names`` as a table's columns: key, label and digits (the page draws its tables from them)."""
    return [{"name": name, "label": METRICS[name].label, "digits": METRICS[name].digits} for name in names]
