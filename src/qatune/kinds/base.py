"""What every kind of QA does, each in its own way: the methods a kind implements, and what they exchange."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from qatune.config import Config, GenerateConfig
from qatune.data.grading_rows import SettledFields
from qatune.data.spreadsheet import LoadReport, QARecord
from qatune.data.validate import Finding
from qatune.errors import ConfigError
from qatune.inference.lockstep import Lockstep
from qatune.model.folder import ModelInfo
from qatune.tasks import TaskKind, task_kind


@dataclass
class Built:
    """A run's model and tokenizer as setup built them, before encoding."""

    model: Any
    tokenizer: Any
    limit: int | None
    """Longest sequence the model reads (None when unknown)."""
    seq2seq: bool


@dataclass
class Encoded:
    """The training rows as tensors' items, the collator that batches them, and what the run saves about them."""

    items: list[Any]
    collator: Any
    info: ModelInfo
    train_records: list[QARecord]
    findings: list[Finding]


@dataclass
class BaseModel:
    """A pretrained model before fine-tuning, asked as a run of its config would be."""

    info: ModelInfo
    note: str | None = None
    """What its answers mean, printed beside its metrics."""


class Kind(ABC):
    """One kind of QA. Its record (:mod:`qatune.tasks`) says what it is; its methods do what differs."""

    def __init__(self, name: str):
        self.record: TaskKind = task_kind(name)

    @property
    def name(self) -> str:
        return self.record.name

    # --- the rows

    def settle_rows(self, records: list[QARecord], report: LoadReport | None = None) -> list[QARecord]:
        """The rows as this kind reads them, after the sheet is loaded (training and evaluation alike); a row it
        cannot use is left out and counted in ``report``."""
        return records

    # --- training

    @abstractmethod
    def tokenizer_texts(self, config: Config, records: list[QARecord], architecture: str) -> tuple[str, list[str]]:
        """The kind of tokenizer a scratch model of ``architecture`` takes ("generative": byte-level BPE, or
        "extractive": WordPiece; T5 is always Unigram) and the texts it is trained on."""

    @abstractmethod
    def build(self, config: Config, tokenizer: Any, settled: SettledFields | None, model_config: Any = None) -> Any:
        """The model to train: from ``config.model.scratch``, or pretrained (``model_config``: its config)."""

    @abstractmethod
    def encode(self, config: Config, built: Built, records: list[QARecord], train_report: LoadReport,
               reports: dict[str, Any], settled: SettledFields | None) -> Encoded:
        """The training rows as items and their collator; what is dropped is told in ``train_report``, what the
        encoding found in ``reports['encoding']``."""

    @abstractmethod
    def objective(self, model: nn.Module) -> nn.Module:
        """The model wrapped so that ``forward(**batch)`` returns the summed loss and its count."""

    @abstractmethod
    def count_items(self, batch: dict[str, torch.Tensor]) -> int:
        """What the loss of ``batch`` is summed over (the loop divides by the window's count)."""

    def batch_answers(self, items: list[Any]) -> list[str] | None:
        """The answers the batch validator checks a batch's labels against, where its labels point at them."""
        return None

    # --- qatune check

    @abstractmethod
    def check(self, prepared: Any) -> tuple[dict[str, Any], list[Finding]]:
        """What ``qatune check`` reports of the encoded rows (``prepared``: train/preparation.py's Prepared): the
        report's keys (``lengths``, ``examples`` among them) and what it finds wrong."""

    @abstractmethod
    def check_lines(self, report: dict[str, Any]) -> list[str]:
        """The report's lines on how rows became tokens, after its token lengths, ending with the header of its
        examples."""

    # --- answering

    answers_whole: bool = False
    """Whether :meth:`answer` gives each answer whole (heads' values, a chosen choice) rather than token by token
    (serve streams a decoder's tokens, and a span as it is found)."""

    @abstractmethod
    def answer(self, model: Any, tokenizer: Any, info: ModelInfo, questions: list[str],
               contexts: list[str | None], generate: GenerateConfig, batch_size: int = 32, progress: bool = False,
               fields: list[dict[str, str]] | None = None) -> list[str]:
        """One answer per question, in the input order. ``fields``: per question, the other columns the prompt
        template names."""

    @abstractmethod
    def evaluation_parts(self, model: Any, tokenizer: Any, info: ModelInfo, records: list[QARecord],
                         generate: GenerateConfig, batch_size: int = 32, progress: bool = False,
                         speedups: str | list[str] = "auto", lockstep: Lockstep | None = None
                         ) -> tuple[list[str], float, int]:
        """Predictions plus the summed loss and its item count: parts that add up across data shards.
        ``lockstep``: this process's share of the rows of a sharded model (every process passes at least one)."""

    def vocabulary_logits(self, rows: int, width: int, supervised: int, all_positions: bool) -> int:
        """How many rows of vocabulary logits a batch of ``rows`` x ``width`` tokens (``supervised``: the most
        supervised positions of a row) computes in training (``all_positions``: train.speedups off); 0 where the
        model's outputs are not over a vocabulary."""
        return 0

    def perplexity(self, loss: float | None) -> float | None:
        """exp(loss) where the loss is a language model's, else None."""
        return None

    # --- the model before fine-tuning (eval --base, --compare base)

    def check_base(self, config: Config, flag: str) -> None:
        """Refuse a config whose model before fine-tuning cannot answer (``flag``: the option that asked)."""
        if config.model.name_or_path is None:
            raise ConfigError(f"{flag} needs a pretrained model (model.name_or_path); a scratch model knows nothing "
                              "before training")

    def base_name(self, config: Config) -> str:
        return f"{config.model.name_or_path} (base, not fine-tuned)"

    @abstractmethod
    def base_model(self, config: Config, tokenizer: Any, model_config: Any, records: list[QARecord]) -> BaseModel:
        """How the pretrained model of ``config`` is asked: the ModelInfo a run of that config would save."""

    # --- export

    def gguf_refusal(self, info: ModelInfo) -> str | None:
        """Why a run of this kind is not written as a GGUF file (None: it may be)."""
        article = "an" if self.name[0] in "aeiou" else "a"
        return (f"it is {article} {self.name} model: its answer is {self.record.answer_said} (llama.cpp runs "
                "language models that write their answers)")


def length_summary(lengths: list[int]) -> dict[str, int]:
    """The spread of the training rows' token lengths, for the encoding report."""
    from qatune.data.generative import percentile

    return {"min": min(lengths), "median": percentile(lengths, 50), "p95": percentile(lengths, 95),
            "max": max(lengths)} if lengths else {}
