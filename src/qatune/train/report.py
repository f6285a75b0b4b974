"""report.md and loss.png for a run directory, written from its files alone.

Reads run.json (status, data report, result), metrics.jsonl (loss, lr, evaluations) and
predictions-validation.csv (the last validation pass) and writes a short Markdown report with the
loss and learning-rate curves (matplotlib, headless) and the 10 worst validation predictions. A grading
run's report adds its answer fields on the last validation: their scores, a confusion matrix per label
field and predicted against gold per number field (confusion-validation-FIELD.png, scores-validation-FIELD.png).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from qatune.data.spreadsheet import describe_validation
from qatune.evaluation.evaluate import field_summary
from qatune.inference.field_plots import write_field_pictures
from qatune.inference.metric_records import METRICS, VALIDATED
from qatune.runs import atomic, layout

log = logging.getLogger("qatune")


def draw_in_background(run_dir: str | Path) -> Future[bytes | None]:
    """Start drawing loss.png on a thread of its own, from metrics.jsonl as it is now (call it once nothing
    more will be logged). Importing matplotlib and drawing take a training run ~0.9 s of Python; run while
    the last checkpoint is written, which mostly waits on the disk, most of it is hidden. Pass the result to
    :func:`write_report`."""
    drawn: Future[bytes | None] = Future()
    train, evals = _metrics(Path(run_dir))

    def draw() -> None:
        try:
            drawn.set_result(_draw_yielding(train, evals))
        except BaseException as exc:  # handed to write_report, which reports it
            drawn.set_exception(exc)

    # A daemon: a process that ends before the report (an error) does not wait for the plot.
    threading.Thread(target=draw, name="qatune-plot", daemon=True).start()
    return drawn


def write_report(run_dir: str | Path, drawn: Future[bytes | None] | None = None) -> Path:
    """report.md and loss.png; ``drawn``: the plot from :func:`draw_in_background` (else it is drawn here)."""
    run_dir = Path(run_dir)
    status = layout.read_status(run_dir)
    train, evals = _metrics(run_dir)
    png = drawn.result() if drawn is not None else _draw(train, evals)
    plot = run_dir / layout.LOSS_PLOT if png is not None else None
    if plot is not None:
        atomic.atomic_write_bytes(plot, png)
    text = [f"# qatune run: {run_dir.name}", ""]
    text += [(f"- status: **{status.get('status', 'unknown')}**, task: {status.get('task', '?')}, "
              f"qatune {status.get('qatune_version', '?')}"),
             f"- started {status.get('started', '?')}, finished {status.get('finished', '-')}", ""]
    text += ["## Data", "", *_data_section(status.get("data", {}), status.get("max_length")), ""]
    result = status.get("result", {})
    text += ["## Training", ""]
    if train:
        text.append(f"- {result.get('steps', train[-1]['step'])} optimizer steps; training loss "
                    f"{_num(result.get('first_train_loss', train[0]['loss']))} at step 1 -> "
                    f"{_num(result.get('final_train_loss', train[-1]['loss']))} at the end")
    if result.get("peak_memory_mb"):
        text.append(f"- peak memory: {result['peak_memory_mb'] / 1024:.2f} GiB in the largest process "
                    "(resident set size on a CPU, CUDA's allocation on a GPU)")
    if result.get("nonfinite_steps"):
        text.append(f"- non-finite steps (not applied): {result['nonfinite_steps']}")
    text += ["", f"![loss and learning rate]({plot.name})" if plot else "(loss.png not written: matplotlib is "
             "not installed; pip install matplotlib)", ""]
    text += ["## Evaluation", ""]
    if evals:
        shown = [METRICS[name] for name in VALIDATED]
        text += ["| epoch | step | " + " | ".join(m.label for m in shown) + " | examples |",
                 "|---:|---:|" + "---:|" * len(shown) + "---:|"]
        text += [f"| {e['epoch']} | {e['step']} | " + " | ".join(m.shown(e.get(m.name)) for m in shown)
                 + f" | {e['num_examples']} |" for e in evals]
        best = result.get("best_eval")
        if best:
            text += ["", f"Best: epoch {best['epoch']} (saved in best/)."]
    else:
        text.append("No validation data (set data.eval_file or data.validation_fraction).")
    text += _fields_section(run_dir, evals[-1] if evals else {})
    worst = _worst_predictions(run_dir / layout.VALIDATION_PREDICTIONS)
    if worst:
        text += ["", "## The 10 worst validation predictions", "",
                 "| row | question | gold | prediction | F1 |", "|---:|---|---|---|---:|"]
        text += [f"| {r['row']} | {_cell(r['question'])} | {_cell(r['gold'])} | {_cell(r['prediction'])} | "
                 f"{float(r['f1']):.0f} |" for r in worst]
    path = run_dir / layout.REPORT
    atomic.atomic_write_text(path, "\n".join(text) + "\n")
    return path


def _fields_section(run_dir: Path, last: dict[str, Any]) -> list[str]:
    """A grading run's answer fields on its last validation (``last``: that evaluation's record): the scores of
    each field, and the pictures of its label and number fields, drawn from predictions-validation.csv."""
    fields = last.get("fields")
    if not fields:
        return []
    rows = _read_rows(run_dir / layout.VALIDATION_PREDICTIONS)
    golds = {name: [r.get(f"{name} (gold)", "") for r in rows] for name in fields} if rows else {}
    predicted = {name: [r.get(f"{name} (predicted)", "") if r.get("parsed") == "true" else None for r in rows]
                 for name in fields}
    pictures = write_field_pictures(run_dir, "validation", fields, golds, predicted)
    text = ["", "## Answer fields", "", f"On the last validation (epoch {last.get('epoch', '?')}, step "
            f"{last.get('step', '?')}):", ""]
    text += [f"- {line.strip()}" for line in field_summary(last)]
    if pictures:
        text.append("")
        for key, path in pictures.items():
            kind, _, field = key.partition(" ")
            what = "confusion matrix" if kind == "confusion" else "predicted against gold"
            text.append(f"![{field}: {what}]({path.name})")
    return text


def _data_section(data: dict[str, Any], max_length: Any) -> list[str]:
    lines = []
    for key in ("train_file", "eval_file"):
        report = data.get(key)
        if not report:
            continue
        dropped = ", ".join(f"{len(rows)} {reason}" for reason, rows in report.get("dropped", {}).items()) or "none"
        lines.append(f"- {key}: {report['file']}: {report['rows_read']} rows read, {report['kept']} kept; "
                     f"dropped: {dropped}; duplicates: {report.get('duplicates', 0)}")
    if data.get("validation"):
        lines.append(f"- validation: {describe_validation(data['validation'])}")
    encoding = data.get("encoding", {})
    if max_length is not None:
        lines.append(f"- max_length: {max_length}")
    if encoding.get("lengths"):
        n = encoding["lengths"]
        lines.append(f"- tokens per example: min {n['min']}, median {n['median']}, p95 {n['p95']}, max {n['max']}; "
                     f"questions shortened: {len(encoding.get('truncated_rows', []))}, "
                     f"dropped as too long: {len(encoding.get('too_long_rows', []))}")
    if "span_audit" in encoding:
        audit = encoding["span_audit"]
        lines.append(f"- windows: {encoding['windows']} ({encoding['windows_without_answer']} without the answer); "
                     f"span audit: {100 * audit['share']:.1f}% of {audit['checked']} labelled spans decode to "
                     f"the answer, {len(audit['mismatches'])} mismatches")
    return lines


def _draw_yielding(train: list[dict], evals: list[dict]) -> bytes | None:
    """_draw, handing the interpreter lock back every 0.2 ms instead of 5: each of the checkpoint's writes and
    fsyncs (on the main thread meanwhile) gives it up and must get it back."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)
    try:
        return _draw(train, evals)
    finally:
        sys.setswitchinterval(before)


