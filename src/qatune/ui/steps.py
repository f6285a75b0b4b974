"""Each step's ``qatune`` command line, and what it left behind, read back for the page: check's report, the
comparison with its rows (flips first), the answered sheet, the exported file with its check and how Ollama asks it,
final/ as a zip (its weights in bf16 by default)."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shlex
import shutil
import zipfile
from pathlib import Path
from typing import Any

from qatune.config import load_config
from qatune.data.spreadsheet import load_from_config, split_validation
from qatune.data.tables import clean_cell, read_table
from qatune.errors import QatuneError
from qatune.runs import atomic, layout
from qatune.ui import PageError
from qatune.ui.jobs import Job
from qatune.ui.workspace import EXPORTS, RUNS, Workspace, run_facts

HELD_OUT = "held-out.csv"
"""The run's held-out rows, written into the run directory for ``eval --compare`` (the rows validation scored)."""
COMPARED_ROWS = 300
"""The rows of a comparison the page lists (flips first); compare-NAME.csv has them all."""
ORDER = {"right->wrong": 0, "wrong->right": 1}
CHECK_LINE = re.compile(r"^check on (\d+) rows of (.+?): (.*)$")
QUANTS = ("f16", "q8_0", "bf16", "f32")
ZIP_DTYPES = ("bf16", "fp32")
"""final/ as a zip: its floating-point weights in bf16 (half the bytes; loaded as config.json's dtype says, so
qatune and transformers compute as before, with weights rounded to bf16), or as trained."""
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
OLLAMA_API = "http://localhost:11434/api/chat"


def digest(path: Path) -> str:
    """What a check is of: the config's text as it was when the check ran."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_args(config: str) -> list[str]:
    return ["check", "--config", config, "--json"]


def check_result(job: Job) -> dict[str, Any] | None:
    """check's report (``{"ok": false, "error": ...}`` for a problem that stopped it), once it ended."""
    if job.state == "running":
        return None
    try:
        report = json.loads(job.output_text())
    except ValueError:
        return {"ok": False, "error": job.error_line() or "qatune check printed no report"}
    return report if isinstance(report, dict) else {"ok": False, "error": "qatune check printed no report"}


def train_args(config: str | None, run: str | None, overwrite: bool) -> list[str]:
    """``train --config X`` (``--overwrite``: replacing its run), or ``train --resume RUN`` (its own saved config) to
    continue a stopped run."""
    if run is not None:
        return ["train", "--resume", run]
    return ["train", "--config", config, *(["--overwrite"] if overwrite else [])]


def config_run(workspace: Workspace, config: str) -> str:
    """The run directory a config trains into (its output_dir), relative to the workspace."""
    output = load_config(workspace.path(config)).output_dir
    path = workspace.path(output)
    if path.parent != workspace.root / RUNS:
        raise PageError(f"{config}: output_dir {output!r} is not a folder of the workspace's {RUNS}/; the page "
                        f"trains into {RUNS}/NAME")
    return f"{RUNS}/{path.name}"


def compare_args(workspace: Workspace, run: str, other: str, sheet: str | None) -> tuple[list[str], str]:
    """``eval RUN --data FILE --compare OTHER --json``, on an uploaded sheet or the run's held-out rows (the file
    the run's own data.eval_file names, or its validation rows written to RUN/held-out.csv); and the file."""
    run_dir = workspace.run(run.removeprefix(f"{RUNS}/"))
    reading: list[str] = []
    if other == "base" and not (facts := run_facts(run_dir))["base"]["ok"]:
        raise PageError(f"{run}: {facts['base']['why']}", 409)
    if sheet is not None:
        data = f"sheets/{sheet}"
        workspace.sheet(sheet)
    else:
        data, reading = held_out_rows(workspace, run_dir)
    if other != "base":
        other = f"{RUNS}/{workspace.run(other.removeprefix(f'{RUNS}/')).name}"
    return ["eval", run, "--data", data, "--compare", other, *reading, "--json"], data


