"""Fewer distinct shapes where each new one costs a kernel build: ``width_rounding`` and the head's rows.

oneDNN (bf16 matrix products on CPU) builds a kernel for each new shape it meets, and a GPU warms kernels up per
shape; MKL (fp32 on CPU) prepares nothing per shape, so there exact shapes cost least.
"""

from __future__ import annotations

import torch

GPU_WIDTH_MULTIPLE = 32
"""On a GPU, batch widths are rounded up to this."""
CPU_WIDTH_MULTIPLE = 2
"""On a CPU, batch widths are rounded up to this (bf16: larger multiples padded more than they saved)."""
HEAD_ROWS_MULTIPLE = 64
"""The LM head's rows (a batch's supervised tokens, new at almost every step) are rounded up to this, and so are
the rows ``unpadded_rows`` and ``last_layer_rows`` gather (a batch's real tokens): each count never met before
costs oneDNN a kernel build and keeps a few MB of it (bench/results/*/memory_epochs*.json)."""


def width_multiple(device_type: str) -> int:
    """What ``width_rounding`` rounds a batch's width up to on this device."""
    return GPU_WIDTH_MULTIPLE if device_type == "cuda" else CPU_WIDTH_MULTIPLE


def kernels_per_shape(tensor: torch.Tensor) -> bool:
    """Whether products with ``tensor`` are prepared per shape: oneDNN (bf16 on CPU, weights in bf16 or under
    autocast) builds kernels for each new one and keeps them, a GPU warms them up; MKL (fp32 on CPU) prepares
    nothing."""
    if tensor.device.type == "cpu" and tensor.dtype == torch.float32:
        return torch.is_autocast_enabled("cpu")
    return True


def rows_multiple(tensor: torch.Tensor) -> int:
    """What the rows of products with ``tensor`` (its weights) are rounded up to (1: none)."""
    return HEAD_ROWS_MULTIPLE if kernels_per_shape(tensor) else 1
