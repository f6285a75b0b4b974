"""The model families qatune knows, one record each: what differs between them and the rest of qatune reads.

A family is found from a model's transformers config (:func:`family_of`, by its ``model_type``). What a record holds
is read where it matters: the LoRA targets when ``model.lora.target_modules`` is null (:mod:`qatune.model.adapters`),
and how ``qatune export --gguf`` writes the family (its :class:`GgufLayout`, read by :mod:`qatune.export.gguf_write`;
:func:`gguf_refusal` says, at check and at export, why a model is not written). The decoder layer is FSDP's unit;
:mod:`qatune.train.sharding` finds it from transformers' own ``_no_split_modules``, and the tests hold the two to each
other. Adding a family is a record here and a parameter in ``tests/families.py``.

The GGUF layouts follow llama.cpp's converter (convert_hf_to_gguf.py, the model class registered for the family's
transformers architecture): which of the config's values it writes under which key, which tensors it reorders or
shifts, and what llama.cpp's runtime assumes of the model without reading it from the file. Tensor names are not
here: gguf-py's own name map for the architecture (``gguf.get_tensor_name_map``) gives them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ATTENTION = ("q_proj", "v_proj")
"""The query and value projections: peft's default LoRA targets for Llama and the families built like it."""

Value = Callable[[Any], "int | float | None"]
"""A hyper-parameter's value read from a transformers config (None: not written)."""


def _int(name: str) -> Value:
    return lambda config: None if getattr(config, name, None) is None else int(getattr(config, name))


def _float(name: str) -> Value:
    return lambda config: None if getattr(config, name, None) is None else float(getattr(config, name))


def head_dim(config: Any) -> int:
    """The width of one attention head (a config without ``head_dim`` splits the hidden size evenly)."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def rope_parameters(config: Any, layers: str = "full_attention") -> dict:
    """The rope parameters of a kind of layer (a config with one kind for all layers has them at the top)."""
    rope = getattr(config, "rope_parameters", None) or {}
    kind = rope.get(layers)
    return kind if isinstance(kind, dict) else rope


def rope_theta(config: Any) -> float:
    return float(rope_parameters(config).get("rope_theta", getattr(config, "rope_theta", None) or 10000.0))


def sliding_rope_theta(config: Any) -> float | None:
    """The rope base of the sliding-window layers where a config gives them their own (Gemma 3)."""
    rope = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention") or {}
    return None if rope.get("rope_theta") is None else float(rope["rope_theta"])


def rotary_dimensions(config: Any) -> int:
    """The dimensions of each head that rope turns (Phi-3 counts them from the hidden size)."""
    share = rope_parameters(config).get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return int(share * config.hidden_size) // config.num_attention_heads


def longrope_factors(kind: str) -> Callable[[Any], list[float] | None]:
    """A longrope scaling's factors dividing each rotated pair's frequency (``kind``: "long_factor", for sequences
    longer than the original context, or "short_factor"), as llama.cpp's converter writes them; None for a model
    without it."""

    def factors(config: Any) -> list[float] | None:
        rope = rope_parameters(config)
        return [float(f) for f in rope[kind]] if rope.get("rope_type") == "longrope" else None

    return factors


def longrope_attention_factor(config: Any) -> float | None:
    """What a longrope scaling multiplies rope's cosines and sines by, long factors or short, as transformers computes
    it (llama.cpp reads it as ``rope.scaling.attn_factor``); None for a model without it."""
    rope = rope_parameters(config)
    if rope.get("rope_type") != "longrope":
        return None
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = original_context(config)
    factor = rope.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def original_context(config: Any) -> int:
    return int(rope_parameters(config).get("original_max_position_embeddings")
               or getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings)


def key_value_heads(config: Any) -> int:
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def llama3_rope_factors(config: Any) -> list[float] | None:
    """Llama 3's rope scaling (rope_type llama3: Llama 3.1, 3.2) as llama.cpp reads it, a factor per pair of
    dimensions dividing its frequency (the converter's ``rope_freqs``); None for a model without it."""
    rope = rope_parameters(config)
    if rope.get("rope_type") != "llama3":
        return None
    width = head_dim(config)
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    context = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for pair in range(0, width, 2):
        wavelength = 2 * math.pi * rope_theta(config) ** (pair / width)
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(float(factor))
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


DECODER_KEYS: tuple[tuple[str, Value], ...] = (
    # What llama.cpp's converter writes for every decoder built like Llama (TextModel.set_gguf_parameters).
    ("block_count", _int("num_hidden_layers")),
    ("context_length", _int("max_position_embeddings")),
    ("embedding_length", _int("hidden_size")),
    ("feed_forward_length", _int("intermediate_size")),
    ("attention.head_count", _int("num_attention_heads")),
    ("attention.head_count_kv", key_value_heads),
    ("rope.freq_base", rope_theta),
    ("attention.layer_norm_rms_epsilon", _float("rms_norm_eps")),
)
HEAD_WIDTH: tuple[tuple[str, Value], ...] = (
    ("attention.key_length", head_dim),
    ("attention.value_length", head_dim),
)
LLAMA_KEYS = (*DECODER_KEYS, *HEAD_WIDTH, ("vocab_size", _int("vocab_size")), ("rope.dimension_count", head_dim))
"""LlamaModel's: the vocabulary size and rope's dimensions besides."""


def _query_scale_is_head_width(config: Any) -> bool:
    return getattr(config, "query_pre_attn_scalar", None) in (None, head_dim(config))


def _full_every(period: int) -> Callable[[Any], bool]:
    """Whether a config's layers use a sliding window but every ``period``-th, which attends to all (llama.cpp's
    pattern for the architecture)."""

    def holds(config: Any) -> bool:
        expected = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                    for i in range(config.num_hidden_layers)]
        return list(getattr(config, "layer_types", None) or expected) == expected

    return holds


