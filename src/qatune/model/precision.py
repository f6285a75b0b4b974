"""The precision a run computes in: ``train.precision: auto`` resolved, and whether this machine can run it.

bf16 is chosen only where it is native: a GPU with bf16, or a CPU with AVX512-BF16 or AMX whose oneDNN (which
runs torch's bf16 matrix products there) may use those instructions. Elsewhere bf16 is emulated, far slower
than fp32.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from qatune.errors import ConfigError


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
