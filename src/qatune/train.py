"""Training: ``train(config)`` wires the pieces; ``fit`` is the loop, readable top to bottom.

Everything that can fail because of the user's data, model or settings happens in ``prepare``,
before the run directory is created, so a failed setup leaves nothing behind.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from qatune import __version__
from qatune.checkpoint import TrainState, find_checkpoint, restore, save_checkpoint
from qatune.config import Config, load_config
from qatune.data.extractive import SpanCollator, prepare_features
from qatune.data.generative import (
    CausalCollator,
    ExampleDataset,
    PromptEncoder,
    PromptTemplate,
    Seq2SeqCollator,
    Seq2SeqEncoder,
    choose_max_length,
    encode_examples,
    resolve_template,
)
from qatune.data.spreadsheet import LoadReport, QARecord, load_from_config, split_validation
from qatune.errors import ConfigError, DataError, RunDirError, TrainingError
from qatune.evaluate import evaluation_parts, metrics_from, write_predictions
from qatune.model import (
    LORA_BASE_IN_RUN,
    ModelInfo,
    apply_lora,
    build_scratch,
    load_model_config,
    load_pretrained,
    load_tokenizer,
    lora_base_in_run,
    model_max_positions,
    quiet_transformers,
    read_status,
    save_model,
    train_scratch_tokenizer,
    write_status,
)
from qatune.report import VALIDATION_PREDICTIONS, write_report
from qatune.objectives import count_items, count_tokens, model_inputs, objective_for
from qatune.validate import (
    Finding,
    error,
    raise_for_errors,
    validate_batch,
    validate_dataset,
    validate_settings,
    warning,
)

log = logging.getLogger("qatune")

EXTRACTIVE_AUTO_MAX_LENGTH = 384
GPU_PAD_MULTIPLE = 32
"""On a GPU, batch widths are rounded up to this: every new shape costs kernel warm-up (measured on an
H200: 48 MiniLM steps took 7.1 s with fresh shapes, 1.6 s once they were seen)."""
MAX_SCALE_SKIPS = 25
"""fp16: overflowing steps in a row that the loss scaler may skip before it counts as non-finite."""


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


def prepare(config: Config, train_records: list[QARecord] | None = None,
            eval_records: list[QARecord] | None = None, with_model: bool = True) -> Prepared:
    """Load data, build or load model and tokenizer, encode the training set, validate the batches.

    Records can be given directly (from Python); otherwise they are read from the config's files.
    ``with_model=False`` loads only the tokenizer and the model's config (for ``qatune check``).
    """
    quiet_transformers()
    _seed_everything(config.seed)
    if config.train.report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("train.report_to: tensorboard needs the tensorboard package: pip install tensorboard")
    reports: dict[str, Any] = {}
    if train_records is None:
        train_records, train_report = load_from_config(config.data, config.data.train_file)
        _log_report(train_report)
    else:
        train_report = LoadReport(file="(records)", rows_read=len(train_records), kept=len(train_records))
    reports["train_file"] = train_report.to_dict()
    if eval_records is None and config.data.eval_file:
        eval_records, eval_report = load_from_config(config.data, config.data.eval_file)
        reports["eval_file"] = eval_report.to_dict()
        _log_report(eval_report)
    elif eval_records is None:
        train_records, eval_records = split_validation(train_records, config.data.validation_fraction, config.seed)
        if eval_records:
            log.info("validation: %d rows held out of the training file (data.validation_fraction=%s)",
                     len(eval_records), config.data.validation_fraction)

    task = config.task
    template = resolve_template(config.data)
    findings: list[Finding] = []
    model = None
    if config.model.scratch is not None:
        shape = config.model.scratch
        texts = _tokenizer_corpus(task, template, train_records)
        tokenizer = train_scratch_tokenizer(task, texts, shape.vocab_size, shape.architecture)
        limit = shape.n_positions
        seq2seq = shape.architecture == "t5"
        if with_model:
            model = build_scratch(shape, task, tokenizer)
        source = f"scratch {task} model"
    else:
        tokenizer = load_tokenizer(config.model, task)
        model_config = load_model_config(config.model)
        seq2seq = task == "generative" and bool(getattr(model_config, "is_encoder_decoder", False))
        if with_model:
            model = load_pretrained(config.model, task, tokenizer, model_config)
        limit = model_max_positions(model_config, tokenizer)
        source = config.model.name_or_path
    if model is not None:
        n_params = sum(p.numel() for p in model.parameters())
        log.info("model: %s (%s, %.1fM parameters)", source, type(model).__name__, n_params / 1e6)

    if task == "generative":
        template = resolve_template(config.data, tokenizer, source)
        encoder = (Seq2SeqEncoder if seq2seq else PromptEncoder)(tokenizer, template)
        lengths = [encoder.full_length(r) for r in train_records]
        max_length = choose_max_length(lengths, config.data.max_length, limit)
        examples, stats = encode_examples(encoder, train_records, max_length)
        reports["encoding"] = {"max_length": max_length, "truncated_rows": stats.truncated_rows,
                               "too_long_rows": stats.too_long_rows, "lengths": _length_summary(lengths)}
        if stats.truncated_rows:
            findings.append(warning("rows-truncated", f"{len(stats.truncated_rows)} rows are longer than "
                                    f"max_length={max_length}: their questions were shortened (rows "
                                    f"{_rows(stats.truncated_rows)}); raise data.max_length or use auto"))
        if stats.too_long_rows:
            findings.append(warning("rows-too-long", f"{len(stats.too_long_rows)} rows dropped: the answer alone "
                                    f"does not fit max_length={max_length} (rows {_rows(stats.too_long_rows)}); "
                                    "raise data.max_length or use auto"))
        items: list[Any] = examples
        if seq2seq:
            collator: Any = Seq2SeqCollator(tokenizer.pad_token_id)
        else:
            collator = CausalCollator(tokenizer.pad_token_id, config.train.train_on_prompt)
        info = ModelInfo(task=task, max_length=max_length, prompt_template=template.template,
                         answer_prefix=template.answer_prefix, qatune_version=__version__, seq2seq=seq2seq)
    else:
        setting = config.data.max_length
        max_length = min(EXTRACTIVE_AUTO_MAX_LENGTH, limit or EXTRACTIVE_AUTO_MAX_LENGTH) if setting == "auto" else setting
        if limit is not None and max_length > limit:
            raise ConfigError(f"data.max_length={max_length} is more than the model's {limit} positions; lower it")
        features, stats, kept = prepare_features(tokenizer, train_records, max_length, config.data.doc_stride, train=True)
        for row in stats.not_found_rows:
            train_report.drop("answer not in context", row)
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
        if stats.not_found_rows:
            findings.append(warning("answer-not-in-context", f"{len(stats.not_found_rows)} rows dropped: the answer "
                                    f"is not in the context (rows {_rows(stats.not_found_rows)})"))
        if stats.unreachable_rows:
            findings.append(warning("answer-longer-than-window", f"{len(stats.unreachable_rows)} rows have an answer "
                                    f"that no window holds whole (rows {_rows(stats.unreachable_rows)}); raise "
                                    "data.max_length or shorten those answers"))
        log.info("windows: %d (%d without the answer, labelled CLS); span audit: %.1f%% of %d labelled spans "
                 "decode to the answer, %d end inside a token", stats.windows, stats.windows_without_answer,
                 100 * stats.audit_share, stats.audit_checked, stats.audit_boundary)
        if stats.audit_mismatches:
            first = stats.audit_mismatches[0]
            findings.append(error("span-audit", f"span audit: {len(stats.audit_mismatches)} labelled spans do not "
                                                f"cover their answer (row {first['row']}: tokens {first['labelled_tokens']!r}, "
                                                f"answer {first['answer']!r}); please report this with the row"))
        train_records = kept
        items = features
        collator = SpanCollator(tokenizer.pad_token_id)
        info = ModelInfo(task=task, max_length=max_length, doc_stride=config.data.doc_stride,
                         qatune_version=__version__)
    if not items:
        reasons = "; ".join(f.message for f in findings) or "see the data report"
        raise DataError(f"no training examples are left in {config.data.train_file}: {reasons}")
    dataset = ExampleDataset(items)
    findings += _validate(config, dataset, collator, tokenizer, len(train_records))
    base_model = None
    if config.model.lora is not None:
        if lora_base_in_run(config.model):
            info.lora_base = LORA_BASE_IN_RUN
            base_model = copy.deepcopy(model) if model is not None else None
        else:
            local = Path(config.model.name_or_path)
            info.lora_base = str(local.resolve()) if local.is_dir() else config.model.name_or_path
        if model is not None:
            model = apply_lora(model, config.model.lora, task)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            log.info("LoRA: training %.2fM of %.1fM parameters", trainable / 1e6,
                     sum(p.numel() for p in model.parameters()) / 1e6)
    return Prepared(config=config, model=model, tokenizer=tokenizer, info=info, train_records=train_records,
                    eval_records=eval_records, dataset=dataset, collator=collator, reports=reports,
                    findings=findings, base_model=base_model)


def _validate(config: Config, dataset: ExampleDataset, collator: Any, tokenizer: Any, n_rows: int) -> list[Finding]:
    """The batch validator on the first two batches the loop will see, plus the settings checks."""
    train_cfg = config.train
    findings = validate_dataset(dataset.items)
    sampler = LengthGroupedBatches(dataset.lengths, train_cfg.batch_size, config.seed, group=train_cfg.group_by_length)
    for indices in list(sampler)[:2]:
        items = [dataset[i] for i in indices]
        answers = [getattr(item, "answer_text", None) for item in items] if config.task == "extractive" else None
        seq2seq = isinstance(collator, Seq2SeqCollator)
        for finding in validate_batch(collator(items), tokenizer=tokenizer, answers=answers, seq2seq=seq2seq):
            if finding not in findings:
                findings.append(finding)
    settings = validate_settings(
        learning_rate=train_cfg.learning_rate, max_grad_norm=train_cfg.max_grad_norm,
        warmup_steps=train_cfg.warmup_steps, precision=train_cfg.precision, task=config.task,
        pretrained=config.model.name_or_path is not None, n_examples=n_rows,
        batch_size=train_cfg.batch_size * train_cfg.gradient_accumulation_steps,
        bf16_native=_bf16_native(train_cfg.device),
    )
    codes = {f.code for f in findings}
    return findings + [f for f in settings if f.code not in codes]


def train(config: Config, output_dir: str | Path | None = None, overwrite: bool = False,
          progress: bool = True, resume: str | Path | None = None) -> Path:
    """Fine-tune according to ``config`` and return the run directory (with final/ inside).

    ``resume``: a run directory or checkpoint to continue from ("" for the config's output_dir).
    """
    run_dir = Path(output_dir or config.output_dir)
    if output_dir is not None:
        config = config.model_copy(update={"output_dir": str(output_dir)})
    if resume is not None:
        if overwrite:
            raise RunDirError("--resume and --overwrite contradict each other; pass one of them")
        return _resume(config, Path(resume) if str(resume) else run_dir, progress)
    main = is_main_process()
    if main:
        check_output_dir(run_dir, overwrite)
    prepared = _prepare_checked(config)
    if main:  # under accelerate launch, only the main process writes files
        create_run_dir(run_dir, overwrite)
        (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
        if prepared.base_model is not None:
            save_model(run_dir / LORA_BASE_IN_RUN, prepared.base_model, prepared.tokenizer, config,
                       ModelInfo(task=config.task, max_length=prepared.info.max_length))
        write_status(run_dir, status="running", qatune_version=__version__,
                     started=time.strftime("%Y-%m-%d %H:%M:%S"), task=config.task,
                     max_length=prepared.info.max_length, data=prepared.reports,
                     data_fingerprint=_fingerprint(prepared))
    return _run(prepared, run_dir, progress)


def is_main_process() -> bool:
    """Rank 0 of an ``accelerate launch``/torchrun job (or the only process)."""
    return int(os.environ.get("RANK", "0")) == 0


def _prepare_checked(config: Config) -> Prepared:
    prepared = prepare(config)
    for finding in prepared.findings:
        if finding.level == "warning":
            log.warning("warning: %s", finding.message)
    raise_for_errors(prepared.findings)
    return prepared


def _run(prepared: Prepared, run_dir: Path, progress: bool, resume_from: Path | None = None) -> Path:
    """fit() with the run's status kept in run.json (by the main process)."""
    main = is_main_process()
    status = write_status if main else (lambda *args, **kwargs: None)
    try:
        result = fit(prepared, run_dir, progress=progress, resume_from=resume_from)
    except TrainingInterrupted as exc:
        status(run_dir, status="stopped", error=str(exc))
        _report(run_dir, main)
        raise
    except TrainingError as exc:
        status(run_dir, status="failed", error=str(exc))
        _report(run_dir, main)
        raise
    except KeyboardInterrupt:
        status(run_dir, status="stopped", error="interrupted")
        raise
    except BaseException as exc:
        status(run_dir, status="failed", error=f"{type(exc).__name__}: {exc}")
        raise
    status(run_dir, status="complete", finished=time.strftime("%Y-%m-%d %H:%M:%S"), result=result)
    _report(run_dir, main)
    log.info("run complete: %s (model in %s)", run_dir, run_dir / "final")
    return run_dir


def _report(run_dir: Path, main: bool) -> None:
    """report.md and loss.png; a failure here never hides the run's own outcome."""
    if not main:
        return
    try:
        write_report(run_dir)
    except Exception as exc:  # the report is a convenience: say so and move on
        log.warning("could not write report.md: %s", exc)


# Keys that may change when a run is resumed; anything else must match the run's saved config.
RESUMABLE_KEYS = ("output_dir", "train.epochs", "train.save_every", "train.keep_checkpoints", "train.logging_steps",
                  "train.early_stopping_patience", "train.eval_batch_size", "generate.")


def _resume(config: Config, path: Path, progress: bool) -> Path:
    checkpoint = find_checkpoint(path)
    run_dir = checkpoint.parent.parent
    saved = load_config(run_dir / "config.yaml")
    changed = [key for key in _differences(saved.model_dump(mode="json"), config.model_dump(mode="json"))
               if not key.startswith(RESUMABLE_KEYS)]
    if changed:
        raise ConfigError(f"the config differs from the run being resumed in {changed}; resume with the run's own "
                          f"config ({run_dir / 'config.yaml'}) or start a new run")
    config = config.model_copy(update={"output_dir": str(run_dir)})
    prepared = _prepare_checked(config)
    if read_status(run_dir).get("data_fingerprint") not in (None, _fingerprint(prepared)):
        raise DataError(f"the training data changed since {run_dir} was started; an exact resume needs the same "
                        "rows (start a new run to train on the new data)")
    prepared.model = _load_weights(prepared.model, checkpoint)
    if is_main_process():
        (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
        write_status(run_dir, status="running", resumed_from=str(checkpoint))
    return _run(prepared, run_dir, progress, resume_from=checkpoint)


def _load_weights(model: torch.nn.Module, checkpoint: Path) -> torch.nn.Module:
    from safetensors.torch import load_file

    if (checkpoint / "adapter_model.safetensors").is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(checkpoint / "adapter_model.safetensors"))
        return model
    state = load_file(checkpoint / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or [])
    missing = [key for key in missing if key not in tied]
    if missing or unexpected:
        raise RunDirError(f"checkpoint {checkpoint} does not fit the model (missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]})")
    model.tie_weights()
    return model


def _differences(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key in sorted(set(a) | set(b)):
        left, right = a.get(key), b.get(key)
        if isinstance(left, dict) and isinstance(right, dict):
            keys += _differences(left, right, f"{prefix}{key}.")
        elif left != right:
            keys.append(prefix + key)
    return keys


def _fingerprint(prepared: Prepared) -> str:
    digest = hashlib.sha256()
    for item in prepared.dataset.items:
        digest.update(json.dumps(item.input_ids).encode())
    return digest.hexdigest()[:16]


def check_output_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse early (before slow work) an output_dir that cannot or must not be used."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"output_dir {run_dir} is a file; choose a directory path (--output-dir)")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        looks_like_run = (run_dir / "run.json").exists() or (run_dir / "config.yaml").exists()
        if not overwrite:
            what = "a run" if looks_like_run else "files"
            raise RunDirError(f"output_dir {run_dir} already holds {what}; pass --overwrite to replace it "
                              "or choose another --output-dir")
        if not looks_like_run:
            raise RunDirError(f"output_dir {run_dir} is not empty and is not a qatune run; refusing to delete it "
                              "even with --overwrite; choose another --output-dir")
    parent = _existing_parent(run_dir)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RunDirError(f"output_dir {run_dir} is not writable (no write permission on {parent}); "
                          "choose another --output-dir")


def create_run_dir(run_dir: Path, overwrite: bool) -> None:
    check_output_dir(run_dir, overwrite)
    if run_dir.exists() and overwrite:
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"cannot create output_dir {run_dir}: {exc.strerror}") from None


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


class LengthGroupedBatches(torch.utils.data.Sampler):
    """Shuffled batches of similar-length examples: less padding, still a new order every epoch.

    Indices are shuffled, cut into mega-batches of 50 batches, each sorted by length and cut into
    batches; then the batch order is shuffled. ``group=False`` gives plain shuffled batches.
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int, group: bool = True, mega: int = 50):
        self.lengths = lengths
        self.batch_size = batch_size
        self.seed = seed
        self.group = group
        self.mega = mega
        self.epoch = 0
        self._skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip(self, batches: int) -> None:
        """Leave out the first ``batches`` batches of the next pass (resuming inside an epoch)."""
        self._skip = batches

    def __iter__(self) -> Iterator[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        if self.group:
            size = self.batch_size * self.mega
            order = [i for start in range(0, len(order), size)
                     for i in sorted(order[start : start + size], key=lambda j: -self.lengths[j])]
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.group:
            rng.shuffle(batches)
        skip, self._skip = self._skip, 0
        return iter(batches[skip:])

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; biases and normalisation weights (all 1-D parameters) get no weight decay."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        # One fused kernel over all parameters (CPU and CUDA, torch >= 2.4): about 3x faster steps.
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, foreach=True)


def build_schedulers(optimizer: torch.optim.Optimizer, config: Config) -> tuple[Any, torch.optim.lr_scheduler.StepLR]:
    """Linear warmup (per optimizer step) chained with StepLR (per epoch or per optimizer step).

    Both are torch's chainable schedulers, so the learning rate is peak * warmup(t) * gamma**k.
    """
    train = config.train
    warmup = None
    if train.warmup_steps > 0:
        w = train.warmup_steps
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / w, end_factor=1.0,
                                                   total_iters=max(1, w - 1))
    decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=train.scheduler.step_size,
                                            gamma=train.scheduler.gamma)
    return warmup, decay


class NonFiniteGuard:
    """Every optimizer step: loss and gradient norm must be finite, from step 1.

    A bad step is never applied. Its diagnosis (rows of the batch, lr, per-layer gradient norms,
    largest logits, precision) goes to the console and to RUN/nonfinite-step-N.json.
    """

    def __init__(self, run_dir: Path | None, policy: str, limit: int, precision: str,
                 bad_steps: list[int] | None = None):
        self.run_dir = run_dir
        self.policy = policy
        self.limit = limit
        self.precision = precision
        self.bad_steps: list[int] = bad_steps if bad_steps is not None else []
        self.in_a_row = 0
        self.scale_skips = 0

    def ok(self) -> None:
        self.in_a_row = 0
        self.scale_skips = 0

    def record(self, step: int, epoch: int, loss: float, grad_norm: float, rows: list[int], lr: float,
               model: torch.nn.Module, logit_absmax: float) -> None:
        self.bad_steps.append(step)
        self.in_a_row += 1
        norms = {name: float(p.grad.detach().float().norm()) for name, p in model.named_parameters()
                 if p.grad is not None}
        worst = sorted(norms.items(), key=lambda kv: -kv[1] if math.isfinite(kv[1]) else -math.inf)
        non_finite_layers = [name for name, value in norms.items() if not math.isfinite(value)]
        diagnosis = {
            "step": step, "epoch": epoch, "loss": loss, "grad_norm": grad_norm, "rows": rows, "lr": lr,
            "precision": self.precision, "largest_abs_logit": logit_absmax,
            "non_finite_grad_layers": non_finite_layers[:50], "largest_grad_norms": dict(worst[:10]),
            "likely_causes": likely_causes(loss, grad_norm, lr, logit_absmax, self.precision),
        }
        if self.run_dir is not None:
            path = self.run_dir / f"nonfinite-step-{step}.json"
            path.write_text(json.dumps(diagnosis, indent=2, default=str) + "\n", encoding="utf-8")
        log.warning("non-finite step %d (loss=%s, grad_norm=%s, lr=%.3g): update not applied; batch rows %s; %s",
                    step, loss, grad_norm, lr, _rows(rows), diagnosis["likely_causes"][0])

    def should_stop(self) -> bool:
        if self.policy == "stop":
            return len(self.bad_steps) >= self.limit
        return self.in_a_row >= self.limit

    def stop_message(self) -> str:
        causes = likely_causes(math.nan, math.nan, 0.0, 0.0, self.precision)
        where = f"; diagnosis in {self.run_dir}/nonfinite-step-*.json" if self.run_dir else ""
        return (f"training stopped: {len(self.bad_steps)} non-finite step(s) (steps {self.bad_steps[:10]}), "
                f"train.on_nonfinite={self.policy}{where}. Likely causes, in order: " + "; ".join(causes))


def likely_causes(loss: float, grad_norm: float, lr: float, logit_absmax: float, precision: str) -> list[str]:
    causes = []
    if not math.isfinite(logit_absmax) or logit_absmax > 1e4:
        causes.append("the forward pass overflowed (huge or non-finite logits): lower train.learning_rate, "
                      "check the data for extreme inputs")
    if precision == "fp16":
        causes.append("fp16 overflows easily: use train.precision: bf16 or fp32")
    if lr > 1e-3:
        causes.append(f"learning rate {lr:.3g} is high for fine-tuning: lower train.learning_rate and keep "
                      "train.max_grad_norm set")
    causes.append("a batch with no supervised tokens or broken labels: run 'qatune check --config ...'")
    causes.append("too high a learning rate without warmup: set train.warmup_steps and train.max_grad_norm")
    return causes


def fit(prepared: Prepared, run_dir: Path | None, progress: bool = True,
        resume_from: Path | None = None) -> dict[str, Any]:
    """The training loop. Returns the first/final training loss and the best evaluation metrics.

    With ``run_dir``, a resumable checkpoint is written every ``train.save_every`` steps, at each
    epoch end, and when SIGINT/SIGTERM asks to stop. ``resume_from`` continues from a checkpoint.
    """
    config, train_cfg, task = prepared.config, prepared.config.train, prepared.config.task
    accelerator = _accelerator(config)
    if accelerator.device.type == "cuda" and hasattr(prepared.collator, "pad_to_multiple_of"):
        prepared.collator.pad_to_multiple_of = GPU_PAD_MULTIPLE
    objective = objective_for(task, prepared.model)
    if hasattr(objective, "describe"):
        log.info("loss: %s", objective.describe())
    optimizer = build_optimizer(objective, train_cfg.learning_rate, train_cfg.weight_decay)
    sampler = LengthGroupedBatches(prepared.dataset.lengths, train_cfg.batch_size, config.seed,
                                   group=train_cfg.group_by_length)
    # Its own generator: starting an epoch must not draw from the global RNG that dropout uses, so a
    # resumed run sees the same dropout masks as an uninterrupted one.
    loader = torch.utils.data.DataLoader(prepared.dataset, batch_sampler=sampler, collate_fn=prepared.collator,
                                         generator=torch.Generator().manual_seed(config.seed))
    objective, optimizer, loader = accelerator.prepare(objective, optimizer, loader)
    clip = gradient_clipper(accelerator, objective, optimizer, train_cfg.max_grad_norm)
    warmup, decay = build_schedulers(optimizer, config)
    schedulers = {"warmup": warmup, "decay": decay}
    main = accelerator.is_main_process
    metrics_log = MetricsLog(run_dir / "metrics.jsonl" if run_dir and main else None,
                             tensorboard=train_cfg.report_to == "tensorboard")
    state = TrainState()
    if resume_from is not None:
        state = restore(resume_from, optimizer, schedulers)
        metrics_log.truncate_after(state.step)
        log.info("resuming from %s (step %d, epoch %d)", resume_from, state.step, state.epoch + 1)
    guard = NonFiniteGuard(run_dir if main else None, train_cfg.on_nonfinite, train_cfg.max_nonfinite_steps,
                           train_cfg.precision, state.bad_steps)
    accum = train_cfg.gradient_accumulation_steps
    bar = tqdm(total=math.ceil(len(sampler) / accum) * train_cfg.epochs, initial=state.step, desc="train",
               unit="step", file=sys.stderr, disable=not (progress and main), dynamic_ncols=True)

    def checkpoint() -> Path | None:
        if run_dir is None or not main:
            return None
        model = accelerator.unwrap_model(objective).model
        return save_checkpoint(run_dir, state, model, prepared.tokenizer, config, prepared.info, optimizer,
                               schedulers, train_cfg.keep_checkpoints)

    window_stats = _Window()
    with StopSignals() as stop:
        for epoch in range(state.epoch, train_cfg.epochs):
            state.epoch = epoch
            sampler.set_epoch(epoch)
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)  # accelerate's loader re-sets the sampler's epoch from its own count
            sampler.skip(state.consumed * accelerator.num_processes)
            objective.train()
            for window in _windows(loader, accum):
                state.consumed += len(window)
                done = _train_step(accelerator, objective, optimizer, clip, window, task, train_cfg, guard, state)
                if done is not None:
                    if warmup is not None:
                        warmup.step()
                    if train_cfg.scheduler.interval == "step":
                        decay.step()
                    window_stats.add(done["loss"], done["items"], done["tokens"])
                    bar.update(1)
                    if state.step == 1 or state.step % train_cfg.logging_steps == 0:
                        record = window_stats.flush(step=state.step, epoch=epoch + 1, lr=done["lr"],
                                                    grad_norm=done["grad_norm"], supervised=done["items"])
                        metrics_log.write({"event": "train", **record})
                        bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{done['lr']:.2e}",
                                        tok_s=f"{record['tokens_per_s']:.0f}")
                    if train_cfg.save_every and state.step % train_cfg.save_every == 0:
                        checkpoint()
                if stop.requested:
                    bar.close()
                    raise TrainingInterrupted(stop.requested, state, checkpoint())
            if train_cfg.scheduler.interval == "epoch":
                decay.step()
            state.epoch, state.consumed = epoch + 1, 0
            if prepared.eval_records:
                model = accelerator.unwrap_model(objective).model
                if _evaluate_epoch(prepared, model, run_dir if main else None, state, metrics_log, accelerator):
                    state.best_checkpoint = f"step-{state.step:07d}"
            checkpoint()
            accelerator.wait_for_everyone()
            patience = train_cfg.early_stopping_patience
            if patience and state.stale_evals >= patience:
                log.info("early stopping: validation %s did not improve for %d evaluations",
                         train_cfg.best_metric, patience)
                break
    bar.close()
    metrics_log.close()
    model = accelerator.unwrap_model(objective).model
    if run_dir is not None and main:
        save_model(run_dir / "final", model, prepared.tokenizer, config, prepared.info)
    accelerator.wait_for_everyone()
    return {"steps": state.step, "first_train_loss": state.first_loss, "final_train_loss": state.last_loss,
            "best_eval": state.best, "nonfinite_steps": guard.bad_steps}


def _train_step(accelerator: Any, objective: torch.nn.Module, optimizer: Any, clip: Callable[[], Any],
                window: list[dict[str, torch.Tensor]], task: str, train_cfg: Any, guard: NonFiniteGuard,
                state: TrainState) -> dict[str, Any] | None:
    """Forward/backward over one accumulation window, clip, check, step. None when no update was applied."""
    items = _global_count(accelerator, sum(count_items(b, task) for b in window))
    if items == 0:
        log.warning("step %d: a batch with no supervised tokens (rows %s); skipped", state.step + 1,
                    _rows(_batch_rows(window)))
        return None
    loss_sum = torch.zeros((), device=accelerator.device)
    logit_absmax = torch.zeros((), device=accelerator.device)
    for i, batch in enumerate(window):
        # Gradients are synchronised across processes only on the window's last micro-batch.
        with accelerator.no_sync(objective) if i < len(window) - 1 else nullcontext():
            out = objective(**model_inputs(batch))
            accelerator.backward(out["loss_sum"] * accelerator.num_processes / items)
        loss_sum += out["loss_sum"].detach()
        logit_absmax = torch.maximum(logit_absmax, out["logit_absmax"].float())
    grad_norm = clip()
    # Loss and non-padding tokens summed over processes, in one collective.
    local_tokens = float(sum(count_tokens(b) for b in window))
    summed = accelerator.reduce(torch.stack([loss_sum.float(), loss_sum.new_tensor(local_tokens).float()]), "sum")
    # The one host-device sync of a step: the NaN guard must see loss and norm before the update.
    total, tokens, grad_norm, absmax = torch.cat([
        summed, torch.stack([torch.as_tensor(grad_norm, device=loss_sum.device).float(), logit_absmax])]).tolist()
    loss = total / items
    lr = optimizer.param_groups[0]["lr"]
    if math.isfinite(loss) and not math.isfinite(grad_norm) and accelerator.scaler is not None:
        # fp16 loss scale too high: the scaler skips this update and lowers the scale.
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        guard.scale_skips += 1
        if guard.scale_skips < MAX_SCALE_SKIPS:
            return None
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        guard.record(state.step + 1, state.epoch + 1, loss, grad_norm, _batch_rows(window), lr,
                     accelerator.unwrap_model(objective).model, absmax)
        if guard.should_stop():
            raise TrainingError(guard.stop_message())
        return None
    guard.ok()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state.step += 1
    state.last_loss = loss
    if state.step == 1:
        state.first_loss = loss
    return {"loss": loss, "items": items, "tokens": int(tokens), "lr": lr, "grad_norm": grad_norm}


def gradient_clipper(accelerator: Any, objective: torch.nn.Module, optimizer: Any, max_norm: float | None
                     ) -> Callable[[], torch.Tensor | float]:
    """A function that clips the gradients to ``max_norm`` and returns their total norm before clipping
    (a tensor: no host sync). Which way to clip is decided once, here.

    With torch's fused AdamW the clipping is folded into the update: the optimizer divides every
    gradient by its ``grad_scale`` inside its one kernel (the hook GradScaler uses), which saves a pass
    over all gradients. fp16 loss scaling, FSDP and DeepSpeed keep accelerate's own clipping.
    """
    from accelerate.utils import DistributedType

    inner = getattr(optimizer, "optimizer", optimizer)
    if not (inner.defaults.get("fused") and accelerator.scaler is None and accelerator.distributed_type in
            (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)):
        return lambda: accelerator.clip_grad_norm_(objective.parameters(), max_norm or math.inf)
    params = [p for group in inner.param_groups for p in group["params"]]

    def folded() -> torch.Tensor:
        grads = [p.grad for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else torch.zeros(())
        # torch.nn.utils.clip_grad_norm_ multiplies by max_norm / (norm + 1e-6) when that is below 1.
        inner.grad_scale = (norm + 1e-6).div(max_norm).clamp(min=1.0) if max_norm else None
        return norm

    return folded


class StopSignals:
    """SIGINT/SIGTERM ask the loop to finish its step, save a checkpoint and stop; a second SIGINT
    stops at once."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        log.warning("%s received: finishing the current step and saving a checkpoint (Ctrl-C again to stop now)",
                    self.requested)


