"""Ctrl-C and SIGTERM: finish the step, save a checkpoint, stop with a resumable run."""

from __future__ import annotations

import logging
import shlex
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qatune.errors import TrainingError
from qatune.train.checkpoint import TrainState

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("qatune")


SAME_CTRL_C = 1.0
"""Seconds within which a second SIGINT is the same Ctrl-C: a signal sent to every process of a job (a scheduler's)
reaches a training process of a multi-process run directly and again from torchrun's agent."""


class StopSignals:
    """SIGINT/SIGTERM ask the loop to finish its step, save a checkpoint and stop; a second SIGINT
    stops at once."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._requested_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, _type: object, exc: BaseException | None, _traceback: object) -> None:
        # The processes of a stopped multi-process run end together: torchrun's agent, seeing one end, sends the
        # others SIGTERM, which must not cut short the line the main one says for all.
        ending = isinstance(exc, TrainingInterrupted) and exc.processes > 1
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if ending and sig == signal.SIGTERM else handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.requested:
            # A second Ctrl-C stops at once; a repeat within SAME_CTRL_C of the first signal is that one, and a
            # SIGTERM after it (torchrun's agent sends one as it shuts down) lets the stop go on.
            if signum == signal.SIGINT and time.monotonic() - self._requested_at >= SAME_CTRL_C:
                raise KeyboardInterrupt
            return
        self.requested, self._requested_at = signal.Signals(signum).name, time.monotonic()
        log.warning("%s received: finishing the current step and saving a checkpoint (Ctrl-C again to stop now)",
                    self.requested)

    def agreed(self, accelerator: Any) -> str | None:
        """The stop to act on now. With several processes, every one must call this at the same point (a
        collective): any process's stop is every process's, so all save the same step and end together; of two
        different signals, the higher-numbered (SIGTERM over SIGINT) names it."""
        if accelerator.num_processes == 1:
            return self.requested
        import torch
        import torch.distributed as dist

        asked = torch.tensor([signal.Signals[self.requested] if self.requested else 0], device=accelerator.device)
        dist.all_reduce(asked, op=dist.ReduceOp.MAX)
        return signal.Signals(int(asked)).name if int(asked) else None


class TrainingInterrupted(TrainingError):
    """Training was asked to stop; a checkpoint was written (exit code 130)."""

    exit_code = 130

    def __init__(self, signal_name: str, state: TrainState, checkpoint: Path | None, processes: int = 1,
                 said_here: bool = True):
        self.checkpoint, self.processes = checkpoint, processes
        self.said_here = said_here
        """False on the processes of a multi-process run but the main one, which says the line for all."""
        where = f"; checkpoint saved in {checkpoint}" if checkpoint else ""
        how = f"; resume with: {resume_command(checkpoint.parent.parent, processes)}" if checkpoint else ""
        when = f"in epoch {state.epoch + 1}" if state.consumed else f"after epoch {state.epoch}"
        super().__init__(f"training stopped by {signal_name} at step {state.step} ({when}){where}{how}")


def resume_command(run_dir: Path, processes: int = 1) -> str:
    """The command that continues a stopped run with its own saved config."""
    launch = f" --num-processes {processes}" if processes > 1 else ""
    return f"qatune train --resume {shlex.quote(str(run_dir))}{launch}"
