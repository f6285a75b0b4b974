"""Extractive QA: an encoder points at the answer's span in the context.

Rows become windows of question + context with the answer's start and end tokens as labels (a window without the
answer points at its first token); the loss is cross-entropy over start and end; the model answers with the best
span over all windows of a context.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from qatune import __version__
from qatune.config import Config, GenerateConfig
from qatune.data.extractive import SpanCollator, prepare_features, window_length
from qatune.data.generative import percentile
from qatune.data.grading_rows import SettledFields
from qatune.data.padding import IGNORE_INDEX
from qatune.data.spreadsheet import LoadReport, QARecord
from qatune.data.validate import Finding, error, warning
from qatune.errors import DataError, row_list
from qatune.inference.generate import extract_answers, score_windows
from qatune.inference.lockstep import Lockstep
from qatune.kinds.base import BaseModel, Built, Encoded, Kind
from qatune.model.folder import ModelInfo
from qatune.model.objectives import SpanObjective
from qatune.model.sources import build_scratch, load_pretrained, model_max_positions

log = logging.getLogger("qatune")

UNTRAINED_HEAD = ("an extractive model's span head is trained by fine-tuning: before it, its weights are random "
                  "(seeded by the config's seed), so the base model points at answers by chance and scores near zero")


class Extractive(Kind):
    def __init__(self) -> None:
        super().__init__("extractive")

    # --- training

    def tokenizer_texts(self, config: Config, records: list[QARecord], architecture: str) -> tuple[str, list[str]]:
        return self.name, [text for r in records for text in (r.question, r.context or "")]

    def build(self, config: Config, tokenizer: Any, settled: SettledFields | None, model_config: Any = None) -> Any:
        if config.model.scratch is not None:
            return build_scratch(config.model.scratch, self.name, tokenizer)
        return load_pretrained(config.model, self.name, tokenizer, model_config)

    def encode(self, config: Config, built: Built, records: list[QARecord], train_report: LoadReport,
               reports: dict[str, Any], settled: SettledFields | None) -> Encoded:
        max_length = window_length(config.data.max_length, built.limit)
        features, stats, kept = prepare_features(built.tokenizer, records, max_length, config.data.doc_stride,
                                                 train=True)
        for row in stats.not_found_rows:
            train_report.drop_kept("answer not in context", row)
        reports["train_file"] = train_report.to_dict()
        reports["encoding"] = {
            "max_length": max_length, "doc_stride": config.data.doc_stride, "windows": stats.windows,
            "windows_without_answer": stats.windows_without_answer, "answer_not_in_context_rows": stats.not_found_rows,
            "unreachable_rows": stats.unreachable_rows,
            "span_audit": {"checked": stats.audit_checked, "matched": stats.audit_matched,
                           "share": stats.audit_share, "token_boundary": stats.audit_boundary,
                           "token_boundary_examples": stats.audit_boundary_examples[:5],
                           "mismatches": stats.audit_mismatches},
        }
        findings = []
        if stats.not_found_rows:
            findings.append(warning("answer-not-in-context", f"{len(stats.not_found_rows)} rows dropped: the answer "
                                    f"is not in the context (rows {row_list(stats.not_found_rows)})"))
        if stats.unreachable_rows:
            findings.append(warning("answer-longer-than-window", f"{len(stats.unreachable_rows)} rows have an "
                                    f"answer that no window holds whole (rows {row_list(stats.unreachable_rows)}); "
                                    "raise data.max_length or shorten those answers"))
        log.info("windows: %d (%d without the answer, labelled CLS); span audit: %.1f%% of %d labelled spans "
                 "decode to the answer, %d end inside a token", stats.windows, stats.windows_without_answer,
                 100 * stats.audit_share, stats.audit_checked, stats.audit_boundary)
        if stats.audit_mismatches:
            first = stats.audit_mismatches[0]
            findings.append(error("span-audit", f"span audit: {len(stats.audit_mismatches)} labelled spans do not "
                                                f"cover their answer (row {first['row']}: tokens "
                                                f"{first['labelled_tokens']!r}, answer {first['answer']!r}); "
                                                "please report this with the row"))
        info = ModelInfo(task=self.name, max_length=max_length, doc_stride=config.data.doc_stride,
                         qatune_version=__version__)
        return Encoded(features, SpanCollator(built.tokenizer.pad_token_id, max_width=built.limit), info, kept,
                       findings)

    def objective(self, model: nn.Module) -> nn.Module:
        return SpanObjective(model)

    def count_items(self, batch: dict[str, torch.Tensor]) -> int:
        if "n_items" in batch:
            return int(batch["n_items"])
        return int((batch["start_positions"] != IGNORE_INDEX).sum())

    def batch_answers(self, items: list[Any]) -> list[str] | None:
        return [getattr(item, "answer_text", None) for item in items]

    # --- qatune check

    def check(self, prepared: Any) -> tuple[dict[str, Any], list[Finding]]:
        return _windows_section(prepared), []

    def check_lines(self, report: dict[str, Any]) -> list[str]:
        windows, audit = report["windows"], report["span_audit"]
        return [f"  windows: {windows['total']} ({windows['without_answer']} without the answer -> CLS; "
                f"at most {windows['max_per_row']} per row)",
                "", "Span audit",
                (f"  labelled spans that decode to the answer: {audit['matched']}/{audit['checked']} "
                 f"({100 * audit['share']:.1f}%); answer ends inside a token: {audit['token_boundary']}; "
                 f"mismatches: {len(audit['mismatches'])}"),
                f"  answers not found in their context: {len(report['answer_not_in_context_rows'])}",
                "  examples (labelled span inside ⟦ ⟧):"]

    # --- answering

    def answer(self, model: Any, tokenizer: Any, info: ModelInfo, questions: list[str],
               contexts: list[str | None], generate: GenerateConfig, batch_size: int = 32, progress: bool = False,
               fields: list[dict[str, str]] | None = None) -> list[str]:
        if any(not c for c in contexts):
            raise DataError("extractive QA needs a context for every question; pass --context/--context-file "
                            "or a file with a context column")
        records = [QARecord(question=q, answers=[], context=c, row=i)
                   for i, (q, c) in enumerate(zip(questions, contexts))]
        features, _, kept = prepare_features(tokenizer, records, info.max_length, info.doc_stride, train=False)
        starts, ends, _, _ = score_windows(model, tokenizer, features, batch_size, progress, generate.precision)
        return extract_answers(features, starts, ends, kept, generate)

    def evaluation_parts(self, model: Any, tokenizer: Any, info: ModelInfo, records: list[QARecord],
                         generate: GenerateConfig, batch_size: int = 32, progress: bool = False,
                         speedups: str | list[str] = "auto", lockstep: Lockstep | None = None
                         ) -> tuple[list[str], float, int]:
        features, _, kept = prepare_features(tokenizer, records, info.max_length, info.doc_stride, train=False)
        starts, ends, loss_sum, count = score_windows(model, tokenizer, features, batch_size, progress,
                                                      generate.precision, lockstep)
        return extract_answers(features, starts, ends, kept, generate), loss_sum, count

    def base_name(self, config: Config) -> str:
        return f"{config.model.name_or_path} (base, its span head untrained)"

    def base_model(self, config: Config, tokenizer: Any, model_config: Any, records: list[QARecord]) -> BaseModel:
        limit = model_max_positions(model_config, tokenizer)
        return BaseModel(ModelInfo(task=self.name, max_length=window_length(config.data.max_length, limit),
                                   doc_stride=config.data.doc_stride), note=UNTRAINED_HEAD)


def _windows_section(prepared: Any) -> dict[str, Any]:
    """check's view of the windows: their lengths, how many per row, the span audit, two labelled spans."""
    features = prepared.dataset.items
    tokens = [len(f) for f in features]
    per_row: dict[int, int] = {}
    for feature in features:
        per_row[feature.row] = per_row.get(feature.row, 0) + 1
    encoding = prepared.reports["encoding"]
    rendered = [render_span(prepared, f) for f in features if f.has_answer][:2]
    return {
        "lengths": {"min": min(tokens), "median": percentile(tokens, 50), "p95": percentile(tokens, 95),
                    "max": max(tokens), "what": "question + context tokens per window"},
        "windows": {"total": encoding["windows"], "without_answer": encoding["windows_without_answer"],
                    "max_per_row": max(per_row.values())},
        "answer_not_in_context_rows": encoding["answer_not_in_context_rows"],
        "span_audit": encoding["span_audit"],
        "examples": rendered,
    }


def render_span(prepared: Any, feature: Any) -> str:
    record = prepared.train_records[feature.example]
    context = record.context or ""
    start = feature.offsets[feature.start_position][0]
    end = feature.offsets[feature.end_position][1]
    left, right = max(0, start - 120), min(len(context), end + 120)
    snippet = ("…" if left else "") + context[left:start] + "⟦" + context[start:end] + "⟧" + context[end:right]
    return f"Q: {record.question}\nC: {snippet}{'…' if right < len(context) else ''}"
