"""``qatune check``: a preflight report on config, data, tokenization and settings. Trains nothing
(unless ``--overfit N``, which trains a few dozen steps on N rows to prove labels and masks are wired).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qatune.config import Config, LoraSettings
from qatune.data.spans import PassageAnswers
from qatune.data.spreadsheet import describe_validation, normalize_question
from qatune.data.validate import error, warning
from qatune.errors import row_list
from qatune.kinds import kind_of
from qatune.kinds.fields_check import render_fields
from qatune.model.families import gguf_refusal
from qatune.train import Prepared, fit, prepare, sharding
from qatune.train.duration_estimate import MATMUL_SHARE, batch_widths, matmul_rate, training_seconds
from qatune.train.memory_estimate import (
    GIB,
    available_bytes,
    estimate,
    measured_activations,
    meta_model,
    processes_here,
    resident_bytes,
    shape,
    verdicts,
)

OVERFIT_STEPS = 50
OVERFIT_TARGET = 0.1
"""Loss per supervised token (or window) the overfit run must reach (or 1/20 of where it started)."""


def run_check(config: Config, overfit: int | None = None, overfit_steps: int = OVERFIT_STEPS,
              processes: int | None = None) -> dict[str, Any]:
    """The report as a dict (``ok`` is False when there is an error finding). ``processes``: how many processes the
    run will train on, on this machine (``train --num-processes``); the memory estimate shows DDP and FSDP on that
    many (2 without it) and judges the configured set-up on it (a ddp config without it: one process)."""
    prepared = prepare(config, with_model=False)
    kind = kind_of(config.task)
    findings = list(prepared.findings)
    report: dict[str, Any] = {
        "task": config.task,
        "model": config.model.name_or_path or "scratch",
        "files": prepared.reports,
        "leakage": _leakage(prepared),
        "max_length": prepared.info.max_length,
    }
    if report["leakage"]["count"]:
        findings.append(warning("leakage", f"{report['leakage']['count']} questions appear in both the training and "
                                           "the evaluation data: evaluation scores will be too optimistic"))
    section, found = kind.check(prepared)
    report.update(section)
    findings += found
    if config.model.trust_remote_code:
        findings.append(remote_code_warning(config))
    refusal = sharding.config_refusal(config)
    if refusal:
        findings.append(error("distributed", refusal))
    model = meta_model(config, prepared.tokenizer, prepared.info.seq2seq)
    if kind.gguf_refusal(prepared.info) is None:
        from qatune.export.gguf_write import tokenizer_refusal

        unwritten = gguf_refusal(model.config) or tokenizer_refusal(prepared.tokenizer)
        if unwritten:
            findings.append(warning("gguf", f"qatune export --gguf cannot write this model: {unwritten}; "
                                            "qatune export RUN --merge FOLDER writes a plain transformers folder"))
    report["memory"], memory_finding = _memory(prepared, processes, model)
    report["training_time"] = _duration(prepared, model)
    if memory_finding is not None:
        findings.append(memory_finding)
    if not prepared.eval_records:
        findings.append(warning("no-validation", "no validation data: set data.eval_file or data.validation_fraction "
                                                 "to see exact match/F1 after every epoch and keep the best model"))
    if overfit:
        report["overfit"] = _overfit(config, prepared, overfit, overfit_steps)
        if not report["overfit"]["passed"]:
            findings.append(error("overfit-failed", report["overfit"]["message"]))
    report["findings"] = [f.to_dict() for f in findings]
    report["ok"] = not any(f.level == "error" for f in findings)
    return report


def remote_code_warning(config: Config) -> Any:
    model = config.model.name_or_path or "the model"
    pinned = f" at revision {config.model.revision}" if config.model.revision else ""
    return warning("remote-code",
                   f"model.trust_remote_code is true: check, train, eval, generate and serve run the Python code that "
                   f"comes with {model}{pinned}, with your permissions on this machine; keep it only for a model whose "
                   "authors you trust" + ("" if pinned else ", and pin the code you read with model.revision"))


def duration_text(seconds: float) -> str:
    if seconds < 90:
        return f"{max(seconds, 1):.0f} seconds"
    if seconds < 5400:
        return f"{seconds / 60:.0f} minutes"
    return f"{seconds / 3600:.1f} hours"


def _duration(prepared: Prepared, model: Any) -> dict[str, Any]:
    """About how long training takes on this machine (train/duration_estimate.py)."""
    config, items = prepared.config, prepared.dataset.items
    gpu = torch.cuda.is_available() and config.train.device != "cpu"
    dtype = torch.bfloat16 if prepared.precision == "bf16" else torch.float32
    rate = matmul_rate(dtype, "cuda" if gpu else "cpu") * MATMUL_SHARE
    answers = [len(i.input_ids) - i.prompt_length for i in items if hasattr(i, "prompt_length")]
    prompts = [i.prompt_length for i in items if hasattr(i, "prompt_length")] or list(prepared.dataset.lengths)
    mean = (lambda values: round(sum(values) / len(values)) if values else 0)  # noqa: E731
    eval_rows = [(mean(prompts), mean(answers))] * len(prepared.eval_records)
    dims = shape(model)
    # a language model's head: on the supervised positions (supervised_head), else on every one
    head_tokens = kind_of(config.task).vocabulary_logits(1, sum(prepared.dataset.lengths), sum(answers),
                                                         config.train.speedups == "off")
    found = training_seconds(model, batch_widths(list(prepared.dataset.lengths), config.train.batch_size),
                             config.train.epochs, config.model.lora is not None, eval_rows, rate, dims["layers"],
                             dims["hidden"], head_tokens)
    where = "this GPU" if gpu else "this CPU"
    found["basis"] = (f"{found['tflops_per_epoch']} TFLOP an epoch at {rate / 1e9:.0f} GFLOP/s ({MATMUL_SHARE:.0%} of "
                      f"a {str(dtype).removeprefix('torch.')} matrix product timed on {where}), "
                      f"{config.train.epochs} epoch{'s' if config.train.epochs != 1 else ''}, validation included")
    return found


def _memory(prepared: Prepared, processes: int | None, model: Any) -> tuple[dict[str, Any], Any]:
    """The estimated peak per process of each set-up, whether it fits (the processes of one machine sharing its
    RAM), and a warning with the cheapest change that makes the configured one fit."""
    config = prepared.config
    items = prepared.dataset.items
    longest = max(prepared.dataset.lengths, default=0)
    supervised = max((len(i.input_ids) - i.prompt_length for i in items if hasattr(i, "prompt_length")), default=0)
    rows = config.train.batch_size
    baseline = resident_bytes()  # what a training process holds besides the model: libraries, data, tokenizer
    shown = processes or 2
    measured = measured_activations(prepared, model)

    def setups(batch_rows: int, changed: Config = config, model: Any = model) -> list[dict[str, Any]]:
        scaled = measured and (measured[0], measured[1] * batch_rows // rows)  # a smaller batch computes less
        return verdicts(estimate(model, changed, prepared.precision, (batch_rows, longest), supervised, shown,
                                 baseline, scaled), available, shared)

    available, where = available_bytes()
    shared = where.startswith("RAM")
    table = setups(rows)
    # The rows are one process, ddp and fsdp (absent for a model without repeated blocks).
    index = 2 if config.train.distributed == "fsdp" and len(table) > 2 else 1 if processes else 0
    configured = table[index]
    usable = processes or processes_here()
    for row in table:  # what this machine can run: the page shows those set-ups only
        row["runnable"] = row["processes"] <= usable
    memory = {"available_gib": round(available / GIB, 2), "device": where, "batch": [rows, longest],
              "setups": table, "configured": configured["setup"]}
    if configured["fits"]:
        return memory, None
    options = []  # (the set-up with the change, the change, what the change is called when none fits)
    if rows > 1:
        options.append((setups(rows // 2)[index], f"train.batch_size {rows // 2} with "
                                                  f"train.gradient_accumulation_steps "
                                                  f"{2 * config.train.gradient_accumulation_steps} (the same updates)",
                        "a smaller batch"))
    if not config.train.activation_checkpointing:
        checkpointed = config.model_copy(update={"train": config.train.model_copy(
            update={"activation_checkpointing": True})})
        options.append((setups(rows, checkpointed)[index], "train.activation_checkpointing: true",
                        "activation checkpointing"))
    fsdp = config.model_copy(update={"train": config.train.model_copy(update={"distributed": "fsdp"})})
    if len(table) > 2 and index != 2 and sharding.config_refusal(fsdp) is None:
        options.append((table[2], f"train.distributed fsdp on {shown} processes", "fsdp"))
    if config.model.lora is None and config.takes_lora:
        lora = config.model_copy(update={"model": config.model.model_copy(update={"lora": LoraSettings()})})
        with_lora = setups(rows, lora, meta_model(lora, prepared.tokenizer, prepared.info.seq2seq))
        options.append((with_lora[min(index, len(with_lora) - 1)], "LoRA adapters (model.lora: {r: 16})", "LoRA"))
    fitting = next((how for verdict, how, _ in options if verdict["fits"]), None)
    tried = [name for _, _, name in options]
    advice = (f"; {fitting} fits" if fitting else
              f"; none of {', '.join(tried[:-1])} or {tried[-1]} fits either" if len(tried) > 1 else
              f"; {tried[0]} does not fit either" if tried else "")
    each = (f" ({configured['processes']} processes of {configured['total_gib']:.1f} GiB each)"
            if shared and configured["processes"] > 1 else "")
    return memory, warning("memory", f"the {configured['setup']} set-up needs an estimated "
                                     f"{configured['needed_gib']:.1f} GiB{each} and the device has "
                                     f"{available / GIB:.1f} GiB ({where}){advice}")


def _leakage(prepared: Prepared) -> dict[str, Any]:
    """Evaluation questions that training shows too. With other prompt columns (a grading sheet's student answer),
    a question comes back with new values by design: only the same question with the same columns counts."""
    def prompt(record: Any) -> tuple[str, ...]:
        return (normalize_question(record.question), *map(normalize_question, record.fields.values()))

    train = {prompt(r) for r in prepared.train_records}
    both = sorted({r.question for r in prepared.eval_records if prompt(r) in train})
    return {"count": len(both), "examples": both[:5]}


def _overfit(config: Config, prepared: Prepared, n: int, steps: int) -> dict[str, Any]:
    rows = prepared.train_records[:n]
    small = config.model_copy(deep=True)
    small.train.epochs = steps
    small.train.batch_size = 100_000  # every step sees all N rows (all their windows, for extractive)
    small.train.gradient_accumulation_steps = 1
    small.train.warmup_steps = 0
    small.train.scheduler.gamma = 1.0
    run = prepare(small, train_records=rows, eval_records=[])
    result = fit(run, None, progress=False)
    first, last = result["first_train_loss"], result["final_train_loss"]
    passed = math.isfinite(last) and last <= max(OVERFIT_TARGET, first / 20)
    message = (f"overfit {len(rows)} rows for {result['steps']} steps: loss {first:.4f} -> {last:.4f} "
               f"({'passed' if passed else 'did not fall near zero'})")
    if not passed:
        message += ("; the labels, masks or learning rate are not letting the model learn even these rows "
                    "(try a higher train.learning_rate for this check, then look at the rendered examples)")
    return {"rows": len(rows), "steps": result["steps"], "first_loss": first, "final_loss": last,
            "target": OVERFIT_TARGET, "passed": passed, "message": message}


def render_report(report: dict[str, Any]) -> str:
    """The human-readable report printed by ``qatune check``."""
    lines = [f"qatune check: {report['task']} QA, model {report['model']}", ""]
    lines.append("Data")
    for key, file in report["files"].items():
        if key in ("encoding", "validation"):
            continue
        lines.append(f"  {key}: {file['file']}: {file['rows_read']} rows read, {file['kept']} kept, "
                     f"{file['duplicates']} duplicates")
        for reason, rows in file["dropped"].items():
            lines.append(f"    dropped {len(rows)} ({reason}): rows {row_list(rows)}")
    lines.append(f"  validation: {describe_validation(report['files']['validation'])}")
    leak = report["leakage"]
    lines.append(f"  questions in both train and eval: {leak['count']}" +
                 (f" (e.g. {leak['examples'][0]!r})" if leak["count"] else ""))
    lengths = report["lengths"]
    lines += ["", "Tokens",
              (f"  {lengths['what']}: min {lengths['min']}, median {lengths['median']}, p95 {lengths['p95']}, "
               f"max {lengths['max']}"),
              f"  max_length: {report['max_length']}"]
    lines += kind_of(report["task"]).check_lines(report)
    for example in report["examples"]:
        lines += ["    " + line for line in example.splitlines()] + [""]
    if "fields" in report:
        lines += [*render_fields(report["fields"]), ""]
    if report.get("grounding"):
        grounding = report["grounding"]
        lines += ["Grounded answers", f"  {PassageAnswers.from_json(grounding).describe()}",
                  f"  generate.grounded: {grounding['setting']}: eval, generate and serve answer "
                  + ("with a span of the passage (or the no-answer text)" if grounding["on"] else "freely"), ""]
    memory = report["memory"]
    lines += ["Memory (estimated peak per process; batch of "
              f"{memory['batch'][0]} rows x {memory['batch'][1]} tokens)"]
    for setup in memory["setups"]:
        parts = ", ".join(f"{name} {gib:.2f}" for name, gib in setup["parts_gib"].items())
        together = (f", {setup['needed_gib']:.2f} GiB for its {setup['processes']} processes"
                    if setup["processes"] > 1 and memory["device"].startswith("RAM") else "")
        configured = "  (this config)" if setup["setup"] == memory["configured"] else ""
        lines.append(f"  {setup['setup']:<12} {setup['total_gib']:6.2f} GiB ({parts}){together}: "
                     f"{'fits' if setup['fits'] else 'does NOT fit'}{configured}")
    lines += [f"  available: {memory['available_gib']:.1f} GiB ({memory['device']})", ""]
    if report.get("training_time"):
        lines += ["Time", f"  training: about {duration_text(report['training_time']['seconds'])} on this machine "
                          f"({report['training_time']['basis']})", ""]
    if "overfit" in report:
        lines += ["Overfit check", f"  {report['overfit']['message']}", ""]
    errors = [f for f in report["findings"] if f["level"] == "error"]
    warnings = [f for f in report["findings"] if f["level"] == "warning"]
    lines.append(f"Findings: {len(errors)} errors, {len(warnings)} warnings")
    for finding in errors + warnings:
        lines.append(f"  {finding['level']}: [{finding['code']}] {finding['message']}")
    lines += ["", "fit to train" if report["ok"] else "NOT fit to train: fix the errors above"]
    return "\n".join(lines)
