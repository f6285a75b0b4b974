"""A generative grader's answer written field by field (``generate.choose_fields``): each label and number field is
chosen from the values training saw, the one the model itself finds most likely after the answer so far, so every
answer parses and no verdict is free text; a text field (feedback) is generated as usual.

A value is ranked by the log-likelihood of its tokens and of the template's text that follows it (the end token
after the last field), so "0.5" cannot win over "0.5" followed by more digits that the model would write. The
prompt is read once per row; its keys and values are copied for the candidates of each choice. Rows go through all
fields a group at a time, so the keys and values held are a group's, whatever the number of rows.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from qatune.config import GenerateConfig
from qatune.data.generative import PromptEncoder
from qatune.data.grading_fields import AnswerTemplate, FieldSpec
from qatune.data.padding import right_pad
from qatune.data.templates import PromptTemplate
from qatune.inference.batches import inference_precision, length_sorted_batches
from qatune.model.folder import ModelInfo
from qatune.model.kv_cache import cache_argument, last_logits_only
from qatune.tasks import task_kind

CHOSEN_KINDS = ("label", "number")
STAND_INS = ("x", "The", "the", "0")
"""Stand-ins for a text field's value: what the answer so far is tokenized with, to see which of its last ids a
value could change (:func:`asked_ids`). Several, since a small BPE joins the space to some first words and not to
others."""


def chooses_fields(info: ModelInfo, generate: GenerateConfig) -> bool:
    """Whether a run's answers are written field by field: a causal LM's grading run with a label or number field
    whose values training saw, and generate.choose_fields on."""
    specs = info.specs() or {}
    return (generate.choose_fields and task_kind(info.task).writes and not info.seq2seq
            and any(spec.kind in CHOSEN_KINDS and spec.values for spec in specs.values()))


def write_answers(model: Any, tokenizer: Any, info: ModelInfo, prompts: list[list[int]], generate: GenerateConfig,
                  free_text: Any, group: int = 32, progress: bool = False) -> list[str]:
    """The answers to ``prompts`` (token ids), field by field, ``group`` rows of similar length at a time (the
    prompts whose keys and values are held at once). ``free_text(prompts)``: the model's generated continuations of
    prompt token ids (a text field's value, up to the end of the answer)."""
    answers = [""] * len(prompts)
    model.eval()
    for rows, _ in length_sorted_batches([len(p) for p in prompts], max(1, group), progress, "generate"):
        for i, answer in zip(rows, _write_group(model, tokenizer, info, [prompts[i] for i in rows], generate,
                                                free_text)):
            answers[i] = answer
    return answers


def _write_group(model: Any, tokenizer: Any, info: ModelInfo, prompts: list[list[int]], generate: GenerateConfig,
                 free_text: Any) -> list[str]:
    """:func:`write_answers`' answers to a group of prompts: each field of every row, then the next field."""
    template = AnswerTemplate.make(list(info.answer_fields or {}), info.answer_template)
    specs = info.specs() or {}
    encoder = PromptEncoder(tokenizer, PromptTemplate(info.prompt_template, info.answer_prefix))
    literals, names = template.pieces()
    device = next(model.parameters()).device
    texts = [""] * len(prompts)
    caches: list[Any] = [None] * len(prompts)
    for index, name in enumerate(names):
        texts = [text + literals[index] for text in texts]
        spec = specs.get(name, FieldSpec("text"))
        last = index == len(names) - 1
        following = literals[index + 1]
        if spec.kind in CHOSEN_KINDS and spec.values:
            for row, prompt in enumerate(prompts):
                if caches[row] is None:
                    caches[row] = read_prompt(model, prompt, device, generate.precision)
                texts[row] += _most_likely(model, encoder, caches[row], texts[row], spec.values, following, last,
                                           device, generate.precision)
            continue
        continued = free_text([prompt + asked_ids(encoder, text) for prompt, text in zip(prompts, texts)])
        texts = [text + _until(value, following, last) for text, value in zip(texts, continued)]
    return [(text + literals[-1]).strip() for text in texts]


@torch.inference_mode()
def read_prompt(model: Any, prompt: list[int], device: torch.device, precision: str) -> tuple[Any, torch.Tensor]:
    """The prompt's keys and values, and the log-probabilities of the first answer token."""
    with inference_precision(precision, device):
        out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, **last_logits_only(model))
    return getattr(out, cache_argument(model)), torch.log_softmax(out.logits[0, -1].float(), -1)


def _most_likely(model: Any, encoder: PromptEncoder, read: tuple[Any, torch.Tensor], text: str,
                 values: tuple[str, ...], following: str, last: bool, device: torch.device, precision: str) -> str:
    """The value the model finds most likely after the prompt and the answer so far, with what follows it."""
    scores = value_scores(model, encoder, read, text, values, following, last, device, precision)
    return values[max(range(len(values)), key=scores.__getitem__)]


@torch.inference_mode()
def value_scores(model: Any, encoder: PromptEncoder, read: tuple[Any, torch.Tensor], text: str,
                 values: tuple[str, ...], following: str, last: bool, device: torch.device,
                 precision: str) -> list[float]:
    """Each value's log-likelihood after the prompt (``read``: :func:`read_prompt`'s) and the answer so far
    (``text``), with the template's text that follows it (the end token after the ``last`` field)."""
    cache, first = read
    candidates = []
    for value in values:
        ids = encoder.answer_ids(text + value + following)
        candidates.append(ids if last else ids[:-1])  # the end token after the last field only
    cache = copy.deepcopy(cache)
    cache.batch_repeat_interleave(len(candidates))
    input_ids, attention_mask = right_pad(candidates, encoder.tokenizer.pad_token_id)
    seen = cache.get_seq_length()
    mask = torch.cat([torch.ones((len(candidates), seen), dtype=attention_mask.dtype), attention_mask], 1)
    with inference_precision(precision, device):
        logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                       **{cache_argument(model): cache}).logits
    logprobs = torch.log_softmax(logits.float(), -1)
    scores = []
    for k, ids in enumerate(candidates):
        score = float(first[ids[0]])
        if len(ids) > 1:
            targets = torch.tensor(ids[1:], device=logprobs.device)
            score += float(logprobs[k, : len(ids) - 1].gather(1, targets[:, None]).sum())
        scores.append(score)
    return scores


def asked_ids(encoder: PromptEncoder, text: str) -> list[int]:
    """The ids a text field's value is generated after: those of the answer so far (``text``) that no value after it
    changes, so they start a trained answer's ids whatever its value. A BPE tokenizer joins the space after
    "Feedback:" to the value's first word ('ĠGreat'): asked after a lone space token ('Ġ'), which training never put
    before such a word, a model writes junk. A tokenizer that keeps the space apart or drops it keeps the whole answer
    so far. The value written is appended to ``text`` as it is (its space included): it comes back stripped."""
    alone = encoder.answer_ids(text)[:-1]
    shared = len(alone)
    for value in STAND_INS:
        ids = encoder.answer_ids(text + value)
        shared = next((i for i, (a, b) in enumerate(zip(alone[:shared], ids)) if a != b), shared)
    return alone[:shared]


def _until(value: str, following: str, last: bool) -> str:
    """A generated text field's value: up to the template's text that follows it (the whole text for the last
    field, whose end the end token marks)."""
    if last or not following.strip():
        return value
    cut = value.casefold().find(following.strip().casefold())
    return value[:cut].rstrip() if cut >= 0 else value
