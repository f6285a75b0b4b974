"""What ``qatune check`` says of a grading run's answer fields: each column's kind, its values and their counts,
values only the evaluation rows have, numbers outside the training range, and the rendered answers' length."""

from __future__ import annotations

from typing import Any

from qatune.config import Config
from qatune.data.generative import percentile
from qatune.data.grading_fields import format_value, label_key
from qatune.data.validate import warning
from qatune.errors import row_list
from qatune.model.scoring import Head

RARE_CLASS_ROWS = 10
"""A label with fewer training rows than this is too rare for a model to learn: check warns."""


def fields_section(prepared: Any, heads: list[Head] | None = None) -> dict[str, Any]:
    """A grading run's answer columns: each one's kind (and whether data.field_kinds set it or the training values
    suggested it); for labels and numbers the training rows per value and the values of the evaluation rows that
    training never shows; for labels the spellings likely the same; for numbers the decimal separator, the
    tolerance, the training range, the evaluation rows outside it and the rows dropped for holding no number; the
    rendered answers' lengths in tokens (``heads``: a scoring run's, which predict the columns: no answer is
    written). ``prepared``: the run as train/preparation.py prepared it."""
    configured = prepared.config.data.field_kinds or {}
    settled = prepared.fields
    columns = {}
    for name, spec in (settled.specs if settled else {}).items():
        held = [(r.row, r.answer_fields.get(name, "")) for r in prepared.eval_records]
        entry: dict[str, Any] = {"kind": spec.kind, "kind_from": "configured" if name in configured else "inferred",
                                 "distinct": len(spec.values), "counts": None, "eval_only": [], "range": None,
                                 "out_of_range_rows": []}
        if spec.kind == "label":
            entry["counts"] = dict(zip(spec.values, spec.counts))
            known = {label_key(value) for value in spec.values}
            entry["eval_only"] = sorted({v.strip() for _, v in held if v.strip() and label_key(v) not in known})
            entry["likely_same"] = settled.likely_same.get(name, [])
            entry["merged"] = settled.merged
        elif spec.kind == "number":
            entry["counts"] = dict(zip(spec.values, spec.counts))
            values = set(map(spec.number, spec.values))
            numbers = [(row, spec.number(v)) for row, v in held]
            entry["eval_only"] = sorted({format_value(n) for _, n in numbers if n is not None and n not in values})
            entry["range"] = [spec.low, spec.high] if spec.low is not None else None
            entry["out_of_range_rows"] = [row for row, n in numbers if n is not None and spec.low is not None
                                          and not spec.low <= n <= spec.high]
            entry.update(decimal=settled.decimals.get(name), tolerance=spec.tolerance,
                         not_numbers=[{"row": row, "cell": cell} for row, cell in settled.not_numbers.get(name, [])])
        columns[name] = entry
    if heads is not None:
        for head in heads:
            columns[head.name]["head"] = _describe_head(head)
        return {"template": prepared.info.answer_template, "columns": columns, "answer_tokens": None}
    answers = [prepared.info.answer_prefix + r.answer for r in prepared.train_records]
    lengths = [len(ids) for ids in prepared.tokenizer(answers, add_special_tokens=False)["input_ids"]] \
        if answers else []
    return {"template": prepared.info.answer_template, "columns": columns,
            "answer_tokens": {"min": min(lengths, default=0), "median": percentile(lengths, 50),
                              "max": max(lengths, default=0)}}


def _describe_head(head: Head) -> str:
    """A scoring head as check shows it: its outputs, and the label weights of data.class_weights."""
    if head.kind == "label":
        weights = (": loss weights " + ", ".join(f"{label!r} {weight:.2f}" for label, weight in
                                                 zip(head.classes, head.class_weights))) if head.class_weights else ""
        return f"a softmax over its {head.width} labels{weights}"
    if head.by_values:
        return f"a softmax over its {head.width} training values, writing their median (model.number_head: values)"
    return "one output on its training range, written as the nearest training value (model.number_head: regression)"


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
        row_cells = entry.get("not_numbers")
        if row_cells:
            shown = ", ".join(f"{c['cell']!r} in row {c['row']}" for c in row_cells[:5])
            findings.append(warning("field-not-a-number", f"{name}: {len(row_cells)} training rows hold no number "
                                    f"({shown}{', ...' if len(row_cells) > 5 else ''}): they are dropped from "
                                    f"training; to keep them as written, set data.field_kinds: {{{name}: label}} "
                                    "(or text), or fix the cells"))
        if entry.get("likely_same") and not entry["merged"]:
            groups = "; ".join(" and ".join(f"{s!r} ({entry['counts'].get(s, 0)} rows)" for s in group)
                               for group in entry["likely_same"])
            findings.append(warning("labels-likely-same", f"{name}: {groups} differ only in case, spacing or "
                                    "punctuation: likely the same label, trained as different ones; set "
                                    "data.merge_label_spellings: true to train each group as its first spelling"))
        rare = [f"{value!r} ({count} rows)" for value, count in (entry["counts"] or {}).items()
                if entry["kind"] == "label" and count < RARE_CLASS_ROWS]
        if rare:
            findings.append(warning("label-too-rare", f"{name}: labels with fewer than {RARE_CLASS_ROWS} training "
                                    f"rows are too rare to learn, the model will rarely if ever give them: "
                                    f"{', '.join(rare)}; add rows of them, or merge them into another label"))
    longest, budget = (fields["answer_tokens"] or {}).get("max", 0), config.generate.max_new_tokens
    if fields["answer_tokens"] and longest >= budget:
        findings.append(warning("answers-cut", f"the longest rendered answer is {longest} tokens and "
                                f"generate.max_new_tokens is {budget}: longer answers are cut before their end "
                                f"and do not parse; set generate.max_new_tokens to at least {longest + 1}"))
    return findings


def render_fields(fields: dict[str, Any]) -> list[str]:
    """The answer fields part of the human-readable report."""
    tokens = fields["answer_tokens"]
    lines = ["Answer fields", f"  answer template: {fields['template']!r}"]
    if tokens:
        lines.append(f"  answer tokens: min {tokens['min']}, median {tokens['median']}, max {tokens['max']}")
    for name, entry in fields["columns"].items():
        lines.append(f"  {name}: {entry['kind']} ({entry['kind_from']}), {entry['distinct']} distinct values")
        if entry["counts"] is not None:
            lines.append("    training rows: " + ", ".join(f"{value!r} {n}" for value, n in entry["counts"].items()))
        if entry.get("decimal"):
            lines.append(f"    read with a {entry['decimal']}; right within {entry['tolerance']:g} of the gold value")
        if entry["range"] is not None:
            low, high = entry["range"]
            lines.append(f"    training range: {format_value(low)} to {format_value(high)}; evaluation rows outside "
                         f"it: {row_list(entry['out_of_range_rows']) or 'none'}")
        if entry.get("not_numbers"):
            lines.append(f"    dropped, no number: rows {row_list([c['row'] for c in entry['not_numbers']])}")
        for group in entry.get("likely_same", []):
            verb = "merged into" if entry["merged"] else "likely the same as"
            lines.append(f"    {', '.join(map(repr, group[1:]))} {verb} {group[0]!r}")
        if entry.get("head"):
            lines.append(f"    head: {entry['head']}")
        if entry["eval_only"]:
            lines.append(f"    in the evaluation rows only: {', '.join(map(repr, entry['eval_only']))}")
    return lines
