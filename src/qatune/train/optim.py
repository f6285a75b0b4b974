"""AdamW, the learning-rate schedule (linear warmup, then StepLR) and gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from qatune.config import Config


def build_optimizer(model: torch.nn.Module | list[torch.Tensor], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over a model's trainable parameters (or the given tensors: fp32 masters); biases and
    normalisation weights (all 1-D parameters) get no weight decay."""
    params = [p for p in model.parameters() if p.requires_grad] if isinstance(model, torch.nn.Module) else model
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        # One fused kernel over all parameters (CPU and CUDA, torch >= 2.4).
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, foreach=True)


def build_schedulers(optimizer: torch.optim.Optimizer, config: Config) -> tuple[Any, torch.optim.lr_scheduler.StepLR]:
    """Linear warmup (per optimizer step) chained with StepLR (per epoch or per optimizer step).

    Both are torch's chainable schedulers, so the learning rate is peak * warmup(t) * gamma**k.
    """
    train = config.train
    warmup = None
    if train.warmup_steps > 0:
        w = train.warmup_steps
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0 / w, end_factor=1.0,
                                                   total_iters=max(1, w - 1))
    decay = torch.optim.lr_scheduler.StepLR(optimizer, step_size=train.scheduler.step_size,
                                            gamma=train.scheduler.gamma)
    return warmup, decay


def gradient_clipper(accelerator: Any, params: Any, max_norm: float | None) -> Callable[[], torch.Tensor | float]:
    """A function that clips the gradients of ``params`` to ``max_norm`` and returns their total norm before
    clipping (``folded_clipping`` does the same inside the optimizer's update)."""
    params = list(params)
    return lambda: accelerator.clip_grad_norm_(params, max_norm or math.inf)
