"""``attention_by_width``: eager or SDPA attention picked per batch by its width.

Under bf16 on CPU, torch's SDPA kernel is slower than plain matmul-softmax-matmul attention on short rows (its
backward runs one small oneDNN product per block and head); from about 256 tokens on the two are level and SDPA
needs less memory. Both implementations are exact; only their speed and memory differ.
"""

from __future__ import annotations

import contextlib
import logging
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("qatune")

EAGER_ATTENTION_MAX_TOKENS = 256


class AttentionByWidth:
    """Eager attention for batches at most EAGER_ATTENTION_MAX_TOKENS wide, SDPA for wider ones: set per
    batch on the model's config, which transformers' attention layers and mask builders read at each
    forward."""

    choices = ("eager", "sdpa")

    def __init__(self, config: Any):
        self.config = config
        self.current = config._attn_implementation

    @staticmethod
    def choice(width: int) -> str:
        return "eager" if width <= EAGER_ATTENTION_MAX_TOKENS else "sdpa"

    def describe(self, longest: int) -> str:
        """What the switch does, for a run whose longest row has ``longest`` tokens."""
        limit = EAGER_ATTENTION_MAX_TOKENS
        text = f"eager for batches of at most {limit} tokens, SDPA for wider ones"
        return text + (f": eager throughout, no row is longer than {longest} tokens" if longest <= limit else "")

    def use(self, width: int) -> None:
        wanted = self.choice(width)
        if wanted != self.current:
            self.config._attn_implementation = self.current = wanted

    @contextmanager
    def forced(self, implementation: str):
        """``implementation`` set on the model meanwhile (the other paths' checks run under each one a run may
        use), the one before set back afterwards."""
        before = self.current
        self.config._attn_implementation = self.current = implementation
        try:
            yield
        finally:
            self.config._attn_implementation = self.current = before


def each_attention(switch: AttentionByWidth | None) -> list[Any]:
    """Context managers that set, in turn, each attention implementation a run may use (one that changes
    nothing where the run uses only one): the other paths' checks run under every one of them."""
    return [switch.forced(name) for name in switch.choices] if switch is not None else [contextlib.nullcontext()]


def attention_switch(model: Any) -> AttentionByWidth | str:
    """The per-batch switch for a model on SDPA that can switch to eager, or why there is none."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return "the model does not run SDPA attention"
    try:  # the model's own check that it has an eager path; the switch then sets the config per batch
        model.set_attn_implementation("eager")
        model.set_attn_implementation("sdpa")
    except (ValueError, ImportError, AttributeError) as exc:  # an architecture without a dynamic switch
        log.debug("attention left as SDPA: %s", exc)
        return "the model cannot switch to eager attention"
    if config._attn_implementation != "sdpa":
        return "the model cannot switch back to SDPA"
    return AttentionByWidth(config)
