"""Two models' answers to the same rows side by side (``qatune eval RUN --data FILE --compare OTHER``): how each
metric moved, and which rows went from right to wrong and from wrong to right.

"Right -> wrong" means right with the other model and wrong with the run: the other is what the run is measured
against (the model before fine-tuning, an earlier run, a GGUF file), and every delta is run minus other.

Whether a row is right: for a run with one answer, its exact match. For a grading run (answer fields), one field
decides (:func:`choose_judge`): the first label field (the gold label), else the first number field (within its
tolerance), else the first text field (token F1 of at least 50). An answer that does not follow the answer
template is wrong in every field.

:func:`compare`, :func:`render_markdown` and :func:`render_csv` are pure functions of the records and the two
lists of predictions; :func:`compare_run` evaluates the models and writes compare-NAME.md and compare-NAME.csv.
"""

from __future__ import annotations

import csv
import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qatune.data.grading_fields import AnswerTemplate, FieldSpec, label_key
from qatune.data.spreadsheet import QARecord
from qatune.data.templates import PromptTemplate
from qatune.errors import ConfigError
from qatune.inference.evaluate import (
    Evaluation,
    base_name,
    base_predictions,
    check_base,
    evaluate_records,
    run_evaluation,
)
from qatune.inference.field_metrics import grading_metrics
from qatune.inference.generate import run_answer_template, uses_context
from qatune.inference.grounding import with_grounding
from qatune.inference.metrics import best_scores, f1
from qatune.inference.run_model import load_run_model, read_run
from qatune.model.folder import ModelInfo
from qatune.runs import atomic, layout

log = logging.getLogger("qatune")

BASE = "base"
"""``--compare base``: the run's own pretrained model, before fine-tuning."""

RIGHT_TO_WRONG, WRONG_TO_RIGHT, SAME = "right->wrong", "wrong->right", "same"
"""A row's ``change``: right with the other and wrong with the run, the reverse, or neither."""

MAIN_METRICS = {"number": ("mae", "within_tolerance", "exact", "spearman"), "label": ("accuracy", "macro_f1"),
                "text": ("token_f1", "rouge_l", "bleu")}
"""The metrics of a field that a comparison shows, by the field's kind."""

ANSWER_METRICS = ("exact_match", "f1", "loss")
"""The metrics a comparison of runs with one answer shows."""

TEXT_RIGHT_F1 = 50.0
"""A text field is right when its token F1 against the gold text is at least this (0-100)."""

_SLACK = 1e-9  # as field_metrics: 1.1 - 0.85 must not miss a tolerance of 0.25 by float rounding

_NAMES = {"mae": "MAE (lower is better)", "within_tolerance": "within tolerance (%)", "exact": "exact (%)",
          "spearman": "Spearman", "accuracy": "accuracy (%)", "macro_f1": "macro F1", "token_f1": "token F1",
          "rouge_l": "ROUGE-L", "bleu": "BLEU", "exact_match": "exact match", "f1": "F1",
          "loss": "loss (lower is better)", "parse_rate": "answers that parse (%)"}
_THREE_DIGITS = {"mae", "spearman", "loss"}


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
    of answers that parse and each field's MAIN_METRICS instead. A delta is run minus other (None when either is)."""
    if not kinds:
        return {name: _delta(run_metrics.get(name), other_metrics.get(name)) for name in ANSWER_METRICS}
    run_fields, other_fields = run_metrics.get("fields", {}), other_metrics.get("fields", {})
    return {
        "parse_rate": _delta(run_metrics.get("parse_rate"), other_metrics.get("parse_rate")),
        "fields": {name: {metric: _delta(run_fields.get(name, {}).get(metric), other_fields.get(name, {}).get(metric))
                          for metric in MAIN_METRICS[spec.kind]}
                   for name, spec in _specs(kinds).items()},
    }


def _delta(run: float | None, other: float | None) -> dict[str, float | None]:
    return {"run": run, "other": other, "delta": None if run is None or other is None else run - other}


# --- files