class TrainingInterrupted(TrainingError):
    """Training was asked to stop; a checkpoint was written (exit code 130)."""

    exit_code = 130

    def __init__(self, signal_name: str, state: TrainState, checkpoint: Path | None):
        self.checkpoint = checkpoint
        where = f"; checkpoint saved in {checkpoint}" if checkpoint else ""
        how = f"; resume with: qatune train --config <your config> --resume {checkpoint.parent.parent}" if checkpoint else ""
        super().__init__(f"training stopped by {signal_name} at step {state.step} (epoch {state.epoch + 1}){where}{how}")


def _evaluate_epoch(prepared: Prepared, model: torch.nn.Module, run_dir: Path | None, state: TrainState,
                    metrics_log: MetricsLog, accelerator: Any) -> bool:
    """Evaluate on the validation rows; save best/ when the chosen metric improves. Returns whether it did.

    With several processes each evaluates every n-th row; predictions and loss sums are gathered so
    that every process computes the same metrics (and takes the same early-stopping decision).
    """
    config, records = prepared.config, prepared.eval_records
    rank, world = accelerator.process_index, accelerator.num_processes
    mine = list(range(rank, len(records), world))
    predictions, loss_sum, count = evaluation_parts(model, prepared.tokenizer, prepared.info,
                                                    [records[i] for i in mine], config.generate,
                                                    config.train.eval_batch_size)
    if world > 1:
        from accelerate.utils import gather_object

        pairs = dict(gather_object(list(zip(mine, predictions))))   # each row index exactly once
        predictions = [pairs[i] for i in range(len(records))]
        sums = gather_object([(loss_sum, count)])
        loss_sum, count = sum(s for s, _ in sums), sum(c for _, c in sums)
    metrics = metrics_from(prepared.info, records, predictions, loss_sum, count)
    model.train()
    metrics_log.write({"event": "eval", "epoch": state.epoch, "step": state.step, **metrics})
    if run_dir is not None:
        write_predictions(run_dir / VALIDATION_PREDICTIONS, prepared.eval_records, predictions)
    log.info("epoch %d: eval loss %s, exact match %.1f, F1 %.1f (%d examples)", state.epoch,
             f"{metrics['loss']:.4f}" if metrics["loss"] is not None else "n/a", metrics["exact_match"],
             metrics["f1"], metrics["num_examples"])
    if not _better(metrics, state.best, config.train.best_metric):
        state.stale_evals += 1
        return False
    state.best = {**metrics, "epoch": state.epoch, "step": state.step}
    state.stale_evals = 0
    if run_dir is not None:
        save_model(run_dir / "best", model, prepared.tokenizer, config, prepared.info)
    return True


