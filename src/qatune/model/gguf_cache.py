"""GGUF files read once: a .gguf model's dequantized weights, tokenizer, config and metadata kept as a plain
transformers folder in qatune's cache, which later commands load in a fraction of a second.

Reading a GGUF file through transformers parses its metadata (a vocabulary element by element) once for the
tokenizer, once for the config and once for the model (with :func:`quick_reader`), and dequantizes every tensor,
for each command. The folder holds exactly what that reading gives (float32
weights), under a key made of the file's path, size and modification time and of the transformers version that
read it: a file changed in place, or another transformers, gets a new folder.

Where: ``$QATUNE_CACHE_DIR/gguf`` (``QATUNE_CACHE_DIR=off`` keeps nothing), else ``$XDG_CACHE_HOME/qatune/gguf``
or ``~/.cache/qatune/gguf``. The :data:`KEEP` folders used last stay; a folder is only kept when its disk has
room for it with :data:`MARGIN` to spare, and when it is at most :data:`LARGEST`. Whatever goes wrong here, the
file is read directly instead.

A packaged model shipped in parts (``gemma3-270m``) has its file written whole once, by its package, into
``packaged/`` beside ``gguf/`` (:func:`assembled`); that file is then converted as any other.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qatune.runs.atomic import DiskFullError, damage, remove_dir, remove_stale_temporaries, write_folder

log = logging.getLogger("qatune")

CACHE_ENV = "QATUNE_CACHE_DIR"
KEEP = 3
"""Converted files kept: those used last."""
MARGIN = 2**30
"""Free space a disk keeps after a converted folder is written there."""
LARGEST = 8 * 2**30
"""The largest converted weights kept (a model of 2B parameters in float32): a larger file is read directly."""
METADATA = "gguf-metadata.json"
"""In a converted folder: the file's metadata as :func:`read_metadata` gives it."""
STALE_S = 3600.0
"""A half-written folder untouched this long was left by a killed process (a conversion takes seconds to minutes)."""
FORMAT = 1
"""Part of the key: a new layout of the converted folders makes new ones."""


_failed: set[Path] = set()
"""Folders this process could not write: not tried again for the next part of the same model."""


class NoRoom(OSError):
    """The cache's disk lacks room for a converted folder (it is then not kept)."""


def cache_root() -> Path | None:
    """qatune's cache folder (None: QATUNE_CACHE_DIR=off, or no home directory)."""
    configured = os.environ.get(CACHE_ENV, "")
    if configured.strip().lower() == "off":
        return None
    if configured:
        return Path(configured).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg:
        return Path(xdg) / "qatune"
    try:
        return Path.home() / ".cache" / "qatune"
    except RuntimeError:  # no home directory to be found: nothing is kept
        return None


def entry_for(file: Path) -> Path | None:
    """The folder that holds (or would hold) ``file`` converted (None: caching is off or the file is gone)."""
    root = cache_root()
    if root is None:
        return None
    import transformers

    try:
        stat = Path(file).stat()
    except OSError:
        return None
    key = json.dumps([str(Path(file).resolve()), stat.st_size, stat.st_mtime_ns, transformers.__version__, FORMAT])
    return root / "gguf" / f"{Path(file).stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def converted(file: Path) -> Path | None:
    """``file``'s converted folder when one is there and intact (a damaged one is removed)."""
    entry = entry_for(file)
    if entry is None or not entry.is_dir():
        return None
    problem = damage(entry)
    if problem is not None:
        log.warning("%s: %s; it is converted again", entry, problem)
        remove_dir(entry)
        return None
    try:
        os.utime(entry)  # used now: kept before the folders used longer ago
    except OSError:
        pass
    return entry


def convert_once(file: Path, fill: Callable[[Path], None]) -> Path | None:
    """``file``'s converted folder, written by ``fill`` (the tokenizer, config and weights, into the folder it is
    given; it raises :class:`NoRoom` when the disk is too full for them) when there is none yet. None when
    caching is off or the folder could not be written: the caller then reads the file itself."""
    found = converted(file)
    if found is not None:
        return found
    entry = entry_for(file)
    if entry is None or entry in _failed:
        return None

    def written(folder: Path) -> None:
        fill(folder)
        (folder / METADATA).write_text(json.dumps(read_metadata(file)), encoding="utf-8")

    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(entry.parent, older_than_s=STALE_S)  # not another process's conversion under way
        write_folder(entry, written, keep_existing=True)
    except (OSError, DiskFullError, ValueError, KeyError, TypeError, RuntimeError, ImportError) as exc:
        _failed.add(entry)  # the tokenizer, config and weights of this command are all read directly
        why = str(exc) if isinstance(exc, NoRoom) else \
            f"it could not be kept in {entry.parent} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        log.info("%s is read directly: %s", Path(file).name, why)
        return None
    log.info("%s converted into %s: later commands read it from there (%s=off keeps nothing)", Path(file).name,
             entry, CACHE_ENV)
    _forget_old(entry.parent)
    return entry


