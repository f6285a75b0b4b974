"""What a step's job must meet before the page starts it: no model's own code run (a config on disk, or a run's
saved one, with model.trust_remote_code), and a training only from a config whose check found no error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter

from qatune.config import load_config
from qatune.errors import QatuneError
from qatune.runs import layout
from qatune.ui import PageError, sheet, steps
from qatune.ui.jobs import Jobs
from qatune.ui.workspace import Workspace


def refuse_remote_code_of_file(path: Path, name: str, command: str | None = None) -> None:
    """A config on disk (written outside the page, or a run's saved one) that asks to run a model's own code, valid
    or not (check reports the rest)."""
    if not path.is_file():
        return
    try:
        sheet.refuse_remote_code(load_config(path), name, command)
    except PageError:
        raise
    except QatuneError:  # not a valid config: the key read as pydantic would read it
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) if path.stat().st_size < 1_000_000 else None
        model = raw.get("model") if isinstance(raw, dict) else None
        if isinstance(model, dict) and _true(model.get("trust_remote_code")):
            raise PageError(sheet.remote_code_message(name, str(model.get("name_or_path") or "the model"),
                                                      command or f"qatune train --config {name}"), 403) from None


def refuse_remote_code_of_run(workspace: Workspace, run: str, command: str) -> None:
    """A run trained (outside the page) with model.trust_remote_code loads its model's code too."""
    refuse_remote_code_of_file(workspace.path(f"{run}/{layout.CONFIG}"), f"{run}/{layout.CONFIG}", command)


def _true(value: Any) -> bool:
    try:
        return TypeAdapter(bool).validate_python(value) is True
    except ValueError:
        return False


def require_passed_check(jobs: Jobs, workspace: Workspace, config: str) -> None:
    """Training starts from a config whose check, of its text as it is now, found no error."""
    path = workspace.existing(config, "config")
    job = jobs.latest("check", config)
    report = steps.check_result(job) if job is not None else None
    if job is None or job.extra["digest"] != steps.digest(path):
        raise PageError(f"check {config} first: the Check step runs qatune check on it "
                        + ("(it changed since its last check)" if job is not None else "(it has not been checked)"),
                        409)
    if report is None:
        raise PageError(f"the check of {config} is still running; train once it has found no error", 409)
    if not report.get("ok"):
        raise PageError(f"the check of {config} found errors: fix them (the Check step lists each with its fix), "
                        "then check again", 409)
