"""Two models' answers to the same rows side by side (``qatune eval RUN --data FILE --compare OTHER``): how each
metric moved, and which rows went from right to wrong and from wrong to right.

"Right -> wrong" means right with the other model and wrong with the run: the other is what the run is measured
against (the model before fine-tuning, an earlier run, a GGUF file), and every delta is run minus other.

Whether a row is right: for a run with one answer, its exact match. For a grading run (answer fields), one field
decides (:func:`choose_judge`): the first label field (the gold label), else the first number field (within its
tolerance), else the first text field (token F1 of at least 50). An answer that does not follow the answer
template is wrong in every field.

:func:`compare` is a pure function of the records and the two lists of predictions; the files and the command
(:func:`qatune.evaluation.compare_report.compare_run`) are in compare_report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qatune.data.grading_fields import AnswerTemplate, FieldSpec, label_key
from qatune.data.spreadsheet import QARecord
from qatune.inference.metric_records import ANSWER, metrics_of
from qatune.inference.metrics import best_scores, f1

BASE = "base"
"""``--compare base``: the run's own pretrained model, before fine-tuning."""

RIGHT_TO_WRONG, WRONG_TO_RIGHT, SAME = "right->wrong", "wrong->right", "same"
"""A row's ``change``: right with the other and wrong with the run, the reverse, or neither."""

TEXT_RIGHT_F1 = 50.0
"""A text field is right when its token F1 against the gold text is at least this (0-100)."""

_SLACK = 1e-9  # as field_metrics: 1.1 - 0.85 must not miss a tolerance of 0.25 by float rounding

@dataclass(frozen=True)
class Judge:
    """What decides whether a row is right: one answer field of a grading run, or the whole answer's exact match."""

    field: str | None = None
    kind: str | None = None
    tolerance: float = 0.0

    def describe(self) -> str:
        if self.field is None:
            return "its answer is an exact match of a gold answer"
        if self.kind == "label":
            return f"its {self.field} is the gold label (ignoring case, spacing and punctuation)"
        if self.kind == "number":
            return f"its {self.field} is within {self.tolerance:g} of the gold value"
        return f"its {self.field} has a token F1 of at least {TEXT_RIGHT_F1:g} against the gold text"

    def summary(self) -> dict[str, Any]:
        return {"field": self.field, "kind": self.kind,
                "tolerance": self.tolerance if self.kind == "number" else None, "rule": self.describe()}


@dataclass(frozen=True)
class Side:
    """One model's answer to one row, judged."""

    answer: str
    em: float
    """0 or 100."""
    f1: float
    """0-100, the best over the gold answers."""
    parsed: dict[str, str] | None
    """A grading run's fields the answer has; None when it has not even the first (or the run has no fields)."""
    fields: dict[str, bool | None]
    """Whether each answer field is right; None where its gold cannot be scored (a number field's gold that is no
    number)."""
    right: bool

    def whole(self) -> bool:
        """Whether the answer has every field of the answer template."""
        return self.parsed is not None and len(self.parsed) == len(self.fields)


@dataclass(frozen=True)
class RowChange:
    """One row with both models' answers."""

    record: QARecord
    run: Side
    other: Side

    @property
    def change(self) -> str:
        if self.other.right and not self.run.right:
            return RIGHT_TO_WRONG
        if self.run.right and not self.other.right:
            return WRONG_TO_RIGHT
        return SAME


@dataclass(frozen=True)
class Comparison:
    judge: Judge
    rows: list[RowChange]
    deltas: dict[str, Any]
    """Run and other and their difference for each metric shown: ``{"exact_match": {"run", "other", "delta"}, ...}``
    or, for a grading run, ``{"parse_rate": {...}, "fields": {FIELD: {METRIC: {...}}}}``."""
    fields: tuple[str, ...] = ()
    """A grading run's answer fields, in the order of its answers; empty for one answer."""

    def flips(self, change: str) -> list[RowChange]:
        """The rows of one change, in the order of the file."""
        return [row for row in self.rows if row.change == change]

    def f1_drops(self) -> list[RowChange]:
        """Rows of a run with one answer whose F1 fell without their exact match changing, the largest drop first
        (rows of equal drops in the order of the file)."""
        if self.fields:
            return []
        dropped = [row for row in self.rows if row.change == SAME and row.run.f1 < row.other.f1]
        return sorted(dropped, key=lambda row: row.run.f1 - row.other.f1)  # stable: ties keep the file's order

    def summary(self) -> dict[str, Any]:
        """The JSON summary: the deciding rule, the deltas and the counts of each change."""
        counts = {change: len(self.flips(change)) for change in (RIGHT_TO_WRONG, WRONG_TO_RIGHT, SAME)}
        return {
            "decided_by": self.judge.summary(),
            "deltas": self.deltas,
            "counts": {
                "rows": len(self.rows),
                "right": {"run": sum(r.run.right for r in self.rows), "other": sum(r.other.right for r in self.rows)},
                "right_to_wrong": counts[RIGHT_TO_WRONG], "wrong_to_right": counts[WRONG_TO_RIGHT],
                "same": counts[SAME],
                "f1_drops": None if self.fields else len(self.f1_drops()),
                "unparsed": ({"run": sum(not r.run.whole() for r in self.rows),
                              "other": sum(not r.other.whole() for r in self.rows)} if self.fields else None),
            },
        }


