"""Metrics over a held-out file: loss, perplexity, exact match and F1, plus a predictions file."""

from __future__ import annotations

import csv
import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qatune.config import Config, GenerateConfig, with_reading_overrides
from qatune.data.spans import in_passage
from qatune.data.spreadsheet import QARecord, load_from_config
from qatune.errors import ConfigError
from qatune.inference.field_metrics import grading_metrics
from qatune.inference.field_plots import write_field_pictures
from qatune.inference.generate import (
    run_answer_template,
    uses_context,
)
from qatune.inference.grounding import grounded as grounded_on
from qatune.inference.grounding import passage_metrics, with_grounding
from qatune.inference.lockstep import Lockstep
from qatune.inference.metric_records import METRICS, metrics_of
from qatune.inference.metrics import best_scores, corpus_scores
from qatune.inference.run_model import load_run_model, model_id, read_run, results_place
from qatune.kinds import kind_of
from qatune.model.folder import ModelInfo
from qatune.model.sources import (
    load_model_config,
    load_pretrained,
    load_tokenizer,
)
from qatune.runs import atomic, layout

log = logging.getLogger("qatune")


def evaluate_records(model: Any, tokenizer: Any, info: ModelInfo, records: list[QARecord],
                     generate: GenerateConfig | None = None, batch_size: int = 32, progress: bool = False,
                     speedups: str | list[str] = "auto") -> tuple[dict[str, Any], list[str]]:
    """Metrics (keys: exact_match, f1, loss, perplexity, num_examples) and one prediction per record.
    ``speedups``: the run's ``train.speedups``, which also decides how the loss is computed here."""
    generate = generate or GenerateConfig()
    predictions, loss_sum, count = evaluation_parts(model, tokenizer, info, records, generate, batch_size, progress,
                                                    speedups)
    metrics = metrics_from(info, records, predictions, loss_sum, count)
    metrics.update(passage_metrics(info, generate, records, predictions))
    return metrics, predictions


def evaluation_parts(model: Any, tokenizer: Any, info: ModelInfo, records: list[QARecord],
                     generate: GenerateConfig | None = None, batch_size: int = 32, progress: bool = False,
                     speedups: str | list[str] = "auto", lockstep: Lockstep | None = None
                     ) -> tuple[list[str], float, int]:
    """Predictions plus the summed loss and its item count: parts that add up across data shards, as the run's
    kind computes them. ``lockstep``: this process's share of the rows of a sharded model (every process passes
    at least one row)."""
    return kind_of(info.task).evaluation_parts(model, tokenizer, info, records, generate or GenerateConfig(),
                                               batch_size, progress, speedups, lockstep)


def metrics_from(info: ModelInfo, records: list[QARecord], predictions: list[str], loss_sum: float,
                 count: int) -> dict[str, Any]:
    """exact_match, f1, loss, perplexity and num_examples; for a run with answer fields (a grading sheet's) also
    parse_rate, unparsed and fields (:func:`qatune.inference.field_metrics.grading_metrics`)."""
    loss = loss_sum / count if count else None
    perplexity = kind_of(info.task).perplexity(loss)
    scores = corpus_scores(predictions, [r.answers for r in records])
    metrics = {**scores, "loss": loss, "perplexity": perplexity, "num_examples": len(records)}
    template = run_answer_template(info)
    if template is not None:
        metrics.update(grading_metrics(info.specs(), [template.parse(p) for p in predictions],
                                       [r.answer_fields for r in records]))
    return metrics


def field_summary(metrics: dict[str, Any]) -> list[str]:
    """Lines on the answer fields of a grading run's metrics: how many answers parsed, each field's main scores."""
    if "fields" not in metrics:
        return []
    parsed = metrics["num_examples"] - metrics["unparsed"]
    lines = [f"fields: {parsed} of {metrics['num_examples']} answers have every field of the answer template"
             f" ({_number(metrics['parse_rate'], '%')}); a field an answer misses counts as wrong"]
    for name, field in metrics["fields"].items():
        kind = "number" if "mae" in field else "label" if "accuracy" in field else "text"
        scores = ", ".join(_field_score(metric, field) for metric in metrics_of(kind))
        found = "" if field.get("parse_rate") in (None, 100.0) else f", found in {_number(field['parse_rate'], '%')}"
        lines.append(f"  {name}: {scores} ({field['rows']} rows{found})")
    return lines