def _better(metrics: dict[str, Any], best: dict[str, Any] | None, metric: str) -> bool:
    if best is None:
        return True
    if metric == "loss":
        return metrics["loss"] is not None and (best["loss"] is None or metrics["loss"] < best["loss"])
    loss, best_loss = metrics["loss"] or 0.0, best["loss"] or 0.0
    return (metrics[metric], -loss) > (best[metric], -best_loss)


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl (nothing when path is None), and to
    TensorBoard when asked."""

    def __init__(self, path: Path | None, tensorboard: bool = False):
        self.path = path
        self.writer = None
        if path is not None and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(path.parent / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=_json_default) + "\n")
        if self.writer is not None:
            prefix = record.get("event", "train")
            for key, value in record.items():
                if key not in ("event", "step", "epoch") and isinstance(value, int | float):
                    self.writer.add_scalar(f"{prefix}/{key}", value, record.get("step", 0))
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def truncate_after(self, step: int) -> None:
        """Drop lines logged after ``step`` (a resumed run writes them again)."""
        if self.path is None or not self.path.exists():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


@dataclass
class _Window:
    """Token-weighted loss and throughput since the last log line."""

    loss_sum: float = 0.0
    items: int = 0
    tokens: int = 0
    since: float = field(default_factory=time.perf_counter)

    def add(self, loss: float, items: int, tokens: int) -> None:
        self.loss_sum += loss * items
        self.items += items
        self.tokens += tokens

    def flush(self, **fields: Any) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.since, 1e-9)
        record = {**fields, "loss": self.loss_sum / max(self.items, 1), "tokens_per_s": self.tokens / elapsed}
        record = {"step": fields["step"], "epoch": fields["epoch"], "loss": record["loss"], "lr": fields["lr"],
                  "grad_norm": fields["grad_norm"], "supervised_tokens": fields["supervised"],
                  "tokens_per_s": record["tokens_per_s"]}
        self.loss_sum, self.items, self.tokens, self.since = 0.0, 0, 0, time.perf_counter()
        return record


def _windows(loader: Any, accum: int) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Groups of ``accum`` micro-batches (the last group of an epoch may be shorter)."""
    window: list[dict[str, torch.Tensor]] = []
    for batch in loader:
        window.append(batch)
        if len(window) == accum:
            yield window
            window = []
    if window:
        yield window


