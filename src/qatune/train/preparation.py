"""Setup, before anything is written: load the rows, build the model, encode, validate.

Everything that can fail because of the user's data, model or settings happens here, so a failed
setup leaves nothing behind. ``prepare`` reads as the list of its steps.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qatune import __version__
from qatune.config import Config
from qatune.data.extractive import SpanCollator, prepare_features, window_length
from qatune.data.generative import (
    CausalCollator,
    EncodeStats,
    ExampleDataset,
    PromptEncoder,
    Seq2SeqCollator,
    Seq2SeqEncoder,
    choose_max_length,
    encode_examples,
    percentile,
    weigh_answer_tokens,
)
from qatune.data.grading_rows import SettledFields, apply_spellings, settle_fields
from qatune.data.scoring import ScoringCollator, ScoringEncoder
from qatune.data.spans import passage_answers
from qatune.data.spreadsheet import (
    LoadReport,
    QARecord,
    describe_validation,
    load_from_config,
    split_validation,
)
from qatune.data.templates import PromptTemplate, resolve_template, scoring_template
from qatune.data.validate import Finding, error, validate_batch, validate_dataset, validate_settings, warning
from qatune.errors import ConfigError, DataError, row_list
from qatune.model.adapters import apply_lora, lora_base_in_run
from qatune.model.folder import ModelInfo
from qatune.model.gguf_file import resolve_prompt
from qatune.model.precision import bf16_native, bf16_verdict, check_device, resolve_precision
from qatune.model.scoring import HeadLayout, build_scoring_model
from qatune.model.scratch_tokenizer import train_scratch_tokenizer
from qatune.model.sources import (
    build_scratch,
    load_model_config,
    load_pretrained,
    load_tokenizer,
    model_max_positions,
    quiet_transformers,
)
from qatune.runs import layout
from qatune.tasks import task_kind
from qatune.train.device import seed_everything
from qatune.train.logs import check_trackers
from qatune.train.sampler import training_batches

log = logging.getLogger("qatune")


@dataclass
class Prepared:
    """Everything a run needs, built and checked before anything is written."""

    config: Config
    model: Any
    tokenizer: Any
    info: ModelInfo
    train_records: list[QARecord]
    eval_records: list[QARecord]
    dataset: ExampleDataset
    collator: Any
    reports: dict[str, Any] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    """Batch validator and settings checks: errors stop train, check reports them."""
    base_model: Any = None
    """LoRA on a scratch model: the random base weights, saved once as RUN/base."""
    precision: str = "fp32"
    """train.precision as it runs (auto resolved): fp32, bf16 or fp16."""
    fields: SettledFields | None = None
    """A grading sheet's answer columns as training settled them (their specs, the rows dropped and why)."""


@dataclass
class _Model:
    model: Any
    tokenizer: Any
    limit: int | None
    """Longest sequence the model reads (None when unknown)."""
    seq2seq: bool


@dataclass
class _Encoded:
    items: list[Any]
    collator: Any
    info: ModelInfo
    train_records: list[QARecord]
    findings: list[Finding]