def _no_rope_every_fourth(config: Any) -> bool:
    layers = getattr(config, "no_rope_layers", None)
    return layers is None or list(layers) == [int((i + 1) % 4 != 0) for i in range(len(layers))]


def _full_rotary(config: Any) -> bool:
    return rotary_dimensions(config) == head_dim(config)


def _rope_type(config: Any) -> str:
    return rope_parameters(config).get("rope_type") or "default"


def _is(name: str, value: Any) -> Callable[[Any], bool]:
    return lambda config: getattr(config, name, None) == value


QUERY_SCALE = ("its query_pre_attn_scalar equals its head_dim (llama.cpp scales queries by 1/sqrt(head_dim))",
               _query_scale_is_head_width)
READER = "transformers' GGUF reader, which checks the file, takes"
"""Why a value must be a family's default: transformers' GGUF reader does not read it from the file."""


@dataclass(frozen=True)
class GgufLayout:
    """How llama.cpp's converter writes a family as GGUF, and what llama.cpp assumes of it."""

    architecture: str
    """``general.architecture``: the model llama.cpp runs it as (gguf-py's ``MODEL_ARCH_NAMES``)."""
    hyperparameters: tuple[tuple[str, Value], ...]
    """(key after ``<architecture>.``, its value read from the transformers config): ints are written as uint32,
    floats as float32, None not at all."""
    permuted: tuple[tuple[str, str], ...] = ()
    """(projection, the config's count of its heads): the projections whose rows llama.cpp's rope reads in another
    order, head by head (Llama's queries and keys: the converter's ``permute``)."""
    transposed: tuple[str, ...] = ()
    """Weights kept (in, out) by transformers that GGUF holds (out, in): GPT-2's Conv1D."""
    norm_shift: float = 0.0
    """Added to every norm weight: Gemma's RMSNorm scales by 1 + weight, llama.cpp's by the weight."""
    assumes: tuple[tuple[str, Callable[[Any], bool]], ...] = ()
    """(what llama.cpp, or transformers' GGUF reader that export's check reads the file with, takes for granted of
    such a model without reading it from the file; the test on a config): a model for which one fails is refused,
    at check and at export, saying which."""
    rope_types: tuple[str, ...] = ("default", "linear")
    """The rope scalings written (``rope_type`` of the config's rope parameters); another is refused."""
    extra_tensors: tuple[tuple[str, Callable[[Any], list[float] | None]], ...] = ()
    """(GGUF name, its values from the config) of tensors the converter makes that the model has no weight for
    (Llama 3's ``rope_freqs``; None: not written for this config)."""
    pre_tokenizers: tuple[tuple[str, str], ...] = ()
    """(hash, llama.cpp's pre-tokenizer name) of the family's published byte-level tokenizers: llama.cpp's converter
    names a tokenizer's pre-tokenization by the sha256 of the ids it gives its test text. A tokenizer is named so in
    a model of any family (a fine-tune may bring another family's tokenizer)."""
    read_back: bool = True
    """Whether transformers' GGUF loader reads the architecture, so that export's check reads the file back with it;
    else (and where the file holds an extra tensor, which that loader does not read, or a config fails
    ``reader_takes``) the check reads the file's tensors into the run's model class with this layout undone."""
    reader_takes: tuple[Callable[[Any], bool], ...] = ()
    """What transformers' GGUF loader takes for granted of the architecture without reading it from the file (tests
    on a config): where one fails, export's check reads the file into the run's model class instead."""

    def read_by_transformers(self, config: Any) -> bool:
        """Whether transformers' GGUF loader reads all a file of this config holds, as the model has it."""
        return (self.read_back and all(takes(config) for takes in self.reader_takes)
                and all(values(config) is None for _, values in self.extra_tensors))


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
    gguf: GgufLayout
    """How ``qatune export --gguf`` writes it."""
    gguf_written: bool = True
    """Whether qatune export --gguf writes it."""

    @property
    def gguf_architecture(self) -> str:
        return self.gguf.architecture


