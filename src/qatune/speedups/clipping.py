"""``folded_clipping``: gradient clipping folded into the fused AdamW update.

torch's fused AdamW divides every gradient by its ``grad_scale`` inside its one kernel (the hook GradScaler
uses); setting that scale to ``norm / max_norm`` where the norm is too large clips the gradients with no pass of
its own over them. The norm itself is summed as one BLAS dot product per fp32 CPU gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def folded_clipper(accelerator: Any, optimizer: Any, max_norm: float | None) -> Callable[[], torch.Tensor] | str:
    """A function that clips the gradients to ``max_norm`` through the optimizer's own update and returns their
    total norm before clipping (a tensor: no host sync); or why it cannot (then clip as usual)."""
    from accelerate.utils import DistributedType

    inner = getattr(optimizer, "optimizer", optimizer)
    if not inner.defaults.get("fused"):
        return "the optimizer is not torch's fused AdamW"
    if accelerator.scaler is not None:
        return "fp16 loss scaling clips through accelerate"
    if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU,
                                            DistributedType.MULTI_GPU):
        return f"{accelerator.distributed_type} clips its sharded gradients itself"
    params = [p for group in inner.param_groups for p in group["params"]]

    def folded() -> torch.Tensor:
        norm = total_norm([p.grad for p in params if p.grad is not None])
        # torch.nn.utils.clip_grad_norm_ multiplies by max_norm / (norm + 1e-6) when that is below 1.
        inner.grad_scale = (norm + 1e-6).div(max_norm).clamp(min=1.0) if max_norm else None
        return norm

    return folded


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``grads`` together (a tensor: no host sync).

    On CPU, fp32 gradients are summed as one BLAS dot product each: faster than torch's per-tensor norm kernels
    there (``_foreach_norm`` has no fused CPU kernel) and closer to the float64 result. Inf and NaN come out as
    they do from ``torch.linalg.vector_norm``.
    """
    if not grads:
        return torch.zeros(())
    if all(g.device.type == "cpu" and g.dtype == torch.float32 for g in grads):
        return torch.stack([g.reshape(-1).dot(g.reshape(-1)) for g in grads]).sum().sqrt()
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
