"""One question asked of a trained run: ``qatune generate RUN "question"``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qatune.data.templates import PromptTemplate
from qatune.errors import DataError
from qatune.inference.generate import generate_config, seed_sampling, uses_context
from qatune.inference.grounding import grounded
from qatune.inference.run_model import load_run_model, read_run
from qatune.kinds import answer_questions
from qatune.model.folder import ModelInfo
from qatune.tasks import task_kind


def answer_one(run_dir: str | Path, question: str, context: str | None = None, context_file: str | None = None,
               which: str = "final", options: dict[str, Any] | None = None, seed: int | None = None,
               fields: dict[str, str] | None = None) -> str:
    """The answer of a trained run to one question (the ``qatune generate RUN "question"`` command).

    ``fields``: values of the other columns the run's prompt names (``--field 'Total Marks=3'``)."""
    if context_file is not None:
        context = _read_context(context_file)
    config, info = read_run(run_dir, which)  # what the prompt needs, before the model loads
    _check_context(info, context)
    given = _check_fields(info, fields or {})
    grounded(info, generate_config(config.generate, options))  # --grounded on where it cannot be
    loaded = load_run_model(run_dir, which)
    seed_sampling(seed)
    generate = generate_config(loaded.config.generate, options)
    return answer_questions(loaded.model, loaded.tokenizer, loaded.info, [question.strip()], [context], generate,
                            fields=[given])[0]


def _check_context(info: ModelInfo, context: str | None) -> None:
    """A run that reads a passage gets one; a run that does not refuses one rather than ignoring it."""
    if not uses_context(info):
        if context is not None:
            raise DataError("this run's prompt has no {context}: it answers from the question alone; "
                            "leave out --context/--context-file")
        return
    if context and context.strip():
        return
    if task_kind(info.task).points:
        raise DataError("this run does extractive QA: pass the passage with --context TEXT or --context-file FILE")
    raise DataError("this run's prompt uses a context ({context}): pass the passage with --context TEXT or "
                    "--context-file FILE")


def _check_fields(info: ModelInfo, fields: dict[str, str]) -> dict[str, str]:
    """--field values by the names the run's prompt uses (matched ignoring case, spaces and _/-)."""
    template = PromptTemplate(info.prompt_template if not task_kind(info.task).points else "")
    given, unknown, missing = template.match_fields(fields)
    if unknown:
        raise DataError(f"--field {unknown[0]!r}: the run's prompt names no such column; it names "
                        f"{template.fields or 'none'}")
    if missing:
        raise DataError(f"the run's prompt also needs the column(s) {missing}: pass each with --field 'NAME=VALUE', "
                        "or answer a file that has them with --file")
    return given


def _read_context(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise DataError(f"context file {path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read context file {path}: {exc}") from None