LLAMA3_TOKENIZER = ("0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5", "llama-bpe")
SMOLLM2_TOKENIZER = ("855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249", "smollm")
ROPE_ROWS = (("q_proj", "num_attention_heads"), ("k_proj", "num_key_value_heads"))
"""Llama's queries and keys: transformers rotates a head's two halves, llama.cpp its interleaved pairs."""
LLAMA3_ROPE = {"rope_types": ("default", "linear", "llama3"), "extra_tensors": (("rope_freqs.weight",
                                                                              llama3_rope_factors),)}
"""LlamaModel's rope: Llama 3's scaling as a tensor of factors (llama.cpp's converter's generate_extra_tensors)."""
LLAMA = GgufLayout("llama", LLAMA_KEYS, permuted=ROPE_ROWS, pre_tokenizers=(LLAMA3_TOKENIZER, SMOLLM2_TOKENIZER),
                   **LLAMA3_ROPE)

FAMILIES = (
    Family("Llama (Llama 3, SmolLM2)", ("llama",), ATTENTION, "LlamaDecoderLayer", LLAMA),
    Family("Mistral", ("mistral",), ATTENTION, "MistralDecoderLayer", LLAMA),
    Family("Qwen2", ("qwen2",), ATTENTION, "Qwen2DecoderLayer", GgufLayout("qwen2", DECODER_KEYS, pre_tokenizers=(
        ("e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea", "qwen2"),))),
    Family("Qwen3", ("qwen3",), ATTENTION, "Qwen3DecoderLayer", GgufLayout(
        "qwen3", (*DECODER_KEYS, *HEAD_WIDTH), assumes=((f"its head_dim is 128 ({READER} Qwen3's)",
                                                         _is("head_dim", 128)),),
        pre_tokenizers=(("d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c", "qwen2"),))),
    Family("Gemma 2", ("gemma2",), ATTENTION, "Gemma2DecoderLayer", GgufLayout(
        "gemma2", (*DECODER_KEYS, *HEAD_WIDTH, ("attn_logit_softcapping", _float("attn_logit_softcapping")),
                   ("final_logit_softcapping", _float("final_logit_softcapping")),
                   ("attention.sliding_window", _int("sliding_window"))),
        norm_shift=1.0, assumes=(QUERY_SCALE, (f"its query_pre_attn_scalar is 256 ({READER} Gemma's)",
                                               _is("query_pre_attn_scalar", 256)),
                                 ("its layers alternate a sliding-window layer and a full one (llama.cpp's gemma2 "
                                  "pattern)", _full_every(2)),
                                 (f"its logits are soft-capped at 50 and 30 ({READER} Gemma 2's)",
                                  lambda c: (c.attn_logit_softcapping, c.final_logit_softcapping) == (50.0, 30.0))))),
    Family("Gemma 3", ("gemma3_text",), ATTENTION, "Gemma3DecoderLayer", GgufLayout(
        "gemma3", (*DECODER_KEYS, *HEAD_WIDTH, ("rope.freq_base_swa", sliding_rope_theta),
                   ("final_logit_softcapping", _float("final_logit_softcapping")),
                   ("attention.sliding_window", _int("sliding_window"))),
        norm_shift=1.0, assumes=(QUERY_SCALE, (f"its query_pre_attn_scalar is 256 ({READER} Gemma's)",
                                               _is("query_pre_attn_scalar", 256)),
                                 ("its layers are five sliding-window layers and a full one, repeated (llama.cpp's "
                                  "gemma3 pattern)", _full_every(6)),
                                 (f"its sliding-window layers' rope base is 10000 ({READER} Gemma 3's)",
                                  lambda c: sliding_rope_theta(c) in (None, 10000.0))))),
    # Phi-3 computes queries, keys and values in one fused projection; Phi-4-mini turns three quarters of each head
    # (its rope dimensions) and scales rope by longrope's factors (two tensors) and attention factor.
    Family("Phi-3", ("phi3",), ("qkv_proj",), "Phi3DecoderLayer", GgufLayout(
        "phi3", (*DECODER_KEYS, ("rope.dimension_count", rotary_dimensions),
                 ("rope.scaling.original_context_length", original_context),
                 ("rope.scaling.attn_factor", longrope_attention_factor),
                 ("attention.sliding_window", lambda config: int(getattr(config, "sliding_window", None) or 0))),
        rope_types=("default", "linear", "longrope"),
        extra_tensors=(("rope_factors_long.weight", longrope_factors("long_factor")),
                       ("rope_factors_short.weight", longrope_factors("short_factor"))),
        reader_takes=(_full_rotary,),  # it reads no rope.dimension_count
        pre_tokenizers=(("ccc2ef013c104be7bae2965776d611e1d7a8a2a9c547dd93a682c9a9fc80352e", "gpt-4o"),))),
    Family("SmolLM3", ("smollm3",), ATTENTION, "SmolLM3DecoderLayer", GgufLayout(
        "smollm3", LLAMA_KEYS, permuted=ROPE_ROWS, read_back=False, **LLAMA3_ROPE, assumes=((
            "every fourth layer has no rope and the others do (llama.cpp's smollm3)", _no_rope_every_fourth),))),
    Family("GPT-2", ("gpt2",), ("c_attn",), "GPT2Block", GgufLayout("gpt2", (
        ("block_count", _int("n_layer")),
        ("context_length", _int("n_positions")),
        ("embedding_length", _int("n_embd")),
        ("feed_forward_length", lambda config: int(config.n_inner or 4 * config.n_embd)),
        ("attention.head_count", _int("n_head")),
        ("attention.layer_norm_epsilon", _float("layer_norm_epsilon"))),
        transposed=(".c_attn.weight", ".c_proj.weight", ".c_fc.weight"),
        pre_tokenizers=(("3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454", "gpt-2"),))),
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
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    unmet = [said for said, holds in family.gguf.assumes if not holds(text)]
    if unmet:
        return f"qatune writes a {family.name} model as GGUF only if {'; and '.join(unmet)}, which this one does not"
    if _rope_type(text) not in family.gguf.rope_types:
        return (f"its rope scaling ({_rope_type(text)}) is not one qatune writes for its family {family.name} "
                f"({', '.join(family.gguf.rope_types)})")
    return None
