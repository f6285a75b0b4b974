"""Metrics over a held-out file: loss, perplexity, exact match and F1, plus a predictions file."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qatune.config import Config, GenerateConfig, with_reading_overrides
from qatune.data.extractive import prepare_features, window_length
from qatune.data.generative import (
    CausalCollator,
    PromptEncoder,
    Seq2SeqCollator,
    Seq2SeqEncoder,
    choose_max_length,
    encode_examples,
)
from qatune.data.padding import IGNORE_INDEX
from qatune.data.spans import in_passage
from qatune.data.spreadsheet import QARecord, answer_kinds, answer_template, load_from_config
from qatune.data.templates import PromptTemplate
from qatune.errors import ConfigError
from qatune.inference.batches import inference_precision
from qatune.inference.field_metrics import grading_metrics
from qatune.inference.field_plots import write_field_pictures
from qatune.inference.generate import (
    extract_answers,
    generate_answers,
    run_answer_template,
    score_windows,
    uses_context,
)
from qatune.inference.grounding import grounded as grounded_on
from qatune.inference.grounding import passage_metrics, with_grounding
from qatune.inference.lockstep import Lockstep, in_step
from qatune.inference.metric_records import METRICS, metrics_of
from qatune.inference.metrics import best_scores, corpus_scores
from qatune.inference.run_model import load_run_model, model_id, read_run, results_place
from qatune.model.folder import ModelInfo
from qatune.model.gguf_file import resolve_prompt
from qatune.model.objectives import Seq2SeqObjective, model_inputs
from qatune.model.sources import (
    load_model_config,
    load_pretrained,
    load_tokenizer,
    model_max_positions,
)
from qatune.runs import atomic, layout
from qatune.speedups import evaluation_loss
from qatune.tasks import task_kind

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
    """Predictions plus the summed loss and its item count: parts that add up across data shards.
    ``lockstep``: this process's share of the rows of a sharded model (every process passes at least one row)."""
    generate = generate or GenerateConfig()
    if task_kind(info.task).scores:
        from qatune.inference.scoring import score_records, scored_answers

        values, loss_sum, count = score_records(model, tokenizer, info, records, batch_size, progress,
                                                generate.precision, lockstep)
        return scored_answers(info, values), loss_sum, count
    if task_kind(info.task).writes:
        loss_sum, count = teacher_forced_loss(model, tokenizer, info, records, batch_size, generate.precision,
                                               speedups, lockstep)
        predictions = generate_answers(model, tokenizer, info, [r.question for r in records],
                                       [r.context for r in records], generate, batch_size, progress,
                                       [r.fields for r in records], lockstep)
        return predictions, loss_sum, count
    features, _, kept = prepare_features(tokenizer, records, info.max_length, info.doc_stride, train=False)
    starts, ends, loss_sum, count = score_windows(model, tokenizer, features, batch_size, progress,
                                                  generate.precision, lockstep)
    return extract_answers(features, starts, ends, kept, generate), loss_sum, count


def metrics_from(info: ModelInfo, records: list[QARecord], predictions: list[str], loss_sum: float,
                 count: int) -> dict[str, Any]:
    """exact_match, f1, loss, perplexity and num_examples; for a run with answer fields (a grading sheet's) also
    parse_rate, unparsed and fields (:func:`qatune.inference.field_metrics.grading_metrics`)."""
    loss = loss_sum / count if count else None
    perplexity = _safe_exp(loss) if task_kind(info.task).writes else None
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


