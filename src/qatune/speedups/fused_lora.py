"""``lora_one_pass``: a LoRA linear layer's product with its frozen base computed in one pass, forward and backward.

peft computes ``base(x) + lora_B(lora_A(x)) * scaling`` as written: the adapter's (N, out) product, its
scaled copy and the sum are three full-size tensors more per layer, and in the backward the scaling and
the gradient that ``x`` receives from both branches are two more full-size passes over memory. With the
base frozen (as LoRA trains it) all of that folds into the matrix products themselves::

    forward    y  = x W^T + b,   y += s (x A^T) B^T          (an accumulating product: one write of y)
    backward   gz = s (g B)                                   (N, r): the adapter's inner gradient
               gx = g W,         gx += gz A                   (accumulated in place)
               gA = gz^T x,      gB = s g^T (x A^T)

The same numbers up to rounding, with the (N, out) temporaries gone.

Each eligible layer keeps its module and weights (saving, merging and loading are peft's own); only its
``forward`` is replaced by one that takes this path when it applies -- one plain LoRA adapter active, no
dropout while training, an ``nn.Linear`` (or GPT-2's ``Conv1D``) base whose weights are frozen, every
tensor in one floating dtype, no autocast or one of that same dtype (bf16 weights under bf16 autocast, as
bf16 training on CPU runs) -- and otherwise calls peft's forward.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn


class _LoraLinear(torch.autograd.Function):
    """``x M + b + s (x A^T) B^T`` for a frozen ``M`` (the base's (in, out) matrix) and ``b``: gradients for
    x, A and B only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, matrix: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        down = flat @ lora_a.t()
        out = torch.addmm(bias, flat, matrix) if bias is not None else flat @ matrix
        out.addmm_(down, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(flat, down, matrix, lora_a, lora_b)
        ctx.scaling = scaling
        ctx.in_shape = x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        flat, down, matrix, lora_a, lora_b = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        inner = (g @ lora_b).mul_(ctx.scaling)
        grad_x = grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ matrix.t()).addmm_(inner, lora_a).view(ctx.in_shape)
        if ctx.needs_input_grad[3]:
            grad_a = inner.t() @ flat
        if ctx.needs_input_grad[4]:
            grad_b = (g.t() @ down).mul_(ctx.scaling)
        return grad_x, None, None, grad_a, grad_b, None


def _bases() -> tuple[type, ...]:
    try:
        from transformers.pytorch_utils import Conv1D  # GPT-2's layers: y = x W + b, W of shape (in, out)
    except ImportError:
        return (nn.Linear,)
    return nn.Linear, Conv1D


PEFT_ATTRIBUTES = ("base_layer", "lora_A", "lora_B", "scaling", "lora_dropout", "lora_variant", "lora_bias",
                   "active_adapters", "disable_adapters", "merged")
"""What the one-pass forward reads of a peft LoRA layer to decide whether it computes it exactly. peft 0.16 is the
first release whose layers have them all (``lora_variant`` came in 0.16, ``lora_bias`` in 0.14)."""


def layers(model: nn.Module) -> list[Any]:
    """The peft LoRA ``Linear`` layers of ``model`` over a base this path computes (nn.Linear, GPT-2's Conv1D)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return []
    bases = _bases()
    return [module for module in model.modules() if type(module) is Linear and type(module.base_layer) in bases]


def missing_attributes(model: nn.Module) -> list[str]:
    """What the one-pass forward needs and the installed peft's LoRA layers lack (an older peft)."""
    found = layers(model)
    return [name for name in PEFT_ATTRIBUTES if any(not hasattr(layer, name) for layer in found)]


def install(model: nn.Module) -> int:
    """Give every peft LoRA ``Linear`` of ``model`` the one-pass forward; returns how many layers have it (none
    where the installed peft lacks what the forward reads: :func:`missing_attributes`)."""
    if missing_attributes(model):
        return 0
    count = 0
    for module in layers(model):
        if getattr(module.forward, "__func__", None) is not _forward:
            module.forward = types.MethodType(_forward, module)
        count += 1
    return count


def remove(model: nn.Module) -> int:
    """Give every LoRA layer of ``model`` peft's forward back; returns how many had the one-pass forward."""
    count = 0
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), "__func__", None) is _forward:
            del module.forward
            count += 1
    return count


def _forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    lora = _plain_adapter(self, x) if not args and not kwargs else None
    if lora is None:
        return type(self).forward(self, x, *args, **kwargs)
    lora_a, lora_b, scaling = lora
    base = self.base_layer
    matrix = base.weight.t() if type(base) is nn.Linear else base.weight
    return _LoraLinear.apply(x, matrix, base.bias, lora_a, lora_b, float(scaling))


def _plain_adapter(layer: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A, B, scaling) of the layer's one active adapter when the one-pass product computes it exactly."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in layer.lora_variant or layer.lora_bias.get(name, False):
        return None
    dropout = layer.lora_dropout[name]
    if layer.training and not (isinstance(dropout, nn.Identity) or getattr(dropout, "p", 1.0) == 0):
        return None
    base, lora_a, lora_b = layer.base_layer, layer.lora_A[name], layer.lora_B[name]
    if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear or lora_a.bias is not None \
            or lora_b.bias is not None:
        return None
    frozen = not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)
    dtype = x.dtype
    if not frozen or not dtype.is_floating_point:
        return None
    device = x.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != dtype:
        # Autocast would run the products in its own dtype. Under bf16 autocast with bf16 weights and inputs
        # (bf16 training on CPU: bf16 weights, fp32 masters) it casts nothing, and the one-pass product is the same.
        return None
    if any(t.dtype != dtype for t in (base.weight, lora_a.weight, lora_b.weight)) or \
            (base.bias is not None and base.bias.dtype != dtype):
        return None
    return lora_a.weight, lora_b.weight, layer.scaling[name]
