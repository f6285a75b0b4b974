"""The kinds of QA qatune trains, each one record: what its answer is (text a decoder writes, a span of a context, the
values of heads), what its config may and must say, how its model loads and adapts, what qatune init writes for it.

What a kind *does* (its rows encoded, its objective, its answers and metrics' parts, its check, its export) is its
class in :mod:`qatune.kinds`, which the layers above it ask; the layers below it read the record
(:func:`task_kind`). No module outside these two packages recognises a task by comparing its name. A new kind of
QA: its record here, its class there, and its tests (docs/architecture.md lists what multiple choice touches).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

WRITTEN, SPAN, HEADS = "written", "span", "heads"
"""What an answer is: text a decoder writes, a span of the given context, or the values heads give."""


@dataclass(frozen=True)
class TaskKind:
    name: str
    """``task:`` in a config, ``task`` in a run's qatune.json."""
    label: str
    answer: Literal["written", "span", "heads"]
    answer_said: str
    """What its answer is, in a message."""
    auto_class: str
    """The transformers auto class a pretrained model of this kind loads as."""
    loads_as: str
    """What that is, for a message about a model that does not load so."""
    peft_task_type: str
    """peft's TaskType of its LoRA adapters."""
    scratch_architectures: tuple[str, ...]
    """model.scratch.architecture values that do this kind (auto first)."""
    context: Literal["required", "optional"]
    """data.context_column."""
    answer_columns: Literal["optional", "required", "refused"]
    """data.answer_columns (a grading sheet's fields)."""
    choice_columns: Literal["required", "refused"] = "refused"
    """data.choice_columns (an exam sheet's choices)."""
    seq2seq_auto_class: str | None = None
    """An encoder-decoder's auto class, where one can do this kind."""
    lora: bool = True
    """Whether model.lora is offered (a scorer's heads train whole)."""
    base_answers: Literal["as it is", "untrained head", "none"] = "as it is"
    """What the model before fine-tuning answers with (eval --base, --compare base)."""
    init_learning_rate: float = 5.0e-5
    """What qatune init writes."""
    init_max_length: int | Literal["auto"] = "auto"
    on_page: bool = True
    """Whether qatune ui offers it."""

    @property
    def writes(self) -> bool:
        """Whether a decoder writes the answer (prompts, chat templates, grounding, GGUF files are its)."""
        return self.answer == WRITTEN

    @property
    def points(self) -> bool:
        """Whether the answer is a span of the context the model points at."""
        return self.answer == SPAN

    @property
    def scores(self) -> bool:
        """Whether heads give the answer's fields."""
        return self.answer == HEADS


TASK_KINDS = {kind.name: kind for kind in (
    TaskKind("generative", "generative QA", WRITTEN, "text the model writes", "AutoModelForCausalLM",
             "a causal language model", "CAUSAL_LM", ("auto", "gpt2", "t5"), context="optional",
             answer_columns="optional", seq2seq_auto_class="AutoModelForSeq2SeqLM"),
    TaskKind("extractive", "extractive QA", SPAN, "a span of the context it is given", "AutoModelForQuestionAnswering",
             "a question-answering encoder", "QUESTION_ANS", ("auto", "bert"), context="required",
             answer_columns="refused", base_answers="untrained head", init_learning_rate=3.0e-5,
             init_max_length=384),
    TaskKind("scoring", "scoring", HEADS, "what heads predict for a sheet's columns",
             "AutoModelForSequenceClassification", "a sequence classifier", "SEQ_CLS", ("auto", "bert", "gpt2"),
             context="optional", answer_columns="required", lora=False, base_answers="none",
             init_learning_rate=3.0e-5),
    TaskKind("multiple-choice", "multiple-choice QA", WRITTEN, "the one of the row's choices it finds most likely",
             "AutoModelForCausalLM", "a causal language model", "CAUSAL_LM", ("auto", "gpt2"), context="optional",
             answer_columns="refused", choice_columns="required", on_page=False),
)}
TASK_NAMES = tuple(TASK_KINDS)


def task_kind(name: str) -> TaskKind:
    """The record of ``task: NAME`` (a config's, or a run's qatune.json)."""
    return TASK_KINDS[name]


def guessed_task(answers_in_context: float | None) -> str:
    """The kind qatune init guesses for a sheet: extractive when most answers occur in their context (a share in
    0-1; None without a context column), else generative."""
    return "extractive" if answers_in_context is not None and answers_in_context >= 0.5 else "generative"


def model_does(model_task: str, task: str) -> bool:
    """Whether a model made for ``model_task`` (a packaged model's) does ``task``: it loads as that task's models do
    (a causal LM writes generative answers and chooses among an exam question's choices alike)."""
    return task_kind(model_task).auto_class == task_kind(task).auto_class
