"""What a bug report needs: versions, devices and threads."""

from __future__ import annotations

import ctypes
import importlib.metadata
import os
import platform
import sys

from qatune import __version__

_PACKAGES = ["torch", "transformers", "tokenizers", "accelerate", "pandas", "numpy", "openpyxl", "peft"]


def environment() -> dict[str, str]:
    info = {
        "qatune": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": str(os.cpu_count()),
    }
    for name in _PACKAGES:
        try:
            info[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info[name] = "not installed"
    try:
        import torch
    except ImportError:
        return info
    info["torch_threads"] = str(torch.get_num_threads())
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["device"] = f"cuda ({', '.join(names)}), CUDA {torch.version.cuda}"
        info["bf16"] = str(torch.cuda.is_bf16_supported())
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        info["device"] = "mps"
    else:
        info["device"] = "cpu"
    info["hf_hub_offline"] = os.environ.get("HF_HUB_OFFLINE", "0")
    return info


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to reuse freed memory instead of returning it to the system.

    A CPU training step allocates and frees hundreds of activation tensors; with glibc's defaults
    the large ones are mmap'd and unmapped every step, and each page is faulted in again (about
    10,000 page faults per W1 step, ~40 ms of kernel time). Raising the mmap and trim thresholds keeps
    those pages in the heap for the next step. What jemalloc/tcmalloc preloading would do, without
    asking the user to preload anything. No-op (False) where the C library is not glibc.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from malloc.h
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30))
    except (OSError, AttributeError):
        return False