def render_markdown(comparison: Comparison, run_name: str, other_name: str, data_name: str,
                    notes: list[str] | tuple[str, ...] = ()) -> str:
    """compare-NAME.md: who is compared, the deltas, then the rows that went right -> wrong and those that went
    wrong -> right (and, for one answer, the rows whose F1 fell), each with the question, gold and both answers."""
    summary = comparison.summary()
    counts = summary["counts"]
    text = [f"# Comparison on {data_name}", "",
            f"- **run**: {run_name}", f"- **other**: {other_name}",
            f"- a row is right when {comparison.judge.describe()}"
            + (f" (the first {comparison.judge.kind} field decides)" if comparison.judge.field else ""),
            f"- {counts['rows']} rows; right: run {counts['right']['run']}, other {counts['right']['other']}; "
            f"right -> wrong (right with the other, wrong with the run): {counts['right_to_wrong']}; "
            f"wrong -> right: {counts['wrong_to_right']}; the same: {counts['same']}"]
    if counts["unparsed"] is not None:
        text.append(f"- answers without every field of the answer template (wrong in each field missing): run "
                    f"{counts['unparsed']['run']}, other {counts['unparsed']['other']}")
    text += [f"- {note}" for note in notes]
    text += ["", "## Metrics", "", "| metric | run | other | run − other |", "|---|---:|---:|---:|"]
    text += [f"| {label} | {_number(d['run'], metric)} | {_number(d['other'], metric)} | "
             f"{_number(d['delta'], metric, sign=True)} |" for label, metric, d in _delta_rows(comparison.deltas)]
    for title, rows in (("Right -> wrong", comparison.flips(RIGHT_TO_WRONG)),
                        ("Wrong -> right", comparison.flips(WRONG_TO_RIGHT))):
        text += ["", f"## {title} ({len(rows)})", ""]
        text += _row_table(rows) if rows else ["None."]
    if not comparison.fields:
        drops = comparison.f1_drops()
        text += ["", f"## F1 fell, exact match unchanged ({len(drops)})", ""]
        text += _row_table(drops, with_f1=True) if drops else ["None."]
    return "\n".join(text) + "\n"


def render_csv(comparison: Comparison) -> str:
    """compare-NAME.csv: one line per row of the file with both answers, what decides each side's rightness
    (exact match and F1; for a grading run, whether each answer parsed and each field's value and rightness), and
    the ``change``. Rightness is ``true``/``false``, empty where a gold cannot be scored."""
    sides = ("run", "other")
    header = ["row", "question", "gold", "answer (run)", "answer (other)", "em (run)", "em (other)", "f1 (run)",
              "f1 (other)"]
    if comparison.fields:
        header += ["parsed (run)", "parsed (other)"]
        for name in comparison.fields:
            header += [f"{name} (gold)", f"{name} (run)", f"{name} (other)", f"{name} right (run)",
                       f"{name} right (other)"]
    header += ["right (run)", "right (other)", "change"]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    for row in comparison.rows:
        run, other = row.run, row.other
        line: list[Any] = [row.record.row, row.record.question, " | ".join(row.record.answers), run.answer,
                           other.answer, round(run.em), round(other.em), run.f1, other.f1]
        if comparison.fields:
            line += [_flag(run.whole()), _flag(other.whole())]
            for name in comparison.fields:
                line.append(row.record.answer_fields.get(name, ""))
                line += [(getattr(row, side).parsed or {}).get(name, "") for side in sides]
                line += [_flag(getattr(row, side).fields.get(name)) for side in sides]
        line += [_flag(run.right), _flag(other.right), row.change]
        writer.writerow(line)
    return buffer.getvalue()


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """What ``qatune eval --compare`` prints: whom it compared with, the rows that flipped, the deltas."""
    counts = summary["counts"]
    lines = [f"compared with {summary['other']}: a row is right when {summary['decided_by']['rule']}",
             f"  right: run {counts['right']['run']} of {counts['rows']}, other {counts['right']['other']}; "
             f"right -> wrong {counts['right_to_wrong']}, wrong -> right {counts['wrong_to_right']}"
             + (f"; F1 fell on {counts['f1_drops']} rows of unchanged exact match" if counts["f1_drops"] else "")]
    for label, metric, d in _delta_rows(summary["deltas"]):
        lines.append(f"  {label}: run {_number(d['run'], metric)}, other {_number(d['other'], metric)} "
                     f"({_number(d['delta'], metric, sign=True)})")
    return lines


