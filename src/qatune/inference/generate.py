"""Answers for questions (and contexts) from a trained model, in batches.

Generative: prompts are encoded exactly as in training, left-padded, and decoded until EOS.
Extractive: every window of the context is scored and the best span is cut from the context.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from tqdm.auto import tqdm

from qatune.config import DataConfig, GenerateConfig, column_key, with_reading_overrides
from qatune.data.answer_fields import AnswerTemplate
from qatune.data.extractive import Feature, SpanCollator, best_span, prepare_features
from qatune.data.generative import PromptEncoder, Seq2SeqEncoder
from qatune.data.padding import left_pad, right_pad
from qatune.data.spreadsheet import QARecord
from qatune.data.templates import PromptTemplate
from qatune.errors import ConfigError, DataError
from qatune.model.folder import ModelInfo
from qatune.model.loading import model_max_positions
from qatune.model.objectives import span_logits, span_loss_sum
from qatune.runs.atomic import atomic_write_bytes, atomic_write_text

log = logging.getLogger("qatune")


def answer_questions(model: Any, tokenizer: Any, info: ModelInfo, questions: list[str],
                     contexts: list[str | None] | None = None, generate: GenerateConfig | None = None,
                     batch_size: int = 32, progress: bool = False,
                     fields: list[dict[str, str]] | None = None) -> list[str]:
    """One answer per question, in the input order. ``fields``: per question, the other columns the
    prompt template names."""
    generate = generate or GenerateConfig()
    contexts = contexts if contexts is not None else [None] * len(questions)
    if info.task == "generative":
        fields = fields if fields is not None else [{}] * len(questions)
        return generate_answers(model, tokenizer, info, questions, contexts, generate, batch_size, progress, fields)
    if any(not c for c in contexts):
        raise DataError("extractive QA needs a context for every question; pass --context/--context-file "
                        "or a file with a context column")
    records = [QARecord(question=q, answers=[], context=c, row=i) for i, (q, c) in enumerate(zip(questions, contexts))]
    features, _, kept = prepare_features(tokenizer, records, info.max_length, info.doc_stride, train=False)
    starts, ends, _, _ = score_windows(model, tokenizer, features, batch_size, progress, generate.precision)
    return extract_answers(features, starts, ends, kept, generate)


def generate_answers(model: Any, tokenizer: Any, info: ModelInfo, questions: list[str], contexts: list[str | None],
                     generate: GenerateConfig, batch_size: int, progress: bool,
                     fields: list[dict[str, str]] | None = None) -> list[str]:
    from transformers import GenerationConfig

    template = PromptTemplate(info.prompt_template, info.answer_prefix)
    encoder = (Seq2SeqEncoder if info.seq2seq else PromptEncoder)(tokenizer, template)
    limit = model_max_positions(model.config, tokenizer)
    # the encoder of a seq2seq model reads the prompt and its decoder writes the answer
    budget = info.max_length if info.seq2seq else prompt_budget(limit, generate.max_new_tokens)
    prompts = []
    for question, context, values in zip(questions, contexts, fields or [{}] * len(questions)):
        ids = encoder.prompt_ids(question, context, budget, fields=values)
        if ids is None:
            raise DataError(f"the prompt template alone is longer than the model's {limit} positions")
        prompts.append(ids)
    sampling = generate.temperature > 0
    config = GenerationConfig(
        max_new_tokens=generate.max_new_tokens, do_sample=sampling,
        temperature=generate.temperature if sampling else None, top_p=generate.top_p if sampling else None,
        top_k=None, eos_token_id=encoder.stop_ids, pad_token_id=tokenizer.pad_token_id,
    )
    device = next(model.parameters()).device
    answers: list[str] = [""] * len(prompts)
    model.eval()
    for chunk in _length_sorted_batches([len(p) for p in prompts], batch_size, progress, "generate"):
        pad = right_pad if info.seq2seq else left_pad  # a decoder-only model continues from the right edge
        input_ids, attention_mask = pad([prompts[i] for i in chunk], tokenizer.pad_token_id)
        with torch.inference_mode(), inference_precision(generate.precision, device):
            out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                 generation_config=config)
        # Seq2seq output starts with the decoder start token; a causal LM's repeats the prompt.
        new_tokens = out[:, 1:] if info.seq2seq else out[:, input_ids.shape[1]:]
        for i, tokens in zip(chunk, new_tokens.tolist()):
            ends = [tokens.index(stop) for stop in encoder.stop_ids if stop in tokens]
            if ends:
                tokens = tokens[: min(ends)]
            answers[i] = tokenizer.decode(tokens, skip_special_tokens=True).strip()
    return answers


def prompt_budget(positions: int | None, max_new_tokens: int) -> int | None:
    """Tokens a causal LM's prompt may have so that ``max_new_tokens`` more fit its positions (at least 8;
    None: no limit known). A longer prompt has its context, then its question, cut to fit."""
    return max(8, positions - max_new_tokens) if positions else None


def inference_precision(precision: str, device: torch.device) -> AbstractContextManager:
    """bf16 autocast for ``generate.precision: bf16`` (and ``auto`` where bf16 is native); fp32 runs as it is."""
    if precision == "auto":
        from qatune.model.precision import resolve_precision

        precision = resolve_precision("auto", device.type)
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def score_windows(model: Any, tokenizer: Any, features: list[Feature], batch_size: int, progress: bool = False,
                  precision: str = "fp32") -> tuple[list[torch.Tensor], list[torch.Tensor], float, int]:
    """Start/end logits of every window, and the summed span loss over labelled windows."""
    collate = SpanCollator(tokenizer.pad_token_id)
    device = next(model.parameters()).device
    starts: list[torch.Tensor] = [torch.empty(0)] * len(features)
    ends: list[torch.Tensor] = [torch.empty(0)] * len(features)
    loss_sum, count = 0.0, 0
    model.eval()
    for chunk in _length_sorted_batches([len(f) for f in features], batch_size, progress, "answer"):
        batch = collate([features[i] for i in chunk])
        with torch.inference_mode(), inference_precision(precision, device):
            start, end = span_logits(model, batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                     batch["token_type_ids"].to(device) if "token_type_ids" in batch else None)
            labelled = batch["start_positions"] >= 0
            if labelled.any():
                loss_sum += float(span_loss_sum(start, end, batch["start_positions"].to(device),
                                                batch["end_positions"].to(device)))
                count += int(labelled.sum())
        for j, i in enumerate(chunk):
            starts[i], ends[i] = start[j].cpu(), end[j].cpu()
    return starts, ends, loss_sum, count


def extract_answers(features: list[Feature], starts: list[torch.Tensor], ends: list[torch.Tensor],
                    records: list[QARecord], generate: GenerateConfig) -> list[str]:
    by_example: dict[int, list[int]] = {}
    for i, feature in enumerate(features):
        by_example.setdefault(feature.example, []).append(i)
    answers = []
    for example, record in enumerate(records):
        indices = by_example.get(example, [])
        text, _ = best_span([features[i] for i in indices], [starts[i] for i in indices], [ends[i] for i in indices],
                            record.context or "", generate.n_best, generate.max_answer_length)
        answers.append(text)
    return answers


def _length_sorted_batches(lengths: list[int], batch_size: int, progress: bool, desc: str) -> Iterator[list[int]]:
    """Indices in batches of similar length (less padding); callers put results back in order."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    yield from tqdm(chunks, desc=desc, unit="batch", disable=not progress, leave=False)


