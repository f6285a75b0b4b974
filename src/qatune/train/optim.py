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
        # One fused kernel over all parameters (CPU and CUDA, torch >= 2.4): about 3x faster steps.
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


def gradient_clipper(accelerator: Any, objective: torch.nn.Module, optimizer: Any, max_norm: float | None,
                     masters: list[torch.Tensor] | None = None) -> Callable[[], torch.Tensor | float]:
    """A function that clips the gradients to ``max_norm`` and returns their total norm before clipping
    (a tensor: no host sync). Which way to clip is decided once, here.

    With torch's fused AdamW the clipping is folded into the update: the optimizer divides every
    gradient by its ``grad_scale`` inside its one kernel (the hook GradScaler uses), which saves a pass
    over all gradients. fp16 loss scaling, FSDP and DeepSpeed keep accelerate's own clipping.
    """
    from accelerate.utils import DistributedType

    inner = getattr(optimizer, "optimizer", optimizer)
    if not (inner.defaults.get("fused") and accelerator.scaler is None and accelerator.distributed_type in
            (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)):
        return lambda: accelerator.clip_grad_norm_(masters if masters is not None else objective.parameters(),
                                                   max_norm or math.inf)
    params = [p for group in inner.param_groups for p in group["params"]]

    def folded() -> torch.Tensor:
        norm = total_norm([p.grad for p in params if p.grad is not None])
        # torch.nn.utils.clip_grad_norm_ multiplies by max_norm / (norm + 1e-6) when that is below 1.
        inner.grad_scale = (norm + 1e-6).div(max_norm).clamp(min=1.0) if max_norm else None
        return norm

    return folded


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``grads`` together (a tensor: no host sync).

    On CPU, fp32 gradients are summed as one BLAS dot product each: 2x faster than torch's per-tensor
    norm kernels there (``_foreach_norm`` has no fused CPU kernel) and closer to the float64 result.
    Inf and NaN come out as they do from ``torch.linalg.vector_norm``.
    """
    if not grads:
        return torch.zeros(())
    if all(g.device.type == "cpu" and g.dtype == torch.float32 for g in grads):
        return torch.stack([g.reshape(-1).dot(g.reshape(-1)) for g in grads]).sum().sqrt()
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
