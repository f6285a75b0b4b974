"""The check of a written GGUF file before it is put in place: read back (by transformers' GGUF loader, or into the
run's model class where that loader does not read all the file holds: :func:`read_back`) and asked the run's
held-out rows. Its chat template and tokenizer must give the run's prompts, text and token ids; it must
predict the next token at every position of prompt and gold answer as the run's own weights rounded to the file's
precision do (it then holds exactly those weights), and as the run does within what the precision is expected to
lose (:data:`AGREEMENT`). Each model predicts those tokens in one batched pass; greedy answers are generated and
compared on the first few rows only (a longer answer diverges from one differing token on, so they are reported,
not required)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qatune.config import GenerateConfig, with_reading_overrides
from qatune.data.generative import Example, PromptEncoder
from qatune.data.padding import right_pad
from qatune.data.spreadsheet import QARecord, load_from_config, split_validation
from qatune.data.templates import PromptTemplate
from qatune.export import ExportError
from qatune.export.gguf_write import read_into, round_like_file
from qatune.kinds import answer_questions
from qatune.model.families import family_of
from qatune.model.folder import LoadedModel
from qatune.model.gguf_file import load_gguf_run, read_gguf_run
from qatune.model.sources import prepare_tokenizer

AGREEMENT = {"f32": 0.995, "f16": 0.98, "bf16": 0.95, "q8_0": 0.93}
"""The least share of next tokens a file of each precision must predict as the run does. f32 holds the run's
weights exactly; f16 and bf16 round each weight to 11 and 8 significant bits, q8_0 to 8 bits per block of 32.
A wrong tensor, permutation, hyper-parameter or tokenizer agrees on far less."""

EXACT = 0.999
"""The least share of next tokens the file must predict as the run's own weights do once rounded to the file's
precision: what it holds is then exactly the run at that precision (a near tie may break the other way)."""

CHECK_ROWS = 32
"""Rows the check asks by default (``qatune export --rows``): thousands of next-token positions of prompts and
answers, where one wrong tensor or setting changes hundreds."""
ANSWER_ROWS = 4
"""Of those, the rows whose greedy answers the run and the file both write by default (``--answers``)."""
BATCH_TOKENS = 2048
"""Padded tokens per forward of the next-token pass: bounds the logits held at once (tokens x vocabulary)."""


@dataclass
class Check:
    """What the written file reproduced of the run, on ``rows`` held-out rows: their prompts, the next token it
    predicts at every position of prompt and gold answer (against the run's model, and against the run's model
    with its weights rounded as the file stores them), and the greedy answers of the first ``answer_rows``."""

    quant: str
    rows: int
    rows_from: str
    prompts_identical: int
    answer_rows: int
    answers_identical: int
    positions: int
    next_tokens_agreeing: int
    next_tokens_as_rounded: int
    first_difference: dict[str, str] | None

    @property
    def answer_share(self) -> float:
        return self.answers_identical / self.answer_rows if self.answer_rows else 1.0

    @property
    def token_share(self) -> float:
        return self.next_tokens_agreeing / self.positions if self.positions else 1.0

    @property
    def rounded_share(self) -> float:
        return self.next_tokens_as_rounded / self.positions if self.positions else 1.0

    def passed(self) -> bool:
        return (self.prompts_identical == self.rows and self.rounded_share >= EXACT
                and self.token_share >= AGREEMENT[self.quant])

    def line(self) -> str:
        line = f"{self.quant}: next-token agreement {100 * self.token_share:.1f}% at {self.positions:,} positions"
        if self.quant != "f32":
            line += f" ({100 * self.rounded_share:.1f}% with the run's weights rounded to {self.quant})"
        return line + f", {self.answers_identical}/{self.answer_rows} answers identical"

    def to_dict(self) -> dict[str, Any]:
        return {"quant": self.quant, "rows": self.rows, "rows_from": self.rows_from,
                "prompts_identical": self.prompts_identical, "answer_rows": self.answer_rows,
                "answers_identical": self.answers_identical, "answer_share": self.answer_share,
                "positions": self.positions, "next_tokens_agreeing": self.next_tokens_agreeing,
                "next_token_share": self.token_share, "next_tokens_as_rounded": self.next_tokens_as_rounded,
                "rounded_share": self.rounded_share,
                "required": {"next_token_share": AGREEMENT[self.quant], "rounded_share": EXACT},
                "passed": self.passed(), "line": self.line(), "first_difference": self.first_difference}


def check_records(loaded: LoadedModel, data_file: str | Path | None, reading: list[str] | tuple[str, ...],
                  rows: int) -> tuple[list[QARecord], str]:
    """The rows the check asks, and where they come from."""
    config = loaded.config
    data = with_reading_overrides(config, list(reading)).data if reading else config.data
    context = "{context}" in loaded.info.prompt_template
    if data_file is not None:
        records, _ = load_from_config(data, data_file, with_context=context)
        where = str(data_file)
    elif config.data.eval_file and Path(config.data.eval_file).is_file():
        records, _ = load_from_config(data, config.data.eval_file, with_context=context)
        where = f"{config.data.eval_file} (the run's data.eval_file)"
    elif config.data.train_file and Path(config.data.train_file).is_file():
        records, _ = load_from_config(data, config.data.train_file, with_context=context)
        if config.data.validation_fraction > 0:
            _, records = split_validation(records, config.data.validation_fraction, config.seed)
            where = f"the run's validation rows of {config.data.train_file}"
        else:
            where = f"{config.data.train_file} (the run's training rows: it holds none out)"
    else:
        raise ExportError("the run's data files are not where its config says; pass --data FILE, a sheet of rows "
                          "to check the exported file on")
    if not records:
        raise ExportError(f"no rows to check the exported file on in {where}")
    return records[:rows], where


def check_file(loaded: LoadedModel, path: Path, quant: str, records: list[QARecord], rows_from: str,
               answer_rows: int = ANSWER_ROWS) -> Check:
    """The written file read back (:func:`read_back`) and asked the run's questions: see :class:`Check`. Rounds
    ``loaded.model``'s weights in place to the file's precision."""
    info = loaded.info
    template = PromptTemplate(info.prompt_template, info.answer_prefix)
    ours = PromptEncoder(loaded.tokenizer, template)
    ours.warm(records)
    examples = [(r, e) for r, e in ((r, ours.example(r, info.max_length)) for r in records) if e is not None]
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else ours.eos_id
    asked = records[:answer_rows]
    expected = _answers(loaded, asked)
    run_next = _next_tokens(loaded.model, [e for _, e in examples], pad)
    if quant != "f32":
        round_like_file(loaded.model, quant)
        rounded_next = _next_tokens(loaded.model, [e for _, e in examples], pad)
    else:
        rounded_next = run_next

    exported = read_back(loaded, path)
    theirs = PromptEncoder(exported.tokenizer, PromptTemplate(exported.info.prompt_template,
                                                              exported.info.answer_prefix))
    end = loaded.tokenizer.decode([ours.end_id])
    identical = 0
    for record in records:
        text = template.render(record.question, record.context, record.fields)
        messages = [*([{"role": "system", "content": record.context}] if record.context else []),
                    {"role": "user", "content": record.question}]
        prompt = exported.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        trained = exported.tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": record.answer}], tokenize=False)
        same_ids = theirs.prompt_ids(record.question, record.context) == ours.prompt_ids(record.question,
                                                                                          record.context)
        identical += int(prompt == text and trained == text + info.answer_prefix + record.answer + end and same_ids)
    got = _answers(exported, asked)
    file_next = _next_tokens(exported.model, [e for _, e in examples], pad)
    same = [a == b for a, b in zip(expected, got)]
    first = next(({"question": r.question, "run": a, "file": b} for r, a, b, s in zip(asked, expected, got, same)
                  if not s), None)
    if first is None:  # the answers asked agree: show where the next tokens part, if they do
        first = _first_next_token_difference(loaded.tokenizer, examples, run_next, file_next)
    positions = sum(len(t) for t in run_next)
    agreeing = sum(int((a == b).sum()) for a, b in zip(run_next, file_next))
    as_rounded = sum(int((a == b).sum()) for a, b in zip(rounded_next, file_next))
    return Check(quant, len(records), rows_from, identical, len(asked), sum(same), positions, agreeing, as_rounded,
                 first)


def read_back(loaded: LoadedModel, path: Path) -> LoadedModel:
    """The written file as a run: read by transformers' GGUF reader where it knows the family's architecture and
    reads all the file holds; else (SmolLM3; Llama 3's rope factors; Phi-4-mini's partial rope and longrope factors)
    its tokenizer, prompt and config so, and its tensors read into a new model of the run's class with the family's
    layout undone. That checks that the file holds the run's weights at its precision, its tokenizer and its prompt;
    not that llama.cpp reads the layout so, which the tests hold to llama.cpp's converter."""
    if family_of(loaded.model.config).gguf.read_by_transformers(loaded.model.config):
        return load_gguf_run(path, device="cpu", convert=False)  # read once: not kept in qatune's cache
    from transformers import PreTrainedTokenizerFast

    # AutoTokenizer would ask the file's config, which transformers does not read for every architecture.
    tokenizer = prepare_tokenizer(PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name,
                                                                            trust_remote_code=False),
                                  "generative", path.name)
    config, info = read_gguf_run(path, tokenizer)
    model = type(loaded.model)(loaded.model.config).eval()
    read_into(model, path)
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, info=info, folder=path)