def answer_one(run_dir: str | Path, question: str, context: str | None = None, context_file: str | None = None,
               which: str = "final", options: dict[str, Any] | None = None, seed: int | None = None,
               fields: dict[str, str] | None = None) -> str:
    """The answer of a trained run to one question (the ``qatune generate RUN "question"`` command).

    ``fields``: values of the other columns the run's prompt names (``--field 'Total Marks=3'``)."""
    from qatune.inference.loading import load_run_model, read_run

    if context_file is not None:
        context = _read_context(context_file)
    _, info = read_run(run_dir, which)  # what the prompt needs, before the model loads
    _check_context(info, context)
    given = _check_fields(info, fields or {})
    loaded = load_run_model(run_dir, which)
    _seed(seed)
    generate = _generate_config(loaded.config.generate, options)
    return answer_questions(loaded.model, loaded.tokenizer, loaded.info, [question.strip()], [context], generate,
                            fields=[given])[0]


def uses_context(info: ModelInfo) -> bool:
    """Whether the run reads a passage besides the question: extractive runs, and prompts with {context}."""
    return info.task == "extractive" or PromptTemplate(info.prompt_template).uses_context


def _check_context(info: ModelInfo, context: str | None) -> None:
    """A run that reads a passage gets one; a run that does not refuses one rather than ignoring it."""
    if not uses_context(info):
        if context is not None:
            raise DataError("this run's prompt has no {context}: it answers from the question alone; "
                            "leave out --context/--context-file")
        return
    if context and context.strip():
        return
    if info.task == "extractive":
        raise DataError("this run does extractive QA: pass the passage with --context TEXT or --context-file FILE")
    raise DataError("this run's prompt uses a context ({context}): pass the passage with --context TEXT or "
                    "--context-file FILE")


