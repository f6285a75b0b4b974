"""Generative QA: a language model writes the answer after a prompt (a causal LM, or an encoder-decoder such as T5).

Rows become prompt + answer tokens with the prompt's labels masked (or the answer as the decoder's labels); the loss
is next-token cross-entropy over the answer; the model answers by decoding (:mod:`qatune.inference.generate`:
grounded in the passage, or a grading sheet's fields chosen, where the run says so).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from qatune import __version__
from qatune.config import Config, GenerateConfig
from qatune.data.generative import (
    CausalCollator,
    EncodeStats,
    PromptEncoder,
    Seq2SeqCollator,
    Seq2SeqEncoder,
    choose_max_length,
    encode_examples,
    weigh_answer_tokens,
)
from qatune.data.grading_rows import SettledFields
from qatune.data.padding import IGNORE_INDEX
from qatune.data.spans import PassageAnswers, passage_answers
from qatune.data.spreadsheet import LoadReport, QARecord, answer_kinds, answer_template
from qatune.data.templates import PromptTemplate, resolve_template
from qatune.data.validate import Finding, error, warning
from qatune.errors import ConfigError, row_list
from qatune.inference.batches import inference_precision
from qatune.inference.generate import generate_answers
from qatune.inference.lockstep import Lockstep, in_step
from qatune.kinds.base import BaseModel, Built, Encoded, Kind, length_summary
from qatune.kinds.fields_check import field_findings, fields_section
from qatune.model.folder import ModelInfo
from qatune.model.gguf_file import resolve_prompt
from qatune.model.objectives import CausalLMObjective, Seq2SeqObjective, is_encoder_decoder, model_inputs
from qatune.model.sources import build_scratch, load_pretrained, model_max_positions
from qatune.speedups import evaluation_loss

log = logging.getLogger("qatune")


class Generative(Kind):
    def __init__(self, name: str = "generative") -> None:
        super().__init__(name)

    # --- training

    def tokenizer_texts(self, config: Config, records: list[QARecord], architecture: str) -> tuple[str, list[str]]:
        template = resolve_template(config.data)
        return "generative", [template.render(r.question, r.context, r.fields) + template.answer_prefix + r.answer
                              for r in records]

    def build(self, config: Config, tokenizer: Any, settled: SettledFields | None, model_config: Any = None) -> Any:
        if config.model.scratch is not None:
            return build_scratch(config.model.scratch, self.name, tokenizer)
        return load_pretrained(config.model, self.name, tokenizer, model_config)

    def encode(self, config: Config, built: Built, records: list[QARecord], train_report: LoadReport,
               reports: dict[str, Any], settled: SettledFields | None) -> Encoded:
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
                weigh_answer_tokens(encoder, example, by_row[example.row], settled.template,
                                    config.data.field_weights)
        for row in stats.too_long_rows:
            train_report.drop_kept(f"does not fit max_length={max_length}", row)
        reports["train_file"] = train_report.to_dict()
        reports["encoding"] = {"max_length": max_length, "truncated_rows": stats.truncated_rows,
                               "too_long_rows": stats.too_long_rows, "lengths": length_summary(lengths)}
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
        info = ModelInfo(task=self.name, max_length=max_length, prompt_template=template.template,
                         answer_prefix=template.answer_prefix, qatune_version=__version__, seq2seq=built.seq2seq,
                         answer_fields=settled.kinds if settled else None,
                         answer_template=settled.template.template if settled else None,
                         field_specs={name: spec.to_json() for name, spec in settled.specs.items()}
                         if settled else None)
        info.grounding = _grounding(config, template, settled, records)
        return Encoded(examples, collator, info, records, findings)

    def objective(self, model: nn.Module) -> nn.Module:
        return Seq2SeqObjective(model) if is_encoder_decoder(model) else CausalLMObjective(model)

    def count_items(self, batch: dict[str, torch.Tensor]) -> int:
        if "n_items" in batch:
            return int(batch["n_items"])
        return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())

    def vocabulary_logits(self, rows: int, width: int, supervised: int, all_positions: bool) -> int:
        return rows * (width if all_positions else supervised)

    # --- qatune check

    def check(self, prepared: Any) -> tuple[dict[str, Any], list[Finding]]:
        section = {**_trained_section(prepared), "grounding": _grounding_report(prepared)}
        findings = []
        if not section["supervision"]["eos_supervised"]:
            findings.append(error("eos-not-supervised", "the EOS after the answer is not a label: the model never "
                                                        "learns to stop"))
        if prepared.info.answer_fields:
            section["fields"] = fields_section(prepared)
            findings += field_findings(section["fields"], prepared.config)
        return section, findings

    def check_lines(self, report: dict[str, Any]) -> list[str]:
        sup = report["supervision"]
        return [f"  rows truncated (question shortened): {len(report['truncated_rows'])}; "
                f"dropped (does not fit): {len(report['dropped_rows'])}",
                "", "What is trained",
                (f"  supervised tokens per example: min {sup['min']}, mean {sup['mean']:.1f}; "
                 f"EOS supervised: {'yes' if sup['eos_supervised'] else 'NO'} ({sup['end_token']!r}); "
                 f"prompt trained: {'yes' if sup['train_on_prompt'] else 'no'}"),
                f"  prompt template: {report['prompt_template']!r}",
                "  examples (trained tokens inside ⟦ ⟧):"]

    # --- answering

    def answer(self, model: Any, tokenizer: Any, info: ModelInfo, questions: list[str],
               contexts: list[str | None], generate: GenerateConfig, batch_size: int = 32, progress: bool = False,
               fields: list[dict[str, str]] | None = None) -> list[str]:
        fields = fields if fields is not None else [{}] * len(questions)
        return generate_answers(model, tokenizer, info, questions, contexts, generate, batch_size, progress, fields)

    def evaluation_parts(self, model: Any, tokenizer: Any, info: ModelInfo, records: list[QARecord],
                         generate: GenerateConfig, batch_size: int = 32, progress: bool = False,
                         speedups: str | list[str] = "auto", lockstep: Lockstep | None = None
                         ) -> tuple[list[str], float, int]:
        loss_sum, count = teacher_forced_loss(model, tokenizer, info, records, batch_size, generate.precision,
                                              speedups, lockstep)
        predictions = self.predictions(model, tokenizer, info, records, generate, batch_size, progress, lockstep)
        return predictions, loss_sum, count

    def predictions(self, model: Any, tokenizer: Any, info: ModelInfo, records: list[QARecord],
                    generate: GenerateConfig, batch_size: int, progress: bool, lockstep: Lockstep | None
                    ) -> list[str]:
        """The answers evaluation_parts scores, with a sharded model's processes in ``lockstep``."""
        return generate_answers(model, tokenizer, info, [r.question for r in records], [r.context for r in records],
                                generate, batch_size, progress, [r.fields for r in records], lockstep)

    def perplexity(self, loss: float | None) -> float | None:
        if loss is None:
            return None
        try:
            return math.exp(loss)
        except OverflowError:
            return float("inf")

    def base_model(self, config: Config, tokenizer: Any, model_config: Any, records: list[QARecord]) -> BaseModel:
        seq2seq = bool(getattr(model_config, "is_encoder_decoder", False))
        template = resolve_prompt(config.data, config.model, tokenizer)
        encoder = (Seq2SeqEncoder if seq2seq else PromptEncoder)(tokenizer, template)
        limit = model_max_positions(model_config, tokenizer)
        max_length = choose_max_length([encoder.full_length(r) for r in records], config.data.max_length, limit)
        fields = answer_template(config.data)
        return BaseModel(ModelInfo(task=self.name, max_length=max_length, prompt_template=template.template,
                                   answer_prefix=template.answer_prefix, seq2seq=seq2seq,
                                   answer_fields=answer_kinds(config.data, records),
                                   answer_template=fields.template if fields is not None else None))

    def gguf_refusal(self, info: ModelInfo) -> str | None:
        if info.seq2seq:
            return "it is an encoder-decoder model (T5), which llama.cpp's GGUF does not hold"
        return None