def assembled(package: Path, name: str, assemble: Callable[[Path], None]) -> Path:
    """The file ``name`` that a package writes whole from its parts: ``assemble(path)`` writes it at ``path`` and
    checks it (raising ValueError on a wrong checksum). Written once into ``packaged/<name>-<key>/`` of the cache,
    the key made of the package's ``package`` file (its path, size and time: a reinstalled package writes it
    again, and the file of the one before is removed); with caching off, into a temporary folder this process
    removes when it ends. The file only gets its name once whole and checked."""
    stat = package.stat()
    key = hashlib.sha256(json.dumps([str(package.resolve()), stat.st_size, stat.st_mtime_ns]).encode()).hexdigest()
    root = cache_root()
    if root is None:
        return _assembled_for_this_process(name, key[:16], assemble)
    folder = root / "packaged" / f"{Path(name).stem}-{key[:16]}"
    target = folder / name
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    _write_assembled(target, assemble)
    for old in folder.parent.glob(f"{Path(name).stem}-*"):
        if old != folder and old.is_dir():
            remove_dir(old)
    return target


_temporary: dict[str, Path] = {}
"""With caching off: the files this process assembled, by their key."""


def _assembled_for_this_process(name: str, key: str, assemble: Callable[[Path], None]) -> Path:
    if key not in _temporary or not _temporary[key].is_file():
        folder = Path(tempfile.mkdtemp(prefix=f"qatune-{Path(name).stem}-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _write_assembled(folder / name, assemble)
        _temporary[key] = folder / name
    return _temporary[key]


def _write_assembled(target: Path, assemble: Callable[[Path], None]) -> None:
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    log.info("%s: writing it whole from its package's parts into %s, once", target.name, target.parent)
    try:
        assemble(partial)
        os.replace(partial, target)  # another process's file, written meanwhile, is the same file
    finally:
        partial.unlink(missing_ok=True)


def summary() -> str:
    """Where converted files are kept, how many and their size (qatune env)."""
    root = cache_root()
    if root is None:
        return f"off ({CACHE_ENV}=off)"
    folder = root / "gguf"
    try:
        entries = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")] if folder.is_dir() else []
        size = sum(f.stat().st_size for entry in entries for f in entry.iterdir() if f.is_file())
        whole = [f for f in (root / "packaged").glob("*/*") if f.is_file() and not f.name.startswith(".")]
    except OSError as exc:
        return f"{folder} (unreadable: {exc.strerror or exc})"
    assembled_files = (f"; {len(whole)} assembled in {root / 'packaged'}, "
                       f"{sum(f.stat().st_size for f in whole) / 2**20:.0f} MB" if whole else "")
    return f"{folder} ({len(entries)} converted, {size / 2**20:.0f} MB{assembled_files})"


def check_room(folder: Path, nbytes: int) -> None:
    """Raise :class:`NoRoom` unless the disk of ``folder`` (a folder being written in the cache) holds ``nbytes``
    and :data:`MARGIN` more, and ``nbytes`` is at most :data:`LARGEST`."""
    if nbytes > LARGEST:
        raise NoRoom(f"its converted weights would take {nbytes / 2**30:.1f} GiB, more than the "
                     f"{LARGEST / 2**30:.0f} GiB qatune keeps of one file")
    free = shutil.disk_usage(folder).free
    if free < nbytes + MARGIN:
        raise NoRoom(f"its converted weights need {nbytes / 2**30:.1f} GiB and the disk of {folder.parent} has "
                     f"{free / 2**30:.1f} GiB free")


def _forget_old(folder: Path) -> None:
    entries = sorted((p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for old in entries[KEEP:]:
        remove_dir(old)


def metadata(file: Path) -> dict[str, Any]:
    """``file``'s metadata: from its converted folder when there is one, else read from the file."""
    found = converted(file)
    if found is not None:
        try:
            return json.loads((found / METADATA).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass
    return read_metadata(file)


def read_metadata(file: Path) -> dict[str, Any]:
    """A GGUF file's key/value metadata (strings and numbers; arrays as their length). Raises OSError or
    ValueError for a file that is no GGUF file."""
    import gguf

    reader = quick_reader()(str(file))
    values: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            values[key] = len(field.data)
            continue
        try:
            values[key] = field.contents()
        except (ValueError, IndexError):  # a value type this gguf cannot read: not one qatune needs
            continue
    return values


@functools.cache
def quick_reader() -> type:
    """gguf's ``GGUFReader`` over a plain array view of the file's memory map: the same fields and tensors, read about
    three times faster. The reader slices the map twice for each string of a vocabulary (SmolLM2's 49k tokens and
    as many merges, Gemma 3's 262k tokens), and each slice of a ``numpy.memmap`` costs a Python call of its own."""
    import gguf
    import numpy as np

    class QuickReader(gguf.GGUFReader):
        @property
        def data(self) -> Any:
            return self._array

        @data.setter
        def data(self, value: Any) -> None:
            self._array = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return QuickReader


def read_quickly() -> None:
    """transformers reads a .gguf file (its config, tokenizer and weights, each in turn) with ``gguf.GGUFReader``,
    looked up as it reads: it gets :func:`quick_reader` from now on."""
    import gguf

    gguf.GGUFReader = quick_reader()
