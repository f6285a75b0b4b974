"""``train.distributed: fsdp``: the model, its gradients and its optimizer state sharded across the processes with
PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``), applied by qatune itself on the processes' own group (gloo
on CPU, where accelerate would silently fall back to DDP; NCCL on GPUs).

Each block the model never splits (transformers' ``_no_split_modules``: GPT-2's blocks, Llama's decoder layers, T5's
blocks of the encoder and of the decoder) is one unit, the rest of the model (embeddings, final norm, head) the root
unit: a unit's parameters are gathered for its forward and backward and freed after, and its gradients
reduce-scattered,
so a process holds about 1/N of the weights, gradients and AdamW state. Gradients are averaged over processes as
DDP averages them (the loop scales the loss by the number of processes), so the steps are the same. Checkpoints are
written shard by shard (torch.distributed.checkpoint: each process writes its own file); what needs the whole model
(final/, best/) gathers it on the first process, every process taking part.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qatune.config import Config
from qatune.errors import ConfigError, RunDirError
from qatune.runs import layout

log = logging.getLogger("qatune")


def _sharded_options(strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen weights (a LoRA run's base) are not saved: they come back from the base model.
    return StateDictOptions(ignore_frozen_params=True, strict=strict)

OPTIMIZER_FORMAT = "dcp"
"""How a sharded run's checkpoint holds its weights and optimizer state: in SHARDS, one file per process written by
torch.distributed.checkpoint and keyed by parameter name."""
SHARDS = layout.SHARDS


def units(model: nn.Module) -> list[nn.Module]:
    """The model's FSDP units: the outermost modules of the classes its transformers model never splits
    (``_no_split_modules``), less any that shares a weight with the rest of the model (tied embeddings stay in the
    root); for a model that names none, the children of its largest list of modules of one class."""
    kinds = {name for module in model.modules() for name in (getattr(module, "_no_split_modules", None) or [])}
    found: list[nn.Module] = []
    inside: set[int] = set()  # modules already within a unit
    for module in model.modules():
        if id(module) in inside:
            continue
        if module is not model and type(module).__name__ in kinds and not _shares_weights(model, module):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found or _largest_list(model)


def _shares_weights(model: nn.Module, part: nn.Module) -> bool:
    """Whether a parameter of ``part`` is also used outside it (tied weights)."""
    mine = {id(p) for p in part.parameters()}
    own = {id(m) for m in part.modules()}
    return any(id(p) in mine for m in model.modules() if id(m) not in own for p in m.parameters(recurse=False))


def _largest_list(model: nn.Module) -> list[nn.Module]:
    """The children of the model's largest list of modules of one class (Llama's ``model.layers``, GPT-2's
    ``transformer.h``)."""
    best: list[nn.Module] = []
    best_size = 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = list(module), size
    return best


def check_setup(config: Config) -> None:
    """What train.distributed fsdp needs before anything is loaded: several processes, and no fp16; and what
    needs it. Under ``accelerate launch`` with an FSDP config, qatune shards the model itself (train.distributed
    fsdp), in place of accelerate's plugin (which on a CPU would train DDP without saying so)."""
    if _true(os.environ.get("ACCELERATE_USE_FSDP")):
        if config.train.distributed != "fsdp":
            raise ConfigError("the accelerate config shards the model (distributed_type FSDP) and this config does "
                              "not: set train.distributed: fsdp (qatune shards the model itself with FSDP2), or "
                              "launch with a multi-GPU accelerate config")
        os.environ.pop("ACCELERATE_USE_FSDP")
        ignored = [name.lower() for name in ("FSDP_OFFLOAD_PARAMS", "FSDP_ACTIVATION_CHECKPOINTING")
                   if _true(os.environ.get(name))]
        log.info("accelerate's FSDP config: the model is sharded by qatune (train.distributed fsdp)%s",
                 f"; {' and '.join(ignored)} are not read: set train.cpu_offload and "
                 "train.activation_checkpointing in qatune's config" if ignored else "")
    refusal = config_refusal(config)
    if refusal:
        raise ConfigError(refusal)
    if config.train.distributed == "fsdp" and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ConfigError("train.distributed fsdp shards the model across processes, and this run has one; "
                          "train with --num-processes N (N >= 2) or torchrun, or set train.distributed: ddp")


def config_refusal(config: Config) -> str | None:
    """What the config itself asks that sharding cannot do (``qatune check`` says it too), or None."""
    train = config.train
    if train.distributed != "fsdp":
        if train.cpu_offload:
            return ("train.cpu_offload keeps the shards of a sharded model in CPU memory and needs "
                    "train.distributed: fsdp; set it, or set train.cpu_offload: false")
        return None
    if train.precision == "fp16":
        return ("train.precision fp16 is not supported with train.distributed fsdp (its loss scaling is not "
                "sharded); use bf16 or fp32")
    return None


def _true(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "yes")


def check_shardable(model: nn.Module) -> None:
    """A model fsdp can shard block by block."""
    if not units(model):
        raise ConfigError(f"train.distributed fsdp shards a model block by block, and {type(model).__name__} has no "
                          "repeated blocks (a list of layers of one kind); set train.distributed: ddp")


