"""Where training runs: the accelerator (device, processes, mixed precision) and the RNG seed."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import torch

from qatune.config import Config
from qatune.errors import ConfigError

GPU_PAD_MULTIPLE = 32
"""On a GPU, batch widths are rounded up to this: every new shape costs kernel warm-up
(bench/gpu_shape_warmup.py measures it on a CUDA machine)."""
CPU_BF16_PAD_MULTIPLE = 2
"""bf16 on CPU: oneDNN builds a matrix kernel for each new shape it meets. On W1 (bench/cpu_pad_multiple.json)
2 made the loop ~5% faster than 1 and a little faster than 4, 8 no faster; in fp32 (MKL) 2 and 4 were slower
(cpu_pad_multiple_fp32.json), so fp32 on CPU keeps exact widths."""


def pad_multiple(device_type: str, precision: str) -> int:
    """What the batch widths of a run are rounded up to: fewer distinct shapes where each new one costs
    a kernel build (GPU; bf16 on CPU), none added in fp32 on CPU (MKL prepares nothing per shape)."""
    if device_type == "cuda":
        return GPU_PAD_MULTIPLE
    return CPU_BF16_PAD_MULTIPLE if device_type == "cpu" and precision == "bf16" else 1


def is_main_process() -> bool:
    """Rank 0 of an ``accelerate launch``/torchrun job (or the only process)."""
    return int(os.environ.get("RANK", "0")) == 0


def resolve_precision(setting: str, device: str) -> str:
    """``train.precision`` as it will run: auto becomes bf16 where bf16 is native, else fp32."""
    if setting != "auto":
        return setting
    return "bf16" if bf16_native(device, unknown=False) else "fp32"


def check_device(device: str, precision: str) -> None:
    """Refuse a ``train.device`` / ``train.precision`` pair this machine cannot run (before anything is written)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is cuda but no GPU is visible; set train.device: auto or cpu")
    on_cpu = device == "cpu" or not torch.cuda.is_available()
    if precision == "fp16" and on_cpu:
        raise ConfigError("train.precision fp16 needs a GPU; on CPU use bf16 or fp32")
    if precision == "bf16" and not on_cpu and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"train.precision bf16 is not supported by this GPU ({torch.cuda.get_device_name()}); "
                          "use fp16 or auto")


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


def bf16_native(device: str, unknown: bool = True) -> bool:
    """Whether bf16 matrix products run natively where training will run (``unknown``: the answer when
    the CPU's flags cannot be read, e.g. not on Linux).

    On CPU that takes the flags (AVX512-BF16 or AMX) and oneDNN, which runs torch's bf16 matrix
    products there, being allowed to use them: under ``ONEDNN_MAX_CPU_ISA=AVX2`` it emulates bf16, far
    slower than fp32 even on an AMX CPU.
    """
    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    if onednn_cap():
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return unknown
    return "avx512_bf16" in flags or "amx_bf16" in flags


def bf16_verdict(device: str) -> str:
    """What ``train.precision: auto`` found about bf16 where training runs, for its log line."""
    if bf16_native(device, unknown=False):
        return "bf16 is native here"
    cap = onednn_cap() if device == "cpu" or not torch.cuda.is_available() else None
    return f"bf16 is not native: {cap} holds oneDNN below AVX512-BF16" if cap else "bf16 is not native here"


_ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def onednn_cap() -> str | None:
    """``NAME=VALUE`` of the variable that holds oneDNN's instruction set below AVX512-BF16, if one does
    (``ONEDNN_MAX_CPU_ISA``, or its older name ``DNNL_MAX_CPU_ISA``, which oneDNN reads when the first is
    unset); None when oneDNN may use bf16 instructions."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(name, "").strip()
        if value:
            return f"{name}={value}" if value.upper() in _ONEDNN_ISAS_WITHOUT_BF16 else None
    return None


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_USER_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocation instead of handing it back to the
    kernel; returns whether it was set.

    A CPU training step allocates and frees hundreds of activation and gradient tensors. By default glibc
    maps large ones afresh and unmaps them when freed, and trims the heap, so every step faults their
    pages in again. Raising the mmap threshold to its maximum (32 MiB) and the trim threshold to 1 GiB keeps
    them in the heap: W1 steps ~5% faster in bf16 and fp32, 2.5-3.8x fewer page faults
    (bench/cpu_allocator.json, bench/cpu_allocator_fp32.json). Not done off glibc, nor when the user set
    glibc's malloc tunables. During training the peak memory is set by what is alive, not by this; once
    training is over, :func:`hand_back_freed_memory` returns what was kept.
    """
    user_set = (any(name in os.environ for name in _USER_MALLOC_SETTINGS)
                or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""))
    if user_set or not _glibc():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def hand_back_freed_memory() -> bool:
    """Return the freed memory glibc's malloc holds (see :func:`keep_freed_memory`) to the kernel; returns
    whether it ran. Called when training is over: what follows (final/, the report's plotting library) would
    otherwise add to the process's peak on top of it (W1: 186 MB handed back, the peak 20 MB lower)."""
    if not _glibc():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    libc.malloc_trim(0)
    return True


def _glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):  # not a name this system knows
        return False


def seed_everything(seed: int) -> None:
    from accelerate.utils import set_seed

    set_seed(seed)
