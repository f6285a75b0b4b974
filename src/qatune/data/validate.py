"""Checks that catch the silent data bugs behind NaN losses, on any batch, dataset or loader.

Usable without the rest of qatune, on tensors a user built with their own code::

    from qatune.data.validate import validate_batch, validate_loader, raise_for_errors
    raise_for_errors(validate_loader(my_loader, tokenizer=tokenizer))

Each finding names the bug, where it is, and the fix. ``train`` runs these on its first batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from qatune.data.padding import IGNORE_INDEX
from qatune.errors import DataError
from qatune.tasks import task_kind

TINY_DATASET = 8


@dataclass(frozen=True)
class Finding:
    level: str
    """error (training would be wrong or NaN) or warning (training may not learn)."""
    code: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.level}: {self.message}"


def error(code: str, message: str) -> Finding:
    return Finding("error", code, message)


def warning(code: str, message: str) -> Finding:
    return Finding("warning", code, message)


def raise_for_errors(findings: Iterable[Finding]) -> None:
    """Raise one DataError listing every error finding (warnings pass)."""
    errors = [f for f in findings if f.level == "error"]
    if len(errors) == 1:
        raise DataError(errors[0].message)
    if errors:
        raise DataError(f"{len(errors)} problems in the training batches:\n"
                        + "\n".join(f"  - {f.message}" for f in errors))


def validate_dataset(dataset: Any) -> list[Finding]:
    """Is this a collection of QA records at all? (Not one long string, not characters.)"""
    if isinstance(dataset, str | bytes):
        return [error("dataset-is-string",
                      f"the dataset is one string of {len(dataset)} characters, not a list of QA records; iterating it "
                      "yields single characters. Build a list of pairs, e.g. [{'question': ..., 'answer': ...}] "
                      "(qatune.data.spreadsheet.load_records does this from a spreadsheet)")]
    try:
        size = len(dataset)
    except TypeError:
        return []
    findings = []
    first = [dataset[i] for i in range(min(size, 16))] if hasattr(dataset, "__getitem__") else []
    if first and all(isinstance(item, str) and len(item) <= 1 for item in first):
        findings.append(error("dataset-is-string",
                              f"the dataset yields single characters ({''.join(first)!r} ...): it was built "
                              "from one string instead of a list of QA records; split the text into "
                              "(question, answer) pairs"))
    if 0 < size < TINY_DATASET:
        findings.append(warning("tiny-dataset",
                                f"the dataset has only {size} examples; a model cannot learn a task from so few "
                                "(fine for an overfitting check); add rows"))
    if size == 0:
        findings.append(error("empty-dataset", "the dataset is empty"))
    return findings


def validate_batch(batch: Any, *, tokenizer: Any = None, pad_token_id: int | None = None,
                   answers: Sequence[str] | None = None, seq2seq: bool = False) -> list[Finding]:
    """Check one collated batch: shapes, labels, attention mask, span positions.

    ``answers`` (extractive, one per row) enables the check that each start/end span decodes to
    its answer; it needs ``tokenizer``.
    """
    if not isinstance(batch, Mapping):
        return [error("batch-not-a-mapping", f"a batch must be a dict of tensors, got {type(batch).__name__}")]
    if "input_ids" not in batch:
        return [error("no-input-ids", f"the batch has no 'input_ids' (keys: {sorted(batch)})")]
    input_ids = torch.as_tensor(batch["input_ids"])
    if input_ids.ndim == 1:
        input_ids = input_ids.unsqueeze(0)
    mask = torch.as_tensor(batch["attention_mask"]) if "attention_mask" in batch else None
    if pad_token_id is None and tokenizer is not None:
        pad_token_id = tokenizer.pad_token_id
    findings = _check_length(input_ids, mask)
    if any(f.level == "error" for f in findings):
        return findings  # everything else follows from sequences cut to nothing
    if mask is not None:
        findings += _check_mask(input_ids, mask, pad_token_id)
    if "start_positions" in batch or "end_positions" in batch:
        findings += _check_spans(batch, input_ids, mask, tokenizer, answers)
    elif "targets" in batch:
        findings += _check_targets(torch.as_tensor(batch["targets"]), input_ids)
    else:
        findings += _check_labels(batch, input_ids, mask, seq2seq)
    return findings


def validate_loader(loader: Iterable[Any], *, tokenizer: Any = None, pad_token_id: int | None = None,
                    max_batches: int = 2, answers: Sequence[Sequence[str]] | None = None) -> list[Finding]:
    """Validate the dataset behind a DataLoader (if any) and its first ``max_batches`` batches."""
    findings = validate_dataset(getattr(loader, "dataset", loader))
    if any(f.level == "error" for f in findings):
        return findings
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        row_answers = answers[i] if answers is not None else None
        for finding in validate_batch(batch, tokenizer=tokenizer, pad_token_id=pad_token_id, answers=row_answers):
            if finding not in findings:
                findings.append(finding)
    return findings


def validate_settings(*, learning_rate: float, max_grad_norm: float | None, warmup_steps: int = 0,
                      precision: str = "fp32", task: str = "generative", pretrained: bool = True,
                      lora: bool = False, n_examples: int | None = None, batch_size: int | None = None,
                      accumulation: int = 1, loss_scaling: bool = True, bf16_native: bool = True) -> list[Finding]:
    """Settings that lead to NaN or to no learning, each with its fix (``accumulation``: micro-batches
    per update, train.gradient_accumulation_steps; ``lora``: adapters train, which take rates ten times
    higher than full fine-tuning)."""
    findings = []
    if precision == "bf16" and not bf16_native:
        findings.append(warning("bf16-emulated", "train.precision bf16 on a CPU without native bf16 (AVX512-BF16/AMX, "
                                                 "or with ONEDNN_MAX_CPU_ISA below them) is emulated, far slower "
                                                 "than fp32; use fp32 or auto here"))
    if learning_rate >= 1e-2 and max_grad_norm is None:
        findings.append(warning("lr-high-no-clipping",
                                f"learning rate {learning_rate:g} is far too high without gradient clipping: the loss "
                                "will diverge to NaN; lower it (5e-5 for fine-tuning) "
                                "and set train.max_grad_norm: 1.0"))
    elif pretrained and learning_rate > (3e-3 if lora else 5e-4):
        what, typical = ("LoRA adapters on", "1e-4 to 1e-3") if lora else ("fine-tuning", "1e-5 to 1e-4")
        findings.append(warning("lr-high",
                                f"learning rate {learning_rate:g} is high for {what} a pretrained model "
                                f"(typical: {typical}); it can destroy what the model knows or diverge"))
    elif pretrained and not lora and learning_rate > 1e-4 and (max_grad_norm is None or warmup_steps == 0):
        findings.append(warning("lr-high-no-warmup",
                                f"learning rate {learning_rate:g} without warmup and clipping can diverge on the first "
                                "steps of full fine-tuning; set train.warmup_steps and train.max_grad_norm"))
    if max_grad_norm is None and not findings:
        findings.append(warning("no-clipping", "no gradient clipping: one bad batch can blow up the weights; "
                                               "set train.max_grad_norm: 1.0"))
    if precision == "fp16" and task_kind(task).points and not loss_scaling:
        findings.append(warning("fp16-no-scaling", "fp16 on an encoder without loss scaling underflows gradients "
                                                   "and overflows logits; use bf16, or fp16 with a GradScaler"))
    elif precision == "fp16":
        findings.append(warning("fp16", "fp16 overflows easily (qatune scales the loss dynamically); prefer bf16 "
                                        "on hardware that has it"))
    if n_examples is not None and n_examples < TINY_DATASET:
        findings.append(warning("tiny-dataset",
                                f"only {n_examples} training examples; a model cannot learn a task from so few "
                                "(the question that started qatune had 2); add rows"))
    if n_examples is not None and batch_size is not None and batch_size * accumulation > n_examples:
        if batch_size > n_examples or accumulation == 1:
            what, fix = f"train.batch_size {batch_size}", "train.batch_size"
        else:
            what = (f"the batch of an update (train.batch_size {batch_size} x train.gradient_accumulation_steps "
                    f"{accumulation} = {batch_size * accumulation})")
            fix = "train.gradient_accumulation_steps"
        findings.append(warning("batch-larger-than-dataset",
                                f"{what} is larger than the {n_examples} training examples; every update sees all "
                                f"of them; lower {fix}"))
    return findings


def _check_length(input_ids: torch.Tensor, mask: torch.Tensor | None) -> list[Finding]:
    width = input_ids.shape[-1]
    longest = int(mask.sum(-1).max()) if mask is not None and mask.numel() else width
    if width <= 2 or longest <= 2:
        return [error("max-length-tiny",
                      f"every sequence in the batch is at most {max(longest, 0) if mask is not None else width} "
                      f"token(s) long: max_length was probably computed as 1 (from a string or a single row) and "
                      "truncation cut everything; use max_length: auto or the token length of your longest example")]
    if width < 8:
        return [warning("max-length-short", f"sequences are only {width} tokens long; check max_length")]
    return []


def _check_mask(input_ids: torch.Tensor, mask: torch.Tensor, pad_token_id: int | None) -> list[Finding]:
    if mask.shape != input_ids.shape:
        return [error("mask-shape",
                      f"attention_mask has shape {tuple(mask.shape)} but input_ids {tuple(input_ids.shape)}")]
    if pad_token_id is None or input_ids.shape[0] < 2:
        return []
    lengths = mask.sum(-1)
    if not bool((lengths == input_ids.shape[-1]).all()):
        return []
    # Every row claims to be full length. Rows padded by the collator end (or start) with a run of
    # pad ids: if rows have such runs of different lengths, the mask was set to 1 on padding.
    tails = [_run_length(row.tolist(), pad_token_id) for row in input_ids]
    heads = [_run_length(row.tolist()[::-1], pad_token_id) for row in input_ids]
    runs = tails if max(tails) >= max(heads) else heads
    padded_rows = [i for i, run in enumerate(runs) if run >= 2]
    if padded_rows and min(runs) < max(runs):
        return [error("mask-on-padding",
                      f"attention_mask is 1 on padding: rows {padded_rows[:10]} end in {max(runs)} pad tokens "
                      f"(id {pad_token_id}) that the mask marks as real, so the model attends to padding (and, "
                      "with labels copied from input_ids, learns to predict padding); build the mask from each "
                      "row's length, e.g. tokenizer(texts, padding=True) returns it")]
    return []


def _run_length(ids: list[int], value: int) -> int:
    n = 0
    for token in reversed(ids):
        if token != value:
            break
        n += 1
    return n


def _check_targets(targets: torch.Tensor, input_ids: torch.Tensor) -> list[Finding]:
    """A scoring batch's targets: a row of heads per row of input_ids, each a number, a class or nothing (NaN,
    IGNORE_INDEX)."""
    if targets.ndim != 2 or targets.shape[0] != input_ids.shape[0]:
        return [error("targets-shape", f"targets have shape {tuple(targets.shape)}; a row of targets (one per head) "
                                       f"is needed for each of the {input_ids.shape[0]} rows of input_ids")]
    known = ~torch.isnan(targets) & (targets != IGNORE_INDEX)
    if bool(torch.isinf(targets).any()):
        return [error("targets-not-finite", "a target is infinite: the loss would be too")]
    if not bool(known.any()):
        return [error("no-targets", "no row of the batch has a target: there is nothing to learn")]
    return []


def _check_labels(batch: Mapping, input_ids: torch.Tensor, mask: torch.Tensor | None,
                  seq2seq: bool = False) -> list[Finding]:
    if "labels" not in batch:
        return [error("no-labels",
                      "the batch has no 'labels': a causal LM computes no loss without them (or you compare "
                      "outputs with nothing); set labels = input_ids with -100 on padding (and on the prompt)")]
    labels = torch.as_tensor(batch["labels"])
    if seq2seq:  # decoder targets: their own length, every position predicted
        if not bool((labels != IGNORE_INDEX).any()):
            return [error("all-labels-ignored", "every decoder label in the batch is -100: nothing to learn")]
        return []
    if labels.shape != input_ids.shape:
        return [error("labels-shape",
                      f"labels have shape {tuple(labels.shape)} but input_ids {tuple(input_ids.shape)}")]
    supervised = labels[:, 1:] != IGNORE_INDEX
    if not bool(supervised.any()):
        return [error("all-labels-ignored",
                      "every label in the batch is -100: there is nothing to learn and the loss is NaN (0/0); "
                      "check that answers are not truncated away and that labels are not masked everywhere")]
    findings = []
    empty = [i for i, row in enumerate(supervised) if not bool(row.any())]
    if empty:
        findings.append(warning("rows-without-labels",
                                f"rows {empty[:10]} of the batch have no supervised tokens (answers truncated?)"))
    if mask is not None:
        on_padding = (labels != IGNORE_INDEX) & (mask == 0)
        if bool(on_padding.any()):
            rows = sorted({int(i) for i in on_padding.nonzero()[:, 0]})
            findings.append(error("labels-on-padding",
                                  f"labels are set on padding positions (rows {rows[:10]}): the model is trained to "
                                  "predict padding; set labels to -100 wherever attention_mask is 0"))
    return findings


def _check_spans(batch: Mapping, input_ids: torch.Tensor, mask: torch.Tensor | None, tokenizer: Any,
                 answers: Sequence[str] | None) -> list[Finding]:
    if "start_positions" not in batch or "end_positions" not in batch:
        return [error("no-span-labels", "the batch has only one of start_positions / end_positions")]
    starts = torch.as_tensor(batch["start_positions"]).reshape(-1)
    ends = torch.as_tensor(batch["end_positions"]).reshape(-1)
    width = input_ids.shape[-1]
    labelled = starts != IGNORE_INDEX
    findings = []
    beyond = [i for i in range(len(starts)) if labelled[i] and not (0 <= starts[i] < width and 0 <= ends[i] < width)]
    if beyond:
        i = beyond[0]
        findings.append(error("span-beyond-sequence",
                              f"start/end positions lie beyond the {width}-token sequence (row {i}: {int(starts[i])}.."
                              f"{int(ends[i])}): they look like character offsets, not token positions; map them "
                              "with the tokenizer's offset_mapping"))
        return findings
    reversed_rows = [i for i in range(len(starts)) if labelled[i] and starts[i] > ends[i]]
    if reversed_rows:
        findings.append(error("span-reversed", f"end position before start position in rows {reversed_rows[:10]}"))
    if mask is not None:
        on_pad = [i for i in range(len(starts)) if labelled[i] and (mask[i, starts[i]] == 0 or mask[i, ends[i]] == 0)]
        if on_pad:
            findings.append(error("span-on-padding", f"start/end positions point at padding in rows {on_pad[:10]}"))
    if "token_type_ids" in batch:
        types = torch.as_tensor(batch["token_type_ids"])
        outside = [i for i in range(len(starts)) if labelled[i] and starts[i] != 0
                   and (types[i, starts[i]] != 1 or types[i, ends[i]] != 1)]
        if outside and bool((types == 1).any()):
            findings.append(error("span-outside-context",
                                  f"start/end positions lie outside the context (in the question) in rows "
                                  f"{outside[:10]}: positions must index the tokenized (question, context) pair"))
    if answers is not None and tokenizer is not None and not findings:
        findings += _check_span_text(input_ids, starts, ends, labelled, tokenizer, answers)
    return findings


def _check_span_text(input_ids: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, labelled: torch.Tensor,
                     tokenizer: Any, answers: Sequence[str]) -> list[Finding]:
    from qatune.data.extractive import squash

    cls_id = getattr(tokenizer, "cls_token_id", None)
    wrong = []
    for i, answer in enumerate(answers):
        if not labelled[i] or answer is None:
            continue
        s, e = int(starts[i]), int(ends[i])
        if s == e and cls_id is not None and int(input_ids[i, s]) == cls_id:
            continue  # a window without the answer
        decoded = tokenizer.decode(input_ids[i, s : e + 1].tolist()).removeprefix("##")
        unknown = getattr(tokenizer, "unk_token", None)
        # The labelled tokens must cover the answer; they may run on to the token boundary.
        if squash(answer) not in squash(decoded) and not (unknown and unknown in decoded):
            wrong.append((i, decoded, answer))
    if not wrong:
        return []
    i, decoded, answer = wrong[0]
    return [error("span-mismatch",
                  f"{len(wrong)} start/end span(s) do not decode to their answer (row {i}: tokens give {decoded!r}, "
                  f"answer is {answer!r}); positions must come from the offset mapping of the tokenized "
                  "(question, context) pair, not from searching the answer's tokens or characters")]
