"""Multiple-choice QA: an exam sheet's question and its choices, one column each, and the right choice.

A causal language model is fine-tuned to write the right choice after a prompt that lists them all (the columns
the prompt names besides the question and the context are the choices: ``data.choice_columns`` lists them in the
default prompt); it answers with the choice whose tokens, and the end token after them, it finds most likely, so
every answer is one of the row's choices. The answer cell may hold the choice's text, its letter (A for the first
choice column) or its column's name. Exact match is then the share of questions answered with the right choice.
"""

from __future__ import annotations

import string
from typing import Any

import torch

from qatune.config import Config, GenerateConfig
from qatune.config.columns import column_key
from qatune.data.generative import PromptEncoder
from qatune.data.spreadsheet import LoadReport, QARecord
from qatune.data.templates import PromptTemplate
from qatune.data.validate import error, warning
from qatune.errors import DataError, row_list
from qatune.inference.batches import inference_precision
from qatune.inference.field_choice import read_prompt, value_scores
from qatune.inference.lockstep import Lockstep, in_step
from qatune.kinds.base import Built, Encoded
from qatune.kinds.generative import Generative
from qatune.model.folder import ModelInfo

NOT_A_CHOICE = "the answer is none of its choices"


class MultipleChoice(Generative):
    answers_whole = True

    def __init__(self) -> None:
        super().__init__("multiple-choice")

    # --- the rows

    def settle_rows(self, records: list[QARecord], report: LoadReport | None = None) -> list[QARecord]:
        kept = []
        for record in records:
            answer = chosen(record.answers[0], record.fields) if record.answers else None
            if record.answers and answer is None:
                if report is not None:
                    report.drop_kept(NOT_A_CHOICE, record.row)
                continue
            if answer is not None:
                record.answers = [answer]
            kept.append(record)
        return kept

    # --- training

    def encode(self, config: Config, built: Built, records: list[QARecord], train_report: LoadReport,
               reports: dict[str, Any], settled: Any) -> Encoded:
        encoded = super().encode(config, built, records, train_report, reports, settled)
        fields = PromptTemplate(encoded.info.prompt_template).fields
        if len(fields) < 2:
            raise DataError(f"multiple-choice QA lists at least two choices in its prompt; it names "
                            f"{fields or 'none'} besides the question: set data.choice_columns (or name the choice "
                            "columns in data.prompt_template)")
        dropped = train_report.dropped.get(NOT_A_CHOICE, [])
        if dropped:
            finding = error if len(dropped) * 2 > train_report.rows_read else warning
            encoded.findings.append(finding("answer-not-a-choice", f"{len(dropped)} rows dropped: {NOT_A_CHOICE} "
                                            f"(rows {row_list(dropped)}); an answer cell holds the choice's text, "
                                            "its letter or its column's name"))
        return encoded

    # --- answering

    def answer(self, model: Any, tokenizer: Any, info: ModelInfo, questions: list[str],
               contexts: list[str | None], generate: GenerateConfig, batch_size: int = 32, progress: bool = False,
               fields: list[dict[str, str]] | None = None) -> list[str]:
        template = PromptTemplate(info.prompt_template, info.answer_prefix)
        encoder = PromptEncoder(tokenizer, template)
        device = next(model.parameters()).device
        answers = []
        model.eval()
        for question, context, given in zip(questions, contexts, fields or [{}] * len(questions)):
            choices = tuple(given.get(name, "") for name in template.fields)
            if not all(choice.strip() for choice in choices):
                raise DataError(f"a multiple-choice question needs its choices {template.fields}")
            prompt = encoder.prompt_ids(question, context, info.max_length, fields=given)
            if prompt is None:
                raise DataError(f"the question and its choices do not fit the model's {info.max_length} tokens")
            with torch.inference_mode(), inference_precision(generate.precision, device):
                scores = value_scores(model, encoder, read_prompt(model, prompt, device, generate.precision), "",
                                      choices, "", True, device, generate.precision)
            answers.append(choices[max(range(len(choices)), key=scores.__getitem__)])
        return answers

    def predictions(self, model: Any, tokenizer: Any, info: ModelInfo, records: list[QARecord],
                    generate: GenerateConfig, batch_size: int, progress: bool, lockstep: Lockstep | None
                    ) -> list[str]:
        answers: list[str] = []
        # a row at a time: with a sharded model (lockstep) every process reads as many prompts and choices
        for chunk, mine in in_step([[record] for record in records], lockstep, []):
            row = chunk[0] if chunk else records[0]
            said = self.answer(model, tokenizer, info, [row.question], [row.context], generate, fields=[row.fields])
            if mine:
                answers += said
        return answers


def chosen(answer: str, choices: dict[str, str]) -> str | None:
    """The choice an answer cell names: a choice's text (ignoring case and surrounding spaces), its letter (A for
    the first) or its column's name; None when it names none."""
    texts = list(choices.values())
    wanted = answer.strip()
    for text in texts:
        if text.strip().casefold() == wanted.casefold():
            return text
    for name, text in choices.items():
        if column_key(name) == column_key(wanted):
            return text
    letter = wanted.rstrip(").").upper()
    if len(letter) == 1 and letter in string.ascii_uppercase[: len(texts)]:
        return texts[string.ascii_uppercase.index(letter)]
    return None
