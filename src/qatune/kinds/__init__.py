"""One class per kind of QA, owning what differs between them: how a model is built for it and rows become tensors,
the objective and what a batch's loss is summed over, how the model answers and is evaluated, what a model before
fine-tuning answers, whether a run exports as GGUF.

Training, evaluation, export, serving and the commands ask the run's kind (:func:`kind_of`); what a kind *is* (its
name, what its config may say, how its model loads) is its record in :mod:`qatune.tasks`. A new kind of QA is a
module here implementing :class:`Kind`, its line in ``KINDS`` and its record.
"""

from __future__ import annotations

from typing import Any

from qatune.config import GenerateConfig
from qatune.kinds.base import BaseModel, Built, Encoded, Kind
from qatune.kinds.extractive import Extractive
from qatune.kinds.generative import Generative
from qatune.kinds.multiple_choice import MultipleChoice
from qatune.kinds.scoring import Scoring
from qatune.model.folder import ModelInfo

KINDS: dict[str, Kind] = {kind.name: kind for kind in (Generative(), Extractive(), Scoring(), MultipleChoice())}


def kind_of(task: str) -> Kind:
    """The kind of ``task: NAME`` (a config's, or a run's qatune.json)."""
    return KINDS[task]


def answer_questions(model: Any, tokenizer: Any, info: ModelInfo, questions: list[str],
                     contexts: list[str | None] | None = None, generate: GenerateConfig | None = None,
                     batch_size: int = 32, progress: bool = False,
                     fields: list[dict[str, str]] | None = None) -> list[str]:
    """One answer per question, in the input order, as the run's kind answers (``info.task``). ``fields``: per
    question, the other columns the prompt template names."""
    contexts = contexts if contexts is not None else [None] * len(questions)
    return kind_of(info.task).answer(model, tokenizer, info, questions, contexts, generate or GenerateConfig(),
                                     batch_size, progress, fields)


__all__ = ["KINDS", "BaseModel", "Built", "Encoded", "Kind", "answer_questions", "kind_of"]
