"""The commands the page runs, each in a process of its own: ``qatune check``, ``train``, ``eval --compare``,
``generate --file`` and ``export``. The page's server goes on serving while they run, and a page that was closed or
reloaded finds them again here. Their stdout and stderr go to files in the workspace's .qatune-ui/, read when the
page asks. One training at a time.

Each runs in a session of its own, so that a Ctrl-C in the terminal reaches ``qatune ui`` alone, which then asks its
training to stop (a checkpoint) once, as the Stop button does.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qatune.ui import PageError
from qatune.ui.progress import RowBars
from qatune.ui.workspace import LOGS, Workspace

log = logging.getLogger("qatune")

STOP_WAIT_S = 120
"""How long ``qatune ui`` waits, when it stops, for a training to write its checkpoint."""
LOG_TAIL_BYTES = 64_000
ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
"""The cursor moves tqdm writes around a second bar (validation's, under training's): not text to show."""
BAR_DESC = re.compile(r"^(\w+): +\d+%\|")


@dataclass
class Job:
    id: str
    kind: str
    args: list[str]
    """The command's arguments after ``qatune``."""
    target: str
    """What it works on: a config (check, train) or a run directory, relative to the workspace."""
    process: subprocess.Popen
    log: Path
    output: Path
    started: float = field(default_factory=time.time)
    finished: float | None = None
    stopping: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    """What its step reads afterwards (the file it writes)."""
    bars: RowBars = field(default_factory=RowBars)
    read_to: int = 0
    """How much of its stderr ``bars`` has read."""
    reading: threading.Lock = field(default_factory=threading.Lock)

    @property
    def command(self) -> str:
        return shlex.join(["qatune", *self.args])

    @property
    def state(self) -> str:
        """running, stopped (asked to stop), done (exit 0), or failed."""
        code = self.process.poll()
        if code is None:
            return "running"
        if self.finished is None:
            self.finished = time.time()
        if self.stopping and code != 0:
            return "stopped"
        return "done" if code == 0 else "failed"

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def log_lines(self, count: int = 30) -> list[str]:
        """The last lines of its stderr, a progress bar redrawn many times once (its last drawing)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            return []
        lines = [line for line in re.split(r"[\r\n]+", ESCAPES.sub("\n", text)) if line.strip()]
        bars = [BAR_DESC.match(line) for line in lines]  # tqdm's "train:  45%|", "generate:  10%|"
        shown = [line for line, this, after in zip(lines, bars, [*bars[1:], None])
                 if not (this and after and this.group(1) == after.group(1))]  # the same bar drawn again
        return shown[-count:]

    def row_bar(self) -> dict[str, Any] | None:
        """The bar of rows it drew last (RowBars.current), its stderr read on from where the last call stopped."""
        with self.reading:  # read and fed in order, whichever request asks
            try:
                with open(self.log, "rb") as f:
                    f.seek(self.read_to)
                    data = f.read()
            except OSError:
                data = b""
            self.read_to += len(data)
            if data:
                self.bars.feed(data.decode("utf-8", errors="replace"))
        return self.bars.current()

    def output_text(self) -> str:
        try:
            return self.output.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def error_line(self) -> str | None:
        """Its one-line error (``error: ...`` on stderr), when it failed."""
        if self.state != "failed":
            return None
        lines = self.log_lines(200)
        found = [line for line in lines if line.startswith(("error: ", "internal error: "))]
        return found[-1] if found else (lines[-1] if lines else f"exit code {self.returncode}")

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "target": self.target, "command": self.command,
                "state": self.state, "returncode": self.returncode, "started": self.started,
                "seconds": round((self.finished or time.time()) - self.started, 1), "stopping": self.stopping,
                "error": self.error_line(), "log": self.log_lines(), "bar": self.row_bar()}


class Jobs:
    """Every command the page started since ``qatune ui`` started."""

    def __init__(self, workspace: Workspace):
        self.workspace = workspace
        self.jobs: dict[str, Job] = {}
        self.numbers = itertools.count(1)
        self.lock = threading.Lock()

    def start(self, kind: str, args: list[str], target: str, **extra: Any) -> Job:
        """Run ``qatune ARGS`` in the workspace. A second training while one runs, or the same command on the same
        target while it runs, is refused."""
        with self.lock:
            if kind == "train" and (running := self.running("train")):
                raise PageError(f"a training is running already ({running[0].target}: {running[0].command}); one "
                                "training at a time: stop it, or wait for it to end", 409)
            if any(job.target == target for job in self.running(kind)):
                raise PageError(f"{kind} of {target} is running already; wait for it to end", 409)
            job_id = f"{kind}-{next(self.numbers)}"
            folder = self.workspace.folder(LOGS)
            log_path, output = folder / f"{job_id}.log", folder / f"{job_id}.out"
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
            with open(log_path, "wb") as err, open(output, "wb") as out:
                process = subprocess.Popen([sys.executable, "-m", "qatune", *args], cwd=self.workspace.root,
                                           stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                           start_new_session=True)
            job = Job(job_id, kind, list(args), target, process, log_path, output, extra=extra)
            self.jobs[job_id] = job
            log.info("started %s", job.command)
            return job

    def get(self, job_id: str) -> Job:
        if job_id not in self.jobs:
            raise PageError(f"no command {job_id!r} was started since qatune ui started", 404)
        return self.jobs[job_id]

    def running(self, kind: str | None = None) -> list[Job]:
        return [job for job in self.jobs.values() if job.state == "running" and kind in (None, job.kind)]

    def latest(self, kind: str, target: str | None = None) -> Job | None:
        found = [job for job in self.jobs.values() if job.kind == kind and target in (None, job.target)]
        return found[-1] if found else None

    def stop(self, job: Job) -> None:
        """Ask it to stop as Ctrl-C does (a training finishes its step and writes a checkpoint); once."""
        if job.state == "running" and not job.stopping:
            job.stopping = True
            job.process.send_signal(signal.SIGINT)

    def shutdown(self, wait_s: float = STOP_WAIT_S) -> None:
        """Stop what still runs (a training with a checkpoint), waiting up to ``wait_s`` for it."""
        running = self.running()
        for job in running:
            self.stop(job)
        deadline = time.monotonic() + wait_s
        for job in running:
            try:
                job.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killed", job.command, wait_s)
                job.process.kill()
                job.process.wait()