def shard(model: nn.Module, precision: str, device: torch.device, offload: bool = False) -> str:
    """Shard ``model`` in place across the processes of the default group; returns a line for the log.
    ``offload``: keep the shards of the weights, gradients and optimizer state in CPU memory (a unit's weights
    are copied to the device for its forward and backward, the optimizer steps on the CPU)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    world = dist.get_world_size()
    check_shardable(model)
    mesh = init_device_mesh(device.type, (world,))
    policy = root_policy = MixedPrecisionPolicy()
    if precision in ("bf16", "fp16"):
        # Compute in the low precision, gradients reduced in fp32; between units the activations stay in the low
        # precision, and the root hands its output (the logits) to the loss in fp32.
        low = torch.bfloat16 if precision == "bf16" else torch.float16
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        root_policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, output_dtype=torch.float32)
    # Pinned host memory needs a GPU; on a CPU the offload only moves the optimizer step out of the units.
    placement = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    blocks = units(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=placement)
    # The rest (embeddings, tied with the output layer where they are, the final norm) is the root unit.
    fully_shard(model, mesh=mesh, mp_policy=root_policy, offload_policy=placement)
    # transformers' generate keeps every process stepping until all have finished (their forwards gather).
    model._is_fsdp_managed_module = True
    total = sum(p.numel() for p in model.parameters())
    local = sum(p.to_local().numel() for p in model.parameters())
    kinds = Counter(type(block).__name__ for block in blocks)
    return (f"fsdp: {' and '.join(f'{n} {kind}' for kind, n in kinds.items())} units and the root, sharded on "
            f"{world} processes: {local / 1e6:.2f}M of {total / 1e6:.2f}M parameters on this process"
            + (f", computing in {precision} with fp32 gradient reduction" if precision != "fp32" else "")
            + (", kept in CPU memory between uses (train.cpu_offload)" if offload else ""))


@contextmanager
def without_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Gradients accumulated locally (a micro-batch before the window's last), reduced on the last one."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def reshard(model: nn.Module) -> None:
    """Frees every unit's gathered weights (no collective). After a forward without backward (validation) the root
    unit keeps its own, which would carry the weights that forward read (train.ema_decay's average) into the next
    training step's forward."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def gathered_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on the first process, in CPU memory; every process must call this (the others get
    an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for name in tied_copies(model):  # written once, as save_pretrained writes a model's tied weights
        weights.pop(name, None)
    return weights


def save_shards(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path | None,
                average: dict[str, torch.Tensor] | None = None) -> None:
    """Each process writes its shard of the weights (the trainable ones), of the optimizer state and of
    train.ema_decay's ``average`` (keyed by parameter name) into ``folder``/SHARDS; every process calls this, the
    first with the folder (the others get it from it)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    where = [str(folder / SHARDS) if folder is not None else None]
    dist.broadcast_object_list(where, src=0)
    weights, state = get_state_dict(model, optimizer, options=_sharded_options())
    dcp.save({"model": weights, "optimizer": state, **({"average": average} if average else {})},
             checkpoint_id=where[0])
    dist.barrier()
    if folder is not None:
        written = len(list((folder / SHARDS).glob("*.distcp")))
        if written < dist.get_world_size():
            raise RunDirError(f"{folder / SHARDS} holds {written} of the {dist.get_world_size()} processes' shards: "
                              "with train.distributed fsdp on several machines, output_dir must be a folder every "
                              "machine shares (a network file system)")


def load_shards(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path,
                average: dict[str, torch.Tensor] | None = None) -> None:
    """A checkpoint's shards (:func:`save_shards`) into the sharded ``model``, its ``optimizer`` and, in place,
    the tensors of train.ema_decay's ``average``, resharded to this run's processes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    stored = dcp.FileSystemReader(str(folder / SHARDS)).read_metadata().state_dict_metadata
    if average and not any(key.startswith("average.") for key in stored):
        raise RunDirError(f"{folder / SHARDS} holds no average of the weights, which train.ema_decay keeps: the "
                          "checkpoint was written without it; resume with the train.ema_decay it was trained with")
    weights, state = get_state_dict(model, optimizer, options=_sharded_options())
    # A weight the loss never reached before the checkpoint (a BERT's pooler under mean pooling) has no optimizer
    # state there, as in the run that wrote it: only the state the checkpoint holds is loaded.
    state["state"] = {name: entry for name, entry in state["state"].items()
                      if all(f"optimizer.state.{name}.{key}" in stored for key in entry)}
    saved = {"model": weights, "optimizer": state, **({"average": average} if average else {})}
    dcp.load(saved, checkpoint_id=str(folder / SHARDS))
    # not strict: weights without optimizer state (above); dcp.load has already read every weight the model trains
    set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"],
                   options=_sharded_options(strict=False))


def tied_copies(model: nn.Module) -> list[str]:
    """Names of parameters that are another (earlier) parameter: an output layer tied to the embeddings."""
    seen: set[int] = set()
    copies = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            copies.append(name)
        seen.add(id(p))
    return copies


def named_full_grads(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter's whole gradient (gathered: every process must iterate them all, in order)."""
    for name, p in model.named_parameters():
        if p.grad is not None:
            yield name, p.grad.full_tensor()
