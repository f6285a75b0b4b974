"""The folder the page works in. Every path the page names is checked here to lie inside it (symbolic links
followed), so nothing the page sends reads or writes a file anywhere else.

    WORKSPACE/
      NAME.yaml          the configs the Sheet step writes
      sheets/            uploaded sheets
      runs/              run directories, as qatune train writes them
      exports/           GGUF files and their Modelfiles
      .qatune-ui/        the logs and output of the commands the page ran
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from qatune.runs.layout import CONFIG, FINAL, looks_like_run, read_status
from qatune.tasks import TASK_KINDS, task_kind
from qatune.ui import PageError

SHEETS, RUNS, EXPORTS, LOGS = "sheets", "runs", "exports", ".qatune-ui"
UPLOAD_SUFFIXES = (".csv", ".tsv", ".xlsx", ".xlsm", ".json", ".jsonl", ".ndjson", ".parquet")
"""What the Sheet step takes: the formats qatune reads (data/tables.py), less .txt."""


@dataclass(frozen=True)
class Saved:
    """An uploaded sheet as it lies in sheets/: ``name``; ``reused``: the same bytes were there already (under that
    name), so nothing was written; ``renamed``: another file held the uploaded name, so it got a name of its own."""

    name: str
    reused: bool = False
    renamed: bool = False


class Workspace:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PageError(f"cannot use {root} as the workspace: {exc.strerror}; pass another --workspace") from None
        if not self.root.is_dir():
            raise PageError(f"--workspace {root} is a file; pass a folder")

    def path(self, relative: str) -> Path:
        """``relative``, a path as the page names it (relative to the workspace), as a path inside the workspace."""
        given = PurePosixPath(str(relative).replace("\\", "/"))
        if not str(relative).strip() or "\x00" in str(relative) or given.is_absolute() or ".." in given.parts:
            raise PageError(f"{relative!r} is not a path inside the workspace; name a file under {self.root}")
        path = (self.root / given).resolve()
        if not path.is_relative_to(self.root):
            raise PageError(f"{relative!r} leads outside the workspace {self.root} (a link?); the page reads and "
                            "writes only inside it")
        return path

    def relative(self, path: Path) -> str:
        return path.resolve().relative_to(self.root).as_posix()

    def existing(self, relative: str, what: str) -> Path:
        path = self.path(relative)
        if not path.exists():
            raise PageError(f"no {what} {relative!r} in the workspace {self.root}", 404)
        return path

    def sheet(self, name: str) -> Path:
        path = self.existing(f"{SHEETS}/{name}", "sheet")
        if not path.is_file():
            raise PageError(f"{SHEETS}/{name} is not a file", 404)
        return path

    def run(self, name: str) -> Path:
        path = self.existing(f"{RUNS}/{name}", "run")
        if not path.is_dir():
            raise PageError(f"{RUNS}/{name} is not a run directory", 404)
        return path

    def folder(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def free_name(self, folder: str, name: str) -> str:
        """``name``, or ``stem-2.suffix``, ``stem-3.suffix``, ... where the folder already holds it."""
        return next(candidate for candidate in _numbered(name) if not (self.root / folder / candidate).exists())

    async def save_upload(self, filename: str, chunks: AsyncIterator[bytes], limit: int) -> Saved:
        """Write an uploaded sheet to sheets/, at most ``limit`` bytes. The same file uploaded again (the same bytes
        under its name, or under the name it was given before, ``stem-2.suffix``) is the file already there; a
        different file under a name in use gets the first free ``stem-N.suffix``."""
        wanted = upload_name(filename)
        folder = self.folder(SHEETS)
        partial = folder / f".{wanted}.part"
        digest, size = hashlib.sha256(), 0
        try:
            with open(partial, "wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise PageError(f"{filename} is larger than the upload limit of {limit / 2**20:.0f} MB; "
                                        "start qatune ui with a larger --max-upload-mb", 413)
                    digest.update(chunk)
                    out.write(chunk)
            if size == 0:
                raise PageError(f"{filename} is empty; it needs a header row and at least one data row")
            for candidate in _numbered(wanted):
                path = folder / candidate
                if not path.exists():
                    partial.rename(path)
                    return Saved(candidate, renamed=candidate != wanted)
                if path.is_file() and path.stat().st_size == size and _sha256(path) == digest.hexdigest():
                    return Saved(candidate, reused=True, renamed=candidate != wanted)
            raise AssertionError("unreachable: _numbered never ends")
        finally:
            partial.unlink(missing_ok=True)

    def remove_sheet(self, name: str) -> None:
        """An upload that cannot be read: not kept, so that no later list offers it."""
        self.sheet(name).unlink(missing_ok=True)

    def sheets(self) -> list[str]:
        folder = self.root / SHEETS
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in UPLOAD_SUFFIXES)

    def runs(self) -> list[dict[str, Any]]:
        """The run directories under runs/, newest first, each with its status from run.json and what its saved
        config says the later steps can do with it (run_facts)."""
        folder = self.root / RUNS
        if not folder.is_dir():
            return []
        found = [p for p in folder.iterdir() if p.is_dir() and looks_like_run(p)]
        found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        return [{"name": p.name, "status": read_status(p).get("status"), "final": (p / FINAL).is_dir(),
                 **run_facts(p)} for p in found]


def run_facts(run_dir: Path) -> dict[str, Any]:
    """What a run's saved config says the later steps can do with it: its task and model, what its answer is
    (written, a span, heads: a GGUF file holds a model that writes), whether it held rows out (Compare's rows),
    whether its prompt reads a passage, and whether it has a base to compare with (and why not, or what it is)."""
    try:
        raw = yaml.safe_load((run_dir / CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        raw = None
    task = raw.get("task", "generative") if isinstance(raw, dict) else read_status(run_dir).get("task")
    if not isinstance(raw, dict) or task not in TASK_KINDS:
        return {"task": task, "answer": None, "model": None, "held_out": False, "context": False,
                "base": {"ok": False, "why": f"{run_dir.name} has no readable {CONFIG} yet", "untrained_head": False}}
    kind = task_kind(task)
    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    name = model.get("name_or_path")
    fraction = data.get("validation_fraction")
    if kind.base_answers == "none":
        why = (f"a {kind.label} run's heads are built for its answer columns when it trains: there is no model before "
               "fine-tuning to ask; compare it with another run")
    elif not name:
        why = ("a model from scratch knew nothing before training: there is no base to compare with; compare it with "
               "another run")
    else:
        why = None
    return {"task": task, "answer": kind.answer,
            "model": name or ("a model from scratch" if model.get("scratch") else None),
            "held_out": bool(data.get("eval_file")) or (isinstance(fraction, (int, float)) and fraction > 0),
            "context": bool(data.get("context_column")),
            "base": {"ok": why is None, "why": why, "untrained_head": kind.base_answers == "untrained head"}}


def _numbered(name: str) -> Any:
    """``name``, ``stem-2.suffix``, ``stem-3.suffix``, ..."""
    stem, suffix = (name.rsplit(".", 1)[0], "." + name.rsplit(".", 1)[1]) if "." in name else (name, "")
    yield name
    number = 2
    while True:
        yield f"{stem}-{number}{suffix}"
        number += 1


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def upload_name(filename: str) -> str:
    """The name an uploaded file is saved under: its last path part, letters, digits, ``._-`` and spaces kept."""
    base = re.split(r"[\\/]", filename or "")[-1]
    name = re.sub(r"[^\w.\- ]+", "_", base).strip(" .")
    suffix = Path(name).suffix.lower()
    if suffix not in UPLOAD_SUFFIXES:
        raise PageError(f"{base or 'the file'}: the page takes {', '.join(UPLOAD_SUFFIXES)} files; save the sheet "
                        "as one of them" + (" (.xls: open it and save it as .xlsx)" if suffix == ".xls" else ""))
    return name[: -len(suffix)] + suffix