def _global_count(accelerator: Any, count: int) -> int:
    if accelerator.num_processes == 1:
        return count
    total = accelerator.reduce(torch.tensor(count, device=accelerator.device), "sum")
    return int(total)


def _batch_rows(window: list[dict[str, torch.Tensor]]) -> list[int]:
    return [int(r) for batch in window for r in batch["row"].tolist()]


def _accelerator(config: Config) -> Any:
    from accelerate import Accelerator

    train_cfg = config.train
    if train_cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is cuda but no GPU is visible; set train.device: auto or cpu")
    on_cpu = train_cfg.device == "cpu" or not torch.cuda.is_available()
    if train_cfg.precision == "fp16" and on_cpu:
        raise ConfigError("train.precision fp16 needs a GPU; on CPU use bf16 or fp32")
    mixed = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[train_cfg.precision]
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # One process may train several times (tests, notebooks); accelerate keeps its state global.
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    try:
        # cpu=True also when there is no GPU: accelerate sets up multi-process CPU training (gloo) only then.
        return Accelerator(mixed_precision=mixed, cpu=on_cpu)
    except ValueError as exc:
        raise ConfigError(f"train.precision {train_cfg.precision} is not supported here: {exc}") from None


def _bf16_native(device: str) -> bool:
    """Whether bf16 matrix products run natively where training will run."""
    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return True  # unknown (not Linux): do not warn
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _seed_everything(seed: int) -> None:
    from accelerate.utils import set_seed

    set_seed(seed)


def _tokenizer_corpus(task: str, template: PromptTemplate, records: list[QARecord]) -> list[str]:
    if task == "generative":
        return [template.render(r.question, r.context, r.fields) + template.answer_prefix + r.answer for r in records]
    return [text for r in records for text in (r.question, r.context or "")]


def _length_summary(lengths: list[int]) -> dict[str, int]:
    from qatune.data.generative import percentile

    return {"min": min(lengths), "median": percentile(lengths, 50), "p95": percentile(lengths, 95),
            "max": max(lengths)} if lengths else {}


def _log_report(report: LoadReport) -> None:
    log.info("data: %s", report.summary())


def _rows(rows: list[int], limit: int = 10) -> str:
    shown = ", ".join(map(str, rows[:limit]))
    return shown + (f" and {len(rows) - limit} more" if len(rows) > limit else "")


def _json_default(value: Any) -> Any:
    return str(value)
