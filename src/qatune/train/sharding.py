"""``train.distributed: fsdp``: the model, its gradients and its optimizer state sharded across the processes with
PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``), applied by qatune itself on the processes' own group (gloo
on CPU, where accelerate would silently fall back to DDP; NCCL on GPUs).

Each repeated transformer block is one unit, the rest of the model (embeddings, final norm, head) the root unit: a
unit's parameters are gathered for its forward and backward and freed after, and its gradients reduce-scattered,
so a process holds about 1/N of the weights, gradients and AdamW state. Gradients are averaged over processes as
DDP averages them (the loop scales the loss by the number of processes), so the steps are the same. What needs
the whole model (a checkpoint, final/, best/) gathers it on the first process; every process takes part.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from qatune.config import Config
from qatune.errors import ConfigError

log = logging.getLogger("qatune")

OPTIMIZER_FORMAT = "full_state_dict"
"""How a sharded run saves its optimizer state: gathered whole and keyed by parameter name (torch.distributed's
state-dict API), so that any number of processes can load it."""


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: the children of its largest list of modules of one class (Llama's
    ``model.layers``, GPT-2's ``transformer.h``, BERT's ``encoder.layer``)."""
    best: list[nn.Module] = []
    best_size = 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = list(module), size
    return best


def check_setup(config: Config) -> None:
    """What train.distributed fsdp needs before anything is loaded: several processes, and no fp16."""
    if config.train.distributed != "fsdp":
        return
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ConfigError("train.distributed fsdp shards the model across processes, and this run has one; "
                          "train with --num-processes N (N >= 2) or torchrun, or set train.distributed: ddp")
    if config.train.precision == "fp16":
        raise ConfigError("train.precision fp16 is not supported with train.distributed fsdp (its loss scaling "
                          "is not sharded); use bf16 or fp32")


def check_shardable(model: nn.Module) -> None:
    """A model fsdp can shard block by block."""
    if not repeated_blocks(model):
        raise ConfigError(f"train.distributed fsdp shards a model block by block, and {type(model).__name__} has no "
                          "repeated blocks (a list of layers of one kind); set train.distributed: ddp")


def shard(model: nn.Module, precision: str, device: torch.device) -> str:
    """Shard ``model`` in place across the processes of the default group; returns a line for the log."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    check_shardable(model)
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy()
    if precision in ("bf16", "fp16"):
        # Compute in the low precision; gradients reduced and logits handed to the loss in fp32.
        low = torch.bfloat16 if precision == "bf16" else torch.float16
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, output_dtype=torch.float32)
    blocks = repeated_blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    # The rest (embeddings, tied with the output layer where they are, the final norm) is the root unit.
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # transformers' generate keeps every process stepping until all have finished (their forwards gather).
    model._is_fsdp_managed_module = True
    total = sum(p.numel() for p in model.parameters())
    local = sum(p.to_local().numel() for p in model.parameters())
    return (f"fsdp: {len(blocks)} {type(blocks[0]).__name__} units and the root, sharded on {world} processes: "
            f"{local / 1e6:.2f}M of {total / 1e6:.2f}M parameters on this process"
            + (f", computing in {precision} with fp32 gradient reduction" if precision != "fp32" else ""))


@contextmanager
def without_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Gradients accumulated locally (a micro-batch before the window's last), reduced on the last one."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def gathered_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The whole model's weights (and the optimizer's state, keyed by parameter name) on the first process, in CPU
    memory; every process must call this (the others get empty dicts)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    for name in tied_copies(model):  # written once, as save_pretrained writes a model's tied weights
        weights.pop(name, None)
    state = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None
    return weights, state


def tied_copies(model: nn.Module) -> list[str]:
    """Names of parameters that are another (earlier) parameter: an output layer tied to the embeddings."""
    seen: set[int] = set()
    copies = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            copies.append(name)
        seen.add(id(p))
    return copies


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """A gathered optimizer state (:func:`gathered_state`) sharded into this process's optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def named_full_grads(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter's whole gradient (gathered: every process must iterate them all, in order)."""
    for name, p in model.named_parameters():
        if p.grad is not None:
            yield name, p.grad.full_tensor()
