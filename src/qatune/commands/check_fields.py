"""What ``qatune check`` says of a grading run's answer fields: each column's kind, its values and their counts,
values only the evaluation rows have, numbers outside the training range, and the rendered answers' length."""

from __future__ import annotations

from collections import Counter
from typing import Any

from qatune.config import Config
from qatune.data.generative import percentile
from qatune.data.grading_fields import format_value, parse_number
from qatune.data.validate import warning
from qatune.errors import row_list
from qatune.train import Prepared


def fields_section(prepared: Prepared) -> dict[str, Any]:
    """A grading run's answer columns: each one's kind (and whether data.field_kinds set it or the training values
    suggested it); for labels and numbers the training rows per value, the values of the evaluation rows that
    training never shows, and for numbers the evaluation rows outside the training range; the rendered answers'
    lengths in tokens."""
    configured = prepared.config.data.field_kinds or {}
    columns = {}
    for name, kind in (prepared.info.answer_fields or {}).items():
        train = [r.answer_fields.get(name, "") for r in prepared.train_records]
        held = [(r.row, r.answer_fields.get(name, "")) for r in prepared.eval_records]
        entry: dict[str, Any] = {"kind": kind, "kind_from": "configured" if name in configured else "inferred",
                                 "distinct": len({_value_key(kind, v) for v in train}), "counts": None,
                                 "eval_only": [], "range": None, "out_of_range_rows": []}
        if kind != "text":
            counts = Counter(_value_key(kind, v) for v in train)
            # numbers in their order (any text that is no number after them), labels the most frequent first
            order = sorted(counts, key=lambda v: (parse_number(v) is None, parse_number(v) or 0.0, v)) \
                if kind == "number" else sorted(counts, key=lambda v: (-counts[v], v))
            entry["counts"] = {value: counts[value] for value in order}
            entry["eval_only"] = sorted({_value_key(kind, v) for _, v in held} - set(counts))
        if kind == "number":
            numbers = [n for n in map(parse_number, train) if n is not None]
            low, high = (min(numbers), max(numbers)) if numbers else (None, None)
            entry["range"] = [low, high] if numbers else None
            entry["out_of_range_rows"] = [row for row, v in held if numbers and (n := parse_number(v)) is not None
                                          and not low <= n <= high]
        columns[name] = entry
    answers = [prepared.info.answer_prefix + r.answer for r in prepared.train_records]
    lengths = [len(ids) for ids in prepared.tokenizer(answers, add_special_tokens=False)["input_ids"]] \
        if answers else []
    return {"template": prepared.info.answer_template, "columns": columns,
            "answer_tokens": {"min": min(lengths, default=0), "median": percentile(lengths, 50),
                              "max": max(lengths, default=0)}}


def _value_key(kind: str, value: str) -> str:
    """A value as the field's rows are counted by: numbers by their value ("2.50" is "2.5"), labels as written,
    stripped (label metrics compare them ignoring case: differently cased spellings show as they are written)."""
    if kind == "number":
        number = parse_number(value)
        return format_value(number) if number is not None else value.strip()
    return value.strip()


def field_findings(fields: dict[str, Any], config: Config) -> list[Any]:
    findings = []
    for name, entry in fields["columns"].items():
        if entry["eval_only"]:
            findings.append(warning("field-values-not-trained", f"{name}: the evaluation rows have values that no "
                                    f"training row has ({', '.join(entry['eval_only'][:5])}); the model cannot learn "
                                    "to write them"))
        if entry["out_of_range_rows"]:
            low, high = entry["range"]
            findings.append(warning("field-out-of-range", f"{name}: {len(entry['out_of_range_rows'])} evaluation rows "
                                    f"are outside the training range {format_value(low)}..{format_value(high)} "
                                    f"(rows {row_list(entry['out_of_range_rows'])})"))
    longest, budget = fields["answer_tokens"]["max"], config.generate.max_new_tokens
    if longest >= budget:
        findings.append(warning("answers-cut", f"the longest rendered answer is {longest} tokens and "
                                f"generate.max_new_tokens is {budget}: longer answers are cut before their end "
                                f"and do not parse; set generate.max_new_tokens to at least {longest + 1}"))
    return findings


def render_fields(fields: dict[str, Any]) -> list[str]:
    """The answer fields part of the human-readable report."""
    tokens = fields["answer_tokens"]
    lines = ["Answer fields", f"  answer template: {fields['template']!r}",
             f"  answer tokens: min {tokens['min']}, median {tokens['median']}, max {tokens['max']}"]
    for name, entry in fields["columns"].items():
        lines.append(f"  {name}: {entry['kind']} ({entry['kind_from']}), {entry['distinct']} distinct values")
        if entry["counts"] is not None:
            lines.append("    training rows: " + ", ".join(f"{value!r} {n}" for value, n in entry["counts"].items()))
        if entry["range"] is not None:
            low, high = entry["range"]
            lines.append(f"    training range: {format_value(low)} to {format_value(high)}; evaluation rows outside "
                         f"it: {row_list(entry['out_of_range_rows']) or 'none'}")
        if entry["eval_only"]:
            lines.append(f"    in the evaluation rows only: {', '.join(map(repr, entry['eval_only']))}")
    return lines