Specs = dict[str, FieldSpec | str]
"""A grading run's answer fields: each one's FieldSpec, or only its kind."""


def choose_judge(kinds: Specs | None, tolerances: dict[str, float] | None = None) -> Judge:
    """The field that decides whether a row is right: the first label field, else the first number field (with
    its tolerance: its spec's, else from ``tolerances``, else 0), else the first text field; exact match without
    fields."""
    if not kinds:
        return Judge()
    specs = _specs(kinds)
    for kind in ("label", "number", "text"):
        for name, spec in specs.items():
            if spec.kind == kind:
                return Judge(name, kind, _tolerance(spec, name, tolerances) if kind == "number" else 0.0)
    return Judge()


def _specs(kinds: Specs) -> dict[str, FieldSpec]:
    return {name: FieldSpec(spec) if isinstance(spec, str) else spec for name, spec in kinds.items()}


def _tolerance(spec: FieldSpec, name: str, tolerances: dict[str, float] | None) -> float:
    return spec.tolerance if spec.tolerance is not None else (tolerances or {}).get(name, 0.0)


def compare(records: list[QARecord], run_predictions: list[str], other_predictions: list[str],
            run_metrics: dict[str, Any], other_metrics: dict[str, Any], kinds: Specs | None = None,
            template: AnswerTemplate | None = None) -> Comparison:
    """Judge both models' answers row by row and take the deltas of their metrics.

    ``kinds`` and ``template``: a grading run's answer fields (their specs, or kinds) and answer template (both
    models' answers are parsed with it); the metrics then have ``fields``
    (:func:`qatune.inference.field_metrics.grading_metrics`), whose number fields' ``tolerance`` is the one a row
    is judged with where the field has no spec of its own.
    """
    kinds = kinds if template is not None else None
    tolerances = {name: field["tolerance"] for name, field in run_metrics.get("fields", {}).items()
                  if "tolerance" in field}
    judge = choose_judge(kinds, tolerances)
    rows = [RowChange(record, judge_answer(record, ours, judge, kinds, template, tolerances),
                      judge_answer(record, theirs, judge, kinds, template, tolerances))
            for record, ours, theirs in zip(records, run_predictions, other_predictions, strict=True)]
    return Comparison(judge, rows, metric_deltas(run_metrics, other_metrics, kinds),
                      tuple(template.columns) if kinds and template is not None else ())


def judge_answer(record: QARecord, answer: str, judge: Judge, kinds: Specs | None = None,
                 template: AnswerTemplate | None = None, tolerances: dict[str, float] | None = None) -> Side:
    """One answer to ``record``, judged: exact match and F1 of the whole text, each field's rightness, and
    whether the row is right by ``judge``."""
    em, f1_score = best_scores(answer, record.answers)
    if not kinds or template is None:
        return Side(answer, 100.0 * em, round(100.0 * f1_score, 2), None, {}, em == 1.0)
    parsed = template.parse(answer)
    fields = {name: field_right(spec, None if parsed is None else parsed.get(name), record.answer_fields.get(name, ""),
                                _tolerance(spec, name, tolerances))
              for name, spec in _specs(kinds).items()}
    return Side(answer, 100.0 * em, round(100.0 * f1_score, 2), parsed, fields, bool(fields.get(judge.field)))


def field_right(spec: FieldSpec | str, predicted: str | None, gold: str, tolerance: float = 0.0) -> bool | None:
    """Whether one field's predicted value is right (None: not predicted, so wrong); None when the gold cannot be
    scored (blank, or a number field's gold that is no number). Numbers are read with the spec's decimal
    separator; labels compared ignoring case, spacing and punctuation."""
    spec = FieldSpec(spec) if isinstance(spec, str) else spec
    kind = spec.kind
    if kind == "number":
        gold_value = spec.number(gold)
        if gold_value is None:
            return None
        value = spec.number(predicted)
        return value is not None and abs(value - gold_value) <= tolerance + _SLACK
    if not gold.strip():
        return None
    if predicted is None:
        return False
    if kind == "label":
        return label_key(predicted) == label_key(gold)
    return 100.0 * f1(predicted, gold) >= TEXT_RIGHT_F1


def metric_deltas(run_metrics: dict[str, Any], other_metrics: dict[str, Any],
                  kinds: Specs | None = None) -> dict[str, Any]:
    """``{METRIC: {"run", "other", "delta"}}`` of exact match, F1 and loss; for a grading run (``kinds``) the share
    of answers that parse and each field's metrics instead (those metric_records marks compared). A delta is run minus
    other (None when either is)."""
    if not kinds:
        return {name: _delta(run_metrics.get(name), other_metrics.get(name))
                for name in metrics_of(ANSWER, compared=True)}
    run_fields, other_fields = run_metrics.get("fields", {}), other_metrics.get("fields", {})
    return {
        "parse_rate": _delta(run_metrics.get("parse_rate"), other_metrics.get("parse_rate")),
        "fields": {name: {metric: _delta(run_fields.get(name, {}).get(metric), other_fields.get(name, {}).get(metric))
                          for metric in metrics_of(spec.kind, compared=True)}
                   for name, spec in _specs(kinds).items()},
    }


def _delta(run: float | None, other: float | None) -> dict[str, float | None]:
    return {"run": run, "other": other, "delta": None if run is None or other is None else run - other}
