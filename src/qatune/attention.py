"""Which attention implementation a training run's batches use (bf16 on CPU: eager or SDPA by batch width)."""

from __future__ import annotations

import contextlib
import logging
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("qatune")

# Under bf16 on CPU, torch's SDPA kernel is slower than plain matmul-softmax-matmul attention on short rows
# (its backward runs one small oneDNN product per block and head); the two are level from about 256 tokens
# on, where SDPA also needs less memory (bench/cpu_attention.json for GPT-2; for SmolLM2 with LoRA, per
# batch: bench/attention_by_width.json).
EAGER_ATTENTION_MAX_TOKENS = 256


class AttentionByWidth:
    """Eager attention for batches at most EAGER_ATTENTION_MAX_TOKENS wide, SDPA for wider ones: set per
    batch on the model's config, which transformers' attention layers and mask builders read at each
    forward. Both are exact; only their speed and memory differ."""

    choices = ("eager", "sdpa")

    def __init__(self, config: Any):
        self.config = config
        self.current = config._attn_implementation

    @staticmethod
    def choice(width: int) -> str:
        return "eager" if width <= EAGER_ATTENTION_MAX_TOKENS else "sdpa"

    def describe(self, longest: int) -> str:
        """The log line's text, for a run whose longest row has ``longest`` tokens."""
        limit = EAGER_ATTENTION_MAX_TOKENS
        text = (f"eager for batches of at most {limit} tokens, SDPA for wider ones (bf16 on CPU, where eager is "
                "faster on short rows)")
        return text + (f": eager throughout, no row is longer than {longest} tokens" if longest <= limit else "")

    def use(self, width: int) -> None:
        wanted = self.choice(width)
        if wanted != self.current:
            self.config._attn_implementation = self.current = wanted

    @contextmanager
    def forced(self, implementation: str):
        """``implementation`` set on the model meanwhile (the loss paths' checks run under each one a run may
        use), the one before set back afterwards."""
        before = self.current
        self.config._attn_implementation = self.current = implementation
        try:
            yield
        finally:
            self.config._attn_implementation = self.current = before


def each_attention(model: Any) -> list[Any]:
    """Context managers that set, in turn, each attention implementation the model's training run may use (one
    that changes nothing where it uses only one): the loss paths' checks run under every one of them."""
    switch = getattr(model, "_qatune_attention", None)
    return [switch.forced(name) for name in switch.choices] if switch is not None else [contextlib.nullcontext()]


def attention_for_training(model: Any, precision: str, device_type: str) -> AttentionByWidth | None:
    """The per-batch attention switch where it was measured faster: bf16 on CPU, a model on SDPA that can
    switch to eager. None where nothing changes (fp32, GPU, another implementation)."""
    config = getattr(model, "config", None)
    if (device_type != "cpu" or precision != "bf16"
            or getattr(config, "_attn_implementation", None) != "sdpa"
            or not hasattr(model, "set_attn_implementation")):
        return None
    try:  # the model's own check that it has an eager path; the switch then sets the config per batch
        model.set_attn_implementation("eager")
        model.set_attn_implementation("sdpa")
    except (ValueError, ImportError, AttributeError) as exc:  # an architecture without a dynamic switch
        log.debug("attention left as SDPA: %s", exc)
        return None
    return AttentionByWidth(config) if config._attn_implementation == "sdpa" else None