def teacher_forced_loss(model: Any, tokenizer: Any, info: ModelInfo, records: list[QARecord],
                        batch_size: int, precision: str = "fp32", speedups: str | list[str] = "auto",
                        lockstep: Lockstep | None = None) -> tuple[float, int]:
    """The summed next-token loss of the records' answers (as training computes it) and its token count."""
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


def _trained_section(prepared: Any) -> dict[str, Any]:
    """check's view of the encoded rows: their lengths, what is supervised (the end token among it), two rows
    rendered."""
    examples = prepared.dataset.items
    lengths = prepared.reports["encoding"]["lengths"]
    info = prepared.info
    # The token that ends an answer: the EOS, or a chat template's end-of-turn token.
    end = PromptEncoder(prepared.tokenizer, PromptTemplate(info.prompt_template, info.answer_prefix)).end_id
    # The collator's own counts, per example without building a batch of each (200,000 rows: 10 s -> 0.2 s);
    # the batch validator has checked real batches of it.
    collator = prepared.collator
    supervised = [collator.supervised(example) for example in examples]
    eos_ok = all(collator.last_label(example) == end for example in examples)
    rendered = [render_trained_tokens(prepared, example) for example in examples[:2]]
    encoding = prepared.reports["encoding"]
    return {
        "lengths": {**lengths, "what": "prompt + answer + EOS tokens"},
        "truncated_rows": encoding["truncated_rows"],
        "dropped_rows": encoding["too_long_rows"],
        "supervision": {"min": min(supervised), "mean": sum(supervised) / len(supervised), "eos_supervised": eos_ok,
                        "end_token": prepared.tokenizer.decode([end], skip_special_tokens=False),
                        "train_on_prompt": prepared.config.train.train_on_prompt},
        "prompt_template": info.prompt_template,
        "examples": rendered,
    }


def _grounding_report(prepared: Any) -> dict[str, Any] | None:
    """How the training answers relate to their passages, what generate.grounded auto decides from it, and whether
    the run's answers will be grounded (None for a run without passages or with answer fields)."""
    answers = PassageAnswers.from_json(prepared.info.grounding)
    if answers is None:
        return None
    setting = prepared.config.generate.grounded
    return {**answers.to_json(), "setting": setting, "on": setting == "on" or (setting == "auto" and answers.auto)}


def render_trained_tokens(prepared: Any, example: Any) -> str:
    """The example's text with the trained (label) tokens inside ⟦ ⟧."""
    if prepared.info.seq2seq:
        source = prepared.tokenizer.decode(example.input_ids, skip_special_tokens=False)
        target = prepared.tokenizer.decode(example.target_ids, skip_special_tokens=False)
        return f"encoder: {source}\ndecoder: ⟦{target}⟧"
    batch = prepared.collator([example])
    n = len(example)  # the collator may round the width up (training on bf16 CPUs, GPUs): no padding shown
    ids = batch["input_ids"][0, :n].tolist()
    trained = [label != IGNORE_INDEX for label in batch["labels"][0, :n].tolist()]
    trained[0] = False  # the first token is never predicted
    pieces, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or trained[i] != trained[start]:
            text = prepared.tokenizer.decode(ids[start:i], skip_special_tokens=False)
            pieces.append(f"⟦{text}⟧" if trained[start] else text)
            start = i
    return "".join(pieces)