def prepare(config: Config, train_records: list[QARecord] | None = None,
            eval_records: list[QARecord] | None = None, with_model: bool = True) -> Prepared:
    """Load data, build or load model and tokenizer, encode the training set, validate the batches.

    Records can be given directly (from Python); otherwise they are read from the config's files.
    ``with_model=False`` loads only the tokenizer and the model's config (for ``qatune check``).
    """
    quiet_transformers()
    seed_everything(config.seed)
    check_trackers(config.train.report_to)
    precision = resolve_precision(config.train.precision, config.train.device)
    check_device(config.train.device, precision)
    reports: dict[str, Any] = {}
    train_records, eval_records, train_report = _setup_records(config, train_records, eval_records, reports)
    train_records, settled = settle_fields(config.data, train_records, train_report)
    eval_records = apply_spellings(eval_records, settled)
    built = _setup_model(config, train_records, with_model, settled)
    if task_kind(config.task).writes:
        encoded = _encode_generative(config, built, train_records, train_report, reports, settled)
    elif task_kind(config.task).scores:
        encoded = _encode_scoring(config, built, train_records, train_report, reports, settled)
    else:
        encoded = _encode_extractive(config, built, train_records, train_report, reports)
    if train_report.file != GIVEN:  # after encoding: rows whose answer is not in their context are dropped there
        log.info("data: %s", train_report.summary())
    if not encoded.items:
        reasons = "; ".join(f.message for f in encoded.findings) or "see the data report"
        raise DataError(f"no training examples are left in {config.data.train_file}: {reasons}")
    dataset = ExampleDataset(encoded.items)
    if config.train.precision == "auto":
        log.info("precision: %s (train.precision auto: %s)", precision, bf16_verdict(config.train.device))
    findings = encoded.findings + validate_first_batches(config, dataset, encoded.collator, built.tokenizer,
                                                         len(encoded.train_records), precision)
    model, base_model = _setup_lora(config, built.model, encoded.info)
    return Prepared(config=config, model=model, tokenizer=built.tokenizer, info=encoded.info,
                    train_records=encoded.train_records, eval_records=eval_records, dataset=dataset,
                    collator=encoded.collator, reports=reports, findings=findings, base_model=base_model,
                    precision=precision, fields=settled)


GIVEN = "(records)"
"""The file name of rows given to prepare() directly, from Python."""


def _setup_records(config: Config, train_records: list[QARecord] | None, eval_records: list[QARecord] | None,
                   reports: dict[str, Any]) -> tuple[list[QARecord], list[QARecord], LoadReport]:
    """Training and validation rows: from the files, or given; validation split off when asked."""
    if train_records is None:
        train_records, train_report = load_from_config(config.data, config.data.train_file)
    else:
        train_report = LoadReport(file=GIVEN, rows_read=len(train_records), kept=len(train_records))
    reports["train_file"] = train_report.to_dict()
    source = GIVEN
    if eval_records is None and config.data.eval_file:
        eval_records, eval_report = load_from_config(config.data, config.data.eval_file)
        reports["eval_file"] = eval_report.to_dict()
        log.info("data: %s", eval_report.summary())
        source = eval_report.file
    elif eval_records is None:
        train_records, eval_records = split_validation(train_records, config.data.validation_fraction, config.seed)
        source = None
    validation = {"rows": len(eval_records), "fraction": config.data.validation_fraction, "file": source}
    reports["validation"] = validation
    if source != GIVEN:  # rows given from Python (check --overfit's none) are the caller's to describe
        log.info("validation: %s", describe_validation(validation))
    return train_records, eval_records, train_report


def _setup_model(config: Config, train_records: list[QARecord], with_model: bool,
                 settled: SettledFields | None = None) -> _Model:
    """Tokenizer and model: trained on the rows and randomly initialised (scratch), or pretrained."""
    task, model = config.task, None
    layout = scoring_layout(config, settled) if task_kind(task).scores and settled else None
    if config.model.scratch is not None:
        shape = config.model.scratch
        if task_kind(task).scores:  # a scratch scorer is a BERT (WordPiece) or a GPT-2 (byte-level BPE)
            texts = [scoring_template(config.data).render(r.question, r.context, r.fields) for r in train_records]
            tokenizer = train_scratch_tokenizer("generative" if shape.architecture == "gpt2" else "extractive",
                                                texts, shape.vocab_size, shape.architecture)
        else:
            texts = _tokenizer_corpus(task, resolve_template(config.data), train_records)
            tokenizer = train_scratch_tokenizer(task, texts, shape.vocab_size, shape.architecture)
        if with_model and layout is not None:
            model = build_scoring_model(config.model, tokenizer, layout, scratch=shape,
                                        weights=config.data.field_weights)
        elif with_model:
            model = build_scratch(shape, task, tokenizer)
        built = _Model(model, tokenizer, shape.n_positions, shape.architecture == "t5")
        source = f"scratch {task} model"
    else:
        tokenizer = load_tokenizer(config.model, task)
        model_config = load_model_config(config.model)
        seq2seq = task_kind(task).writes and bool(getattr(model_config, "is_encoder_decoder", False))
        if with_model and layout is not None:
            model = build_scoring_model(config.model, tokenizer, layout, model_config,
                                        weights=config.data.field_weights)
        elif with_model:
            model = load_pretrained(config.model, task, tokenizer, model_config)
        built = _Model(model, tokenizer, model_max_positions(model_config, tokenizer), seq2seq)
        source = config.model.name_or_path
    if model is not None:
        n_params = sum(p.numel() for p in model.parameters())
        log.info("model: %s (%s, %.1fM parameters)", source, type(model).__name__, n_params / 1e6)
    return built


