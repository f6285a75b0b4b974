"""What a training has logged, for the page's live view: the loss curves (train and validation), step, epoch,
tokens/s and time left. Read from the run directory alone (metrics.jsonl, run.json, config.yaml) and from the last
line of the training's progress bar, which has the steps in all and the time left."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import yaml

from qatune.runs import layout

BAR = re.compile(r"(\d+)/(\d+) \[([\d:]+)<([\d:?]+)")
"""tqdm's ``n/total [elapsed<remaining`` of ``qatune train``'s progress bar."""
MAX_POINTS = 1000
"""A longer curve is thinned to about this many points (the last one kept)."""


def training_progress(run_dir: Path, log_lines: list[str] = ()) -> dict[str, Any]:
    """The run's curves and figures; ``log_lines``: the end of its training's stderr, when the page started it."""
    records = read_metrics(run_dir / layout.METRICS)
    train = [r for r in records if r.get("event") == "train" and "step" in r]
    evals = [r for r in records if r.get("event") == "eval" and "step" in r]
    status = layout.read_status(run_dir)
    result = status.get("result") or {}
    last = train[-1] if train else {}
    bar = next((m for line in reversed(log_lines) if (m := BAR.search(line))), None)
    step = max(int(bar.group(1)) if bar else 0, int(last.get("step", 0)), int(result.get("steps") or 0))
    total = int(bar.group(2)) if bar else result.get("steps")
    return {
        "status": status.get("status"),
        "step": step,
        "total_steps": total,
        "epoch": last.get("epoch"),
        "epochs": _epochs(run_dir),
        "tokens_per_s": _finite(last.get("tokens_per_s")),
        "elapsed_s": _seconds(bar.group(3)) if bar else None,
        "remaining_s": _seconds(bar.group(4)) if bar and status.get("status") == "running" else None,
        "train": thin([[r["step"], _finite(r.get("loss"))] for r in train]),
        "validation": [[r["step"], _finite(r.get("loss")), _finite(r.get("exact_match")), _finite(r.get("f1"))]
                       for r in evals],
        "result": {key: result.get(key) for key in ("steps", "final_train_loss", "first_train_loss")
                   if _finite(result.get(key)) is not None},
    }


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's lines (a line being written, or damaged, is left out)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return []
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def thin(points: list[list[Any]], limit: int = MAX_POINTS) -> list[list[Any]]:
    if len(points) <= limit:
        return points
    stride = math.ceil(len(points) / limit)
    return points[::stride] + ([points[-1]] if (len(points) - 1) % stride else [])


def _epochs(run_dir: Path) -> int | None:
    try:
        config = yaml.safe_load((run_dir / layout.CONFIG).read_text(encoding="utf-8"))
        return int(config["train"]["epochs"])
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        return None


def _finite(value: Any) -> float | None:
    """A number as JSON can carry it: NaN and infinities (a diverged loss) as None."""
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _seconds(text: str) -> int | None:
    if "?" in text:
        return None
    seconds = 0
    for part in text.split(":"):
        seconds = seconds * 60 + int(part)
    return seconds
