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
from qatune.kinds import kind_of

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
    from qatune.model.sources import auto_class, build_scratch, load_model_config, with_dropout

    with torch.device("meta"):
        if config.model.scratch is not None:
            model = build_scratch(config.model.scratch, config.task, tokenizer)
        else:
            model_config = load_model_config(config.model)
            if config.model.dropout is not None:  # as the run trains it: dropout decides the attention kernel
                model_config = with_dropout(model_config, config.model.dropout)
            model = auto_class(config.task, seq2seq).from_config(model_config)
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
             supervised: int, processes: int, baseline: int | None = None,
             measured: tuple[int, int] | None = None) -> list[Estimate]:
    """Peaks per process for one process, DDP and FSDP on ``processes``; ``batch_tokens``: (rows, longest row) of
    the widest batch; ``supervised``: the most supervised tokens in one row; ``measured``: what a block keeps per
    token (:func:`measured_layer_bytes`) and the token positions of the heaviest step (:func:`heaviest_step`), which
    replace the activations' formula."""
    from qatune.train.sharding import units

    baseline = resident_bytes() if baseline is None else baseline
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trained = sum(p.numel() for p in params if p.requires_grad)
    on_cpu = config.train.device == "cpu" or not torch.cuda.is_available()
    masters = precision == "bf16" and on_cpu and config.train.speedups != "off"  # bf16_master_weights
    weights = 2 * total + 4 * trained if masters else 4 * total
    grads = (2 + 4 if masters else 4) * trained  # masters: the bf16 gradients, and fp32 ones added up for the update
    moments = 8 * trained
    averaged = {"averaged weights": 4 * trained} if config.train.ema_decay is not None else {}  # fp32, as trained
    rows, width = batch_tokens
    dims = shape(model)
    per_value = 2 if precision == "fp32" else 1  # the formula counts 16-bit values
    layer = rows * width * (34 * dims["hidden"] + 5 * dims["heads"] * width) * per_value
    if measured is not None:
        per_token, positions = measured
        layer = per_token * positions
    activations = dims["layers"] * layer
    if config.train.activation_checkpointing:  # each block's input, and one block recomputed at a time
        activations = dims["layers"] * rows * width * dims["hidden"] * 2 * per_value + layer
    logit_rows = kind_of(config.task).vocabulary_logits(rows, width, supervised, config.train.speedups == "off")
    logits = logit_rows * dims["vocab"] * 4 * 2
    work = {"activations": activations, "backward's working memory": int(BACKWARD_SHARE * activations),
            "logits": logits}
    if precision == "bf16" and not masters:  # autocast keeps a bf16 copy of every weight it multiplies
        work["bf16 copies of the weights"] = 2 * total
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


def measured_activations(prepared: Any, model: torch.nn.Module) -> tuple[int, int] | None:
    """What a block keeps per token, measured on a copy of the model at the heaviest step's width
    (:func:`measured_layer_bytes`), and that step's token positions (:func:`heaviest_step`), as ``prepared`` (a
    Prepared run) trains; None where the model cannot be measured so (the formula stands)."""
    from qatune.speedups import Speedups
    from qatune.speedups.attention import EAGER_ATTENTION_MAX_TOKENS
    from qatune.speedups.shapes import width_multiple

    config = prepared.config
    device = "cuda" if torch.cuda.is_available() and config.train.device != "cpu" else "cpu"
    speedups = Speedups(config.train.speedups, prepared.precision, device)
    multiple = width_multiple(device) if speedups.on("width_rounding") else 1
    bucketed = prepared.precision == "bf16" and device == "cpu"  # as train/heap.few_shapes pads them
    _, width, positions = heaviest_step(prepared.dataset, config, speedups.on, multiple, bucketed=bucketed)
    eager = speedups.on("attention_by_width") and width <= EAGER_ATTENTION_MAX_TOKENS
    masters = speedups.on("bf16_master_weights") and prepared.precision == "bf16" and device == "cpu"
    per_token = measured_layer_bytes(model, width, prepared.precision, masters, "eager" if eager else None)
    return None if per_token is None else (per_token, positions)


