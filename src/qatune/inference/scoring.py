"""A scoring run's answers: each row's label and number columns predicted by the model's heads
(:mod:`qatune.model.scoring`), written as the run's answer template writes them, so that eval, generate --file,
--compare and serve read them as they read a generative grader's."""

from __future__ import annotations

from typing import Any

import torch

from qatune.data.grading_fields import AnswerTemplate
from qatune.data.scoring import ScoringCollator, ScoringEncoder
from qatune.data.spreadsheet import QARecord
from qatune.data.templates import PromptTemplate
from qatune.inference.batches import inference_precision, length_sorted_batches
from qatune.inference.lockstep import Lockstep
from qatune.model.folder import ModelInfo
from qatune.model.scoring import HeadLayout, scoring_loss


def score_records(model: Any, tokenizer: Any, info: ModelInfo, records: list[QARecord], batch_size: int = 32,
                  progress: bool = False, precision: str = "fp32", lockstep: Lockstep | None = None
                  ) -> tuple[list[dict[str, str]], float, int]:
    """Each record's predicted values (column -> text), and the loss summed over the records whose columns are
    known (their answer_fields), with their count. ``lockstep``: this process's share of the rows of a sharded
    model (at least one row each)."""
    layout = HeadLayout.from_json(info.scoring_heads or [])
    specs = info.specs() or {}
    encoder = ScoringEncoder(tokenizer, PromptTemplate(info.prompt_template, answer_prefix=""))
    targets = [layout.targets(r.answer_fields, specs) for r in records]
    examples, _ = encoder.encode(records, targets, info.max_length)
    collate = ScoringCollator(tokenizer.pad_token_id)
    weights = getattr(model.config, "qatune_field_weights", None)
    device = next(model.parameters()).device
    values: list[dict[str, str]] = [{} for _ in records]
    loss_sum, count = 0.0, 0
    model.eval()
    for chunk, mine in length_sorted_batches([len(e) for e in examples], batch_size, progress, "score", lockstep):
        batch = collate([examples[i] for i in chunk])
        with torch.inference_mode(), inference_precision(precision, device):
            outputs = model(input_ids=batch["input_ids"].to(device),
                            attention_mask=batch["attention_mask"].to(device)).logits
        if not mine:
            continue
        known = [bool(r.answer_fields) for r in (records[i] for i in chunk)]
        if any(known):
            rows = torch.tensor(known, device=outputs.device)
            loss_sum += float(scoring_loss(outputs[rows], batch["targets"].to(device)[rows], layout, weights))
            count += sum(known)
        for i, row in zip(chunk, layout.values(outputs)):
            values[i] = row
    return values, loss_sum, count


def scored_answers(info: ModelInfo, values: list[dict[str, str]]) -> list[str]:
    """The predicted values as the run's answer template writes them (what eval and generate --file parse)."""
    template = AnswerTemplate.make(list(info.answer_fields or {}), info.answer_template)
    return [template.render(row) for row in values]
