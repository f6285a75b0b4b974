"""Resumable checkpoints: RUN/checkpoints/step-NNNNNNN/.

A checkpoint is a model folder (model.safetensors, tokenizer, config.yaml, qatune.json: eval and
generate accept it) plus what an exact resume needs: optimizer.pt and scheduler.pt (tensors and
numbers only, read back with ``torch.load(weights_only=True)``), rng.pt, and trainer_state.json
(step, epoch, position in the epoch, best metrics); with train.ema_decay, average.pt (the weights' moving
average: the model folder holds the weights as trained, which a resume continues from). A run with
train.distributed fsdp writes its weights, optimizer state and average in place of model.safetensors,
optimizer.pt and average.pt as sharded/, one file per process (torch.distributed.checkpoint). It is written with
:func:`qatune.runs.atomic.write_folder`, so a process killed at any moment leaves either the new checkpoint or
none, never a half-written one under a valid name.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qatune.errors import RunDirError
from qatune.runs import atomic, layout
from qatune.train import averaging
from qatune.train.averaging import WeightAverage

log = logging.getLogger("qatune")

_NAME = re.compile(r"^step-(\d+)$")
TRAINER_STATE = "trainer_state.json"
_LINK_REFUSED = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES)
"""os.link errors that mean "copy instead" (another file system, no hard links); a full disk is not one."""
RESUME_FILES = (TRAINER_STATE, "optimizer.pt", "scheduler.pt", "rng.pt")
"""What a checkpoint holds beyond a model folder."""
SHARDED_FILES = (TRAINER_STATE, "scheduler.pt", "rng.pt", f"{layout.SHARDS}/.metadata")
"""What a sharded run's checkpoint holds beyond its model's config and tokenizer."""


LOG_WINDOW_KEYS = ("loss_sum", "items", "tokens", "seconds")
"""What a checkpoint saves of the open logging window (qatune.train.logs.LogWindow)."""


@dataclass
class TrainState:
    """Where training stands; saved as trainer_state.json in every checkpoint."""

    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """Current epoch, 0-based."""
    consumed: int = 0
    """Micro-batches of the current epoch already trained on (per process)."""
    best: dict[str, Any] | None = None
    best_checkpoint: str | None = None
    stale_evals: int = 0
    """Evaluations in a row without improvement (early stopping)."""
    first_loss: float = float("nan")
    last_loss: float = float("nan")
    bad_steps: list[int] = field(default_factory=list)
    optimizer_format: str = "torch"
    """Where the optimizer's state is: torch (optimizer.pt, its own state_dict), or dcp (sharded/, with the weights:
    a run with train.distributed fsdp)."""
    processes: int | None = None
    """How many processes trained (the batches of an epoch are split between them). None in checkpoints written
    before it was saved."""
    log_window: dict[str, float] | None = None  # LOG_WINDOW_KEYS
    """The open logging window (loss sum, items, tokens, seconds since the last metrics line). None in
    checkpoints written before it was saved: a run resumed from one starts an empty window."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / layout.CHECKPOINTS


def save_checkpoint(run_dir: Path, state: TrainState, model: Any, tokenizer: Any, config: Any, info: Any,
                    optimizer: torch.optim.Optimizer, schedulers: dict[str, Any], keep: int,
                    shards: Callable[[Path], None] | None = None, average: WeightAverage | None = None) -> Path:
    """Write a checkpoint atomically, then prune all but the last ``keep`` (and the best). ``shards``: writes the
    weights and optimizer state of a sharded model into a folder (in place of model.safetensors and optimizer.pt),
    every process taking part. ``average``: train.ema_decay's average, saved beside the trained weights (by
    ``shards`` with the weights' shards in a sharded run; counted in the space the folder needs either way)."""
    from qatune.model.folder import write_model_files

    def fill(folder: Path) -> None:
        write_model_files(folder, model, tokenizer, config, info, with_weights=shards is None)
        with _without_zip_checksums():
            if shards is None:
                torch.save(optimizer.state_dict(), folder / "optimizer.pt")
            else:
                shards(folder)
            torch.save({k: s.state_dict() for k, s in schedulers.items() if s is not None}, folder / "scheduler.pt")
            torch.save(_rng_state(), folder / "rng.pt")
            if average is not None and shards is None:
                average.save(folder)
        # Written last: a folder without it is not a checkpoint.
        (folder / TRAINER_STATE).write_text(json.dumps(asdict(state), indent=2) + "\n", encoding="utf-8")

    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    size = _state_bytes(model.state_dict()) + sum(_state_bytes(s) for s in optimizer.state.values())
    if average is not None:
        size += sum(t.numel() * t.element_size() for t in average.averages)
    path = atomic.write_folder(root / f"step-{state.step:07d}", fill, size_hint=size)
    _prune(root, keep, state.best_checkpoint)
    return path


