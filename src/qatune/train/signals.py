"""Ctrl-C and SIGTERM: finish the step, save a checkpoint, stop with a resumable run."""

from __future__ import annotations

import logging
import shlex
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qatune.errors import TrainingError
from qatune.train.checkpoint import TrainState

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("qatune")


class StopSignals:
    """SIGINT/SIGTERM ask the loop to finish its step, save a checkpoint and stop; a second SIGINT
    stops at once."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        log.warning("%s received: finishing the current step and saving a checkpoint (Ctrl-C again to stop now)",
                    self.requested)


class TrainingInterrupted(TrainingError):
    """Training was asked to stop; a checkpoint was written (exit code 130)."""

    exit_code = 130

    def __init__(self, signal_name: str, state: TrainState, checkpoint: Path | None, processes: int = 1):
        self.checkpoint = checkpoint
        where = f"; checkpoint saved in {checkpoint}" if checkpoint else ""
        how = f"; resume with: {resume_command(checkpoint.parent.parent, processes)}" if checkpoint else ""
        when = f"in epoch {state.epoch + 1}" if state.consumed else f"after epoch {state.epoch}"
        super().__init__(f"training stopped by {signal_name} at step {state.step} ({when}){where}{how}")


def resume_command(run_dir: Path, processes: int = 1) -> str:
    """The command that continues a stopped run with its own saved config."""
    launch = f" --num-processes {processes}" if processes > 1 else ""
    return f"qatune train --resume {shlex.quote(str(run_dir))}{launch}"
