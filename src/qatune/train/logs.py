"""What training writes as it goes: metrics.jsonl, one line per logging step, and the same numbers to the
trackers of train.report_to: TensorBoard, and MLflow and Trackio through accelerate's trackers."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qatune.config import Config
from qatune.errors import ConfigError
from qatune.runs import atomic, layout

log = logging.getLogger("qatune")

TRACKER_MODULES = {"tensorboard": ("tensorboard",), "mlflow": ("mlflow", "sqlalchemy", "alembic"),
                   "trackio": ("trackio",)}
"""What each tracker of train.report_to imports; pyproject.toml's extra of the same name installs them (MLflow's
local store is a SQLite file, written through SQLAlchemy and alembic)."""


def trackers(report_to: str | list[str]) -> list[str]:
    """train.report_to as a list of tracker names, each once (none: an empty list)."""
    names = [report_to] if isinstance(report_to, str) else report_to
    return list(dict.fromkeys(name for name in names if name != "none"))


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_trackers(report_to: str | list[str]) -> None:
    """Refuse, before anything is loaded or trained, trackers whose packages are not installed."""
    missing = [name for name in trackers(report_to) if not all(map(installed, TRACKER_MODULES[name]))]
    if missing:
        verb = "needs" if len(missing) == 1 else "need"
        raise ConfigError(f"train.report_to {' and '.join(missing)} {verb}: pip install 'qatune[{','.join(missing)}]'")


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl (nothing when path is None: on the other processes), and
    logs its numbers to the trackers of train.report_to, with the resolved config as mlflow's and trackio's
    parameters. Their runs are named after the run directory.

    mlflow's and trackio's are accelerate's trackers, driven here rather than through Accelerator(log_with=...):
    Accelerator.end_training, which finishes them, also ends the process group that saving final/ still needs."""

    def __init__(self, path: Path | None, report_to: str | list[str] = "none", config: Config | None = None,
                 resumed_from: Path | None = None):
        self.path = path
        names = trackers(report_to) if path is not None else []
        self.tensorboard = path.parent / layout.TENSORBOARD if "tensorboard" in names else None
        """TensorBoard's folder; its writer is opened at the first line written (after a resume's truncation)."""
        self.writer = None
        self.purge_step: int | None = None
        self.trackers: list[Any] = []
        accelerated = [name for name in names if name in _OPEN]
        if accelerated:
            run_name = path.parent.name + (f" (resumed from {resumed_from.name})" if resumed_from else "")
            params = _params(config) if config is not None else {}
            with _stdout_to_stderr():
                for name in accelerated:
                    try:
                        tracker = _OPEN[name](path.parent, run_name)
                        tracker.start()
                    except Exception as exc:  # e.g. a tracking server that does not answer
                        self.close("failed")
                        raise ConfigError(f"train.report_to {name}: cannot start logging: {exc}") from exc
                    self.trackers.append(tracker)
                    tracker.store_init_configuration(params)

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")
        step, scalars = record.get("step", 0), _scalars(record)
        if self.tensorboard is not None and self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the events of earlier writers from that step on (a resumed run's)
            self.writer = SummaryWriter(log_dir=str(self.tensorboard), purge_step=self.purge_step)
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        with _stdout_to_stderr():
            for tracker in self.trackers:
                tracker.log(scalars, step=step)

    def close(self, outcome: str = "complete") -> None:
        """Finish the trackers' runs (once; later calls do nothing). ``outcome``: complete, stopped or failed, as
        run.json says; mlflow's run ends FINISHED, KILLED or FAILED accordingly."""
        self.tensorboard = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        started, self.trackers = self.trackers, []
        with _stdout_to_stderr():
            for tracker in started:
                if tracker.name == "trackio":
                    import trackio

                    # accelerate's finish leaves the run trackio's current one, which trackio finishes (and
                    # announces on stdout) again at exit; trackio.finish() finishes it and forgets it.
                    trackio.finish()
                elif tracker.name == "mlflow":
                    import mlflow

                    mlflow.end_run(status=_MLFLOW_STATUS[outcome])
                else:
                    tracker.finish()

    @contextlib.contextmanager
    def closed_on_error(self) -> Iterator[None]:
        """Inside, an exception finishes the trackers' runs as stopped (a stop asked for, Ctrl-C) or failed."""
        from qatune.train.signals import TrainingInterrupted

        try:
            yield
        except BaseException as exc:
            try:
                self.close("stopped" if isinstance(exc, TrainingInterrupted | KeyboardInterrupt) else "failed")
            except Exception as closing:  # the training error is the one to report
                log.warning("could not finish the trackers' runs: %s", closing)
            raise

    def truncate_after(self, step: int) -> None:
        """Drop lines logged after ``step`` (a resumed run writes them again), in TensorBoard too."""
        self.purge_step = step + 1
        if self.path is None or not self.path.exists():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if json.loads(line).get("step", 0) <= step]
        atomic.atomic_write_text(self.path, "".join(line + "\n" for line in kept))