@contextmanager
def _without_zip_checksums() -> Iterator[None]:
    """torch.save computes a CRC-32 of every record, which torch.load never checks (damage is found by the
    folder's manifest instead): skipping it makes writing the optimizer state about 2x faster."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def model_folder_from(checkpoint: Path, folder: Path) -> Path:
    """Write ``folder`` (atomically) as the model folder of ``checkpoint``: its model files hard-linked
    (copied where the file system refuses links), so the weights are not serialized a second time."""
    def fill(tmp: Path) -> None:
        for source in sorted(checkpoint.rglob("*")):
            relative = source.relative_to(checkpoint)
            if not source.is_file() or relative.as_posix() in (*RESUME_FILES, averaging.FILE, atomic.MANIFEST) or \
                    relative.parts[0] == layout.SHARDS:
                continue
            target = tmp / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target)
            except OSError as exc:
                if exc.errno not in _LINK_REFUSED:
                    raise
                shutil.copy2(source, target)

    return atomic.write_folder(folder, fill)


def find_checkpoint(path: Path) -> Path:
    """``path`` itself when it is a checkpoint, else the newest intact checkpoint of a run directory.

    A damaged checkpoint (a truncated, missing or edited file) is skipped for the next older one, with
    a warning; a damaged checkpoint named directly, or a run with no intact one, is an error.
    """
    path = Path(path)
    if path.parent.name == layout.CHECKPOINTS and not path.exists():
        kept = [p.name for p in list_checkpoints(path.parent.parent)]
        if not kept:
            raise RunDirError(f"no checkpoint {path.name} in {path.parent}, which holds none; pass a run directory "
                              "that saved checkpoints, or start a new run")
        raise RunDirError(f"no checkpoint {path.name} in {path.parent} (it holds {', '.join(kept)}); resume from "
                          "one of those, or from the run directory for its newest intact one")
    if (path / TRAINER_STATE).is_file() or path.parent.name == layout.CHECKPOINTS:
        problem = damage(path)
        if problem:
            raise RunDirError(f"checkpoint {path} is damaged: {problem}; resume from the run directory to use "
                              "its newest intact checkpoint")
        return path
    candidates = list_checkpoints(path)
    if not candidates:
        raise RunDirError(f"nothing to resume in {path}: no checkpoints/step-*/trainer_state.json; "
                          "start a new run, or pass a run directory that saved checkpoints")
    for checkpoint in reversed(candidates):
        problem = damage(checkpoint)
        if problem is None:
            return checkpoint
        log.warning("skipping damaged checkpoint %s: %s", checkpoint.name, problem)
    raise RunDirError(f"no intact checkpoint to resume in {path}: every one is damaged (newest: "
                      f"{damage(candidates[-1])}); start a new run")


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint (None when it can be resumed from)."""
    sharded = (checkpoint / layout.SHARDS).is_dir()
    for name in SHARDED_FILES if sharded else RESUME_FILES:
        if not (checkpoint / name).is_file():
            return f"{checkpoint / name} is missing"
    if not sharded and not any((checkpoint / name).is_file()
                               for name in ("model.safetensors", "adapter_model.safetensors")):
        return f"{checkpoint} holds no model.safetensors"
    problem = atomic.damage(checkpoint)
    if problem:
        return problem
    try:
        load_state(checkpoint)
    except (ValueError, TypeError) as exc:
        return f"{checkpoint / TRAINER_STATE} is not a valid training state ({exc})"
    return None


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def load_state(checkpoint: Path) -> TrainState:
    data = json.loads((checkpoint / TRAINER_STATE).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise TypeError("not a JSON object")
    state = TrainState(**{k: v for k, v in data.items() if k in TrainState.__dataclass_fields__})
    for name in ("step", "epoch", "consumed", "stale_evals", "processes"):
        value = getattr(state, name)
        if name == "processes" and value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a whole number >= 0, found {value!r}")
    window = state.log_window
    if window is not None and not (isinstance(window, dict) and set(window) == set(LOG_WINDOW_KEYS) and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in window.values())):
        raise ValueError(f"log_window must be an object of the numbers {list(LOG_WINDOW_KEYS)}, found {window!r}")
    return state


def restore(checkpoint: Path, optimizer: torch.optim.Optimizer, schedulers: dict[str, Any],
            load_shards: Callable[[Path], None] | None = None) -> TrainState:
    """Load optimizer, scheduler and RNG states (safe loading: tensors and plain data only). ``load_shards``: loads
    a sharded run's weights and optimizer state from the checkpoint (train.distributed fsdp)."""
    state = load_state(checkpoint)
    if (state.optimizer_format == "torch") != (load_shards is None):
        written = "without" if state.optimizer_format == "torch" else "with"
        raise RunDirError(f"{checkpoint} was written by a run {written} train.distributed fsdp; resume it with the "
                          "train.distributed it was trained with")
    if load_shards is None:
        optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=True, map_location="cpu"))
    else:
        load_shards(checkpoint)
    saved = torch.load(checkpoint / "scheduler.pt", weights_only=True)
    for key, scheduler in schedulers.items():
        if scheduler is not None and key in saved:
            scheduler.load_state_dict(saved[key])
    _set_rng_state(torch.load(checkpoint / "rng.pt", weights_only=True))
    return state


def _state_bytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": pos, "has_gauss": has_gauss, "cached": cached},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _prune(root: Path, keep: int, best: str | None) -> None:
    checkpoints = [p for p in root.iterdir() if _NAME.match(p.name)]
    checkpoints.sort(key=lambda p: int(_NAME.match(p.name).group(1)))
    for old in checkpoints[:-keep]:
        if old.name != best:
            atomic.remove_dir(old)  # a kill during the deletion must not leave a half-deleted checkpoint
    atomic.remove_stale_temporaries(root)
