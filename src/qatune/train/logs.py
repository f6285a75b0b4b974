"""What training writes as it goes: metrics.jsonl (and TensorBoard), one line per logging step."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qatune.runs import atomic, layout


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl (nothing when path is None), and to
    TensorBoard when asked."""

    def __init__(self, path: Path | None, tensorboard: bool = False):
        self.path = path
        self.writer = None
        if path is not None and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(path.parent / layout.TENSORBOARD))

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")
        if self.writer is not None:
            prefix = record.get("event", "train")
            for key, value in record.items():
                if key not in ("event", "step", "epoch") and isinstance(value, int | float):
                    self.writer.add_scalar(f"{prefix}/{key}", value, record.get("step", 0))
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def truncate_after(self, step: int) -> None:
        """Drop lines logged after ``step`` (a resumed run writes them again)."""
        if self.path is None or not self.path.exists():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
        atomic.atomic_write_text(self.path, "".join(line + "\n" for line in kept))


@dataclass
class LogWindow:
    """Loss (weighted by supervised items) and throughput since the last log line. Saved in every checkpoint, so
    a window that spans an interruption logs what an uninterrupted run logs."""

    loss_sum: float = 0.0
    items: int = 0
    tokens: int = 0
    since: float = field(default_factory=time.perf_counter)

    def state(self) -> dict[str, float]:
        """The open window for trainer_state.json; its time as the seconds it has run so far."""
        return {"loss_sum": self.loss_sum, "items": self.items, "tokens": self.tokens,
                "seconds": time.perf_counter() - self.since}

    @classmethod
    def restored(cls, saved: dict[str, float] | None) -> LogWindow:
        """The window a checkpoint saved; an empty one for checkpoints written before windows were saved."""
        if saved is None:
            return cls()
        return cls(float(saved["loss_sum"]), int(saved["items"]), int(saved["tokens"]),
                   time.perf_counter() - float(saved["seconds"]))

    def add(self, loss: float, items: int, tokens: int) -> None:
        self.loss_sum += loss * items
        self.items += items
        self.tokens += tokens

    def flush(self, *, step: int, epoch: int, lr: float, grad_norm: float, supervised: int) -> dict[str, Any]:
        elapsed = max(time.perf_counter() - self.since, 1e-9)
        record = {"step": step, "epoch": epoch, "loss": self.loss_sum / max(self.items, 1), "lr": lr,
                  "grad_norm": grad_norm, "supervised_tokens": supervised, "tokens_per_s": self.tokens / elapsed}
        self.loss_sum, self.items, self.tokens, self.since = 0.0, 0, 0, time.perf_counter()
        return record
