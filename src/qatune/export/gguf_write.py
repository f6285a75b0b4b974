"""Writing a run as one GGUF file with the ``gguf`` package alone (llama.cpp's own gguf-py), as llama.cpp's
converter writes these architectures: Llama (SmolLM2, Mistral), Qwen2 and GPT-2, with a byte-level BPE tokenizer:
weights, the hyper-parameters llama.cpp reads, the tokenizer with its pre-tokenizer name, the chat template
(:mod:`qatune.export.gguf_prompt`) and qatune's own keys (:mod:`qatune.model.gguf_file`)."""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch

from qatune.data.generative import PromptEncoder
from qatune.data.templates import PromptTemplate
from qatune.export import ExportError
from qatune.export.gguf_prompt import chat_template
from qatune.model.families import family_of
from qatune.model.folder import LoadedModel
from qatune.model.gguf_file import embedded_run
from qatune.runs import layout

QUANTS = ("f32", "f16", "bf16", "q8_0")

PRE_TOKENIZERS = {
    # llama.cpp's convert_hf_to_gguf.py names a byte-level BPE tokenizer's pre-tokenization by the hash of the
    # ids it gives CHECK_TEXT; these are the ones of small models qatune trains.
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085": "phi-2",
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "olmo",
    "32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3": "stablelm2",
}
SPLITS = {
    # A byte-level tokenizer whose vocabulary is not one of those above (a model's own, or trained from a sheet)
    # but that splits text with the regular expression of a known family: llama.cpp's pre-tokenizer of that name
    # splits the same way.
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+": "qwen2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+": "llama-bpe",
}
CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) "
    "✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)


