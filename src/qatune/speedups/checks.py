"""What the paths' start-up checks share: comparing with the model's own outputs, and remembering the answer.

Every path that changes how a step is computed is used for a model only after it has reproduced the model's own
outputs on a tiny batch, on the device the run trains on and under the precision it computes in. The answer is
remembered per model (evaluations build their loss once per epoch), keyed by what it was checked under.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

_REMEMBERED: weakref.WeakKeyDictionary[nn.Module, dict[Hashable, Any]] = weakref.WeakKeyDictionary()

REDUCED_PRECISION_SLACK = 100.0
"""How much looser a check is under bf16/fp16 autocast than in fp32: products at another batch size or through
another kernel round differently, by about the format's precision (bf16 keeps 8 bits). A real difference (a
wrong position, a wrong mask) is of the size of the values compared."""


def remembered(model: nn.Module, key: Hashable, compute: Callable[[nn.Module], Any]) -> Any:
    """``compute(model)``, once per model and ``key``."""
    answers = _REMEMBERED.setdefault(model, {})
    if key not in answers:
        answers[key] = compute(model)
    return answers[key]


def forget(model: nn.Module) -> None:
    """Drop what was remembered for ``model`` (its weights or placement changed)."""
    _REMEMBERED.pop(model, None)


def close_enough(mine: torch.Tensor, theirs: torch.Tensor, tolerance: float) -> bool:
    """Same shape, and equal within ``tolerance`` absolute plus ``tolerance`` relative (``torch.allclose``)."""
    return mine.shape == theirs.shape and torch.allclose(mine.float(), theirs.float(), atol=tolerance,
                                                         rtol=tolerance)


def close_to_scale(mine: torch.Tensor, theirs: torch.Tensor, tolerance: float) -> bool:
    """Same shape, and no element further from the model's than ``tolerance`` times the largest of its values."""
    if mine.shape != theirs.shape:
        return False
    if not theirs.numel():
        return True
    return bool((mine.float() - theirs.float()).abs().max() <= tolerance * theirs.float().abs().max())
