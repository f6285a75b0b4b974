"""``fused_gelu``: transformers' Python tanh-GELU swapped for torch's fused kernel of the same function.

GPT-2's ``gelu_new`` is written in Python as six elementwise kernels; torch's ``gelu(approximate="tanh")`` is
one. The model's config and saved weights are unchanged.
"""

from __future__ import annotations

from torch import nn


def python_gelus(model: nn.Module) -> int:
    """How many of transformers' Python tanh-GELU modules the model holds."""
    try:
        from transformers.activations import NewGELUActivation
    except ImportError:
        return 0
    return sum(type(module) is NewGELUActivation for module in model.modules())


def fuse_activations(model: nn.Module) -> int:
    """Swap every Python tanh-GELU of the model for torch's fused one; returns the number swapped."""
    try:
        from transformers.activations import NewGELUActivation, PytorchGELUTanh
    except ImportError:
        return 0
    swapped = 0
    for module in model.modules():
        for name, child in module.named_children():
            if type(child) is NewGELUActivation:
                setattr(module, name, PytorchGELUTanh())
                swapped += 1
    return swapped
