"""One process's failure made known to every process of a multi-process run, so that none is left waiting.

Without it, the others learn of a failure only when their next collective meets the failed process's closed
connection (gloo), or never (NCCL: until the collective's timeout); a process busy with its own work (its share of
the held-out rows, a checkpoint) goes on, and takes the launcher's SIGTERM for a stop asked by the user, until
torchrun kills it 30 s later with its run.json still saying running.

So a failing process first publishes its message in the store that the run's processes share (the c10d TCP store
of torchrun's rendezvous, at MASTER_ADDR:MASTER_PORT; the first failure is kept), and every process watches for it
on a thread of its own (a main thread blocked in a collective, or busy, cannot be reached). A process told of
another's failure records it in run.json (the main process), says it in one line (one process per machine), and
ends at once: with the failing process's exit code on another machine, with 0 on the failing process's own (whose
exit code is the run's there). The failing process waits until the others have ended (a few seconds at most), then
ends with the same line.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, TypeVar

from qatune.errors import QatuneError, TrainingError
from qatune.train.signals import TrainingInterrupted

log = logging.getLogger("qatune")

ENDED_WAIT = timedelta(seconds=10)
"""How long a failing process waits for the others to end before it ends too."""
EXITED_WAIT = timedelta(seconds=2)
"""How long a failing process then waits for the others on its machine to have exited: torchrun's agent, seeing
the failing process end, sends SIGTERM to (and logs it for) every process of the machine still running."""
_CONNECT = timedelta(seconds=30)
_WATCH = timedelta(days=30)
_FINISHED = "finished"
E = TypeVar("E", bound=BaseException)
_LOST_CONTACT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""How gloo says that another process's end closed the connection under a collective."""


@dataclass(frozen=True)
class Failure:
    """The failure of one process, as every process reports it."""

    rank: int
    node: int
    """The failing process's machine (torchrun's GROUP_RANK)."""
    message: str
    """One line: which process failed, and why."""
    exit_code: int


class ProcessFailed(TrainingError):
    """This process failed in a multi-process run, and the others have been stopped: its message names it."""

    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.exit_code = failure.exit_code


def on_every_process(error: E) -> E:
    """``error``, marked as raised by every process alike (decided on numbers they share, after a collective): each
    ends with it, and none is named as the one that failed."""
    error.on_every_process = True  # type: ignore[attr-defined]
    return error


