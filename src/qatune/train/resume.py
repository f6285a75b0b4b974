"""``--resume``: continue a stopped run from its newest checkpoint, exactly as if it never stopped."""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from pathlib import Path

import torch

from qatune.config import Config, differences, load_config
from qatune.errors import ConfigError, DataError, RunDirError
from qatune.runs import layout
from qatune.runs.lock import RunLock
from qatune.train.checkpoint import TrainState, find_checkpoint, load_state
from qatune.train.device import is_main_process
from qatune.train.outcome import prepare_checked, run_and_record
from qatune.train.preparation import fingerprint
from qatune.train.signals import resume_command

log = logging.getLogger("qatune")

RESUMABLE_KEYS = ("output_dir", "train.epochs", "train.save_every", "train.keep_checkpoints", "train.logging_steps",
                  "train.early_stopping_patience", "train.eval_batch_size", "generate.")
"""Keys that may change when a run is resumed; anything else must match the run's saved config."""


def saved_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config a run was saved with (RUN/config.yaml), ``overrides`` applied on top: what ``--resume``
    uses without ``--config``."""
    run_dir = run_dir_of(Path(path))
    saved = run_dir / layout.CONFIG
    if not saved.is_file():
        raise RunDirError(f"nothing to resume in {path}: {saved} not found; pass a run directory written by "
                          "qatune train (or one of its checkpoints)")
    return load_config(saved, overrides)


def resume_run(config: Config, path: Path, progress: bool) -> Path:
    run_dir = run_dir_of(path)
    with RunLock(run_dir) if is_main_process() else nullcontext():
        return _resume_locked(config, path, run_dir, progress)


def run_dir_of(path: Path) -> Path:
    """The run directory of a run directory or of one of its checkpoints."""
    path = Path(path)
    return path.parent.parent if path.parent.name == layout.CHECKPOINTS else path


def _resume_locked(config: Config, path: Path, run_dir: Path, progress: bool) -> Path:
    checkpoint = find_checkpoint(path)
    saved = load_config(run_dir / layout.CONFIG)
    changed = [key for key in differences(saved.model_dump(mode="json"), config.model_dump(mode="json"))
               if not key.startswith(RESUMABLE_KEYS)]
    if changed:
        may_change = ", ".join(key + "*" if key.endswith(".") else key for key in RESUMABLE_KEYS[1:])
        raise ConfigError(f"the config differs from the run being resumed in {changed}; only {may_change} may "
                          f"change on resume: resume without --config (the run's own {run_dir / layout.CONFIG} is "
                          "used) and --set only those keys, or start a new run")
    state = load_state(checkpoint)
    check_epochs_left(state, config.train.epochs, saved.train.epochs, checkpoint, path)
    check_processes(state, checkpoint, path)
    config = config.model_copy(update={"output_dir": str(run_dir)})
    prepared = prepare_checked(config)
    if layout.read_status(run_dir).get("data_fingerprint") not in (None, fingerprint(prepared)):
        raise DataError(f"the training data changed since {run_dir} was started; an exact resume needs the same "
                        "rows (start a new run to train on the new data)")
    if not (checkpoint / layout.SHARDS).is_dir():  # a sharded run's weights are loaded once it is sharded
        prepared.model = load_weights(prepared.model, checkpoint)
    prepared.base_model = None  # RUN/base is already saved
    if is_main_process():
        layout.write_config(run_dir, config.to_yaml())
        layout.write_status(run_dir, status="running", resumed_from=str(checkpoint))
    return run_and_record(prepared, run_dir, progress, resume_from=checkpoint)


def check_epochs_left(state: TrainState, epochs: int, planned: int, checkpoint: Path, path: Path) -> None:
    """Refuse a ``train.epochs`` that would end the run without training (a stale config file would
    otherwise mark a stopped run complete). The one exception: a checkpoint at the end of the run's own last
    epoch, where resuming only writes final/ and the report (a run stopped just before them). ``path`` is
    what was asked to resume: a run directory or a checkpoint."""
    done = state.epoch  # whole epochs trained; a checkpoint inside an epoch has consumed > 0
    if epochs > done:
        return
    if state.consumed == 0 and epochs == done == planned:
        log.info("nothing left to train: %s ends epoch %d of %d; writing final/ and the report", checkpoint,
                 done, planned)
        return
    where = (f"in epoch {done + 1} of {planned}" if state.consumed else f"after epoch {done} of {planned}")
    raise ConfigError(f"the run stopped {where} (step {state.step}, {checkpoint}); train.epochs {epochs} would "
                      f"end it without training: resume with the run's own config ({resume_command(path)}) "
                      f"or --set train.epochs to {done + 1} or more")


def check_processes(state: TrainState, checkpoint: Path, path: Path, processes: int | None = None) -> None:
    """Refuse to resume with another number of processes (this run's, or ``processes``): the batches of an epoch, and
    so the steps, are split by it, and the position in the epoch is counted per process."""
    processes = processes or int(os.environ.get("WORLD_SIZE", "1"))
    if state.processes is not None and state.processes != processes:
        raise ConfigError(f"{checkpoint} was written by a run of {state.processes} process"
                          f"{'es' if state.processes > 1 else ''} and this one has {processes}: an exact resume "
                          f"needs the same number (each process trains its own share of every step): "
                          f"{resume_command(path, state.processes)}")


def check_launch(path: str, processes: int) -> None:
    """Before ``processes`` are launched to resume ``path``: refused at once if they could not resume it."""
    checkpoint = find_checkpoint(Path(path))
    check_processes(load_state(checkpoint), checkpoint, Path(path), processes)


def load_weights(model: torch.nn.Module, checkpoint: Path) -> torch.nn.Module:
    """A checkpoint's weights (or LoRA adapters) into the freshly built model."""
    from safetensors.torch import load_file

    if (checkpoint / "adapter_model.safetensors").is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(checkpoint / "adapter_model.safetensors"))
        return model
    state = load_file(checkpoint / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or [])
    missing = [key for key in missing if key not in tied]
    if missing or unexpected:
        raise RunDirError(f"checkpoint {checkpoint} does not fit the model (missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]})")
    model.tie_weights()
    return model