def held_out_rows(workspace: Workspace, run_dir: Path) -> tuple[str, list[str]]:
    """The rows the run held out, as a file ``eval`` reads with the run's config, and the ``--set`` it needs."""
    config = load_config(run_dir / layout.CONFIG)
    data = config.data
    if data.eval_file:
        return workspace.relative(workspace.existing(data.eval_file, "held-out file")), []
    if data.validation_fraction <= 0:
        raise PageError(f"{workspace.relative(run_dir)} holds no rows out (data.validation_fraction is 0): choose a "
                        "sheet with the same columns to compare on")
    train_file = workspace.existing(data.train_file, "training sheet")
    records, _ = load_from_config(data, train_file)
    _, held_out = split_validation(records, data.validation_fraction, config.seed)
    header, rows, first_row = read_table(train_file, sheet=data.sheet, encoding=data.encoding,
                                         delimiter=data.delimiter)
    path = run_dir / HELD_OUT
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for record in held_out:
            writer.writerow([clean_cell(cell) or "" for cell in rows[record.row - first_row]])
    # Written as UTF-8 CSV, which the run's own reading settings may not describe.
    reading = [f"data.{key}={value}" for key, value in (("delimiter", ","), ("encoding", "utf-8"))
               if getattr(data, key) not in (None, value)]
    return workspace.relative(path), [arg for item in reading for arg in ("--set", item)]


def compare_result(workspace: Workspace, job: Job) -> dict[str, Any] | None:
    """eval --compare's metrics and summary, and the rows from compare-NAME.csv, those that changed first."""
    if job.state != "done":
        return None
    try:
        result = json.loads(job.output_text())
        compared = result["compare"]
    except (ValueError, KeyError, TypeError):
        return None
    rows = []
    try:
        with open(workspace.path(compared["files"]["csv"]), encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, PageError):
        pass
    rows.sort(key=lambda row: ORDER.get(row.get("change", ""), 2))
    return {"metrics": {k: v for k, v in result.items() if k != "compare"}, "compare": compared,
            "rows": rows[:COMPARED_ROWS], "rows_total": len(rows)}


def answer_args(run: str, sheet: str) -> list[str]:
    """``generate RUN --file SHEET``: RUN/answers-NAME.csv, or a grading run's graded sheet in the file's format."""
    return ["generate", run, "--file", f"sheets/{sheet}"]


def answer_result(workspace: Workspace, job: Job) -> str | None:
    """The answered sheet's path in the workspace (generate --file prints it)."""
    if job.state != "done":
        return None
    lines = job.output_text().strip().splitlines()
    return workspace.relative(workspace.path(lines[-1])) if lines else None


def export_args(workspace: Workspace, run: str, quant: str) -> tuple[list[str], str]:
    if quant not in QUANTS:
        raise PageError(f"quant {quant!r}: choose one of {', '.join(QUANTS)}")
    name = workspace.free_name(EXPORTS, f"{Path(run).name}-{quant}.gguf")
    workspace.folder(EXPORTS)
    return ["export", run, "--gguf", f"{EXPORTS}/{name}", "--quant", quant], f"{EXPORTS}/{name}"


def export_result(workspace: Workspace, job: Job) -> dict[str, Any] | None:
    """The GGUF file, its Modelfile, the line of export's check, and how Ollama asks the model (ollama_usage)."""
    if job.state == "running":
        return None
    check = next((m for line in job.log_lines(200) if (m := CHECK_LINE.match(line))), None)
    found = {"check": None if check is None else {"rows": int(check.group(1)), "rows_from": check.group(2),
                                                  "line": check.group(3)}}
    if job.state == "done":
        gguf = job.extra["gguf"]
        modelfile = str(Path(gguf).with_suffix(".Modelfile"))
        if "ollama" not in job.extra:  # read once: every tab's state carries it
            job.extra["ollama"] = ollama_usage(workspace, job.target, modelfile)
        found.update(gguf=gguf, modelfile=modelfile, ollama=job.extra["ollama"])
    return found


def ollama_usage(workspace: Workspace, run: str, modelfile: str) -> dict[str, Any]:
    """How to ask the exported model in Ollama, with a held-out row of the run as the example. The Modelfile's
    TEMPLATE puts the passage where qatune's prompt has it, and reads it from the conversation's system messages
    (export/gguf_prompt.py): a run whose prompt reads a passage is asked through the API, the passage as the system
    message, the question as the user's; any other with ``ollama run NAME "question"``."""
    name = re.sub(r"[^a-z0-9._-]+", "-", Path(modelfile).stem.casefold()).strip("-.") or "qatune"
    try:
        passage = "{{ .System }}" in workspace.path(modelfile).read_text(encoding="utf-8")
    except (OSError, PageError):
        passage = False
    question, context = example_row(workspace, run)
    usage: dict[str, Any] = {"name": name, "passage": passage,
                             "create": f"ollama create {name} -f {Path(modelfile).name}"}
    if not passage:
        usage["ask"] = shlex.join(["ollama", "run", name, question or "your question"])
        return usage
    body = {"model": name, "stream": False,
            "messages": [{"role": "system", "content": context or "the passage that holds the answer"},
                         {"role": "user", "content": question or "your question"}]}
    usage["ask"] = f"curl {OLLAMA_API} -d {shlex.quote(json.dumps(body, ensure_ascii=False))}"
    return usage


