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

from qatune.config import Config
from qatune.data.generative import ExampleDataset, Seq2SeqCollator
from qatune.data.grading_rows import SettledFields, apply_spellings, settle_fields
from qatune.data.spreadsheet import (
    LoadReport,
    QARecord,
    describe_validation,
    load_from_config,
    split_validation,
)
from qatune.data.validate import Finding, validate_batch, validate_dataset, validate_settings
from qatune.errors import DataError
from qatune.kinds import Built, kind_of
from qatune.model.adapters import apply_lora, lora_base_in_run
from qatune.model.folder import ModelInfo
from qatune.model.precision import bf16_native, bf16_verdict, check_device, resolve_precision
from qatune.model.scratch_tokenizer import train_scratch_tokenizer
from qatune.model.sources import load_model_config, load_tokenizer, model_max_positions, quiet_transformers
from qatune.runs import layout
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
    kind = kind_of(config.task)
    train_records, eval_records = kind.settle_rows(train_records, train_report), kind.settle_rows(eval_records)
    train_records, settled = settle_fields(config.data, train_records, train_report)
    eval_records = apply_spellings(eval_records, settled)
    built = _setup_model(config, train_records, with_model, settled)
    encoded = kind.encode(config, built, train_records, train_report, reports, settled)
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
                 settled: SettledFields | None = None) -> Built:
    """Tokenizer and model: trained on the rows and randomly initialised (scratch), or pretrained."""
    kind, model = kind_of(config.task), None
    if config.model.scratch is not None:
        shape = config.model.scratch
        family, texts = kind.tokenizer_texts(config, train_records, shape.architecture)
        tokenizer = train_scratch_tokenizer(family, texts, shape.vocab_size, shape.architecture)
        if with_model:
            model = kind.build(config, tokenizer, settled)
        built = Built(model, tokenizer, shape.n_positions, shape.architecture == "t5")
        source = f"scratch {kind.name} model"
    else:
        tokenizer = load_tokenizer(config.model, kind.name)
        model_config = load_model_config(config.model)
        if with_model:
            model = kind.build(config, tokenizer, settled, model_config)
        seq2seq = kind.record.writes and bool(getattr(model_config, "is_encoder_decoder", False))
        built = Built(model, tokenizer, model_max_positions(model_config, tokenizer), seq2seq)
        source = config.model.name_or_path
    if model is not None:
        n_params = sum(p.numel() for p in model.parameters())
        log.info("model: %s (%s, %.1fM parameters)", source, type(model).__name__, n_params / 1e6)
    return built


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
        answers = kind_of(config.task).batch_answers(items)
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


def fingerprint(prepared: Prepared) -> str:
    """A digest of the encoded training rows: an exact resume needs the same ones."""
    import hashlib
    import json

    digest = hashlib.sha256()
    for item in prepared.dataset.items:
        digest.update(json.dumps(item.input_ids).encode())
    return digest.hexdigest()[:16]