def heaviest_step(dataset: Any, config: Config, on: Any, multiple: int = 1, epochs: int = 3,
                  bucketed: bool = False) -> tuple[int, int, int]:
    """(rows, width, token positions computed) of the step that computes the most positions in the run's first
    ``epochs`` epochs, batched as training batches them: rows of one context together, each group's shared prompt
    prefix computed once (``prefix_groups``, ``shared_prefix``), padding left out (``unpadded_rows``); ``on``: whether
    a speed path is on; ``multiple``: what widths are rounded up to; ``bucketed``: to one of few sizes first."""
    from qatune.data.padding import batch_width
    from qatune.speedups import prefixes
    from qatune.train.sampler import training_batches

    sampler = training_batches(dataset, config)
    items = dataset.items
    causal = bool(items) and all(hasattr(item, "prompt_length") for item in items)
    shares = causal and not config.train.train_on_prompt
    best = (0, 0, 0)
    for epoch in range(min(epochs, config.train.epochs)):
        sampler.set_epoch(epoch)
        for batch in sampler:
            lengths = [dataset.lengths[i] for i in batch]
            width = batch_width(max(lengths), multiple, None, bucketed)
            unpadded = causal and on("unpadded_rows")
            positions = sum(lengths) if unpadded else len(batch) * width
            if shares and (on("prefix_groups") or on("shared_prefix")):
                rows = [items[i].input_ids for i in batch]
                limits = [items[i].prompt_length - 1 for i in batch]
                planned = prefixes.plan(rows, limits, width, multiple) if on("prefix_groups") else None
                if planned is not None:
                    positions = min(positions, len(planned["rows"]) * planned["prefix_width"]
                                    + len(batch) * planned["suffix_width"])
                else:
                    common = prefixes.shared_prefix(rows, limits)
                    positions = common + (sum(lengths) if unpadded else len(batch) * width) - len(batch) * common
            if positions > best[2]:
                best = (len(batch), width, positions)
    return best


BACKWARD_SHARE = 0.3
"""The backward pass's own memory (the gradients of the activations of the block it is in, the optimizer's
temporaries) as a share of the activations kept: measured on the shipped configs (bench/memory_epochs.py)."""
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers")
"""Where a transformers config keeps its number of blocks."""


def measured_layer_bytes(model: torch.nn.Module, width: int, precision: str, masters: bool,
                         attention: str | None = None) -> int | None:
    """What autograd keeps for the backward pass of one block, per token, at ``width`` tokens: measured on the spot
    on copies of the model with one and with two blocks (random weights, a small vocabulary; ``model`` may be on the
    meta device), as the run computes (bf16 weights with ``masters``, else bf16 autocast, or fp32; ``attention``:
    the attention implementation the run uses at that width). None for a model it cannot copy so (an
    encoder-decoder, a config without a block count)."""
    import copy

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    key = next((name for name in LAYER_COUNTS if isinstance(getattr(config, name, None), int)), None)
    if config is None or key is None or getattr(config, "is_encoder_decoder", False) or width < 1:
        return None
    sizes = []
    for blocks in (1, 2):
        small = copy.deepcopy(config)
        setattr(small, key, blocks)
        small.vocab_size = min(int(getattr(config, "vocab_size", 512) or 512), 512)
        if attention is not None:
            small._attn_implementation = attention
        try:
            with torch.device("cpu"):
                copied = type(base)(small)
            if masters:
                copied = copied.to(torch.bfloat16)
            copied.train()
            sizes.append(_saved_bytes(copied, width, precision == "bf16" and not masters))
        except Exception:  # a model class that cannot be built or run so: the formula stands in
            return None
    return max(0, (sizes[1] - sizes[0]) // width)


def _saved_bytes(model: torch.nn.Module, width: int, autocast: bool) -> int:
    """The bytes of the distinct storages autograd keeps for the backward pass of one row of ``width`` tokens."""
    storages: dict[int, int] = {}
    weights = {tuple(p.shape) for p in model.parameters()}  # weights, and autocast's copies of them: not per token

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.dim() <= 2 and tuple(tensor.shape) in weights):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, model.config.vocab_size, (1, width))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(input_ids=ids)
    return sum(storages.values())


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


def processes_here() -> int:
    """How many training processes this machine runs to any purpose: one per GPU, else one per two CPU cores (a
    process of one thread gains nothing over one process of two)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // 2)


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