ANSWER_FORMATS = (".csv", ".tsv", ".xlsx", ".json", ".jsonl")
"""What ``generate --file`` writes, chosen by the suffix of --output."""


def answer_file(run_dir: str | Path, data_file: str | Path, output: str | Path | None = None, which: str = "final",
                options: dict[str, Any] | None = None, seed: int | None = None,
                reading: list[str] | tuple[str, ...] = ()) -> Path:
    """Answer every row of a spreadsheet and return the path of the answers (``reading``: ``key=value``
    changes to how the file is read, over config.READING_KEYS, for a file laid out unlike the training file).

    The answers file has the columns row, question, the input's other columns (in their order) and
    answer, in the format its suffix names (ANSWER_FORMATS; default RUN/answers-NAME.csv). A run with answer
    fields (a grading sheet's) writes a graded sheet instead (:func:`write_graded`).
    """
    from qatune.data.spreadsheet import load_from_config
    from qatune.inference.loading import load_run_model, read_run

    path = _answers_path(run_dir, data_file, output)
    config, info = read_run(run_dir, which)  # the data file is read before the model loads
    template = run_answer_template(info)
    if template is not None and not output:  # a graded sheet is written in the format it was read in
        path = _answers_path(run_dir, data_file, output, keep_format=True)
    data = with_reading_overrides(config, reading).data if reading else config.data
    records, _ = load_from_config(data, data_file, with_answers=False, with_context=uses_context(info))
    if template is None:
        names, rows = _input_table(data, Path(data_file), records)
    loaded = load_run_model(run_dir, which)
    _seed(seed)
    generate = _generate_config(loaded.config.generate, options)
    answers = answer_questions(loaded.model, loaded.tokenizer, loaded.info, [r.question for r in records],
                               [r.context for r in records], generate, loaded.config.train.eval_batch_size,
                               progress=True, fields=[r.fields for r in records])
    path.parent.mkdir(parents=True, exist_ok=True)
    if template is not None:
        write_graded(path, Path(data_file), data, template, info.answer_fields or {},
                     {r.row: answer for r, answer in zip(records, answers, strict=True)})
        return path
    _write_table(path, [*names, "answer"], [[*row, answer] for row, answer in zip(rows, answers, strict=True)])
    return path


def run_answer_template(info: ModelInfo) -> AnswerTemplate | None:
    """The answer template a run with answer fields (data.answer_columns) wrote its answers with; None for others."""
    if not info.answer_fields:
        return None
    return AnswerTemplate.make(list(info.answer_fields), info.answer_template)


def write_graded(path: Path, data_file: Path, data: DataConfig, template: AnswerTemplate, kinds: dict[str, str],
                 answers: dict[int, str]) -> None:
    """The input sheet with the model's answer fields added, written atomically; ``answers``: the model's text by
    the row number of the row it answers.

    Every input column and row stays, in its order. After them come one column per answer field (named after it,
    or "FIELD (model)" when the input has a column of that name), "parsed" (yes, or no where the answer did not
    follow the answer template) and "model output" (the answer as written, on the rows that did not parse). A
    workbook written as .xlsx is a copy of the input with only the graded sheet changed, its other sheets kept.
    """
    from qatune.data.tables import EXCEL_SUFFIXES, read_table

    header, cells, first_row = read_table(data_file, sheet=data.sheet, encoding=data.encoding,
                                          delimiter=data.delimiter)
    added = _graded_names(header, template)
    graded = {row: _graded_cells(template, kinds, answer) for row, answer in answers.items()}
    unparsed = sum(values[-2] == "no" for values in graded.values())
    log.info("graded %d rows: %d answers did not follow the answer template (%s: no)", len(graded), unparsed,
             added[-2])
    if data_file.suffix.lower() in EXCEL_SUFFIXES and path.suffix.lower() == ".xlsx":
        atomic_write_bytes(path, _graded_workbook(data_file, data.sheet, len(header), added, graded))
        return
    rows = []
    for offset, line in enumerate(cells):
        line = [*line, *[None] * (len(header) - len(line))]
        new = graded.get(first_row + offset, [None] * len(added))
        rows.append([*(_plain(cell) for cell in line), *new])
    _write_table(path, [*header, *added], rows)


