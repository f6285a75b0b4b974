"""Answers for questions (and contexts) from a trained model, in batches.

Generative: prompts are encoded exactly as in training, left-padded, and decoded until EOS.
Extractive: every window of the context is scored and the best span is cut from the context.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from pydantic import ValidationError

from qatune.config import GenerateConfig
from qatune.data.extractive import Feature, SpanCollator, best_span
from qatune.data.generative import PromptEncoder, Seq2SeqEncoder
from qatune.data.grading_fields import AnswerTemplate
from qatune.data.padding import left_pad, right_pad
from qatune.data.spreadsheet import QARecord
from qatune.data.templates import PromptTemplate
from qatune.errors import ConfigError, DataError
from qatune.inference.batches import inference_precision, length_sorted_batches
from qatune.inference.field_choice import chooses_fields, write_answers
from qatune.inference.grounding import AllowedAnswers, GroundedLogits, allowed_answers, grounded, no_answer_text
from qatune.inference.lockstep import Lockstep
from qatune.model.folder import ModelInfo
from qatune.model.objectives import span_logits, span_loss_sum
from qatune.model.sources import model_max_positions
from qatune.tasks import task_kind

log = logging.getLogger("qatune")


def generate_answers(model: Any, tokenizer: Any, info: ModelInfo, questions: list[str], contexts: list[str | None],
                     generate: GenerateConfig, batch_size: int, progress: bool,
                     fields: list[dict[str, str]] | None = None, lockstep: Lockstep | None = None) -> list[str]:
    """``lockstep``: this process's share of the questions, for a sharded model (at least one question each); a
    grading run's label and number fields are chosen (:mod:`qatune.inference.field_choice`) unless sharded."""
    template = PromptTemplate(info.prompt_template, info.answer_prefix)
    encoder = (Seq2SeqEncoder if info.seq2seq else PromptEncoder)(tokenizer, template)
    limit = model_max_positions(model.config, tokenizer)
    # the encoder of a seq2seq model reads the prompt and its decoder writes the answer
    budget = info.max_length if info.seq2seq else prompt_budget(limit, generate.max_new_tokens)
    prompts = []
    for question, context, values in zip(questions, contexts, fields or [{}] * len(questions)):
        ids = encoder.prompt_ids(question, context, budget, fields=values)
        if ids is None:
            raise DataError(f"the prompt template alone is longer than the model's {limit} positions")
        prompts.append(ids)
    if lockstep is None and chooses_fields(info, generate):
        return write_answers(model, tokenizer, info, prompts, generate, lambda continued: _continuations(
            model, tokenizer, info, continued, generate, batch_size, False, encoder, None), batch_size, progress)
    spans = None
    if grounded(info, generate):
        prefix, stops, no_answer = "" if info.seq2seq else info.answer_prefix, encoder.stop_ids, no_answer_text(info)

        def spans(rows: list[int]) -> list[AllowedAnswers | None]:
            return allowed_answers(tokenizer, [contexts[i] for i in rows], prefix, stops, generate.max_new_tokens,
                                   no_answer)
    return _continuations(model, tokenizer, info, prompts, generate, batch_size, progress, encoder, lockstep, spans)


def _continuations(model: Any, tokenizer: Any, info: ModelInfo, prompts: list[list[int]], generate: GenerateConfig,
                   batch_size: int, progress: bool, encoder: Any, lockstep: Lockstep | None,
                   spans: Callable[[list[int]], list[AllowedAnswers | None]] | None = None) -> list[str]:
    """What the model writes after each prompt (token ids) until an end token, decoded. ``spans``: the allowed
    answers of the given rows (grounded decoding), built batch by batch."""
    from transformers import GenerationConfig, LogitsProcessorList

    sampling = generate.temperature > 0
    config = GenerationConfig(
        max_new_tokens=generate.max_new_tokens, do_sample=sampling,
        temperature=generate.temperature if sampling else None, top_p=generate.top_p if sampling else None,
        top_k=None, eos_token_id=encoder.stop_ids, pad_token_id=tokenizer.pad_token_id,
    )
    device = next(model.parameters()).device
    answers: list[str] = [""] * len(prompts)
    model.eval()
    for chunk, mine in length_sorted_batches([len(p) for p in prompts], batch_size, progress, "generate", lockstep):
        pad = right_pad if info.seq2seq else left_pad  # a decoder-only model continues from the right edge
        input_ids, attention_mask = pad([prompts[i] for i in chunk], tokenizer.pad_token_id)
        processors = LogitsProcessorList()
        if spans is not None:  # generated tokens start after the prompt (causal) or the decoder start token
            processors.append(GroundedLogits(spans(chunk), 1 if info.seq2seq else input_ids.shape[1]))
        with torch.inference_mode(), inference_precision(generate.precision, device):
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                 generation_config=config, logits_processor=processors,
                                 synced_gpus=True if lockstep is not None else None)
        if not mine:
            continue
        # Seq2seq output starts with the decoder start token; a causal LM's repeats the prompt.
        new_tokens = out[:, 1:] if info.seq2seq else out[:, input_ids.shape[1]:]
        for i, tokens in zip(chunk, new_tokens.tolist()):
            ends = [tokens.index(stop) for stop in encoder.stop_ids if stop in tokens]
            if ends:
                tokens = tokens[: min(ends)]
            answers[i] = tokenizer.decode(tokens, skip_special_tokens=True).strip()
    return answers


