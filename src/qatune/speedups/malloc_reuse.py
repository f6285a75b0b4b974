"""CPU training: glibc's malloc keeps freed memory for reuse during training, and hands it back afterwards.

A CPU training step allocates and frees hundreds of activation and gradient tensors. By default glibc maps
large ones afresh and unmaps them when freed, and trims the heap, so every step faults their pages in again.
Raising the mmap threshold to its maximum (32 MiB) and the trim threshold to 1 GiB keeps them in the heap
(``bench/probes/ablate.py --path malloc_reuse`` measures it). Not done off glibc, nor when the user set
glibc's malloc tunables. During training the peak memory is set by what is alive, not by this.
"""

from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_USER_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def user_settings() -> bool:
    """Whether the user set glibc's malloc tunables themselves (then malloc is left to them)."""
    return (any(name in os.environ for name in _USER_MALLOC_SETTINGS)
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""))


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocation instead of handing it back to the
    kernel; returns whether it was set."""
    if user_settings() or not glibc():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def hand_back_freed_memory() -> bool:
    """Return the freed memory glibc's malloc holds to the kernel; returns whether it ran. Called when
    training is over: what follows (final/, the report's plotting library) would otherwise add to the
    process's peak on top of it."""
    if not glibc():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    libc.malloc_trim(0)
    return True


def glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (ValueError, OSError):  # not a name this system knows
        return False