class FailureWatch:
    """While entered, a multi-process run's processes learn of any one's failure (nothing with one process, or under
    a launcher without torchrun's agent store).

    ``record(message)`` is called with the failure's line by a process that ends because another failed (the main
    process writes run.json with it); the failing process records its own failure itself.
    """

    def __init__(self, record: Callable[[str], None]):
        self.record = record
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.node = int(os.environ.get("GROUP_RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.prefix = f"qatune/{run}/"
        self._store: Any = None
        """The main thread's connection to the store (the watcher holds its own, blocked in a wait)."""
        self._watcher: threading.Thread | None = None
        self._ending = threading.Lock()

    def __enter__(self) -> FailureWatch:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        # torchrun's agent serves the store before the processes start (without it, process 0 would serve it only
        # once its process group is made, and a process failing before that would have no one to tell).
        if self.world == 1 or not (host and port.isdigit()) or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return self
        try:
            self._store, watching = _connect(host, int(port)), _connect(host, int(port))
        except RuntimeError as exc:
            log.debug("no failure watch: the processes' store at %s:%s does not answer: %s", host, port, exc)
            self._store = None
            return self
        self._watcher = threading.Thread(target=self._watch, args=(watching,), name="qatune-failure-watch",
                                         daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watcher is None:
            return
        # Release this process's watcher: the run has ended here (a thread left waiting in the store at the
        # interpreter's exit aborts it).
        try:
            self._store.set(self._key("wake", self.rank), _FINISHED)
        except RuntimeError:
            return
        self._watcher.join(timeout=_CONNECT.total_seconds())

    def failed(self, exc: BaseException) -> BaseException:
        """In the failing process's error path (the main thread): the exception to raise, naming this process, once
        every other process has been told and has ended. When another process failed first, this process ends here
        with that failure instead (this call does not return). Without a watch: ``exc`` itself."""
        if self._store is None or isinstance(exc, TrainingInterrupted | KeyboardInterrupt) or getattr(
                exc, "on_every_process", False):
            return exc  # a stop asked for, or an error every process raises alike: each ends with it
        lost = _lost_contact(exc)
        mine = Failure(self.rank, self.node, self._line(exc, lost), _exit_code(exc))
        if threading.current_thread() is threading.main_thread():
            # The launcher's SIGTERM, once another process has ended, must not cut this one's report short.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            published = self._store.compare_set(self._key("failure"), "", json.dumps(asdict(mine)))
        except RuntimeError as store_error:  # the store is gone: there is no one left to tell
            log.debug("could not publish this process's failure: %s", store_error)
            return exc
        kept = Failure(**json.loads(published))
        if kept.rank != self.rank:
            self._end(kept, self._store)
        others = [rank for rank in range(self.world) if rank != self.rank]
        try:
            for rank in others:
                self._store.set(self._key("wake", rank), "failed")
            if not lost:  # a process that lost contact has no one left to wait for
                self._store.wait([self._key("ended", rank) for rank in others], ENDED_WAIT)
                ended = [self._store.get(self._key("ended", rank)).decode().split() for rank in others]
                _wait_for_exits([int(pid) for node, pid in ended if int(node) == self.node], EXITED_WAIT)
        except RuntimeError as store_error:  # a process that did not answer in time, or the store gone
            log.debug("not every process said it ended: %s", store_error)
        return ProcessFailed(kept)

    def _watch(self, store: Any) -> None:
        """The watcher thread: wait until this process is woken, by another's failure or its own end."""
        try:
            store.wait([self._key("wake", self.rank)], _WATCH)
            if store.get(self._key("wake", self.rank)).decode() == _FINISHED:
                return
            failure = Failure(**json.loads(store.get(self._key("failure"))))
        except RuntimeError:  # the store went away: the run is over
            return
        if failure.rank != self.rank:
            self._end(failure, store, wait=False)

    def _end(self, failure: Failure, store: Any, wait: bool = True) -> None:
        """End this process because ``failure`` happened elsewhere: run.json, one line per machine, the exit code.
        Only one thread ends the process; with ``wait`` false, a second caller returns at once."""
        if not self._ending.acquire(blocking=wait):
            return
        try:
            self.record(failure.message)
        except Exception as exc:  # the other process's failure is the one to report
            log.warning("could not record the failure: %s", exc)
        if self.local_rank == 0 and failure.node != self.node:  # the failing process speaks for its own machine
            print(f"error: {failure.message}", file=sys.stderr)
        try:
            store.set(self._key("ended", self.rank), f"{self.node} {os.getpid()}")
        except RuntimeError:
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        # On the failing process's machine its own exit code is the run's there, and it ends after this one: a
        # nonzero code here, first, would have torchrun's agent send it SIGTERM and log so under its one line.
        os._exit(0 if failure.node == self.node else failure.exit_code)

    def _line(self, exc: BaseException, lost: bool) -> str:
        who = f"process {self.rank} of {self.world}"
        if lost:  # gloo's own words name a socket, not a process
            return f"{who} stopped: another process ended without saying why (killed, or out of memory?)"
        if isinstance(exc, QatuneError):
            return f"{who} failed: {exc}"
        return (f"{who} failed: internal error: {type(exc).__name__}: {exc} (run with -v for the traceback; please "
                "report it with the output of 'qatune env')")

    def _key(self, *parts: object) -> str:
        return self.prefix + "/".join(map(str, parts))


def _wait_for_exits(pids: list[int], limit: timedelta) -> None:
    """Wait until the processes ``pids`` of this machine have exited (ended, or waiting for their parent to read
    their exit code), ``limit`` at most."""
    import time

    deadline = time.monotonic() + limit.total_seconds()
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")  # the state follows the name's ')'
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: whether the process exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _connect(host: str, port: int) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=_CONNECT)


def _exit_code(exc: BaseException) -> int:
    return exc.exit_code if isinstance(exc, QatuneError) else 2


def _lost_contact(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective meeting a process that has ended (the end, not the cause)."""
    return isinstance(exc, RuntimeError) and any(sign in str(exc) for sign in _LOST_CONTACT)

