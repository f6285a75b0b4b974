"""What a command has drawn and logged, for the page's live views. A training's loss curves (train and validation),
validation's metrics per epoch (metric_records.VALIDATED), step, epoch, tokens/s and time left come from the run
directory (metrics.jsonl, run.json, config.yaml) and the last line of its progress bar, which has the steps in all and
the time left. The rows a command answers (validation after each epoch, eval --compare's two models, generate --file,
export's check) come from the bars inference draws on stderr (``generate:  40%|####  | 80/200 [00:10<00:15,
8.00row/s]``), read as they come (RowBars)."""

from __future__ import annotations

import json
import math
import re
import threading
from pathlib import Path
from typing import Any

import yaml

from qatune.inference.metric_records import VALIDATED, columns
from qatune.runs import layout

BAR = re.compile(r"^train: .*?(\d+)/(\d+) \[([\d:]+)<([\d:?]+)")
"""tqdm's ``n/total [elapsed<remaining`` of ``qatune train``'s progress bar (validation draws bars of its own)."""
ANY_BAR = re.compile(r"^([A-Za-z][\w-]*): +\d+%\|[^|]*\| *(\d+)/(\d+) \[([\d:]+)<([\d:?]+)[,\]]")
"""Any tqdm bar of a qatune command: its description, ``n/total [elapsed<remaining`` (a drawing cut short by a
read does not match)."""
TRAIN_DESC = "train"
MAX_POINTS = 1000
"""A longer curve is thinned to about this many points (the last one kept)."""


def training_progress(run_dir: Path, log_lines: list[str] = (), validating: dict[str, Any] | None = None
                      ) -> dict[str, Any]:
    """The run's curves and figures; ``log_lines``: the end of its training's stderr, when the page started it;
    ``validating``: the rows validation has answered so far, while it runs (RowBars.current)."""
    records = read_metrics(run_dir / layout.METRICS)
    train = [r for r in records if r.get("event") == "train" and "step" in r]
    evals = [r for r in records if r.get("event") == "eval" and "step" in r]
    status = layout.read_status(run_dir)
    result = status.get("result") or {}
    last = train[-1] if train else {}
    bar = next((m for line in reversed(log_lines) if (m := BAR.search(line))), None)
    step = max(int(bar.group(1)) if bar else 0, int(last.get("step", 0)), int(result.get("steps") or 0))
    total = int(bar.group(2)) if bar else result.get("steps")
    running = status.get("status") == "running"
    return {
        "status": status.get("status"),
        "step": step,
        "total_steps": total,
        "epoch": last.get("epoch"),
        "epochs": _epochs(run_dir),
        "tokens_per_s": _finite(last.get("tokens_per_s")),
        "elapsed_s": _seconds(bar.group(3)) if bar else None,
        "remaining_s": _seconds(bar.group(4)) if bar and running else None,
        "validating": validating if running else None,
        "train": thin([[r["step"], _finite(r.get("loss"))] for r in train]),
        "validation": [[r["step"], _finite(r.get("loss")), _finite(r.get("exact_match")), _finite(r.get("f1"))]
                       for r in evals],
        "evaluations": [{"epoch": r.get("epoch"), "step": r["step"],
                         **{name: _finite(r.get(name)) for name in VALIDATED}, "rows": r.get("num_examples")}
                        for r in evals],
        "validation_columns": columns(VALIDATED),
        "result": {key: result.get(key) for key in ("steps", "final_train_loss", "first_train_loss")
                   if _finite(result.get(key)) is not None},
    }


class RowBars:
    """The tqdm bars a command draws on stderr, fed its text as it is written: the bar drawn last (its rows done, in
    all, the time spent and left), how many bars of rows have begun (eval --compare answers with one model, then the
    other), and whether the last drawing was one of training's step bars. Thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.partial = ""
        self.last: dict[str, Any] | None = None
        """The last bar of rows drawn (not training's steps)."""
        self.begun = 0
        """Bars of rows begun: a drawing after training's, of another description, or of fewer rows than the drawing
        before (a bar draws its 0 first, and more rows before the next one begins)."""
        self.training_last = False
        """Whether the last bar drawn was training's (so no rows are being answered now)."""

    def feed(self, text: str) -> None:
        with self.lock:
            pieces = re.split(r"[\r\n]", self.partial + text)
            self.partial = pieces.pop()  # the drawing written last: the next text may go on with it
            for piece in [*pieces, self.partial]:  # (read again with the next text: a drawing counts once)
                self._line(piece)

    def _line(self, line: str) -> None:
        found = ANY_BAR.match(line.strip())
        if found is None:
            return
        desc, done, total = found.group(1), int(found.group(2)), int(found.group(3))
        if desc == TRAIN_DESC:
            self.training_last = True
            return
        previous = self.last
        if (previous is None or self.training_last or desc != previous["desc"] or done < previous["done"]
                or (done == 0 and total != previous["total"])):
            self.begun += 1
        self.training_last = False
        self.last = {"desc": desc, "done": done, "total": total, "elapsed_s": _seconds(found.group(4)),
                     "remaining_s": _seconds(found.group(5)), "bar": self.begun}

    def current(self) -> dict[str, Any] | None:
        """The bar of rows drawn last, unless training's steps were drawn after it; ``active``: rows are left."""
        with self.lock:
            if self.last is None or self.training_last:
                return None
            return {**self.last, "active": self.last["done"] < self.last["total"]}


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
