"""The run directory: its file names, its status file, and writes that a crash cannot leave half done.

A run directory::

    RUN/
      config.yaml        resolved config of the run
      run.json           status (running/complete/failed/stopped), data reports, chosen max_length
      metrics.jsonl      one line per logging step and per evaluation
      final/  best/      save_pretrained model (safetensors) + tokenizer + config.yaml + qatune.json
      base/              LoRA on a scratch model: the random base weights
      checkpoints/       resumable training state (step-NNNNNNN/)
      report.md loss.png predictions-validation.csv nonfinite-step-N.json tensorboard/

This module is the only one that knows these names. Every folder is written to a hidden temporary
sibling, fsynced and renamed into place, so a process killed at any moment leaves the old folder
or the new one, never a half-written one under a valid name.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qatune.errors import RunDirError

CONFIG = "config.yaml"
STATUS = "run.json"
METRICS = "metrics.jsonl"
FINAL = "final"
BEST = "best"
BASE = "base"
"""LoRA on a scratch model: the random base weights are saved in RUN/base."""
CHECKPOINTS = "checkpoints"
MODEL_INFO = "qatune.json"
"""Inside a model folder: what eval and generate need besides weights and tokenizer."""
REPORT = "report.md"
LOSS_PLOT = "loss.png"
VALIDATION_PREDICTIONS = "predictions-validation.csv"
TENSORBOARD = "tensorboard"


def nonfinite_report(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"nonfinite-step-{step}.json"


def eval_outputs(run_dir: Path, data_file: str | Path) -> dict[str, Path]:
    """Where ``qatune eval`` writes its metrics and predictions for a data file."""
    stem = Path(data_file).stem
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


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file through a temporary sibling and a rename: readers see the old or the new text."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_folder(folder: Path, fill: Callable[[Path], None]) -> Path:
    """Create ``folder`` atomically: ``fill`` writes into a hidden temporary sibling, which is fsynced
    and renamed over ``folder`` (the old one stays until the new one is in place)."""
    folder = Path(folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-tmp-", dir=folder.parent))
    try:
        fill(tmp)
        fsync_tree(tmp)
        replace_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def remove_stale_temporaries(folder: Path) -> None:
    """Remove what a killed process left behind: ``write_folder``'s and ``replace_dir``'s hidden siblings."""
    for pattern in (".*-tmp-*", ".*-old-*"):
        for stale in Path(folder).glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


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


def check_output_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse early (before slow work) an output_dir that cannot or must not be used."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"output_dir {run_dir} is a file; choose a directory path (--output-dir)")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        is_run = looks_like_run(run_dir)
        if not overwrite:
            what = "a run" if is_run else "files"
            raise RunDirError(f"output_dir {run_dir} already holds {what}; pass --overwrite to replace it "
                              "or choose another --output-dir")
        if not is_run:
            raise RunDirError(f"output_dir {run_dir} is not empty and is not a qatune run; refusing to delete it "
                              "even with --overwrite; choose another --output-dir")
    parent = _existing_parent(run_dir)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RunDirError(f"output_dir {run_dir} is not writable (no write permission on {parent}); "
                          "choose another --output-dir")


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
        status = read_status(path).get("status", "unknown")
        raise RunDirError(f"{path} has no {which}/ model (run status: {status}); "
                          f"the run did not finish — train again or pass a checkpoint folder")
    raise RunDirError(f"{path} is not a qatune run directory (no {which}/{MODEL_INFO}); "
                      "pass the output_dir of a 'qatune train' run")


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
