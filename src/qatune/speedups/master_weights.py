"""``bf16_master_weights``: bf16 training on CPU with the model's weights held in bf16, fp32 master copies in
the optimizer.

Under bf16 autocast every linear layer casts its fp32 weight to bf16 in each forward and its bf16
weight gradient back to fp32 in each backward, and norms, residual adds and activations stay in fp32.
Here the weights themselves are bf16, so the forward and backward cast nothing; what keeps training
as exact as under autocast is that the optimizer updates fp32 copies ("masters"): the bf16 gradients
of each micro-batch are added into fp32 master gradients, and after each update the bf16 weights are
refreshed from the masters (an update smaller than a bf16 step is kept, not rounded away).
Checkpoints, best/ and final/ are written from the masters; evaluation runs on them too. Without this path,
bf16 on CPU is autocast over fp32 weights, as on a GPU.

Frozen weights (a LoRA base) are kept in bf16 alone: they never change, and a bf16 copy is what
autocast multiplies with anyway. The run's saved base/ is written before they are cast.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def applies(precision: str, device_type: str, processes: int) -> str | None:
    """None where the path applies (bf16 on CPU in one process), else why it does not."""
    if precision != "bf16":
        return f"{precision} run"
    if device_type != "cpu":
        return "CPU only (a GPU trains under autocast)"
    if processes > 1:
        return "one process only (several reduce the model's own gradients)"
    return None


class MasterWeights:
    """fp32 masters of a model's trainable parameters, whose weights it turns to bf16."""

    def __init__(self, model: nn.Module):
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.masters = [p.detach().float().clone() for p in self.params]
        self.frozen = [p for p in model.parameters() if not p.requires_grad]
        self.half_weights = [p.data.to(torch.bfloat16) for p in self.params]
        self._buffers: list[torch.Tensor] | None = None
        self._compute()
        for p in self.frozen:
            p.data = p.data.to(torch.bfloat16)

    @torch.no_grad()
    def accumulate(self) -> None:
        """After each micro-batch's backward: its bf16 gradients into the fp32 master gradients (buffers
        kept from step to step: a fresh 4-byte copy of every gradient each step costs page faults)."""
        if self._buffers is None:
            self._buffers = [torch.empty_like(m) for m in self.masters]
        pairs = [(m, buffer, p.grad) for p, m, buffer in zip(self.params, self.masters, self._buffers)
                 if p.grad is not None]
        # A master without a gradient (the optimizer's zero_grad set it to None) starts this window afresh.
        first = [(buffer, grad) for m, buffer, grad in pairs if m.grad is None]
        later = [(buffer, grad.float()) for m, buffer, grad in pairs if m.grad is not None]
        if first:
            torch._foreach_copy_([buffer for buffer, _ in first], [grad for _, grad in first])
        if later:
            torch._foreach_add_([buffer for buffer, _ in later], [grad for _, grad in later])
        for m, buffer, _ in pairs:
            m.grad = buffer
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """After an optimizer step: the bf16 weights from the updated masters."""
        torch._foreach_copy_(self.half_weights, self.masters)

    def named_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, m.grad) for name, m in zip(self.names, self.masters) if m.grad is not None)

    @contextmanager
    def full_precision(self) -> Iterator[None]:
        """The model with its fp32 master weights (for saving and evaluating), bf16 again afterwards."""
        self._full()
        try:
            yield
        finally:
            self._compute()

    def release(self) -> None:
        """Training is over: the model keeps its fp32 masters (frozen weights back to fp32 too)."""
        self._full()
        for p in self.frozen:
            p.data = p.data.float()

    def _compute(self) -> None:
        for p, half in zip(self.params, self.half_weights):
            p.data = half

    def _full(self) -> None:
        for p, master in zip(self.params, self.masters):
            p.data = master