def _encode_generative(config: Config, built: _Model, records: list[QARecord], train_report: LoadReport,
                       reports: dict[str, Any], settled: SettledFields | None = None) -> _Encoded:
    template = resolve_prompt(config.data, config.model, built.tokenizer)
    encoder = (Seq2SeqEncoder if built.seq2seq else PromptEncoder)(built.tokenizer, template)
    encoder.warm(records)
    lengths = [encoder.full_length(r) for r in records]
    max_length = choose_max_length(lengths, config.data.max_length, built.limit)
    examples, stats = encode_examples(encoder, records, max_length)
    if settled is not None and config.data.field_weights:
        if built.seq2seq:
            raise ConfigError("data.field_weights: weighs a causal LM's answer tokens; an encoder-decoder (T5) "
                              "model's are not weighed: remove data.field_weights")
        by_row = {r.row: r for r in records}
        for example in examples:
            weigh_answer_tokens(encoder, example, by_row[example.row], settled.template, config.data.field_weights)
    for row in stats.too_long_rows:
        train_report.drop_kept(f"does not fit max_length={max_length}", row)
    reports["train_file"] = train_report.to_dict()
    reports["encoding"] = {"max_length": max_length, "truncated_rows": stats.truncated_rows,
                           "too_long_rows": stats.too_long_rows, "lengths": _length_summary(lengths)}
    findings = []
    if stats.truncated_rows:
        findings.append(warning("rows-truncated", f"{len(stats.truncated_rows)} rows are longer than "
                                f"max_length={max_length}: their questions were shortened (rows "
                                f"{row_list(stats.truncated_rows)}); raise data.max_length or use auto"))
    if stats.too_long_rows:
        findings.append(_too_long(stats, encoder, records, max_length))
    pad_id = built.tokenizer.pad_token_id
    collator = (Seq2SeqCollator(pad_id, max_width=built.limit) if built.seq2seq
                else CausalCollator(pad_id, config.train.train_on_prompt, max_width=built.limit))
    info = ModelInfo(task="generative", max_length=max_length, prompt_template=template.template,
                     answer_prefix=template.answer_prefix, qatune_version=__version__, seq2seq=built.seq2seq,
                     answer_fields=settled.kinds if settled else None,
                     answer_template=settled.template.template if settled else None,
                     field_specs={name: spec.to_json() for name, spec in settled.specs.items()} if settled else None)
    info.grounding = _grounding(config, template, settled, records)
    return _Encoded(examples, collator, info, records, findings)


def _grounding(config: Config, template: PromptTemplate, settled: SettledFields | None,
               records: list[QARecord]) -> dict[str, Any] | None:
    """How the training answers relate to their passages, and what generate.grounded auto decides from it (saved
    with the run); None for a run that cannot be grounded (no {context}, or a grading sheet's answer fields)."""
    if not template.uses_context or settled is not None:
        if config.generate.grounded == "on":
            why = "its answers are a grading sheet's fields" if settled is not None else "its prompt has no {context}"
            raise ConfigError(f"generate.grounded on: grounded decoding answers with a span of the passage, and this "
                              f"run has none to take ({why}); use auto or off")
        return None
    answers = passage_answers(records)
    log.info("grounding: %s", answers.describe())
    return answers.to_json()