def example_row(workspace: Workspace, run: str) -> tuple[str | None, str | None]:
    """A question (and its passage) the run did not train on: the held-out row with the shortest passage, else the
    first row of its sheet; (None, None) where the sheet cannot be read."""
    try:
        run_dir = workspace.run(run.removeprefix(f"{RUNS}/"))
        config = load_config(run_dir / layout.CONFIG)
        data = config.data
        path = workspace.existing(data.eval_file or data.train_file, "sheet")
        records, _ = load_from_config(data, path)
        if not data.eval_file and data.validation_fraction > 0:
            records = split_validation(records, data.validation_fraction, config.seed)[1] or records
    except (QatuneError, OSError, ValueError):
        return None, None
    if not records:
        return None, None
    record = min(records, key=lambda r: len(r.context or ""))
    return record.question, record.context


def final_sizes(run_dir: Path) -> dict[str, int]:
    """The bytes of final/'s files with its weights as trained, and with its floating-point weights in bf16 (read
    from the safetensors headers)."""
    final = _final(run_dir)
    sizes = {dtype: 0 for dtype in ZIP_DTYPES}
    for path in final.rglob("*"):
        if not path.is_file():
            continue
        size = path.stat().st_size
        sizes["fp32"] += size
        sizes["bf16"] += size - _bf16_saving(path) if path.suffix == ".safetensors" else size
    return sizes


def _bf16_saving(path: Path) -> int:
    """The bytes a safetensors file loses with its F32/F64 tensors in bf16."""
    try:
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    except (OSError, ValueError):
        return 0
    saving = 0
    for name, entry in header.items():
        if name != "__metadata__" and entry.get("dtype") in ("F32", "F64"):
            start, end = entry["data_offsets"]
            saving += (end - start) - (end - start) // SAFETENSORS_BYTES[entry["dtype"]] * 2
    return saving


def zip_final(run_dir: Path, destination: Path, dtype: str = "bf16") -> Path:
    """RUN/final/ as one zip file (stored, not compressed: safetensors weights do not shrink), its files under
    ``final/``. ``dtype`` bf16: its F32/F64 weights as bf16, its manifest written anew; the folder loads with
    qatune (generate, serve, eval) and transformers as final/ does."""
    final = _final(run_dir)
    folder = final
    if dtype == "bf16":
        folder = destination.with_name(destination.name + ".final")
        _bf16_copy(final, folder)
    partial = destination.with_name(destination.name + ".part")
    try:
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
            for path in sorted(folder.rglob("*")):
                if path.is_file():
                    archive.write(path, Path(layout.FINAL) / path.relative_to(folder))
        partial.replace(destination)
    finally:
        partial.unlink(missing_ok=True)
        if folder != final:
            shutil.rmtree(folder, ignore_errors=True)
    return destination


def _final(run_dir: Path) -> Path:
    final = run_dir / layout.FINAL
    if not final.is_dir():
        raise PageError(f"{run_dir.name} has no final/ model yet: train it to the end (or resume it) first", 404)
    return final


def _bf16_copy(final: Path, folder: Path) -> None:
    """final/ into ``folder``: safetensors files with their F32/F64 tensors as bf16 (metadata kept), other files
    linked (or copied), and a manifest of what the folder now holds, as atomic.write_folder writes one."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    for path in sorted(final.rglob("*")):
        target = folder / path.relative_to(final)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif path.suffix == ".safetensors":
            with safe_open(path, framework="pt") as opened:
                metadata = opened.metadata()
                tensors = {name: opened.get_tensor(name) for name in opened.keys()}
            tensors = {name: t.to(torch.bfloat16) if t.dtype in (torch.float32, torch.float64) else t
                       for name, t in tensors.items()}
            save_file(tensors, target, metadata=metadata)
        elif path.name != atomic.MANIFEST:
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
    if (final / atomic.MANIFEST).is_file():
        atomic.write_manifest(folder)
