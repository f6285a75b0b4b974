"""What a transformers model calls its key/value cache, in its forward's arguments and in its outputs: ``cache``
from transformers 5.2x on, ``past_key_values`` before (later versions still take that name, with a deprecation
warning, until they drop it)."""

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
