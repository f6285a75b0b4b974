"""What a transformers model calls its key/value cache, in its forward's arguments and in its outputs: ``cache``
from transformers 5.2x on, ``past_key_values`` before (later versions still take that name, with a deprecation
warning, until they drop it); and whether its forward can leave out the logits of all but the last position."""

from __future__ import annotations

import functools
import inspect
from typing import Any


@functools.cache
def _argument_of(forward: Any) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_argument(model: Any) -> str:
    """The name of ``model``'s key/value cache: pass it as ``**{name: cache}``, read it as ``getattr(out, name)``."""
    return _argument_of(type(model).forward)


@functools.cache
def _keeps_logits(forward: Any) -> bool:
    return "logits_to_keep" in inspect.signature(forward).parameters


def last_logits_only(model: Any) -> dict[str, Any]:
    """Arguments for a causal LM's forward that compute the logits of the last position only, where the model takes
    them (as ``model.generate`` does when it reads a prompt): the same numbers there, without a vocabulary's worth of
    logits for every other position (262k a position for Gemma 3)."""
    return {"logits_to_keep": 1} if _keeps_logits(type(model).forward) else {}