def teacher_forced_loss(model: Any, tokenizer: Any, info: ModelInfo, records: list[QARecord],
                         batch_size: int, precision: str = "fp32", speedups: str | list[str] = "auto",
                         lockstep: Lockstep | None = None) -> tuple[float, int]:
    template = PromptTemplate(info.prompt_template, info.answer_prefix)
    encoder = (Seq2SeqEncoder if info.seq2seq else PromptEncoder)(tokenizer, template)
    encoder.warm(records)
    examples, _ = encode_examples(encoder, records, info.max_length)
    if not examples and lockstep is None:
        return 0.0, 0
    if info.seq2seq:
        objective, collate = Seq2SeqObjective(model), Seq2SeqCollator(tokenizer.pad_token_id)
    else:
        objective, collate = evaluation_loss(model, CausalCollator(tokenizer.pad_token_id), speedups)
    device = next(model.parameters()).device
    examples.sort(key=len)
    chunks = [examples[i : i + batch_size] for i in range(0, len(examples), batch_size)]
    total, count = 0.0, 0
    model.eval()
    with torch.inference_mode(), inference_precision(precision, device):
        for chunk, mine in in_step(chunks, lockstep, []):
            if not chunk:  # this process has no row short enough: a forward of one unsupervised token
                objective(**_unsupervised_token(tokenizer, device))
                continue
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in model_inputs(collate(chunk)).items()}
            out = objective(**batch)
            if mine:
                total += float(out["loss_sum"])
                count += int(out["count"])
    return total, count


def _unsupervised_token(tokenizer: Any, device: torch.device) -> dict[str, torch.Tensor]:
    token = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    one = torch.tensor([[token]], device=device)
    return {"input_ids": one, "attention_mask": torch.ones_like(one), "labels": torch.full_like(one, IGNORE_INDEX)}


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
    if task_kind(config.task).scores:
        raise ConfigError(f"{flag} evaluates a model before fine-tuning, and a scoring model's heads are built for "
                          "its answer columns when it trains: there is no base to ask; compare the run with another "
                          "run instead (--compare RUN)")
    if config.model.name_or_path is None:
        raise ConfigError(f"{flag} needs a pretrained model (model.name_or_path); a scratch model knows nothing "
                          "before training")


def base_name(config: Config) -> str:
    if task_kind(config.task).points:
        return f"{config.model.name_or_path} (base, its span head untrained)"
    return f"{config.model.name_or_path} (base, not fine-tuned)"


UNTRAINED_HEAD = ("an extractive model's span head is trained by fine-tuning: before it, its weights are random "
                  "(seeded by the config's seed), so the base model points at answers by chance and scores near zero")


def base_predictions(config: Config, records: list[QARecord], batch_size: int | None = None,
                     progress: bool = False) -> tuple[dict[str, Any], list[str], ModelInfo]:
    """The pretrained model of ``config`` (:func:`check_base` passed) on ``records``, prompted exactly as a run of
    that config would be: its metrics, its predictions and the ModelInfo it was asked with."""
    tokenizer = load_tokenizer(config.model, config.task)
    model_config = load_model_config(config.model)
    torch.manual_seed(config.seed)  # an extractive model's untrained span head: the same weights at every comparison
    model = load_pretrained(config.model, config.task, tokenizer, model_config)
    if task_kind(config.task).points:
        info = ModelInfo(task="extractive", max_length=window_length(config.data.max_length,
                                                                     model_max_positions(model_config, tokenizer)),
                         doc_stride=config.data.doc_stride)
        model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
        metrics, predictions = evaluate_records(model, tokenizer, info, records, config.generate,
                                                batch_size or config.train.eval_batch_size, progress,
                                                config.train.speedups)
        return {**metrics, "note": UNTRAINED_HEAD}, predictions, info
    seq2seq = bool(getattr(model_config, "is_encoder_decoder", False))
    template = resolve_prompt(config.data, config.model, tokenizer)
    encoder = (Seq2SeqEncoder if seq2seq else PromptEncoder)(tokenizer, template)
    limit = model_max_positions(model_config, tokenizer)
    max_length = choose_max_length([encoder.full_length(r) for r in records], config.data.max_length, limit)
    fields = answer_template(config.data)
    info = ModelInfo(task=config.task, max_length=max_length, prompt_template=template.template,
                     answer_prefix=template.answer_prefix, seq2seq=seq2seq,
                     answer_fields=answer_kinds(config.data, records),
                     answer_template=fields.template if fields is not None else None)
    model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    metrics, predictions = evaluate_records(model, tokenizer, info, records, config.generate,
                                            batch_size or config.train.eval_batch_size, progress,
                                            config.train.speedups)
    return metrics, predictions, info


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


def _safe_exp(loss: float | None) -> float | None:
    if loss is None:
        return None
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")