def _graded_names(header: list[str], template: AnswerTemplate) -> list[str]:
    """The added columns' names: each field's own, then parsed and model output; "NAME (model)" when the input
    has a column of that name (compared as columns are matched: ignoring case, spaces, _ and -)."""
    taken = {column_key(str(name)) for name in header}
    names = []
    for name in [*template.columns, "parsed", "model output"]:
        if column_key(name) in taken:
            name = f"{name} (model)"
        taken.add(column_key(name))
        names.append(name)
    return names


_PLAIN_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)")


def _graded_cells(template: AnswerTemplate, kinds: dict[str, str], answer: str) -> list[Any]:
    """One row's added cells: the fields (a number field written as a number when it is one), parsed, and the
    model's text where it did not parse."""
    parsed = template.parse(answer)
    if parsed is None:
        return [*[None] * len(template.columns), "no", answer]
    values: list[Any] = []
    for name in template.columns:
        value = parsed[name]
        if kinds.get(name) == "number" and _PLAIN_NUMBER.fullmatch(value):
            number = float(value)
            value = int(number) if number.is_integer() and abs(number) < 1e15 else number
        values.append(value if value != "" else None)
    return [*values, "yes", None]


def _graded_workbook(data_file: Path, sheet: str | int | None, width: int, added: list[str],
                     graded: dict[int, list[Any]]) -> bytes:
    """The input workbook with the added columns after its ``width`` columns on the graded sheet."""
    from openpyxl import load_workbook

    from qatune.data.tables import choose_sheet

    book = load_workbook(data_file)
    chosen = choose_sheet(data_file, book.sheetnames, sheet)
    worksheet = book.worksheets[chosen] if isinstance(chosen, int) else book[chosen]
    for row, values in [(1, added), *graded.items()]:
        for offset, value in enumerate(values):
            _set_cell(worksheet.cell(row=row, column=width + 1 + offset), value)
    buffer = io.BytesIO()
    book.save(buffer)
    return buffer.getvalue()


def _set_cell(cell: Any, value: Any) -> None:
    from openpyxl.cell.cell import ILLEGAL_CHARACTERS_RE

    cell.value = ILLEGAL_CHARACTERS_RE.sub("", value) if isinstance(value, str) else value
    if isinstance(cell.value, str) and cell.value.startswith("="):
        cell.data_type = "s"  # an answer that looks like a formula stays text


def _answers_path(run_dir: str | Path, data_file: str | Path, output: str | Path | None,
                  keep_format: bool = False) -> Path:
    """Where the answers go, checked before any work: a format we write, and not the questions file.
    ``keep_format``: by default, the format of the questions file (.csv when it is none we write)."""
    suffix = ".csv"
    if keep_format:
        given = Path(data_file).suffix.lower()
        suffix = ".xlsx" if given in (".xlsx", ".xlsm") else given if given in ANSWER_FORMATS else ".csv"
    if output:
        path = Path(output)
    elif Path(run_dir).is_file():  # a .gguf file: beside it, named after it
        path = Path(run_dir).parent / f"answers-{Path(run_dir).stem}-{Path(data_file).stem}{suffix}"
    else:
        path = Path(run_dir) / f"answers-{Path(data_file).stem}{suffix}"
    if path.suffix.lower() not in ANSWER_FORMATS:
        raise DataError(f"--output {path}: cannot write '{path.suffix or '(no suffix)'}' files; end the name with "
                        f"one of {', '.join(ANSWER_FORMATS)}")
    questions = Path(data_file)
    if path.resolve() == questions.resolve() or (path.exists() and questions.exists() and path.samefile(questions)):
        raise DataError(f"--output {path} is the questions file itself; writing the answers there would overwrite "
                        "the questions file; pick another name, e.g. answers" + path.suffix)
    if path.is_dir():
        raise DataError(f"--output {path} is a directory; name a file, e.g. {path / 'answers.csv'}")
    return path


