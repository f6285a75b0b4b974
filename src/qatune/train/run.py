"""``train(config)``: check the output folder, prepare, create the run directory, fit, keep run.json
true at every outcome, write the report."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from qatune import __version__, rundir
from qatune.config import Config
from qatune.errors import RunDirError, TrainingError
from qatune.model_folder import ModelInfo, save_model
from qatune.report import draw_in_background, write_report
from qatune.train.device import is_main_process
from qatune.train.loop import fit
from qatune.train.preparation import Prepared, prepare
from qatune.train.signals import TrainingInterrupted
from qatune.validate import raise_for_errors

log = logging.getLogger("qatune")


def train(config: Config, output_dir: str | Path | None = None, overwrite: bool = False,
          progress: bool = True, resume: str | Path | None = None) -> Path:
    """Fine-tune according to ``config`` and return the run directory (with final/ inside).

    ``resume``: a run directory or checkpoint to continue from ("" for the config's output_dir).
    """
    from qatune.train.resume import resume_run

    run_dir = Path(output_dir or config.output_dir)
    if output_dir is not None:
        config = config.model_copy(update={"output_dir": str(output_dir)})
    if resume is not None:
        if overwrite:
            raise RunDirError("--resume and --overwrite contradict each other; pass one of them")
        return resume_run(config, Path(resume) if str(resume) else run_dir, progress)
    main = is_main_process()
    if main:
        rundir.check_output_path(run_dir)
    # Under accelerate launch, only the main process locks and writes files.
    with rundir.RunLock(run_dir) if main else nullcontext():
        if main:
            rundir.check_output_dir(run_dir, overwrite)
        prepared = prepare_checked(config)
        if main:
            rundir.create_run_dir(run_dir, overwrite)
            rundir.write_config(run_dir, config.to_yaml())
            if prepared.base_model is not None:
                save_model(run_dir / rundir.BASE, prepared.base_model, prepared.tokenizer, config,
                           ModelInfo(task=config.task, max_length=prepared.info.max_length))
                prepared.base_model = None  # a full copy of the model: training does not need it in memory
            rundir.write_status(run_dir, status="running", qatune_version=__version__,
                                started=time.strftime("%Y-%m-%d %H:%M:%S"), task=config.task,
                                precision=prepared.precision,
                                max_length=prepared.info.max_length, data=prepared.reports,
                                data_fingerprint=fingerprint(prepared))
        return run_and_record(prepared, run_dir, progress)


def prepare_checked(config: Config) -> Prepared:
    """``prepare``, its warnings logged and its errors raised."""
    prepared = prepare(config)
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

    try:
        result = fit(prepared, run_dir, progress=progress, resume_from=resume_from,
                     when_trained=when_trained if main else None)
    except TrainingInterrupted as exc:
        status(run_dir, status="stopped", error=str(exc))
        _report(run_dir, main)
        raise
    except TrainingError as exc:
        status(run_dir, status="failed", error=str(exc))
        _report(run_dir, main)
        raise
    except KeyboardInterrupt:
        status(run_dir, status="stopped", error="interrupted")
        raise
    except BaseException as exc:
        status(run_dir, status="failed", error=f"{type(exc).__name__}: {exc}")
        raise
    status(run_dir, status="complete", finished=time.strftime("%Y-%m-%d %H:%M:%S"), result=result)
    _report(run_dir, main, drawn[0] if drawn else None)
    log.info("run complete: %s (model in %s)", run_dir, run_dir / rundir.FINAL)
    return run_dir


def _status_writer(main: bool) -> Callable[..., None]:
    """run.json updates by the main process. After a failure they are best effort: a full disk that
    stopped the run must not hide its own message behind a second error."""
    def write(run_dir: Path, **fields: Any) -> None:
        if not main:
            return
        if fields.get("status") == "complete":
            rundir.write_status(run_dir, **fields)
            return
        try:
            rundir.write_status(run_dir, **fields)
        except OSError as exc:
            log.warning("could not record the run's status in %s: %s", run_dir / rundir.STATUS, exc)

    return write


def fingerprint(prepared: Prepared) -> str:
    """A digest of the encoded training rows: an exact resume needs the same ones."""
    import hashlib
    import json

    digest = hashlib.sha256()
    for item in prepared.dataset.items:
        digest.update(json.dumps(item.input_ids).encode())
    return digest.hexdigest()[:16]


def _report(run_dir: Path, main: bool, drawn: Any = None) -> None:
    """report.md and loss.png (``drawn``: by draw_in_background); a failure here never hides the run's own
    outcome."""
    if not main:
        return
    try:
        write_report(run_dir, drawn)
    except Exception as exc:  # the report is a convenience: say so and move on
        log.warning("could not write report.md: %s", exc)
