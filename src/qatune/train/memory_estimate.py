"""Will it fit? The peak memory of one training process, estimated before anything is trained (``qatune check``),
for one process, DDP and FSDP on N processes, against what the device has.

The model is built on PyTorch's meta device (shapes, no memory) to count its weights. A process holds:

- its baseline: Python, torch, transformers and the tokenizer (measured: this process's resident set now);
- the weights (fp32; bf16 with fp32 master copies of the trained ones where one CPU process trains bf16);
- the gradients of the trained weights, and AdamW's two moments (fp32);
- DDP: a second copy of the gradients (its reduction buckets);
- FSDP: 1/N of weights, gradients and moments, plus the units gathered at a time (the root, two blocks);
- the activations kept for the backward pass at the longest batch the data produces (per layer and token about
  34 x hidden + 5 x heads x length values in 16 bits, twice that in fp32: Korthikanti et al., 2022), and the
  logits with their gradient; with train.activation_checkpointing, each block's input and one block's activations.

:func:`checkpoint_activations` turns that option on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from qatune.config import Config

GIB = 2**30


@dataclass
class Estimate:
    """One set-up's peak per process, by part (bytes)."""

    setup: str
    processes: int
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def to_dict(self) -> dict[str, Any]:
        return {"setup": self.setup, "processes": self.processes, "total_gib": round(self.total / GIB, 3),
                "parts_gib": {k: round(v / GIB, 3) for k, v in self.parts.items()}}


def meta_model(config: Config, tokenizer: Any, seq2seq: bool) -> torch.nn.Module:
    """The run's model built on the meta device (its LoRA adapters too): every shape, no memory."""
    from qatune.model.sources import auto_class, build_scratch, load_model_config

    with torch.device("meta"):
        if config.model.scratch is not None:
            model = build_scratch(config.model.scratch, config.task, tokenizer)
        else:
            model = auto_class(config.task, seq2seq).from_config(load_model_config(config.model))
        if config.model.lora is not None:
            from qatune.model.adapters import apply_lora

            model = apply_lora(model, config.model.lora, config.task)
    return model


def shape(model: torch.nn.Module) -> dict[str, int]:
    """Hidden size, layers, heads and vocabulary of a transformers model's config."""
    c = getattr(model, "config", None)
    first = (lambda *names: next((int(getattr(c, n)) for n in names if getattr(c, n, None)), 0))  # noqa: E731
    return {"hidden": first("hidden_size", "n_embd", "d_model"), "layers": first("num_hidden_layers", "n_layer",
                                                                                   "num_layers"),
            "heads": first("num_attention_heads", "n_head", "num_heads"), "vocab": first("vocab_size")}


def estimate(model: torch.nn.Module, config: Config, precision: str, batch_tokens: tuple[int, int],
             supervised: int, processes: int, baseline: int | None = None) -> list[Estimate]:
    """Peaks per process for one process, DDP and FSDP on ``processes``; ``batch_tokens``: (rows, longest row) of
    the widest batch; ``supervised``: the most supervised tokens in one row."""
    from qatune.train.sharding import units

    baseline = resident_bytes() if baseline is None else baseline
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    on_cpu = config.train.device == "cpu" or not torch.cuda.is_available()
    masters = precision == "bf16" and on_cpu and config.train.speedups != "off"  # bf16_master_weights
    weights = 2 * total + 4 * trained if masters else 4 * total
    grads = (2 if masters else 4) * trained
    moments = 8 * trained
    averaged = {"averaged weights": 4 * trained} if config.train.ema_decay is not None else {}  # fp32, as trained
    rows, width = batch_tokens
    dims = shape(model)
    per_value = 2 if precision == "fp32" else 1  # the formula counts 16-bit values
    layer = rows * width * (34 * dims["hidden"] + 5 * dims["heads"] * width) * per_value
    activations = dims["layers"] * layer
    if config.train.activation_checkpointing:  # each block's input, and one block recomputed at a time
        activations = dims["layers"] * rows * width * dims["hidden"] * 2 * per_value + layer
    logit_rows = rows * (supervised if config.task == "generative" and config.train.speedups != "off" else width)
    # a scoring model's outputs are a few per position (a decoder's) or per row, not a vocabulary's
    logits = 0 if config.task == "scoring" else logit_rows * dims["vocab"] * 4 * 2
    work = {"activations": activations, "logits": logits}
    one = Estimate("1 process", 1, {"baseline": baseline, "weights": weights, "gradients": grads,
                                    "optimizer": moments, **averaged, **work})
    estimates = [one]
    if processes > 1:
        plain_weights = 4 * total
        estimates.append(Estimate(f"ddp x {processes}", processes, {
            "baseline": baseline, "weights": plain_weights, "gradients": 4 * trained,
            "ddp buckets": 4 * trained, "optimizer": moments, **averaged, **work}))
        blocks = units(model)
        if blocks:
            block = max(sum(p.numel() for p in b.parameters()) for b in blocks)
            root = total - sum(sum(p.numel() for p in b.parameters()) for b in blocks)
            # train.cpu_offload on a GPU: the shards live in CPU memory, not in the GPU's
            held = 0 if config.train.cpu_offload and not on_cpu else 1
            estimates.append(Estimate(f"fsdp x {processes}", processes, {
                "baseline": baseline, "weights": held * plain_weights // processes,
                "gradients": held * 4 * trained // processes, "optimizer": held * moments // processes,
                **{name: held * size // processes for name, size in averaged.items()},  # each shard's average
                "gathered units": 4 * (root + 2 * block) * 2, **work}))
    return estimates


def resident_bytes() -> int:
    """This process's resident set size now."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def available_bytes() -> tuple[int, str]:
    """What one device offers a training process: a GPU's memory, else the machine's available RAM (shared by
    all its processes)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, f"GPU {torch.cuda.get_device_name(0)}"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()}
        return info["MemAvailable"], "RAM available"
    except (OSError, KeyError, ValueError, IndexError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "RAM"


def verdicts(estimates: list[Estimate], available: int, shared: bool) -> list[dict[str, Any]]:
    """Each set-up with whether it fits: ``shared``: the processes share one pool (a CPU machine's RAM)."""
    out = []
    for e in estimates:
        needed = e.total * (e.processes if shared else 1)
        out.append({**e.to_dict(), "needed_gib": round(needed / GIB, 3), "needed_bytes": needed,
                    "fits": needed <= 0.9 * available})
    return out


def checkpoint_activations(model: torch.nn.Module) -> str:
    """train.activation_checkpointing: each transformer block keeps only its input for the backward pass, which
    recomputes the rest (transformers' own checkpointing, non-reentrant: it composes with LoRA and FSDP)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        from qatune.errors import ConfigError

        raise ConfigError(f"{type(base).__name__} does not support activation checkpointing; set "
                          "train.activation_checkpointing: false")
    enable = getattr(base, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # transformers before 5.x's rename
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if getattr(base.config, "use_cache", None):
        base.config.use_cache = False  # a cache is of no use in training, and transformers warns of it
    return "activation checkpointing: each block's activations recomputed in the backward pass"
