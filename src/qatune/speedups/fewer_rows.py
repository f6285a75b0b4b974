"""``last_layer_rows`` and ``unpadded_rows`` (:mod:`qatune.speedups.causal`): a decoder's position-wise modules
(attention projections, MLP) run on the rows that matter only, through hooks on the model's own modules."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn


def hooks(net: nn.Module, mask: torch.Tensor, read: torch.Tensor | None, unpadded: bool, multiple: int = 1) -> Any:
    """What runs on fewer rows in a forward over ``mask`` ((B, T), 1 on real tokens): with ``read`` (the
    flattened positions the loss reads) the last layer's output projection and MLP on those; with
    ``unpadded`` every other position-wise module on the real tokens, where the batch holds padding.
    ``multiple``: the rows gathered are rounded up to it with zero rows (whose outputs are dropped)."""
    modules: list[tuple[nn.Module, torch.Tensor]] = []
    if read is not None:
        last = net.layers[-1]
        modules += [(last.self_attn.o_proj, read), (last.mlp, read)]
    real = mask.reshape(-1).nonzero().squeeze(1) if unpadded else None
    if real is not None and len(real) < mask.numel():
        taken = {id(module) for module, _ in modules}
        modules += [(module, real) for layer in net.layers for module in position_wise(layer)
                    if id(module) not in taken]
    return Rows(modules, multiple) if modules else contextlib.nullcontext()


def position_wise(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's modules that work position by position: its attention's projections and its MLP."""
    attention = getattr(layer, "self_attn", None)
    found = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    found.append(getattr(layer, "mlp", None))
    return [module for module in found if isinstance(module, nn.Module)]


class Rows:
    """While entered: each module computes the rows at its index (of the flattened positions) only: a forward
    pre-hook gathers its input rows, a forward hook scatters its output rows into zeros. Modules called on
    one tensor with one index in turn (the query, key and value projections) share its gather. ``multiple``: the
    gathered rows are rounded up to it with zero rows, whose outputs are dropped (their gradients are zero), so
    that the products meet few distinct shapes."""

    def __init__(self, modules: list[tuple[nn.Module, torch.Tensor]], multiple: int = 1):
        self.modules = modules
        self.multiple = multiple
        self.handles: list[Any] = []
        self.shapes: dict[int, torch.Size] = {}
        self.gathered: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __enter__(self) -> None:
        for module, index in self.modules:
            self.handles.append(module.register_forward_pre_hook(functools.partial(self._gather, index)))
            self.handles.append(module.register_forward_hook(functools.partial(self._scatter, index)))

    def __exit__(self, *_: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.gathered = None

    def _gather(self, index: torch.Tensor, module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        self.shapes[id(module)] = x.shape[:-1]
        if self.gathered is None or self.gathered[0] is not x or self.gathered[1] is not index:
            rows = x.reshape(-1, x.shape[-1]).index_select(0, index)
            extra = -len(index) % self.multiple
            if extra:
                rows = torch.cat([rows, rows.new_zeros(extra, rows.shape[1])])
            self.gathered = (x, index, rows)
        return (self.gathered[2], *args[1:])

    def _scatter(self, index: torch.Tensor, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        shape = self.shapes.pop(id(module))
        out = out[:len(index)]
        full = out.new_zeros(shape.numel(), out.shape[-1]).index_copy_(0, index, out)
        return full.view(*shape, out.shape[-1])


def has_last_rows(net: nn.Module) -> bool:
    layers = getattr(net, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return False
    last = layers[-1]
    return isinstance(getattr(last, "mlp", None), nn.Module) and isinstance(
        getattr(getattr(last, "self_attn", None), "o_proj", None), nn.Module)


def has_position_wise(net: nn.Module) -> bool:
    layers = getattr(net, "layers", None)
    return isinstance(layers, nn.ModuleList) and len(layers) > 0 and all(position_wise(layer) for layer in layers)