_MLFLOW_STATUS = {"complete": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


def _scalars(record: dict[str, Any]) -> dict[str, int | float]:
    """A metrics.jsonl line's numbers under the names the trackers show: train/loss, eval/f1..."""
    prefix = record.get("event", "train")
    return {f"{prefix}/{key}": value for key, value in record.items()
            if key not in ("event", "step", "epoch") and isinstance(value, int | float)}


def _params(config: Config) -> dict[str, Any]:
    """The resolved config as flat parameters (train.learning_rate: 0.0001), lists as JSON text."""
    flat: dict[str, Any] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                flat[prefix + key] = json.dumps(value) if isinstance(value, list) else value

    walk(config.model_dump(mode="json"), "")
    return flat


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """trackio announces itself with print(); stdout is for command results (qatune train prints the run
    directory)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _import_with(module: str, **variables: str) -> None:
    """Import ``module`` (once a process) with the environment ``variables`` that the user has not set, set only
    while it is imported: it reads them then, and the environment is left as it was."""
    if module in sys.modules:
        return
    added = {name: value for name, value in variables.items() if not os.environ.get(name)}
    os.environ.update(added)
    try:
        importlib.import_module(module)
    finally:
        for name in added:
            del os.environ[name]


def _mlflow(run_dir: Path, run_name: str) -> Any:
    """accelerate's MLflowTracker, the experiment named after the run directory, on MLFLOW_TRACKING_URI when it is
    set, else on a SQLite store in RUN/mlflow (MLflow 3 refuses its plain-files store by default)."""
    _import_with("mlflow", MLFLOW_DISABLE_TELEMETRY="true")  # offline: no usage reports to MLflow's servers
    import mlflow
    from accelerate.tracking import MLflowTracker

    uri, artifacts = os.environ.get("MLFLOW_TRACKING_URI"), None
    if not uri:
        store = (run_dir / layout.MLFLOW).resolve()
        store.mkdir(exist_ok=True)
        uri, artifacts = f"sqlite:///{(store / layout.MLFLOW_DB).as_posix()}", (store / "artifacts").as_uri()
    mlflow.set_tracking_uri(uri)  # also when the variable is set: an earlier run in this process set its own
    return MLflowTracker(experiment_name=run_dir.name, logging_dir=artifacts, run_name=run_name)


def _trackio(run_dir: Path, run_name: str) -> Any:
    """accelerate's TrackioTracker, the project named after the run directory, stored in RUN/trackio unless
    TRACKIO_DIR is set (trackio reads it once, when first imported)."""
    store = (run_dir / layout.TRACKIO).resolve()
    _import_with("trackio", TRACKIO_DIR=str(store))
    import trackio.utils
    from accelerate.tracking import TrackioTracker

    if not os.environ.get("TRACKIO_DIR") and trackio.utils.TRACKIO_DIR != store:
        log.warning("train.report_to trackio: logging to %s, not %s: trackio keeps the directory it found when this "
                    "process first imported it", trackio.utils.TRACKIO_DIR, store)
    # embed=False: in a notebook, trackio would start its dashboard's server
    return TrackioTracker(run_dir.name, name=run_name, embed=False)


_OPEN = {"mlflow": _mlflow, "trackio": _trackio}
"""How to open each tracker logged through accelerate (TensorBoard is written directly)."""


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
