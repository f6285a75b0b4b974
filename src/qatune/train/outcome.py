"""A run's outcome kept true: ``fit`` with run.json saying running, complete, stopped or failed at every end,
and the report written whatever happened. Shared by a new run (run.py) and a resumed one (resume.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qatune.config import Config
from qatune.data.validate import raise_for_errors
from qatune.errors import TrainingError
from qatune.runs import layout
from qatune.train import sharding
from qatune.train.device import is_main_process
from qatune.train.loop import fit
from qatune.train.preparation import Prepared, prepare
from qatune.train.process_failure import FailureWatch
from qatune.train.report import draw_in_background, write_report
from qatune.train.signals import TrainingInterrupted

log = logging.getLogger("qatune")


def prepare_checked(config: Config) -> Prepared:
    """``prepare``, its warnings logged and its errors raised."""
    prepared = prepare(config)
    if config.train.distributed == "fsdp" and prepared.model is not None:
        sharding.check_shardable(prepared.model)
    for finding in prepared.findings:
        if finding.level == "warning":
            log.warning("warning: %s", finding.message)
    raise_for_errors(prepared.findings)
    return prepared


def run_and_record(prepared: Prepared, run_dir: Path, progress: bool, resume_from: Path | None = None) -> Path:
    """fit() with the run's status kept in run.json (by the main process)."""
    main = is_main_process()
    status = _status_writer(main)
    drawn = []  # loss.png, drawn while the last checkpoint is written

    def when_trained() -> None:
        drawn.append(draw_in_background(run_dir))

    # With several processes, a failure on one ends them all at once, each saying which failed and why.
    with FailureWatch(lambda message: status(run_dir, status="failed", error=message)) as failures:
        try:
            result = fit(prepared, run_dir, progress=progress, resume_from=resume_from,
                         when_trained=when_trained if main else None)
        except TrainingInterrupted as exc:
            status(run_dir, status="stopped", error=str(exc))
            _report(run_dir, main)
            raise
        except KeyboardInterrupt:
            status(run_dir, status="stopped", error="interrupted")
            raise
        except BaseException as exc:
            failure = failures.failed(exc)  # does not return when another process failed first
            status(run_dir, status="failed", error=str(failure) if isinstance(failure, TrainingError)
                   else f"{type(failure).__name__}: {failure}")
            if isinstance(failure, TrainingError):
                _report(run_dir, main)
            if failure is exc:
                raise
            raise failure from exc
    status(run_dir, status="complete", finished=time.strftime("%Y-%m-%d %H:%M:%S"), result=result)
    _report(run_dir, main, drawn[0] if drawn else None)
    log.info("run complete: %s (model in %s)", run_dir, run_dir / layout.FINAL)
    return run_dir


def _status_writer(main: bool) -> Callable[..., None]:
    """run.json updates by the main process. After a failure they are best effort: a full disk that
    stopped the run must not hide its own message behind a second error."""
    def write(run_dir: Path, **fields: Any) -> None:
        if not main:
            return
        if fields.get("status") == "complete":
            layout.write_status(run_dir, **fields)
            return
        try:
            layout.write_status(run_dir, **fields)
        except OSError as exc:
            log.warning("could not record the run's status in %s: %s", run_dir / layout.STATUS, exc)

    return write


def _report(run_dir: Path, main: bool, drawn: Any = None) -> None:
    """report.md and loss.png (``drawn``: by draw_in_background); a failure here never hides the run's own
    outcome."""
    if not main:
        return
    try:
        write_report(run_dir, drawn)
    except Exception as exc:  # the report is a convenience: say so and move on
        log.warning("could not write report.md: %s", exc)