def pre_tokenizer(tokenizer: Any) -> str | None:
    """The name llama.cpp knows the tokenizer's pre-tokenization by: from the hash of its ids on llama.cpp's test
    text, as llama.cpp's converter finds it; else "gpt-2" for a plain byte-level one (GPT-2's own split, as the
    tokenizers qatune trains for scratch models have), or the family whose split expression it uses (SPLITS);
    None: unknown."""
    ids = tokenizer.encode(CHECK_TEXT)
    name = PRE_TOKENIZERS.get(sha256(str(ids).encode()).hexdigest())
    if name is not None:
        return name
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    pre = spec.get("pre_tokenizer") or {}
    if spec.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    steps = pre.get("pretokenizers") or []
    if (pre.get("type") == "Sequence" and len(steps) == 2 and steps[0].get("type") == "Split"
            and steps[0].get("behavior") == "Isolated" and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex", True)):
        return SPLITS.get((steps[0].get("pattern") or {}).get("Regex"))
    return None


def write_gguf(loaded: LoadedModel, path: Path, quant: str) -> None:
    """The run's model, tokenizer, prompt and qatune's keys as one GGUF file."""
    import gguf

    model, config = loaded.model, loaded.model.config
    arch = family_of(config).gguf_architecture
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(loaded.folder.parent.name if loaded.folder.name in (layout.FINAL, layout.BEST)
                    else loaded.folder.name)
    _hyperparameters(writer, arch, config)
    writer.add_file_type(int(_file_type(quant)))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer(writer, loaded, config)
    for key, value in embedded_run(loaded.config, loaded.info).items():
        writer.add_string(key, value)
    for name, array, kind in _tensors(model, arch, quant):
        writer.add_tensor(name, array, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _file_type(quant: str) -> Any:
    import gguf

    return {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quant]


def _tensor_type(quant: str) -> Any:
    import gguf

    return {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
            "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[quant]


def _hyperparameters(writer: Any, arch: str, config: Any) -> None:
    import gguf

    if arch == "gpt2":
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_block_count(config.n_layer)
        writer.add_feed_forward_length(config.n_inner or 4 * config.n_embd)
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        return
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(config.vocab_size)
    if rope.get("rope_type") == "linear" and rope.get("factor"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))


def _tokenizer(writer: Any, loaded: LoadedModel, config: Any) -> None:
    import gguf

    tokenizer = loaded.tokenizer
    vocab = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    size = max(config.vocab_size, max(vocab) + 1)
    tokens, kinds = [], []
    for index in range(size):
        if index not in vocab:
            tokens.append(f"[PAD{index}]")
            kinds.append(gguf.TokenType.UNUSED)
        elif index in added:
            tokens.append(vocab[index])
            kinds.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(vocab[index])
            kinds.append(gguf.TokenType.NORMAL)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    merges = [m if isinstance(m, str) else " ".join(part.replace(" ", "Ġ") for part in m)
              for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(tokenizer))
    writer.add_token_list(tokens)
    writer.add_token_types([int(kind) for kind in kinds])
    writer.add_token_merges(merges)
    for index, add in ((tokenizer.bos_token_id, writer.add_bos_token_id), (tokenizer.eos_token_id,
                       writer.add_eos_token_id), (tokenizer.unk_token_id, writer.add_unk_token_id),
                       (tokenizer.pad_token_id, writer.add_pad_token_id)):
        if index is not None:
            add(int(index))
    encoder = PromptEncoder(tokenizer, PromptTemplate(loaded.info.prompt_template, loaded.info.answer_prefix))
    if encoder.end_id != tokenizer.eos_token_id:
        writer.add_eot_token_id(int(encoder.end_id))  # the end of the assistant's turn also ends generation
    first = tokenizer("a")["input_ids"]
    writer.add_add_bos_token(bool(first) and tokenizer.bos_token_id is not None and first[0] == tokenizer.bos_token_id)
    writer.add_add_eos_token(False)
    end = tokenizer.decode([encoder.end_id])
    writer.add_chat_template(chat_template(loaded.info.prompt_template, loaded.info.answer_prefix, end))


def _tensors(model: Any, arch: str, quant: str) -> Any:
    """(GGUF name, numpy array, its GGML type) of every tensor llama.cpp reads, as its converter writes them."""
    import numpy as np

    config = model.config
    for hf_name, name, data in _named_tensors(model, arch):
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = _permute(data, config.num_attention_heads, config.num_attention_heads)
        elif arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _permute(data, config.num_attention_heads, config.num_key_value_heads)
        array, kind = _quantize(data.contiguous().numpy(), name, quant)
        yield name, np.ascontiguousarray(array), kind


def _named_tensors(model: Any, arch: str) -> Any:
    """(transformers name, GGUF name, float32 tensor as GGUF lays it out) of every tensor the file holds; the
    rows of Llama's queries and keys are still in transformers' order."""
    import gguf

    config = model.config
    architecture = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(architecture, config.n_layer if arch == "gpt2" else config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue  # llama.cpp takes the token embeddings as the output layer
        if hf_name.endswith((".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ExportError(f"the model's tensor {hf_name} has no GGUF name for {arch}")
        data = tensor.detach().to(torch.float32)
        if arch == "gpt2" and hf_name.endswith(_GPT2_CONV1D):
            data = data.t()  # GPT-2's Conv1D keeps (in, out)
        yield hf_name, name, data


_GPT2_CONV1D = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")


def _quantize(array: Any, name: str, quant: str) -> tuple[Any, Any]:
    """The tensor as the file stores it, and its GGML type: vectors, norms and GPT-2's positions stay F32, and
    rows that do not divide into Q8_0's blocks of 32 are F16, as llama.cpp's converter writes them."""
    import gguf

    kind = _tensor_type(quant)
    if array.ndim <= 1 or name.endswith("_norm.weight") or name == "position_embd.weight":
        kind = gguf.GGMLQuantizationType.F32
    try:
        return gguf.quants.quantize(array, kind), kind
    except gguf.QuantError:
        kind = gguf.GGMLQuantizationType.F16
        return gguf.quants.quantize(array, kind), kind


@torch.no_grad()
def round_like_file(model: Any, quant: str) -> None:
    """Round the model's weights in place as the file of precision ``quant`` stores them: what a correct file
    holds, read back (Q8_0's blocks run along the rows llama.cpp multiplies, which reordering rows keeps)."""
    import gguf

    arch = family_of(model.config).gguf_architecture
    state = model.state_dict()
    for hf_name, name, data in _named_tensors(model, arch):
        array, kind = _quantize(data.contiguous().numpy(), name, quant)
        rounded = torch.from_numpy(gguf.quants.dequantize(array, kind).reshape(data.shape).copy())
        if arch == "gpt2" and hf_name.endswith(_GPT2_CONV1D):
            rounded = rounded.t()
        state[hf_name].copy_(rounded)


def _permute(weights: torch.Tensor, heads: int, kv_heads: int | None) -> torch.Tensor:
    """Llama's query and key rows reordered as llama.cpp's rope reads them (its converter's permute)."""
    if kv_heads is not None and heads != kv_heads:
        heads = kv_heads
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))
