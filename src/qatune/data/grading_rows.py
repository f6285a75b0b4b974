"""A grading sheet's training rows settled before anything is encoded: each answer column's kind and spec, the
rows whose number cell holds no number dropped (and named), the spellings of one label that differ only in case,
spacing or punctuation found (and merged into their most frequent spelling with data.merge_label_spellings)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from qatune.config import DataConfig
from qatune.data.grading_fields import AnswerTemplate, FieldSpec, field_spec, likely_same
from qatune.data.numbers import decimal_separator, parse_number
from qatune.data.spreadsheet import LoadReport, QARecord, answer_kinds, answer_template


@dataclass
class SettledFields:
    """What settling a grading sheet's training rows found. ``not_numbers``: per number field, the (row, cell)
    of each row dropped for holding no number there; ``likely_same``: per label field, the groups of spellings
    that differ only in case, spacing or punctuation (the most frequent first); ``merged``: whether they were
    merged (data.merge_label_spellings)."""

    template: AnswerTemplate
    specs: dict[str, FieldSpec]
    decimals: dict[str, str] = field(default_factory=dict)
    """Per number field, why its decimal separator is what it is (DecimalSeparator.describe)."""
    not_numbers: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    likely_same: dict[str, list[list[str]]] = field(default_factory=dict)
    merged: bool = False

    @property
    def kinds(self) -> dict[str, str]:
        return {name: spec.kind for name, spec in self.specs.items()}

    def spellings(self) -> dict[str, dict[str, str]]:
        """Per label field, each merged spelling -> the spelling it was merged into (empty unless ``merged``)."""
        if not self.merged:
            return {}
        return {name: {other: group[0] for group in groups for other in group[1:]}
                for name, groups in self.likely_same.items()}


def settle_fields(data: DataConfig, records: list[QARecord], report: LoadReport | None = None
                  ) -> tuple[list[QARecord], SettledFields | None]:
    """The training rows of a grading sheet (data.answer_columns) settled as the module says, with their fields'
    specs; ``report`` counts the rows dropped. Other sheets: the rows as they are, and None."""
    template = answer_template(data)
    if template is None:
        return records, None
    kinds = answer_kinds(data, records) or {}
    decimals = {name: decimal_separator([r.answer_fields.get(name, "") for r in records])
                for name, kind in kinds.items() if kind == "number"}
    not_numbers: dict[str, list[tuple[int, str]]] = {}
    kept = []
    for record in records:
        bad = [name for name, decimal in decimals.items()
               if parse_number(record.answer_fields.get(name, ""), decimal.separator) is None]
        for name in bad:
            not_numbers.setdefault(name, []).append((record.row, record.answer_fields.get(name, "")))
        if bad:
            if report is not None:
                report.drop_kept(f"{bad[0]} is not a number", record.row)
            continue
        kept.append(record)
    settled = SettledFields(template, {}, {name: d.describe() for name, d in decimals.items()}, not_numbers,
                            {name: groups for name, kind in kinds.items() if kind == "label"
                             and (groups := likely_same([r.answer_fields.get(name, "") for r in kept]))},
                            data.merge_label_spellings)
    kept = apply_spellings(kept, settled)
    settled.specs = {name: field_spec(kind, [r.answer_fields.get(name, "") for r in kept])
                     for name, kind in kinds.items()}
    return kept, settled


def apply_spellings(records: list[QARecord], settled: SettledFields | None) -> list[QARecord]:
    """``records`` with each label spelling merged into the one it was merged into in training, their answers
    written again (rows of an evaluation file read as the training rows were)."""
    merges = settled.spellings() if settled is not None else {}
    if not any(merges.values()):
        return records
    out = []
    for record in records:
        cells = {name: merges.get(name, {}).get(value.strip(), value) for name, value in record.answer_fields.items()}
        if cells == record.answer_fields:
            out.append(record)
        else:
            out.append(replace(record, answer_fields=cells, answers=[settled.template.render(cells)]))
    return out