def _input_table(data: DataConfig, data_file: Path, records: list[QARecord]) -> tuple[list[str], list[list[Any]]]:
    """row, question and the input's other columns as they are in the file, one row per record (read once,
    before any answer is generated; the answer column is added after)."""
    from qatune.data.spreadsheet import resolve_column
    from qatune.data.tables import read_table

    header, cells, first_row = read_table(data_file, sheet=data.sheet, encoding=data.encoding,
                                          delimiter=data.delimiter)
    question = resolve_column(header, data.question_column, "question_column", data_file.name)
    others = [i for i in range(len(header)) if i != question]
    names = ["row", "question"]
    for i in others:
        names.append(_free_name(str(header[i]).strip() or f"column {i + 1}", [*names, "answer"]))
    rows = []
    for record in records:
        line = cells[record.row - first_row]
        rows.append([record.row, record.question, *(_plain(line[i] if i < len(line) else None) for i in others)])
    return names, rows


def _free_name(name: str, taken: list[str]) -> str:
    """``name``, or ``name (input)`` when the answers file already has such a column (row, question, answer)."""
    candidate, n = name, 1
    while candidate in taken:
        candidate = f"{name} (input)" if n == 1 else f"{name} (input {n})"
        n += 1
    return candidate


def _plain(value: Any) -> Any:
    """An input cell as the answers file holds it: text, numbers and booleans as they are, blanks empty,
    anything else (dates, lists) as the text training reads."""
    from qatune.data.tables import clean_cell

    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if value is None or isinstance(value, str | bool | int | float):
        return value
    return clean_cell(value)


def _write_table(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    """Write ``rows`` in the format ``path``'s suffix names, atomically (a temporary sibling, then a rename)."""
    suffix = path.suffix.lower()
    if suffix == ".xlsx":
        atomic_write_bytes(path, _xlsx_bytes(header, rows))
        return
    if suffix in (".json", ".jsonl"):
        records = [dict(zip(header, row)) for row in rows]
        if suffix == ".json":
            text = json.dumps(records, ensure_ascii=False, indent=2) + "\n"
        else:
            text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    else:
        buffer = io.StringIO()
        writer = csv.writer(buffer, delimiter="\t" if suffix == ".tsv" else ",")
        writer.writerow(header)
        writer.writerows(rows)
        text = buffer.getvalue()
    atomic_write_text(path, text)


def _xlsx_bytes(header: list[str], rows: list[list[Any]]) -> bytes:
    from openpyxl import Workbook
    from openpyxl.cell.cell import ILLEGAL_CHARACTERS_RE

    book = Workbook()
    sheet = book.active
    sheet.title = "answers"
    for line in [header, *rows]:
        sheet.append([ILLEGAL_CHARACTERS_RE.sub("", v) if isinstance(v, str) else v for v in line])
        for cell in sheet[sheet.max_row]:
            if isinstance(cell.value, str) and cell.value.startswith("="):
                cell.data_type = "s"  # an answer that looks like a formula stays text
    buffer = io.BytesIO()
    book.save(buffer)
    return buffer.getvalue()


def _check_fields(info: ModelInfo, fields: dict[str, str]) -> dict[str, str]:
    """--field values by the names the run's prompt uses (matched ignoring case, spaces and _/-)."""
    template = PromptTemplate(info.prompt_template if info.task == "generative" else "")
    given, unknown, missing = template.match_fields(fields)
    if unknown:
        raise DataError(f"--field {unknown[0]!r}: the run's prompt names no such column; it names "
                        f"{template.fields or 'none'}")
    if missing:
        raise DataError(f"the run's prompt also needs the column(s) {missing}: pass each with --field 'NAME=VALUE', "
                        "or answer a file that has them with --file")
    return given


def _generate_config(base: GenerateConfig, options: dict[str, Any] | None) -> GenerateConfig:
    updates = {k: v for k, v in (options or {}).items() if v is not None}
    try:
        return GenerateConfig.model_validate({**base.model_dump(), **updates})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None


def _read_context(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise DataError(f"context file {path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read context file {path}: {exc}") from None


def _seed(seed: int | None) -> None:
    if seed is not None:
        torch.manual_seed(seed)