def _encode_scoring(config: Config, built: _Model, records: list[QARecord], train_report: LoadReport,
                    reports: dict[str, Any], settled: SettledFields) -> _Encoded:
    """A row's text as the model reads it, and a target per head."""
    template = scoring_template(config.data)
    encoder = ScoringEncoder(built.tokenizer, template)
    layout = scoring_layout(config, settled)
    lengths = [len(ids) for ids in encoder.ids(records)]
    max_length = choose_max_length(lengths, config.data.max_length, built.limit)
    targets = [layout.targets(r.answer_fields, settled.specs) for r in records]
    examples, stats = encoder.encode(records, targets, max_length)
    reports["train_file"] = train_report.to_dict()
    reports["encoding"] = {"max_length": max_length, "truncated_rows": stats.truncated_rows,
                           "too_long_rows": [], "lengths": _length_summary(lengths)}
    findings = []
    if stats.truncated_rows:
        findings.append(warning("rows-truncated", f"{len(stats.truncated_rows)} rows are longer than "
                                f"max_length={max_length} tokens: the model reads only their first {max_length} "
                                f"(rows {row_list(stats.truncated_rows)}); raise data.max_length or use auto"))
    info = ModelInfo(task="scoring", max_length=max_length, prompt_template=template.template, answer_prefix="",
                     qatune_version=__version__, answer_fields=settled.kinds,
                     answer_template=settled.template.template,
                     field_specs={name: spec.to_json() for name, spec in settled.specs.items()},
                     scoring_heads=layout.to_json())
    return _Encoded(examples, ScoringCollator(built.tokenizer.pad_token_id), info, records, findings)


def _too_long(stats: EncodeStats, encoder: PromptEncoder, records: list[QARecord], max_length: int) -> Finding:
    """Rows that do not fit max_length, and why; an error when they are most of the data."""
    rows = stats.too_long_rows
    if len(stats.answer_too_long_rows) == len(rows):
        why = f"the answer alone does not fit max_length={max_length}"
    else:
        first = next(r for r in records if r.row == rows[0])
        why = (f"they do not fit max_length={max_length} even with the question cut to nothing; the prompt's own "
               f"text is {encoder.fixed_length(first)} tokens")
        if stats.answer_too_long_rows:
            why += f"; {len(stats.answer_too_long_rows)} of their answers alone do not fit"
    text = (f"{len(rows)} of {len(records)} rows dropped: {why} (rows {row_list(rows)}); raise data.max_length or "
            "use auto")
    if len(rows) * 2 > len(records):
        return error("rows-too-long", f"most rows cannot be trained: {text}")
    return warning("rows-too-long", text)


def _encode_extractive(config: Config, built: _Model, records: list[QARecord], train_report: LoadReport,
                       reports: dict[str, Any]) -> _Encoded:
    max_length = window_length(config.data.max_length, built.limit)
    features, stats, kept = prepare_features(built.tokenizer, records, max_length, config.data.doc_stride, train=True)
    for row in stats.not_found_rows:
        train_report.drop_kept("answer not in context", row)
    reports["train_file"] = train_report.to_dict()
    reports["encoding"] = {
        "max_length": max_length, "doc_stride": config.data.doc_stride, "windows": stats.windows,
        "windows_without_answer": stats.windows_without_answer, "answer_not_in_context_rows": stats.not_found_rows,
        "unreachable_rows": stats.unreachable_rows,
        "span_audit": {"checked": stats.audit_checked, "matched": stats.audit_matched,
                       "share": stats.audit_share, "token_boundary": stats.audit_boundary,
                       "token_boundary_examples": stats.audit_boundary_examples[:5],
                       "mismatches": stats.audit_mismatches},
    }
    findings = []
    if stats.not_found_rows:
        findings.append(warning("answer-not-in-context", f"{len(stats.not_found_rows)} rows dropped: the answer "
                                f"is not in the context (rows {row_list(stats.not_found_rows)})"))
    if stats.unreachable_rows:
        findings.append(warning("answer-longer-than-window", f"{len(stats.unreachable_rows)} rows have an answer "
                                f"that no window holds whole (rows {row_list(stats.unreachable_rows)}); raise "
                                "data.max_length or shorten those answers"))
    log.info("windows: %d (%d without the answer, labelled CLS); span audit: %.1f%% of %d labelled spans "
             "decode to the answer, %d end inside a token", stats.windows, stats.windows_without_answer,
             100 * stats.audit_share, stats.audit_checked, stats.audit_boundary)
    if stats.audit_mismatches:
        first = stats.audit_mismatches[0]
        findings.append(error("span-audit", f"span audit: {len(stats.audit_mismatches)} labelled spans do not "
                                            f"cover their answer (row {first['row']}: tokens "
                                            f"{first['labelled_tokens']!r}, answer {first['answer']!r}); "
                                            "please report this with the row"))
    info = ModelInfo(task="extractive", max_length=max_length, doc_stride=config.data.doc_stride,
                     qatune_version=__version__)
    return _Encoded(features, SpanCollator(built.tokenizer.pad_token_id, max_width=built.limit), info, kept, findings)


