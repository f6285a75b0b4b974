"""Scoring: heads over an encoder (or a decoder's last token) give a grading sheet's columns: a class per label
column, a value per number column.

Rows become the text the model reads and one target per head; the loss is cross-entropy for labels and a regression
(or classes) for numbers, weighed as the config says; the model answers with every head's value, written with the
run's answer template.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from qatune import __version__
from qatune.config import Config, GenerateConfig
from qatune.data.generative import choose_max_length
from qatune.data.grading_rows import SettledFields
from qatune.data.scoring import ScoringCollator, ScoringEncoder
from qatune.data.spreadsheet import LoadReport, QARecord
from qatune.data.templates import scoring_template
from qatune.data.validate import Finding, warning
from qatune.errors import ConfigError, row_list
from qatune.inference.lockstep import Lockstep
from qatune.inference.scoring import score_records, scored_answers
from qatune.kinds.base import BaseModel, Built, Encoded, Kind, length_summary
from qatune.kinds.fields_check import field_findings, fields_section
from qatune.model.folder import ModelInfo
from qatune.model.scoring import HeadLayout, build_scoring_model, scoring_objective
from qatune.model.sources import build_scratch


class Scoring(Kind):
    answers_whole = True

    def __init__(self) -> None:
        super().__init__("scoring")

    # --- training

    def tokenizer_texts(self, config: Config, records: list[QARecord], architecture: str) -> tuple[str, list[str]]:
        """A scratch scorer is a BERT (WordPiece) or a GPT-2 (byte-level BPE)."""
        template = scoring_template(config.data)
        return ("generative" if architecture == "gpt2" else "extractive",
                [template.render(r.question, r.context, r.fields) for r in records])

    def build(self, config: Config, tokenizer: Any, settled: SettledFields | None, model_config: Any = None) -> Any:
        if settled is None:
            return build_scratch(config.model.scratch, self.name, tokenizer)
        layout = scoring_layout(config, settled)
        if config.model.scratch is not None:
            return build_scoring_model(config.model, tokenizer, layout, scratch=config.model.scratch,
                                       weights=config.data.field_weights)
        return build_scoring_model(config.model, tokenizer, layout, model_config, weights=config.data.field_weights)

    def encode(self, config: Config, built: Built, records: list[QARecord], train_report: LoadReport,
               reports: dict[str, Any], settled: SettledFields | None) -> Encoded:
        """A row's text as the model reads it, and a target per head."""
        assert settled is not None  # a scoring config names its answer columns (config/reading.py)
        template = scoring_template(config.data)
        encoder = ScoringEncoder(built.tokenizer, template)
        layout = scoring_layout(config, settled)
        lengths = [len(ids) for ids in encoder.ids(records)]
        max_length = choose_max_length(lengths, config.data.max_length, built.limit)
        targets = [layout.targets(r.answer_fields, settled.specs) for r in records]
        examples, stats = encoder.encode(records, targets, max_length)
        reports["train_file"] = train_report.to_dict()
        reports["encoding"] = {"max_length": max_length, "truncated_rows": stats.truncated_rows,
                               "too_long_rows": [], "lengths": length_summary(lengths)}
        findings = []
        if stats.truncated_rows:
            findings.append(warning("rows-truncated", f"{len(stats.truncated_rows)} rows are longer than "
                                    f"max_length={max_length} tokens: the model reads only their first {max_length} "
                                    f"(rows {row_list(stats.truncated_rows)}); raise data.max_length or use auto"))
        info = ModelInfo(task=self.name, max_length=max_length, prompt_template=template.template, answer_prefix="",
                         qatune_version=__version__, answer_fields=settled.kinds,
                         answer_template=settled.template.template,
                         field_specs={name: spec.to_json() for name, spec in settled.specs.items()},
                         scoring_heads=layout.to_json())
        return Encoded(examples, ScoringCollator(built.tokenizer.pad_token_id), info, records, findings)

    def objective(self, model: nn.Module) -> nn.Module:
        return scoring_objective(model)

    def count_items(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["n_items"])  # the rows whose columns are known: the collator counts them

    # --- qatune check

    def check(self, prepared: Any) -> tuple[dict[str, Any], list[Finding]]:
        fields = fields_section(prepared, scoring_layout(prepared.config, prepared.fields).heads)
        section = {"lengths": {**prepared.reports["encoding"]["lengths"], "what": "tokens per row"},
                   "truncated_rows": prepared.reports["encoding"]["truncated_rows"],
                   "prompt_template": prepared.info.prompt_template,
                   "examples": [prepared.tokenizer.decode(item.input_ids) for item in prepared.dataset.items[:2]],
                   "fields": fields}
        return section, field_findings(fields, prepared.config)

    def check_lines(self, report: dict[str, Any]) -> list[str]:
        return [f"  rows cut at max_length (their end is not read): {len(report['truncated_rows'])}", "",
                "What the model reads", f"  text template: {report['prompt_template']!r}",
                "  examples, as tokens read back:"]

    # --- answering

    def answer(self, model: Any, tokenizer: Any, info: ModelInfo, questions: list[str],
               contexts: list[str | None], generate: GenerateConfig, batch_size: int = 32, progress: bool = False,
               fields: list[dict[str, str]] | None = None) -> list[str]:
        rows = [QARecord(question=q, answers=[], context=c, row=i, fields=f or {})
                for i, (q, c, f) in enumerate(zip(questions, contexts, fields or [{}] * len(questions)))]
        values, _, _ = score_records(model, tokenizer, info, rows, batch_size, progress, generate.precision)
        return scored_answers(info, values)

    def evaluation_parts(self, model: Any, tokenizer: Any, info: ModelInfo, records: list[QARecord],
                         generate: GenerateConfig, batch_size: int = 32, progress: bool = False,
                         speedups: str | list[str] = "auto", lockstep: Lockstep | None = None
                         ) -> tuple[list[str], float, int]:
        values, loss_sum, count = score_records(model, tokenizer, info, records, batch_size, progress,
                                                generate.precision, lockstep)
        return scored_answers(info, values), loss_sum, count

    def check_base(self, config: Config, flag: str) -> None:
        raise ConfigError(f"{flag} evaluates a model before fine-tuning, and a scoring model's heads are built for "
                          "its answer columns when it trains: there is no base to ask; compare the run with another "
                          "run instead (--compare RUN)")

    def base_model(self, config: Config, tokenizer: Any, model_config: Any, records: list[QARecord]) -> BaseModel:
        raise AssertionError("check_base refuses a scoring config's base model")


def scoring_layout(config: Config, settled: SettledFields) -> HeadLayout:
    """The heads of a scoring run's answer columns, as model.number_head and data.class_weights say."""
    return HeadLayout.from_specs(settled.specs, config.model.number_head, config.data.class_weights)