def prompt_budget(positions: int | None, max_new_tokens: int) -> int | None:
    """Tokens a causal LM's prompt may have so that ``max_new_tokens`` more fit its positions (at least 8;
    None: no limit known). A longer prompt has its context, then its question, cut to fit."""
    return max(8, positions - max_new_tokens) if positions else None


def score_windows(model: Any, tokenizer: Any, features: list[Feature], batch_size: int, progress: bool = False,
                  precision: str = "fp32", lockstep: Lockstep | None = None
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor], float, int]:
    """Start/end logits of every window, and the summed span loss over labelled windows. ``lockstep``: this
    process's share of the windows, for a sharded model (at least one window each)."""
    collate = SpanCollator(tokenizer.pad_token_id)
    device = next(model.parameters()).device
    starts: list[torch.Tensor] = [torch.empty(0)] * len(features)
    ends: list[torch.Tensor] = [torch.empty(0)] * len(features)
    loss_sum, count = 0.0, 0
    model.eval()
    for chunk, mine in length_sorted_batches([len(f) for f in features], batch_size, progress, "answer", lockstep):
        batch = collate([features[i] for i in chunk])
        with torch.inference_mode(), inference_precision(precision, device):
            start, end = span_logits(model, batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                     batch["token_type_ids"].to(device) if "token_type_ids" in batch else None)
            labelled = batch["start_positions"] >= 0
            if not mine:
                continue
            if labelled.any():
                loss_sum += float(span_loss_sum(start, end, batch["start_positions"].to(device),
                                                batch["end_positions"].to(device)))
                count += int(labelled.sum())
        for j, i in enumerate(chunk):
            starts[i], ends[i] = start[j].cpu(), end[j].cpu()
    return starts, ends, loss_sum, count


def extract_answers(features: list[Feature], starts: list[torch.Tensor], ends: list[torch.Tensor],
                    records: list[QARecord], generate: GenerateConfig) -> list[str]:
    by_example: dict[int, list[int]] = {}
    for i, feature in enumerate(features):
        by_example.setdefault(feature.example, []).append(i)
    answers = []
    for example, record in enumerate(records):
        indices = by_example.get(example, [])
        text, _ = best_span([features[i] for i in indices], [starts[i] for i in indices], [ends[i] for i in indices],
                            record.context or "", generate.n_best, generate.max_answer_length)
        answers.append(text)
    return answers


def uses_context(info: ModelInfo) -> bool:
    """Whether the run reads a passage besides the question: extractive runs, and prompts with {context}."""
    return task_kind(info.task).points or PromptTemplate(info.prompt_template).uses_context


def run_answer_template(info: ModelInfo) -> AnswerTemplate | None:
    """The answer template a run with answer fields (data.answer_columns) wrote its answers with; None for others."""
    if not info.answer_fields:
        return None
    return AnswerTemplate.make(list(info.answer_fields), info.answer_template)



def generate_config(base: GenerateConfig, options: dict[str, Any] | None) -> GenerateConfig:
    updates = {k: v for k, v in (options or {}).items() if v is not None}
    try:
        return GenerateConfig.model_validate({**base.model_dump(), **updates})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def seed_sampling(seed: int | None) -> None:
    if seed is not None:
        torch.manual_seed(seed)