def _answers(loaded: LoadedModel, records: list[QARecord]) -> list[str]:
    """Greedy answers in fp32, free (not grounded), as long as the run's generate.max_new_tokens allows."""
    generate = GenerateConfig(max_new_tokens=loaded.config.generate.max_new_tokens, temperature=0.0,
                              grounded="off")  # the two models compared, not their decoding
    return answer_questions(loaded.model, loaded.tokenizer, loaded.info, [r.question for r in records],
                            [r.context for r in records], generate, progress=True, fields=[r.fields for r in records])


@torch.no_grad()
def _next_tokens(model: Any, examples: list[Example], pad_id: int) -> list[torch.Tensor]:
    """Per example, the token the model predicts after each position of its prompt and gold answer: one pass,
    in batches of rows of like length (right-padded, the padding masked) of at most BATCH_TOKENS tokens."""
    inputs = [e.input_ids[:-1] for e in examples]
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    predicted: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * len(inputs)
    start = 0
    while start < len(order):  # ascending lengths: a batch is as wide as its last row
        stop = start + 1
        while stop < len(order) and (stop + 1 - start) * len(inputs[order[stop]]) <= BATCH_TOKENS:
            stop += 1
        chunk = order[start:stop]
        input_ids, attention_mask = right_pad([inputs[i] for i in chunk], pad_id)
        argmax = model(input_ids=input_ids, attention_mask=attention_mask).logits.argmax(-1)
        for row, i in enumerate(chunk):
            predicted[i] = argmax[row, : len(inputs[i])]
        start = stop
    return predicted


