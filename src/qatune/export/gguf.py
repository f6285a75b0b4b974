"""``qatune export RUN --gguf OUT.gguf``: a causal LM run as one GGUF file for llama.cpp, Ollama and LM Studio,
an Ollama Modelfile beside it, and proof that the file answers as the run does.

LoRA adapters are merged first (the run's model folder is loaded as for inference). The file is written
(:mod:`qatune.export.gguf_write`) into a folder of its own, checked (:mod:`qatune.export.gguf_check`), and only
then put in place with its Modelfile (:mod:`qatune.export.gguf_prompt`). The file carries the run's prompt twice:
as a chat template that renders exactly the prompt qatune trained with (the question as the user message, the
context as the system message), and under qatune's own keys (:mod:`qatune.model.gguf_file`), so that ``qatune
eval`` and ``generate`` prompt it as they prompt the run.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from qatune.config.columns import PLACEHOLDER, column_key
from qatune.data.generative import PromptEncoder
from qatune.data.templates import PromptTemplate
from qatune.export import ExportError
from qatune.export.gguf_check import ANSWER_ROWS, CHECK_ROWS, Check, check_file, check_records, failure_message
from qatune.export.gguf_prompt import modelfile, unwritable_characters
from qatune.export.gguf_write import QUANTS, tokenizer_refusal, write_gguf
from qatune.kinds import kind_of
from qatune.model.families import family_of, gguf_refusal, rope_parameters
from qatune.model.folder import LoadedModel, ModelInfo, load_model_folder
from qatune.runs import layout
from qatune.runs.atomic import atomic_write_text
from qatune.runs.lock import RunLock

__all__ = ["Check", "ExportError", "export_gguf", "unsupported"]


def export_gguf(run_dir: str | Path, output: str | Path, quant: str = "f16", which: str = layout.FINAL,
                data_file: str | Path | None = None, reading: list[str] | tuple[str, ...] = (),
                rows: int = CHECK_ROWS, answer_rows: int = ANSWER_ROWS) -> tuple[Path, Check]:
    """Write the run's model as ``output`` (a .gguf file) and ``<output stem>.Modelfile`` beside it, once the
    file has been read back and found to answer as the run does; returns the file and the check.

    The check asks ``rows`` rows (their prompts and next tokens; greedy answers on the first ``answer_rows``) of
    ``data_file`` (read as ``reading`` says, like qatune eval's --set), else of the run's data.eval_file, else of
    its validation rows, else of its first training rows."""
    output = Path(output)
    if output.suffix.lower() != ".gguf":
        raise ExportError(f"--gguf {output}: the file name must end in .gguf")
    if quant not in QUANTS:
        raise ExportError(f"--quant {quant}: choose one of {', '.join(QUANTS)}")
    with RunLock(output, "export file"):
        if output.exists():
            raise ExportError(f"{output} already exists; choose another file name or remove it first")
        loaded = load_model_folder(run_dir, which, device="cpu")
        refusal = unsupported(loaded)
        if refusal:
            raise ExportError(f"cannot export {run_dir} as GGUF: {refusal}; qatune export {run_dir} --merge FOLDER "
                              "writes it as a plain transformers folder instead")
        records, rows_from = check_records(loaded, data_file, reading, rows)
        output.parent.mkdir(parents=True, exist_ok=True)
        # Read back from a folder of its own: transformers' GGUF loader also reads tokenizer files beside it.
        work = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
        try:
            written = work / output.name
            write_gguf(loaded, written, quant)
            check = check_file(loaded, written, quant, records, rows_from, answer_rows)
            run = layout.results_dir(Path(run_dir), loaded.folder)
            if (run / layout.STATUS).is_file():  # the run directory, never a model folder (its manifest)
                atomic_write_text(run / f"export-{output.stem}.json",
                                  json.dumps({"file": str(output), **check.to_dict()}, indent=2) + "\n")
            if not check.passed():
                raise ExportError(failure_message(check))
            os.replace(written, output)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        atomic_write_text(output.with_suffix(".Modelfile"), modelfile(loaded, output.name))
    return output, check


def unsupported(loaded: LoadedModel) -> str | None:
    """Why the loaded run cannot be written as GGUF (None: it can)."""
    info, model = loaded.info, loaded.model
    refusal = kind_of(info.task).gguf_refusal(info)
    if refusal:
        return refusal
    refusal = gguf_refusal(model.config)
    if refusal:
        return refusal
    refusal = tokenizer_refusal(loaded.tokenizer)
    if refusal:
        return refusal
    extra = prompt_columns(info)
    if extra:
        return (f"its prompt reads the column(s) {', '.join(repr(c) for c in extra)} besides the question and the "
                "context; a chat template has only the question (the user message) and the context (the system "
                "message)")
    encoder = PromptEncoder(loaded.tokenizer, PromptTemplate(info.prompt_template, info.answer_prefix))
    unwritable = unwritable_characters(info.prompt_template + info.answer_prefix
                                       + loaded.tokenizer.decode([encoder.end_id]))
    if unwritable:
        return (f"its prompt holds the control character(s) {', '.join(unwritable)}, which a chat template cannot "
                "carry to llama.cpp and other engines (only tabs and line breaks can be written)")
    rope = rope_parameters(model.config).get("rope_type") or "default"
    written = family_of(model.config).gguf.rope_types
    if rope not in written:
        return f"its rope scaling ({rope}) is not one qatune writes for its family ({', '.join(written)})"
    return None


def prompt_columns(info: ModelInfo) -> list[str]:
    """The placeholders of the run's prompt other than the question and the context."""
    names = [m.group(1) for m in PLACEHOLDER.finditer(info.prompt_template) if m.group(1) is not None]
    return [name for name in dict.fromkeys(names) if column_key(name) not in ("question", "context")]
