"""Where training runs: the accelerator (device, processes, mixed precision) and the RNG seed."""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import torch

from qatune.config import Config, differences
from qatune.errors import ConfigError
from qatune.model.precision import check_device
from qatune.train.process_failure import on_every_process


def is_main_process() -> bool:
    """Rank 0 of an ``accelerate launch``/torchrun job (or the only process)."""
    return int(os.environ.get("RANK", "0")) == 0


def make_accelerator(config: Config, precision: str) -> Any:
    from accelerate import Accelerator

    train_cfg = config.train
    check_device(train_cfg.device, precision)
    on_cpu = train_cfg.device == "cpu" or not torch.cuda.is_available()
    mixed = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[precision]
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # One process may train several times (tests, notebooks); accelerate keeps its state global.
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    try:
        # cpu=True also when there is no GPU: accelerate sets up multi-process CPU training (gloo) only then.
        return Accelerator(mixed_precision=mixed, cpu=on_cpu)
    except ValueError as exc:
        raise ConfigError(f"train.precision {precision} is not supported here: {exc}") from None


def check_same_setup(accelerator: Any, config: Config, data: str) -> None:
    """Refuse to train when the processes were started with different configs or rows (machines launched with
    different files): they would train different models in lockstep. ``data``: a digest of the training rows."""
    if accelerator.num_processes == 1:
        return
    import torch.distributed as dist

    mine = {"config": config.model_dump(mode="json", exclude={"output_dir"}), "data": data}
    everyone: list[Any] = [None] * accelerator.num_processes
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        changed = differences(everyone[0]["config"], theirs["config"])
        if theirs["data"] != everyone[0]["data"]:
            changed.append("the training rows (data.train_file's content)")
        if changed:
            raise on_every_process(ConfigError(
                f"the processes were started with different set-ups: process {rank} differs from process 0 in "
                f"{changed}; start every machine with the same config file, --set options and data"))


def seed_everything(seed: int) -> None:
    from accelerate.utils import set_seed

    set_seed(seed)


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory so far, in MiB: what CUDA allocated on a GPU, the resident set size on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        # The high-water mark of this program's own memory. getrusage's maxrss also keeps, across exec, the peak
        # of the process it was forked from (a notebook, a test runner), which can be far larger.
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**10
    except (OSError, StopIteration, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
