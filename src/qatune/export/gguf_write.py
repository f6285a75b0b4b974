"""Writing a run as one GGUF file with the ``gguf`` package alone (llama.cpp's own gguf-py), as llama.cpp's
converter writes the model's family: weights, the hyper-parameters llama.cpp reads, the tokenizer (a byte-level BPE
with its pre-tokenizer's name, or a SentencePiece BPE as Gemma's with its scores) and its special tokens, the chat
template (:mod:`qatune.export.gguf_prompt`) and qatune's own keys (:mod:`qatune.model.gguf_file`).

What differs between families is data: the family's :class:`qatune.model.families.GgufLayout` (its architecture,
its hyper-parameters' keys, the tensors reordered, transposed or shifted, the tensors it adds such as Llama 3's rope
factors) and gguf-py's tensor name map for the architecture. Nothing here asks which family it writes."""

from __future__ import annotations

import json
import logging
import re
import tempfile
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch

from qatune.data.generative import PromptEncoder
from qatune.data.templates import PromptTemplate
from qatune.export import ExportError
from qatune.export.gguf_prompt import chat_template
from qatune.model.families import FAMILIES, GgufLayout, family_of, rope_parameters
from qatune.model.folder import LoadedModel
from qatune.model.gguf_cache import quick_reader
from qatune.model.gguf_file import embedded_run
from qatune.runs.layout import BEST, FINAL

QUANTS = ("f32", "f16", "bf16", "q8_0")

