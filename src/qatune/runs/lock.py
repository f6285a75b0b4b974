"""One qatune process at a time on a run directory (or an export target): a lock file beside it."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qatune.errors import RunDirError

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("qatune")


def lock_path(folder: Path) -> Path:
    """The lock file of a run directory (or export target): hidden, beside it."""
    folder = Path(folder).absolute()
    return folder.parent / f".{folder.name}.qatune-lock"


class RunLock:
    """One qatune process at a time on a run directory (or an export target).

    The lock is a hidden file beside the folder (``.NAME.qatune-lock``: the folder itself may not exist
    yet, or be replaced with --overwrite) holding the owner's pid, host, start time and command. A
    lock whose process no longer runs is taken over, with a message.
    """

    def __init__(self, folder: Path, what: str = "run directory"):
        folder = Path(folder).absolute()
        self.folder, self.what = folder, what
        self.path = lock_path(folder)
        self.held = False

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(f"cannot lock {self.what} {self.folder}: cannot create {self.path.parent} "
                              f"({exc.strerror}); choose another folder") from None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_or_refuse()
                continue
            except OSError as exc:
                raise RunDirError(f"cannot lock {self.what} {self.folder}: {exc.strerror} ({self.path}); "
                                  "choose another folder") from None
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(_me(), f)
            self.held = True
            return
        raise RunDirError(f"cannot lock {self.what} {self.folder}: {self.path} keeps coming back; "
                          "is another qatune starting there?")

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                if _read_lock(self.path).get("pid") == os.getpid():
                    self.path.unlink()
            except OSError:
                pass  # already gone: nothing to release

    def _take_over_or_refuse(self) -> None:
        owner = _read_lock(self.path)
        if _alive(owner) and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
            raise RunDirError(f"{self.what} {self.folder} is already in use by this process")
        if _alive(owner):
            since = owner.get("started", "?")
            raise RunDirError(f"{self.what} {self.folder} is in use by qatune process {owner.get('pid')} on "
                              f"{owner.get('host')} (started {since}: {owner.get('command', '?')}); wait for it "
                              f"to finish or stop it, or choose another folder")
        log.warning("taking over the lock of %s %s: its process %s (started %s) no longer runs", self.what,
                    self.folder, owner.get("pid", "?"), owner.get("started", "?"))
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass  # another process took it over first; the next attempt sees its lock


def holder(folder: Path) -> dict[str, Any] | None:
    """The process that holds the lock of ``folder`` (its pid, host, start time and command), if one that still
    runs does."""
    owner = _read_lock(lock_path(folder))
    return owner if _alive(owner) else None


def _me() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start_ticks": _start_ticks(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["qatune", *sys.argv[1:]])[:300]}


def _read_lock(path: Path) -> dict[str, Any]:
    try:
        owner = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # empty or half-written (its writer died at once): nobody holds it
    return owner if isinstance(owner, dict) else {}


def _alive(owner: dict[str, Any]) -> bool:
    """Whether the lock's owner still runs. Another host cannot be checked: it is taken to run."""
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if owner.get("host") != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # a process of another user holds that pid
    ticks = _start_ticks(pid)
    # The pid may have been reused by a new process since: compare start times where Linux tells them.
    return ticks is None or owner.get("start_ticks") in (None, ticks)


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux /proc), else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None
