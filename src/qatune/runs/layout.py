"""The run directory's layout: its file names, its status file, output-dir checks, finding its model folders.

A run directory::

    RUN/
      config.yaml        resolved config of the run
      run.json           status (running/complete/failed/stopped), data reports, chosen max_length
      metrics.jsonl      one line per logging step and per evaluation
      final/  best/      save_pretrained model (safetensors) + tokenizer + config.yaml + qatune.json
      base/              LoRA on a scratch model: the random base weights
      checkpoints/       resumable training state (step-NNNNNNN/)
      report.md loss.png predictions-validation.csv nonfinite-step-N.json tensorboard/ mlflow/ trackio/

This module is the only one that knows these names. The run's files and folders are written with
:mod:`qatune.runs.atomic`, so a process killed at any moment leaves the old folder or the new one, never a
half-written one under a valid name; :mod:`qatune.runs.lock` keeps a second process out of a run in use.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from qatune.errors import RunDirError
from qatune.runs.atomic import atomic_write_text
from qatune.runs.lock import holder

log = logging.getLogger("qatune")

CONFIG = "config.yaml"
STATUS = "run.json"
METRICS = "metrics.jsonl"
FINAL = "final"
BEST = "best"
BASE = "base"
"""LoRA on a scratch model: the random base weights are saved in RUN/base."""
CHECKPOINTS = "checkpoints"
SHARDS = "sharded"
"""In a checkpoint of a run with train.distributed fsdp: its weights and optimizer state, a file per process
(torch.distributed.checkpoint), in place of model.safetensors and optimizer.pt."""
MODEL_INFO = "qatune.json"
"""Inside a model folder: what eval and generate need besides weights and tokenizer."""
REPORT = "report.md"
LOSS_PLOT = "loss.png"
VALIDATION_PREDICTIONS = "predictions-validation.csv"
TENSORBOARD = "tensorboard"
MLFLOW = "mlflow"
"""train.report_to mlflow: the local MLflow store (mlflow.db), unless MLFLOW_TRACKING_URI names another."""
MLFLOW_DB = "mlflow.db"
TRACKIO = "trackio"
"""train.report_to trackio: trackio's local store (a SQLite file per project), unless TRACKIO_DIR names another."""


def nonfinite_report(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"nonfinite-step-{step}.json"


def eval_outputs(run_dir: Path, data_file: str | Path, prefix: str = "") -> dict[str, Path]:
    """Where ``qatune eval`` writes its metrics and predictions for a data file (``prefix``: a model file's name
    and a dash, when the results go beside it)."""
    stem = prefix + Path(data_file).stem
    return {"metrics": Path(run_dir) / f"eval-{stem}.json", "predictions": Path(run_dir) / f"predictions-{stem}.csv"}


def looks_like_run(path: Path) -> bool:
    return (path / STATUS).is_file() or (path / CONFIG).is_file()


def read_status(run_dir: Path) -> dict[str, Any]:
    """run.json as a dict ({} when missing or unreadable)."""
    try:
        status = json.loads((Path(run_dir) / STATUS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def write_status(run_dir: Path, **fields: Any) -> None:
    """Update run.json atomically."""
    status = read_status(run_dir)
    status.update(fields)
    atomic_write_text(Path(run_dir) / STATUS, json.dumps(status, indent=2, default=str) + "\n")


def write_config(run_dir: Path, yaml_text: str) -> None:
    atomic_write_text(Path(run_dir) / CONFIG, yaml_text)




def check_output_path(run_dir: Path) -> None:
    """Refuse an output_dir that is a file or cannot be written."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"output_dir {run_dir} is a file; choose a directory path (--output-dir)")
    parent = _existing_parent(run_dir)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RunDirError(f"output_dir {run_dir} is not writable (no write permission on {parent}); "
                          "choose another --output-dir")


def check_output_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse early (before slow work) an output_dir that cannot or must not be used."""
    check_output_path(run_dir)
    if run_dir.is_dir() and any(run_dir.iterdir()):
        if not looks_like_run(run_dir):
            # --overwrite deletes only qatune runs, so it is no way out here: say so, with or without it.
            raise RunDirError(f"output_dir {run_dir} holds files and is not a qatune run; qatune will not delete "
                              "it (not even with --overwrite); choose another --output-dir")
        if not overwrite:
            raise RunDirError(f"output_dir {run_dir} already holds a run; pass --overwrite to replace it "
                              "or choose another --output-dir")


def create_run_dir(run_dir: Path, overwrite: bool) -> None:
    check_output_dir(run_dir, overwrite)
    if run_dir.exists() and overwrite:
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"cannot create output_dir {run_dir}: {exc.strerror}") from None


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def find_model_folder(path: str | Path, which: str = FINAL) -> Path:
    """``RUN`` (uses RUN/final or RUN/best) or a model folder itself."""
    path = Path(path)
    if not path.exists():
        raise RunDirError(f"run directory {path} not found; pass the output_dir of a 'qatune train' run")
    if not path.is_dir():
        raise RunDirError(f"{path} is a file, not a run directory")
    if (path / MODEL_INFO).is_file():
        return path
    folder = path / which
    if (folder / MODEL_INFO).is_file():
        return folder
    if looks_like_run(path):
        raise RunDirError(_why_no_model(path, which))
    raise RunDirError(f"{path} is not a qatune run directory (no {which}/{MODEL_INFO}); "
                      "pass the output_dir of a 'qatune train' run")


def _why_no_model(run_dir: Path, which: str) -> str:
    """Why a run directory has no ``which``/ model, and what to do about it."""
    recorded = read_status(run_dir)
    status = recorded.get("status", "unknown")
    validation = (recorded.get("data") or {}).get("validation") or {}
    owner = holder(run_dir)
    checkpoint = f"or pass a checkpoint folder ({run_dir / CHECKPOINTS}/step-N)"
    if which == BEST and (validation.get("rows") == 0 or (status == "complete" and not validation)):
        return (f"{run_dir} has no best/ model: best/ is kept only when the run has validation data "
                "(data.eval_file or data.validation_fraction); use final/ (the default)")
    if owner is not None:
        return (f"{run_dir} is still training (qatune process {owner.get('pid')}, started "
                f"{owner.get('started', '?')}); its {which}/ model is written when it finishes: wait for it, "
                f"{checkpoint}")
    if status in ("running", "stopped"):
        return (f"{run_dir} has no {which}/ model: the run stopped before it finished (run status: {status}); "
                f"continue it with qatune train --resume {run_dir}, {checkpoint}")
    return (f"{run_dir} has no {which}/ model (run status: {status}); the run did not finish: train again, "
            f"{checkpoint}")


def results_dir(given: Path, model_folder: Path) -> Path:
    """Where eval writes its files: the run directory when given ``RUN/final`` itself."""
    if given.resolve() == model_folder.resolve() and (model_folder.parent / STATUS).is_file():
        return model_folder.parent
    return given


def find_lora_base(folder: Path) -> Path | None:
    """RUN/base of a LoRA-on-scratch run, seen from one of its model folders (final/, best/, a checkpoint)."""
    for run_dir in (folder.parent, folder.parent.parent):
        if (run_dir / BASE / "config.json").is_file():
            return run_dir / BASE
    return None