def _delta_rows(deltas: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, metric, its delta) for each metric of ``deltas``, in order."""
    rows = [(_NAMES.get(metric, metric), metric, d) for metric, d in deltas.items() if metric != "fields"]
    for name, metrics in deltas.get("fields", {}).items():
        rows += [(f"{name}: {_NAMES.get(metric, metric)}", metric, d) for metric, d in metrics.items()]
    return rows


def _row_table(rows: list[RowChange], with_f1: bool = False) -> list[str]:
    header = "| row | question | gold | run | other |" + (" F1 run | F1 other |" if with_f1 else "")
    lines = [header, "|---:|---|---|---|---|" + ("---:|---:|" if with_f1 else "")]
    for row in rows:
        cells = [str(row.record.row), _cell(row.record.question), _cell(" | ".join(row.record.answers)),
                 _answer_cell(row.run), _answer_cell(row.other)]
        if with_f1:
            cells += [f"{row.run.f1:.0f}", f"{row.other.f1:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _answer_cell(side: Side) -> str:
    unparsed = side.fields and not side.whole()
    return _cell(side.answer) + (" *(misses fields of the answer template)*" if unparsed else "")


def _cell(text: str) -> str:
    """A table cell: | escaped, line breaks as <br>; (empty) for an empty text."""
    text = str(text).strip().replace("|", "\\|")
    return "<br>".join(line.strip() for line in text.splitlines()) if text else "*(empty)*"


def _number(value: float | None, metric: str, sign: bool = False) -> str:
    if value is None:
        return "n/a"
    digits = 3 if metric in _THREE_DIGITS else 1
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def _flag(value: bool | None) -> str:
    return "" if value is None else "true" if value else "false"


# --- the command


def compare_run(run_dir: str | Path, data_file: str | Path, other: str, which: str = layout.FINAL,
                batch_size: int | None = None, progress: bool = False,
                reading: list[str] | tuple[str, ...] = (), grounded: str | None = None
                ) -> tuple[Evaluation, dict[str, Any]]:
    """Evaluate a run on a file, as ``qatune eval`` does (writing its results), then ``other`` on the same rows,
    and write compare-NAME.md and compare-NAME.csv beside the run's results.

    ``other``: "base" (the run's pretrained model before fine-tuning, prompted as the run is), another run
    directory or model folder, or a .gguf file. Each model is asked with the prompt it was trained with; both
    answers are scored with the run's answer fields. Returns the run's evaluation and the comparison's JSON
    summary (:meth:`Comparison.summary`, with ``other`` and ``files``). ``grounded``: generate.grounded for both
    models (None: each its own setting; auto is off for the base model).
    """
    config, info = read_run(run_dir, which)  # every problem with the other is found before a model loads
    if other == BASE:
        check_base(config, "--compare base")
    else:
        check_comparable(info, read_run(other)[1], str(run_dir), other)
    run = run_evaluation(run_dir, data_file, which, batch_size, progress, reading, grounded)
    if other == BASE:
        based = config.model_copy(update={"generate": with_grounding(config.generate, grounded)})
        other_metrics, other_predictions, asked = base_predictions(based, run.records, batch_size, progress)
        other_name = base_name(config)
    else:
        loaded = load_run_model(other)
        other_metrics, other_predictions = evaluate_records(
            loaded.model, loaded.tokenizer, loaded.info, run.records, with_grounding(loaded.config.generate, grounded),
            batch_size or loaded.config.train.eval_batch_size, progress, loaded.config.train.speedups)
        asked, other_name = loaded.info, str(loaded.folder)
        del loaded
    template = run_answer_template(run.info)
    if template is not None:  # both sides scored with the run's fields, kinds and template
        other_metrics.update(grading_metrics(run.info.specs(), [template.parse(p) for p in other_predictions],
                                             [r.answer_fields for r in run.records]))
    comparison = compare(run.records, run.predictions, other_predictions, run.metrics, other_metrics,
                         run.info.specs(), template)
    notes = []
    if (asked.prompt_template, asked.answer_prefix) != (run.info.prompt_template, run.info.answer_prefix):
        notes.append(f"the two models are asked with different prompts: the run with "
                     f"{run.info.prompt_template!r}, the other with {asked.prompt_template!r}")
    if run.metrics.get("grounded") != other_metrics.get("grounded"):
        on, off = ("the run", "the other") if run.metrics.get("grounded") else ("the other", "the run")
        notes.append(f"{on} answered with spans of the passage (grounded decoding), {off} freely; --grounded on or off "
                     "decodes both alike")
    stem = run.paths["metrics"].stem.removeprefix("eval-")
    paths = {"markdown": run.paths["metrics"].parent / f"compare-{stem}.md",
             "csv": run.paths["metrics"].parent / f"compare-{stem}.csv"}
    atomic.atomic_write_text(paths["markdown"], render_markdown(comparison, run.metrics["model"], other_name,
                                                                Path(data_file).name, notes))
    atomic.atomic_write_text(paths["csv"], render_csv(comparison))
    summary = {"other": other_name, **comparison.summary(), "files": {k: str(v) for k, v in paths.items()}}
    return run, summary


def check_comparable(info: ModelInfo, other: ModelInfo, run_name: str, other_name: str) -> None:
    """Refuse another model that cannot answer the run's rows, or writes its answers in other fields."""
    problems = []
    if other.answer_fields and info.answer_fields and (
            (list(other.answer_fields), other.answer_template) != (list(info.answer_fields), info.answer_template)):
        problems.append(f"it writes the answer fields {list(other.answer_fields)} as {other.answer_template!r}, the "
                        f"run {list(info.answer_fields)} as {info.answer_template!r}; compare models that write the "
                        "same answer columns with the same data.answer_template")
    if uses_context(other) and not uses_context(info):
        problems.append(f"it reads a context, which {run_name} does not, so the rows are read without one")
    if other.task != "extractive":
        given = set(PromptTemplate(info.prompt_template).fields)
        missing = sorted(set(PromptTemplate(other.prompt_template).fields) - given)
        if missing:
            problems.append(f"its prompt names the column(s) {missing}, which the prompt of {run_name} does not, so "
                            "the rows are read without them")
    if problems:
        raise ConfigError(f"--compare {other_name}: {'; '.join(problems)}")
