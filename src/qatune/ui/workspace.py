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

import re
from collections.abc import AsyncIterator
from pathlib import Path, PurePosixPath
from typing import Any

from qatune.runs.layout import looks_like_run, read_status
from qatune.ui import PageError

SHEETS, RUNS, EXPORTS, LOGS = "sheets", "runs", "exports", ".qatune-ui"
UPLOAD_SUFFIXES = (".csv", ".tsv", ".xlsx", ".xlsm", ".json", ".jsonl", ".ndjson", ".parquet")
"""What the Sheet step takes: the formats qatune reads (data/tables.py), less .txt."""


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
        stem, suffix = (name.rsplit(".", 1)[0], "." + name.rsplit(".", 1)[1]) if "." in name else (name, "")
        candidate, number = name, 1
        while (self.root / folder / candidate).exists():
            number += 1
            candidate = f"{stem}-{number}{suffix}"
        return candidate

    async def save_upload(self, filename: str, chunks: AsyncIterator[bytes], limit: int) -> str:
        """Write an uploaded sheet to sheets/ (a free name made from ``filename``), at most ``limit`` bytes;
        returns its name there."""
        name = self.free_name(SHEETS, upload_name(filename))
        folder = self.folder(SHEETS)
        partial = folder / f".{name}.part"
        size = 0
        try:
            with open(partial, "wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > limit:
                        raise PageError(f"{filename} is larger than the upload limit of {limit / 2**20:.0f} MB; "
                                        "start qatune ui with a larger --max-upload-mb", 413)
                    out.write(chunk)
            if size == 0:
                raise PageError(f"{filename} is empty; it needs a header row and at least one data row")
            partial.rename(folder / name)
        finally:
            partial.unlink(missing_ok=True)
        return name

    def sheets(self) -> list[str]:
        folder = self.root / SHEETS
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix.lower() in UPLOAD_SUFFIXES)

    def runs(self) -> list[dict[str, Any]]:
        """The run directories under runs/, newest first, each with its status from run.json."""
        folder = self.root / RUNS
        if not folder.is_dir():
            return []
        found = [p for p in folder.iterdir() if p.is_dir() and looks_like_run(p)]
        found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        return [{"name": p.name, "status": read_status(p).get("status"), "task": read_status(p).get("task"),
                 "final": (p / "final").is_dir()} for p in found]


def upload_name(filename: str) -> str:
    """The name an uploaded file is saved under: its last path part, letters, digits, ``._-`` and spaces kept."""
    base = re.split(r"[\\/]", filename or "")[-1]
    name = re.sub(r"[^\w.\- ]+", "_", base).strip(" .")
    suffix = Path(name).suffix.lower()
    if suffix not in UPLOAD_SUFFIXES:
        raise PageError(f"{base or 'the file'}: the page takes {', '.join(UPLOAD_SUFFIXES)} files; save the sheet "
                        "as one of them" + (" (.xls: open it and save it as .xlsx)" if suffix == ".xls" else ""))
    return name[: -len(suffix)] + suffix