def _field_score(name: str, field: dict[str, Any]) -> str:
    metric = METRICS[name]
    label = f"within {field['tolerance']:g}" if name == "within_tolerance" else metric.label
    return f"{label} {metric.shown(field.get(name), unit=True)}"


def _number(value: float | None, unit: str = "", digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def evaluate_run(run_dir: str | Path, data_file: str | Path, which: str = layout.FINAL,
                 batch_size: int | None = None, progress: bool = False,
                 reading: list[str] | tuple[str, ...] = (), grounded: str | None = None
                 ) -> tuple[dict[str, Any], dict[str, Path]]:
    """Evaluate a run's model on a file; writes the metrics JSON and a predictions CSV next to the run.

    ``reading``: ``key=value`` changes to how the file is read (sheet, columns, delimiter: READING_KEYS),
    for a held-out file laid out unlike the training file. ``grounded``: generate.grounded for this evaluation
    (auto, on or off; None: the run's own).
    """
    done = run_evaluation(run_dir, data_file, which, batch_size, progress, reading, grounded)
    return done.metrics, done.paths


@dataclass
class Evaluation:
    """One model's results on the rows of one file: what eval wrote, and what a comparison reads."""

    metrics: dict[str, Any]
    predictions: list[str]
    records: list[QARecord]
    info: ModelInfo
    paths: dict[str, Path]


def run_evaluation(run_dir: str | Path, data_file: str | Path, which: str = layout.FINAL,
                   batch_size: int | None = None, progress: bool = False,
                   reading: list[str] | tuple[str, ...] = (), grounded: str | None = None) -> Evaluation:
    """:func:`evaluate_run`, with the rows read and the predictions kept."""
    config, info = read_run(run_dir, which)  # the data file is read before the model
    data = with_reading_overrides(config, reading).data if reading else config.data
    generate = with_grounding(config.generate, grounded)
    grounded_on(info, generate)  # --grounded on for a run without passages fails before the model loads
    records, report = load_from_config(data, data_file, with_context=uses_context(info))
    records = kind_of(info.task).settle_rows(records, report)
    loaded = load_run_model(run_dir, which)
    metrics, predictions = evaluate_records(
        loaded.model, loaded.tokenizer, loaded.info, records, generate,
        batch_size or loaded.config.train.eval_batch_size, progress, loaded.config.train.speedups,
    )
    metrics["data_file"] = str(data_file)
    metrics["rows_dropped"] = report.dropped_total
    metrics["model"] = str(loaded.folder)
    metrics["model_id"] = model_id(loaded)  # which writing of that model was evaluated
    out_dir, prefix = results_place(run_dir, loaded)
    paths = write_results(out_dir, data_file, metrics, records, predictions, prefix, loaded.info)
    return Evaluation(metrics, predictions, records, loaded.info, paths)


def evaluate_base(config: Config, data_file: str | Path | None = None, batch_size: int | None = None,
                  progress: bool = False) -> tuple[dict[str, Any], dict[str, Path]]:
    """The untouched pretrained model of a config, prompted exactly as a run of that config would be,
    on data.eval_file (or ``data_file``): what fine-tuning starts from. Writes the metrics JSON and a
    predictions CSV into OUTPUT_DIR-base/ (the run directory itself stays free for training). Its generate.grounded
    auto is off (nothing was trained to decide it); on grounds it."""
    check_base(config)
    data_file = data_file or config.data.eval_file
    if data_file is None:
        raise ConfigError("--base evaluates on data.eval_file, and this config has none; pass --data FILE")
    records, report = load_from_config(config.data, data_file)
    records = kind_of(config.task).settle_rows(records, report)
    metrics, predictions, info = base_predictions(config, records, batch_size, progress)
    metrics["data_file"] = str(data_file)
    metrics["rows_dropped"] = report.dropped_total
    metrics["model"] = base_name(config)
    out_dir = Path(f"{config.output_dir.rstrip('/')}-base")
    out_dir.mkdir(parents=True, exist_ok=True)
    return metrics, write_results(out_dir, data_file, metrics, records, predictions, info=info)


def check_base(config: Config, flag: str = "--base") -> None:
    """Refuse, before anything loads, a config whose model before fine-tuning cannot answer (``flag``: the option
    that asked for it, named by the error)."""
    kind_of(config.task).check_base(config, flag)


def base_name(config: Config) -> str:
    return kind_of(config.task).base_name(config)


def base_predictions(config: Config, records: list[QARecord], batch_size: int | None = None,
                     progress: bool = False) -> tuple[dict[str, Any], list[str], ModelInfo]:
    """The pretrained model of ``config`` (:func:`check_base` passed) on ``records``, prompted exactly as a run of
    that config would be: its metrics, its predictions and the ModelInfo it was asked with."""
    kind = kind_of(config.task)
    tokenizer = load_tokenizer(config.model, config.task)
    model_config = load_model_config(config.model)
    torch.manual_seed(config.seed)  # an extractive model's untrained span head: the same weights at every comparison
    model = load_pretrained(config.model, config.task, tokenizer, model_config)
    base = kind.base_model(config, tokenizer, model_config, records)
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    metrics, predictions = evaluate_records(model, tokenizer, base.info, records, config.generate,
                                            batch_size or config.train.eval_batch_size, progress,
                                            config.train.speedups)
    if base.note is not None:
        metrics["note"] = base.note
    return metrics, predictions, base.info


def write_results(out_dir: Path, data_file: str | Path, metrics: dict[str, Any], records: list[QARecord],
                  predictions: list[str], prefix: str = "", info: ModelInfo | None = None) -> dict[str, Path]:
    """eval-NAME.json and predictions-NAME.csv, each written atomically; results of another file with the
    same name (data/a/x.csv after data/b/x.csv) are replaced with a warning. A grading run's (``info`` with
    answer fields) also gets a picture per label and number field (:mod:`qatune.inference.field_plots`), under
    the keys "confusion FIELD" and "scores FIELD"."""
    paths = layout.eval_outputs(out_dir, data_file, prefix)
    metrics["data_path"] = str(Path(data_file).resolve())
    try:
        before = json.loads(paths["metrics"].read_text(encoding="utf-8")).get("data_path")
    except (OSError, ValueError, AttributeError):
        before = None
    if before and before != metrics["data_path"]:
        log.warning("replacing %s, the results of %s (files of one name share their results' names)",
                    paths["metrics"].name, before)
    atomic.atomic_write_text(paths["metrics"], json.dumps(metrics, indent=2) + "\n")
    write_predictions(paths["predictions"], records, predictions, info, metrics.get("grounded"))
    template = run_answer_template(info) if info is not None else None
    if template is not None and "fields" in metrics:
        parsed = [template.parse(p) for p in predictions]
        names = list(metrics["fields"])
        paths.update(write_field_pictures(out_dir, prefix + Path(data_file).stem, metrics["fields"],
                                          {name: [r.answer_fields.get(name, "") for r in records] for name in names},
                                          {name: [None if p is None else p.get(name) for p in parsed]
                                           for name in names}))
    return paths


def write_predictions(path: Path, records: list[QARecord], predictions: list[str],
                      info: ModelInfo | None = None, grounded: bool | None = None) -> None:
    """CSV with one row per question; the em and f1 columns (0-100) average to the reported metrics.

    A run with answer fields (``info``) adds ``parsed`` (true/false: whether the prediction has every field of the
    answer template) and, per field, ``FIELD (gold)`` and ``FIELD (predicted)`` (empty where it did not parse).
    ``grounded`` (a run that reads a passage: whether its decoding was grounded) adds ``grounded`` and
    ``in_passage`` (true/false: whether the prediction is a span of the row's passage)."""
    template = run_answer_template(info) if info is not None else None
    names = list(template.columns) if template is not None else []
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["row", "question", "gold", "prediction", "em", "f1",
                     *(["grounded", "in_passage"] if grounded is not None else []),
                     *(["parsed"] if template is not None else []),
                     *(f"{name} ({side})" for name in names for side in ("gold", "predicted"))])
    for record, prediction in zip(records, predictions, strict=True):
        em, f1 = best_scores(prediction, record.answers)
        line = [record.row, record.question, " | ".join(record.answers), prediction, round(100 * em),
                round(100 * f1, 2)]
        if grounded is not None:
            line += [str(grounded).lower(), str(in_passage(prediction, record.context or "")).lower()]
        if template is not None:
            parsed = template.parse(prediction)
            line.append("true" if template.complete(parsed) else "false")
            for name in names:
                line += [record.answer_fields.get(name, ""), (parsed or {}).get(name, "")]
        writer.writerow(line)
    atomic.atomic_write_text(path, buffer.getvalue())
