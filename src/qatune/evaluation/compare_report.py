"""A comparison's files and the command that makes them (``qatune eval RUN --data FILE --compare OTHER``):
:func:`compare_run` evaluates both models and writes compare-NAME.md and compare-NAME.csv; :func:`render_markdown`,
:func:`render_csv` and :func:`summary_lines` are pure functions of a :class:`~qatune.evaluation.compare.Comparison`.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from qatune.data.templates import PromptTemplate
from qatune.errors import ConfigError
from qatune.evaluation.compare import BASE, RIGHT_TO_WRONG, WRONG_TO_RIGHT, Comparison, RowChange, Side, compare
from qatune.evaluation.evaluate import (
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
from qatune.inference.metric_records import METRICS
from qatune.inference.run_model import load_run_model, read_run
from qatune.model.folder import ModelInfo
from qatune.runs import atomic, layout
from qatune.tasks import task_kind

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
    rows = [(_heading(metric), metric, d) for metric, d in deltas.items() if metric != "fields"]
    for name, metrics in deltas.get("fields", {}).items():
        rows += [(f"{name}: {_heading(metric)}", metric, d) for metric, d in metrics.items()]
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
    return METRICS[metric].shown(value, sign) if metric in METRICS else "n/a" if value is None else f"{value:.1f}"


def _heading(metric: str) -> str:
    return METRICS[metric].heading if metric in METRICS else metric


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
    notes = [other_metrics["note"]] if other == BASE and "note" in other_metrics else []
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
    summary = {"other": other_name, **comparison.summary(), **({"notes": notes} if notes else {}),
               "files": {k: str(v) for k, v in paths.items()}}
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
    if not task_kind(other.task).points:
        given = set(PromptTemplate(info.prompt_template).fields)
        missing = sorted(set(PromptTemplate(other.prompt_template).fields) - given)
        if missing:
            problems.append(f"its prompt names the column(s) {missing}, which the prompt of {run_name} does not, so "
                            "the rows are read without them")
    if problems:
        raise ConfigError(f"--compare {other_name}: {'; '.join(problems)}")