OTHER_PRE_TOKENIZERS = {
    # llama.cpp's names of the byte-level tokenizers of small models of no family of qatune's (the families' own
    # are in their records), by the hash of the ids they give CHECK_TEXT.
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
    text, as llama.cpp's converter finds it (the families' records hold those of their tokenizers); else "gpt-2"
    for a plain byte-level one (GPT-2's own split, as the tokenizers qatune trains for scratch models have), or the
    family whose split expression it uses (SPLITS); None: unknown."""
    known = dict(OTHER_PRE_TOKENIZERS)
    known.update(entry for family in FAMILIES for entry in family.gguf.pre_tokenizers)
    ids = tokenizer.encode(CHECK_TEXT)
    name = known.get(sha256(str(ids).encode()).hexdigest())
    if name is not None:
        return name
    normalizer, pre = _stage(tokenizer, "normalizer"), _stage(tokenizer, "pre_tokenizer") or {}
    if normalizer is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    steps = pre.get("pretokenizers") or []
    if (pre.get("type") == "Sequence" and len(steps) == 2 and steps[0].get("type") == "Split"
            and steps[0].get("behavior") == "Isolated" and steps[1].get("type") == "ByteLevel"
            and not steps[1].get("use_regex", True)):
        return SPLITS.get((steps[0].get("pattern") or {}).get("Regex"))
    return None


def _stage(tokenizer: Any, name: str) -> dict | None:
    """One stage of a fast tokenizer's pipeline (``normalizer``, ``pre_tokenizer``) as tokenizer.json writes it,
    without writing the whole vocabulary out (Gemma's is 33 MB)."""
    stage = getattr(tokenizer.backend_tokenizer, name)
    return None if stage is None else json.loads(stage.__getstate__())


def _merges(tokenizer: Any) -> list:
    return json.loads(tokenizer.backend_tokenizer.to_str())["model"].get("merges", [])


def write_gguf(loaded: LoadedModel, path: Path, quant: str) -> None:
    """The run's model, tokenizer, prompt and qatune's keys as one GGUF file."""
    import gguf
    import numpy as np

    model, config = loaded.model, loaded.model.config
    layout = family_of(config).gguf
    writer = gguf.GGUFWriter(str(path), layout.architecture)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(loaded.folder.parent.name if loaded.folder.name in (FINAL, BEST)
                    else loaded.folder.name)
    _hyperparameters(writer, layout, config)
    writer.add_file_type(int(_file_type(quant)))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer(writer, loaded, config)
    for key, value in embedded_run(loaded.config, loaded.info).items():
        writer.add_string(key, value)
    for name, array, kind in _tensors(model, layout, quant):
        writer.add_tensor(name, array, raw_dtype=kind)
    for name, values in extra_tensors(layout, config).items():
        writer.add_tensor(name, np.asarray(values, dtype=np.float32), raw_dtype=gguf.GGMLQuantizationType.F32)
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


def extra_tensors(layout: GgufLayout, config: Any) -> dict[str, list[float]]:
    """The tensors the layout writes besides the model's weights, for this config."""
    values = {name: value(config) for name, value in layout.extra_tensors}
    return {name: value for name, value in values.items() if value is not None}


def hyperparameters(layout: GgufLayout, config: Any) -> dict[str, int | float]:
    """The hyper-parameters the layout writes for a transformers config, by their full GGUF keys."""
    values = {f"{layout.architecture}.{key}": value(config) for key, value in layout.hyperparameters}
    return {key: value for key, value in values.items() if value is not None}


def _hyperparameters(writer: Any, layout: GgufLayout, config: Any) -> None:
    import gguf

    for key, value in hyperparameters(layout, config).items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    rope = rope_parameters(config)
    if rope.get("rope_type") == "linear" and rope.get("factor"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))


def end_of_turn(loaded: LoadedModel) -> int | None:
    """The token that ends the run's answers where it is not the EOS (Llama 3's <|eot_id|>, Gemma's <end_of_turn>,
    ChatML's <|im_end|> beside <|endoftext|>): llama.cpp stops at it as at the EOS."""
    tokenizer = loaded.tokenizer
    encoder = PromptEncoder(tokenizer, PromptTemplate(loaded.info.prompt_template, loaded.info.answer_prefix))
    return None if encoder.end_id == tokenizer.eos_token_id else int(encoder.end_id)


SPACES_AS_PIECES = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
"""The normalizer of a SentencePiece BPE converted to tokenizer.json as Gemma's is: every space written as ▁."""
BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")


def vocabulary_kind(tokenizer: Any) -> str | None:
    """How llama.cpp runs the tokenizer (``tokenizer.ggml.model``): "gpt2", a byte-level BPE (its pre-tokenizer
    named by :func:`pre_tokenizer`), or "llama", SentencePiece's BPE as Gemma's tokenizer.json holds it (spaces as
    ▁, no space put in front, bytes a piece lacks as <0xXX> tokens); None: neither."""
    model = tokenizer.backend_tokenizer.model
    if type(model).__name__ != "BPE":
        return None
    if model.byte_fallback and _stage(tokenizer, "normalizer") == SPACES_AS_PIECES:
        return "llama"
    return "gpt2" if pre_tokenizer(tokenizer) is not None else None


def tokenizer_refusal(tokenizer: Any) -> str | None:
    """Why the tokenizer cannot be written for llama.cpp (None: it can)."""
    if not getattr(tokenizer, "is_fast", False):
        return "its tokenizer is not a fast (tokenizer.json) one"
    if type(tokenizer.backend_tokenizer.model).__name__ != "BPE":
        return ("its tokenizer is not a BPE one (qatune writes byte-level BPE tokenizers and SentencePiece BPE ones "
                "as Gemma's)")
    if vocabulary_kind(tokenizer) is None:
        return ("its tokenizer splits text in a way llama.cpp has no pre-tokenizer for (its pre-tokenization is "
                "neither GPT-2's nor one llama.cpp's converter knows)")
    return None


def _vocabulary(tokenizer: Any, size: int, kind: str) -> tuple[list[str], list[int], list[float]]:
    """The file's tokens, their types and (SentencePiece's) scores, as llama.cpp's converter writes them: added
    tokens control (special) or user-defined, ids the tokenizer lacks unused [PADn]; a piece's score is minus the
    rank of the merge that makes it, so llama.cpp, which merges the best-scored pair first, merges as the BPE
    does."""
    import gguf

    vocab = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    merges = _merges(tokenizer)
    rank: dict[str, int] = {}
    for at, merge in enumerate(merges):
        rank.setdefault("".join(merge.split(" ") if isinstance(merge, str) else merge), at)
    tokens, kinds, scores = [], [], []
    for index in range(size):
        token = vocab.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            kinds.append(gguf.TokenType.UNUSED)
            scores.append(-1000.0)
            continue
        tokens.append(token)
        if index in added:
            kinds.append(gguf.TokenType.CONTROL if added[index].special else gguf.TokenType.USER_DEFINED)
            scores.append(-1000.0)
        elif kind == "llama" and BYTE_TOKEN.fullmatch(token):
            kinds.append(gguf.TokenType.BYTE)
            scores.append(0.0)
        else:
            kinds.append(gguf.TokenType.NORMAL)
            scores.append(0.0 if len(token) == 1 else -float(rank.get(token, len(merges))))
    return tokens, [int(kind) for kind in kinds], scores


def _tokenizer(writer: Any, loaded: LoadedModel, config: Any) -> None:
    import gguf

    tokenizer = loaded.tokenizer
    kind = vocabulary_kind(tokenizer)
    # As many tokens as the model has embeddings (llama.cpp requires it): a token the tokenizer adds beyond them
    # (GemmaTokenizer's <mask> where a vocabulary lacks one) is one the model cannot read anyway.
    tokens, kinds, scores = _vocabulary(tokenizer, config.vocab_size, kind)
    writer.add_tokenizer_model(kind)
    writer.add_tokenizer_pre(pre_tokenizer(tokenizer) if kind == "gpt2" else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    if kind == "llama":
        writer.add_token_scores(scores)
        writer.add_add_space_prefix(False)
    # The merges and the special tokens' ids as llama.cpp's converter reads them from the tokenizer's files
    # (SentencePiece's llama.cpp merges by the scores; transformers' GGUF reader takes the merges where a file has
    # them).
    quiet = logging.getLogger("gguf.vocab")  # it warns of post-processor details llama.cpp does not use
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory() as folder:
            tokenizer.save_pretrained(folder)
            special = gguf.SpecialVocab(folder, load_merges=bool(_merges(tokenizer)), n_vocab=len(tokens),
                                        special_token_types=("bos", "eos", "unk", "pad"))
    finally:
        quiet.setLevel(level)
    eot = end_of_turn(loaded)
    if eot is not None:
        special.special_token_ids["eot"] = eot
    first = tokenizer("a")["input_ids"]
    special.add_special_token = {  # what the tokenizer does, not what its files say it does
        "bos": bool(first) and tokenizer.bos_token_id is not None and first[0] == tokenizer.bos_token_id,
        "eos": False}
    end = tokenizer.decode([eot if eot is not None else tokenizer.eos_token_id])
    special.chat_template = chat_template(loaded.info.prompt_template, loaded.info.answer_prefix, end)
    special.add_to_gguf(writer, quiet=True)


def _tensors(model: Any, layout: GgufLayout, quant: str) -> Any:
    """(GGUF name, numpy array, its GGML type) of every tensor llama.cpp reads, as its converter writes them."""
    import numpy as np

    for hf_name, name, data in file_tensors(model, layout):
        heads = rope_heads(hf_name, model.config, layout)
        if heads is not None:
            data = _permute(data, heads)
        array, kind = _quantize(data.contiguous().numpy(), name, quant)
        yield name, np.ascontiguousarray(array), kind


def rope_heads(hf_name: str, config: Any, layout: GgufLayout) -> int | None:
    """The heads a tensor's rows are permuted by for llama.cpp's rope (None: not permuted)."""
    for projection, count in layout.permuted:
        if hf_name.endswith((f".{projection}.weight", f".{projection}.bias")):
            return int(getattr(config, count, None) or config.num_attention_heads)
    return None


def file_tensors(model: Any, layout: GgufLayout) -> Any:
    """(transformers name, GGUF name, float32 tensor as the file holds it) of every tensor the file holds; rows
    that llama.cpp's rope reads permuted (``layout.permuted``) are still in transformers' order."""
    import gguf

    config = model.config
    architecture = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == layout.architecture)
    blocks = dict(layout.hyperparameters)["block_count"](config)  # every layout writes its count of layers
    names = gguf.get_tensor_name_map(architecture, blocks)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and tied:
            continue  # llama.cpp takes the token embeddings as the output layer
        if hf_name.endswith((".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")):
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ExportError(f"the model's tensor {hf_name} has no GGUF name for {layout.architecture}")
        yield hf_name, name, to_file(hf_name, tensor.detach().to(torch.float32), layout)


def to_file(hf_name: str, data: torch.Tensor, layout: GgufLayout) -> torch.Tensor:
    """A transformers tensor as the layout stores it (rows permuted for rope aside)."""
    if hf_name.endswith(layout.transposed):
        data = data.t()
    if layout.norm_shift and hf_name.endswith("norm.weight"):
        data = data + layout.norm_shift
    return data


def from_file(hf_name: str, data: torch.Tensor, layout: GgufLayout) -> torch.Tensor:
    """:func:`to_file` undone, as transformers' GGUF reader undoes it."""
    if layout.norm_shift and hf_name.endswith("norm.weight"):
        data = data - layout.norm_shift
    if hf_name.endswith(layout.transposed):
        data = data.t()
    return data


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

    layout = family_of(model.config).gguf
    state = model.state_dict()
    for hf_name, name, data in file_tensors(model, layout):
        array, kind = _quantize(data.contiguous().numpy(), name, quant)
        rounded = torch.from_numpy(gguf.quants.dequantize(array, kind).reshape(data.shape).copy())
        state[hf_name].copy_(from_file(hf_name, rounded, layout))


@torch.no_grad()
def read_into(model: Any, path: Path) -> None:
    """Load a GGUF file's tensors into a model of the family it was written from, the family's layout undone: how
    export's check reads back an architecture transformers' GGUF reader does not know (``layout.read_back``)."""
    import gguf

    layout = family_of(model.config).gguf
    by_name = {name: hf_name for hf_name, name, _ in file_tensors(model, layout)}
    extra = extra_tensors(layout, model.config)  # the model computes them from its config
    state = model.state_dict()
    for tensor in quick_reader()(str(path)).tensors:
        if tensor.name in extra:
            continue
        hf_name = by_name.get(tensor.name)
        if hf_name is None:
            raise ExportError(f"{path.name} holds a tensor {tensor.name} that a {layout.architecture} model lacks")
        data = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy()).to(torch.float32)
        heads = rope_heads(hf_name, model.config, layout)
        if heads is not None:
            data = _unpermute(data, heads)
        state[hf_name].copy_(from_file(hf_name, data, layout).reshape(state[hf_name].shape))


def _permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of one rope projection reordered as llama.cpp's rope reads them (its converter's permute): per head,
    transformers' two halves interleaved."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _unpermute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """:func:`_permute` undone."""
    return (weights.reshape(heads, weights.shape[0] // heads // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))
