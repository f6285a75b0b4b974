"""Each step's ``qatune`` command line, and what it left behind, read back for the page: check's report, the
comparison with its rows (flips first), the answered sheet, the exported file and its check, final/ as a zip."""

from __future__ import annotations

import csv
import hashlib
import json
import re
import zipfile
from pathlib import Path
from typing import Any

from qatune.config import load_config
from qatune.data.spreadsheet import load_from_config, split_validation
from qatune.data.tables import clean_cell, read_table
from qatune.runs import layout
from qatune.ui import PageError
from qatune.ui.jobs import Job
from qatune.ui.workspace import EXPORTS, RUNS, Workspace

HELD_OUT = "held-out.csv"
"""The run's held-out rows, written into the run directory for ``eval --compare`` (the rows validation scored)."""
COMPARED_ROWS = 300
"""The rows of a comparison the page lists (flips first); compare-NAME.csv has them all."""
ORDER = {"right->wrong": 0, "wrong->right": 1}
CHECK_LINE = re.compile(r"^check on (\d+) rows of (.+?): (.*)$")
QUANTS = ("f16", "q8_0", "bf16", "f32")


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


def export_result(job: Job) -> dict[str, Any] | None:
    """The GGUF file, its Modelfile and the line of export's check."""
    if job.state == "running":
        return None
    check = next((m for line in job.log_lines(200) if (m := CHECK_LINE.match(line))), None)
    found = {"check": None if check is None else {"rows": int(check.group(1)), "rows_from": check.group(2),
                                                  "line": check.group(3)}}
    if job.state == "done":
        gguf = job.extra["gguf"]
        found.update(gguf=gguf, modelfile=str(Path(gguf).with_suffix(".Modelfile")))
    return found


def zip_final(run_dir: Path, destination: Path) -> Path:
    """RUN/final/ as one zip file (stored, not compressed: safetensors weights do not shrink), its files under
    ``final/``."""
    final = run_dir / layout.FINAL
    if not final.is_dir():
        raise PageError(f"{run_dir.name} has no final/ model yet: train it to the end (or resume it) first", 404)
    partial = destination.with_name(destination.name + ".part")
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for path in sorted(final.rglob("*")):
            if path.is_file():
                archive.write(path, Path(layout.FINAL) / path.relative_to(final))
    partial.replace(destination)
    return destination
