"""The model families qatune knows, one record each: what differs between them and the rest of qatune reads.

A family is found from a model's transformers config (:func:`family_of`, by its ``model_type``). What a record holds
is read where it matters: the LoRA targets when ``model.lora.target_modules`` is null (:mod:`qatune.model.adapters`),
and whether ``qatune export --gguf`` writes the family (:func:`gguf_refusal`, said by export and by check). The
decoder layer is FSDP's unit; :mod:`qatune.train.sharding` finds it from transformers' own ``_no_split_modules``, and
the tests hold the two to each other. Adding a family is a record here and a parameter in ``tests/families.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ATTENTION = ("q_proj", "v_proj")
"""The query and value projections: peft's default LoRA targets for Llama and the families built like it."""


@dataclass(frozen=True)
class Family:
    name: str
    """What users call it."""
    model_types: tuple[str, ...]
    """transformers' ``model_type`` values of its configs."""
    lora_targets: tuple[str, ...]
    """The modules LoRA adapts when model.lora.target_modules is null (peft's default where peft has one)."""
    decoder_layer: str
    """The class of its repeated block: one FSDP unit each."""
    gguf_architecture: str
    """The architecture llama.cpp runs it as (``general.architecture`` of its GGUF file)."""
    gguf_written: bool
    """Whether qatune export --gguf writes it."""


FAMILIES = (
    Family("Llama (Llama 3, SmolLM2)", ("llama",), ATTENTION, "LlamaDecoderLayer", "llama", True),
    Family("Mistral", ("mistral",), ATTENTION, "MistralDecoderLayer", "llama", True),
    Family("Qwen2", ("qwen2",), ATTENTION, "Qwen2DecoderLayer", "qwen2", True),
    Family("Qwen3", ("qwen3",), ATTENTION, "Qwen3DecoderLayer", "qwen3", False),
    Family("Gemma 2", ("gemma2",), ATTENTION, "Gemma2DecoderLayer", "gemma2", False),
    Family("Gemma 3", ("gemma3_text",), ATTENTION, "Gemma3DecoderLayer", "gemma3", False),
    # Phi-3 (Phi-4-mini) computes queries, keys and values in one fused projection.
    Family("Phi-3", ("phi3",), ("qkv_proj",), "Phi3DecoderLayer", "phi3", False),
    Family("SmolLM3", ("smollm3",), ATTENTION, "SmolLM3DecoderLayer", "smollm3", False),
    Family("GPT-2", ("gpt2",), ("c_attn",), "GPT2Block", "gpt2", True),
)


def family_of(model_config: Any) -> Family | None:
    """The family of a transformers config (a multimodal config's text model's), or None for one qatune does not
    know."""
    types = [getattr(model_config, "model_type", None)]
    text = getattr(model_config, "get_text_config", None)
    if text is not None:
        types.append(getattr(text(), "model_type", None))
    return next((family for kind in types for family in FAMILIES if kind in family.model_types), None)


def gguf_refusal(model_config: Any) -> str | None:
    """Why qatune export --gguf does not write a causal LM of this config (None: it does)."""
    family = family_of(model_config)
    written = ", ".join(f.name for f in FAMILIES if f.gguf_written)
    if family is None:
        kind = getattr(model_config, "model_type", None) or "unknown"
        return f"its model type {kind} is not a family qatune knows (qatune writes {written})"
    if not family.gguf_written:
        return (f"qatune does not write {family.name} models (GGUF architecture {family.gguf_architecture}) as GGUF; "
                f"it writes {written}")
    return None