def _setup_lora(config: Config, model: Any, info: ModelInfo) -> tuple[Any, Any]:
    """Wrap the model with LoRA adapters when asked. Returns (model, base weights to save in RUN/base)."""
    if config.model.lora is None:
        return model, None
    base_model = None
    if lora_base_in_run(config.model):
        info.lora_base = layout.BASE
        base_model = copy.deepcopy(model) if model is not None else None
    else:
        local = Path(config.model.name_or_path)
        info.lora_base = str(local.resolve()) if local.is_dir() else config.model.name_or_path
    if model is not None:
        model = apply_lora(model, config.model.lora, config.task)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        log.info("LoRA: training %.2fM of %.1fM parameters", trainable / 1e6,
                 sum(p.numel() for p in model.parameters()) / 1e6)
    return model, base_model


def validate_first_batches(config: Config, dataset: ExampleDataset, collator: Any, tokenizer: Any,
                           n_rows: int, precision: str) -> list[Finding]:
    """The batch validator on the first two batches the loop will see, plus the settings checks."""
    train_cfg = config.train
    findings = validate_dataset(dataset.items)
    sampler = training_batches(dataset, config)
    seq2seq = isinstance(collator, Seq2SeqCollator)
    for indices in list(sampler)[:2]:
        items = [dataset[i] for i in indices]
        answers = [getattr(item, "answer_text", None) for item in items] if task_kind(config.task).points else None
        for finding in validate_batch(collator(items), tokenizer=tokenizer, answers=answers, seq2seq=seq2seq):
            if finding not in findings:
                findings.append(finding)
    settings = validate_settings(
        learning_rate=train_cfg.learning_rate, max_grad_norm=train_cfg.max_grad_norm,
        warmup_steps=train_cfg.warmup_steps, precision=precision, task=config.task,
        pretrained=config.model.name_or_path is not None, lora=config.model.lora is not None, n_examples=n_rows,
        batch_size=train_cfg.batch_size, accumulation=train_cfg.gradient_accumulation_steps,
        bf16_native=bf16_native(train_cfg.device),
    )
    codes = {f.code for f in findings}
    return findings + [f for f in settings if f.code not in codes]


def _tokenizer_corpus(task: str, template: PromptTemplate, records: list[QARecord]) -> list[str]:
    if task_kind(task).writes:
        return [template.render(r.question, r.context, r.fields) + template.answer_prefix + r.answer for r in records]
    return [text for r in records for text in (r.question, r.context or "")]


def _length_summary(lengths: list[int]) -> dict[str, int]:
    return {"min": min(lengths), "median": percentile(lengths, 50), "p95": percentile(lengths, 95),
            "max": max(lengths)} if lengths else {}


def fingerprint(prepared: Prepared) -> str:
    """A digest of the encoded training rows: an exact resume needs the same ones."""
    import hashlib
    import json

    digest = hashlib.sha256()
    for item in prepared.dataset.items:
        digest.update(json.dumps(item.input_ids).encode())
    return digest.hexdigest()[:16]


def scoring_layout(config: Config, settled: SettledFields) -> HeadLayout:
    """The heads of a scoring run's answer columns, as model.number_head and data.class_weights say."""
    return HeadLayout.from_specs(settled.specs, config.model.number_head, config.data.class_weights)