def _first_next_token_difference(tokenizer: Any, examples: list[tuple[QARecord, Example]],
                                 run_next: list[torch.Tensor], file_next: list[torch.Tensor]) -> dict[str, str] | None:
    for (record, example), a, b in zip(examples, run_next, file_next):
        differ = (a != b).nonzero()
        if len(differ):
            at = int(differ[0])
            return {"question": record.question, "after": tokenizer.decode(example.input_ids[max(0, at - 7): at + 1]),
                    "run": tokenizer.decode([int(a[at])]), "file": tokenizer.decode([int(b[at])])}
    return None


def failure_message(check: Check) -> str:
    why = []
    if check.prompts_identical < check.rows:
        why.append(f"its chat template or tokenizer gave another prompt for {check.rows - check.prompts_identical} "
                   "rows")
    if check.rounded_share < EXACT:
        why.append(f"it predicts {100 * check.rounded_share:.1f}% of next tokens as the run's weights rounded to "
                   f"{check.quant} do (at least {100 * EXACT:.1f}% expected: the file does not hold those weights "
                   "as the run uses them)")
    if check.token_share < AGREEMENT[check.quant]:
        why.append(f"next-token agreement with the run {100 * check.token_share:.1f}% (at least "
                   f"{100 * AGREEMENT[check.quant]:.0f}% expected of {check.quant})")
    first, example = check.first_difference, ""
    if first and "after" in first:
        example = (f"; first differing next token: {first['question']!r}, after {first['after']!r}: the run "
                   f"predicts {first['run']!r}, the file {first['file']!r}")
    elif first:
        example = (f"; first differing answer: {first['question']!r}: the run says {first['run']!r}, the file "
                   f"{first['file']!r}")
    return f"the exported file does not answer as the run does: {'; '.join(why)}{example}; nothing was written"
