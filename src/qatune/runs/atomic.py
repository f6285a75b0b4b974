"""Writes that a crash cannot leave half done.

"Atomic" here means: a reader never sees a half-written file or folder, only the old one or the new one
(each is written to a hidden temporary sibling, fsynced and renamed into place); a full disk ends in
:class:`DiskFullError` with nothing left behind; and every folder written here carries a manifest, so that damage
done later (truncated, missing or edited files) is found before loading.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qatune.errors import RunDirError

MANIFEST = "qatune-manifest.json"
"""Inside every folder written by :func:`write_folder`: each file's size (and sha256 up to HASH_LIMIT)."""
HASH_LIMIT = 64 * 2**20
"""Files up to this size are hashed in the manifest; larger ones (weights, optimizer state) are checked by
size and, for safetensors, by their header."""


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file through a temporary sibling and a rename: readers see the old or the new text."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """atomic_write_text for bytes (an .xlsx, say)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            raise DiskFullError(path.parent, path.name, len(data)) from None
        raise


def write_folder(folder: Path, fill: Callable[[Path], None], size_hint: int = 0, keep_existing: bool = False) -> Path:
    """Create ``folder`` atomically: ``fill`` writes into a hidden temporary sibling, which gets a
    manifest, is fsynced and renamed over ``folder`` (the old one stays until the new one is in place).
    ``keep_existing``: a ``folder`` that another process put in place meanwhile stays, and this one is dropped.

    A full disk ends in :class:`DiskFullError` (``size_hint``: the bytes the folder needs, for its
    message) with nothing left behind.
    """
    folder = Path(folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-tmp-", dir=folder.parent))
    try:
        fill(tmp)
        open_as_umask(tmp)
        write_manifest(tmp)
        fsync_tree(tmp)
        if keep_existing:
            _rename_unless_there(tmp, folder)
        else:
            replace_dir(tmp, folder)
    except BaseException as exc:
        written = _tree_size(tmp)
        full = isinstance(exc, Exception) and _disk_full(exc, folder.parent, size_hint - written)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DiskFullError(folder.parent, folder.name + "/", max(size_hint, written)) from None
        raise
    return folder


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def open_as_umask(folder: Path) -> None:
    """Give a finished folder the permissions a plain ``mkdir``/``open`` would have: the temporary folder
    (``mkdtemp``) and some writers' files are private (0700/0600), which hid models from other users and
    from containers running under another uid."""
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def _umask() -> int:
    """The process's umask (read from /proc where it can be: setting it to read it is not thread-safe)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class DiskFullError(RunDirError):
    """The disk filled up while qatune wrote a file or folder; nothing half-written was left behind."""

    def __init__(self, where: Path, name: str, needed: int):
        try:
            free = shutil.disk_usage(where).free
        except OSError:
            free = 0
        self.where, self.name, self.needed = Path(where), name, needed
        super().__init__(f"no space left on the disk of {where} while writing {name} (it needs about "
                         f"{_megabytes(needed)}, {_megabytes(free)} free); free some space there and run the "
                         "command again (a training run continues from its last checkpoint with --resume)")


def _megabytes(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def _disk_full(exc: BaseException, where: Path, still_needed: int) -> bool:
    """Whether a failed write ran out of space. Libraries wrap the OSError in errors of their own (torch.save:
    'unexpected pos ...'), so a write that failed on a disk with less room left than it still needed
    (and under 1 MB) counts too."""
    if _disk_full_inside(exc):
        return True
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return False
    return free < max(2**20, still_needed)


def _disk_full_inside(exc: BaseException) -> bool:
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _tree_size(folder: Path) -> int:
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:
        return 0


def folder_id(folder: Path) -> str | None:
    """A short digest of a folder's manifest: it changes whenever the folder is written anew (None: no manifest)."""
    try:
        return hashlib.sha256((Path(folder) / MANIFEST).read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def write_manifest(folder: Path) -> None:
    """Record every file's size (and sha256 when small) so that damage is found before loading."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        size = path.stat().st_size
        entry: dict[str, Any] = {"size": size}
        if size <= HASH_LIMIT:
            entry["sha256"] = _sha256(path)
        files[path.relative_to(folder).as_posix()] = entry
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n", encoding="utf-8")


def damage(folder: Path) -> str | None:
    """What is wrong with a folder written by :func:`write_folder` (None when it is intact).

    Checks the manifest (missing, truncated or edited files) and the header of every safetensors
    file. A folder without a manifest (written by older qatune) gets the header checks only.
    """
    folder = Path(folder)
    manifest = folder / MANIFEST
    if manifest.is_file():
        try:
            files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"{manifest} is not a valid manifest"
        for name, entry in files.items():
            path = folder / name
            if not path.is_file():
                return f"{path} is missing"
            size = path.stat().st_size
            if size != entry.get("size"):
                return f"{path} has {size} bytes, {entry.get('size')} were written (truncated or replaced)"
            if "sha256" in entry and _sha256(path) != entry["sha256"]:
                return f"{path} was changed after it was written (its checksum differs)"
    for path in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_damage(path)
        if problem:
            return problem
    return None


def _safetensors_damage(path: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header and the tensor bytes it describes."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path} is truncated ({size} bytes)"
            length = int.from_bytes(head, "little")
            if length > size - 8:
                return f"{path} is truncated (its header alone needs {length + 8} bytes, the file has {size})"
            header = json.loads(f.read(length))
    except (OSError, ValueError) as exc:
        return f"{path} is not a readable safetensors file ({exc})"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"{path} is truncated ({size} of {expected} bytes)"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def remove_stale_temporaries(folder: Path, older_than_s: float = 0.0) -> None:
    """Remove what a killed process left behind: ``write_folder``'s and ``replace_dir``'s hidden siblings (those
    untouched for ``older_than_s`` seconds, where other processes may be writing beside this one)."""
    now = time.time()
    for pattern in (".*-tmp-*", ".*-old-*"):
        for stale in Path(folder).glob(pattern):
            try:
                if older_than_s and now - stale.stat().st_mtime < older_than_s:
                    continue
            except OSError:
                continue
            shutil.rmtree(stale, ignore_errors=True)


def remove_dir(folder: Path) -> None:
    """Delete ``folder`` without anyone ever finding it half-deleted: it is first renamed to a hidden
    sibling, which remove_stale_temporaries clears if a kill interrupts the deletion."""
    hidden = folder.with_name(f".{folder.name}-old-{os.getpid()}")
    shutil.rmtree(hidden, ignore_errors=True)
    try:
        os.replace(folder, hidden)
    except FileNotFoundError:
        return
    shutil.rmtree(hidden, ignore_errors=True)


def replace_dir(source: Path, target: Path) -> None:
    """Move ``source`` to ``target``, replacing it; the old one stays until the new one is in place."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}-old-{os.getpid()}")
        os.replace(target, old)
    os.replace(source, target)
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _rename_unless_there(source: Path, target: Path) -> None:
    try:
        os.rename(source, target)  # a directory is never renamed over a non-empty one
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not target.is_dir():
            raise
        shutil.rmtree(source, ignore_errors=True)
        return
    _fsync_dir(target.parent)


def fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # not every platform lets a directory be opened; the rename itself still happened
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; durability is then the filesystem's
    finally:
        os.close(fd)