def _metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """The training and the evaluation records of metrics.jsonl."""
    lines = [json.loads(x) for x in _read_text(run_dir / layout.METRICS).splitlines() if x.strip()]
    return [x for x in lines if x.get("event") == "train"], [x for x in lines if x.get("event") == "eval"]


def _draw(train: list[dict], evals: list[dict]) -> bytes | None:
    """loss.png's bytes (None: nothing logged, or no matplotlib)."""
    if not train:
        return None
    try:
        # A Figure of its own renders to PNG without pyplot, its backends and its global figure list
        # (importing pyplot costs a training run ~0.1 s more).
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(7, 6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot([x["step"] for x in train], [x["loss"] for x in train], label="training loss")
    points = [x for x in evals if x.get("loss") is not None]
    if points:
        top.plot([x["step"] for x in points], [x["loss"] for x in points], "o-", label="validation loss")
    top.set_ylabel("loss")
    top.legend()
    top.grid(alpha=0.3)
    bottom.plot([x["step"] for x in train], [x["lr"] for x in train], color="tab:orange")
    bottom.set_ylabel("learning rate")
    bottom.set_xlabel("optimizer step")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    return png.getvalue()


def _worst_predictions(path: Path, n: int = 10) -> list[dict[str, str]]:
    return sorted(_read_rows(path), key=lambda r: (float(r["f1"]), int(r["row"])))[:n]


def _read_rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


def _num(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "n/a"


def _cell(text: str, limit: int = 80) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"
