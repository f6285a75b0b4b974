"""``qatune export RUN --gguf OUT.gguf``: a causal LM run as one GGUF file for llama.cpp, Ollama and LM Studio,
an Ollama Modelfile beside it, and proof that the file answers as the run does.

Written with the ``gguf`` package alone (llama.cpp's own gguf-py), as llama.cpp's converter writes these
architectures: Llama (SmolLM2, Mistral), Qwen2 and GPT-2, with a byte-level BPE tokenizer. LoRA adapters are
merged first (the run's model folder is loaded as for inference). The file carries the run's prompt twice: as a
chat template that renders exactly the prompt qatune trained with (the question as the user message, the
context as the system message), and under qatune's own keys (:mod:`qatune.model.gguf_file`), so that
``qatune eval`` and ``generate`` prompt it as they prompt the run.

Before the file is put in place, it is read back by transformers' GGUF loader and checked against the run's
model on held-out rows: the prompts its chat template renders and their token ids must be the run's, it must
predict the next token at every position of prompt and gold answer as the run's own weights rounded to the
file's precision do (it then holds exactly those weights), and as the run does within what the precision is
expected to lose (:data:`AGREEMENT`). The share of identical greedy answers is measured and reported.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Any

import torch

from qatune.config import GenerateConfig, with_reading_overrides
from qatune.config.columns import PLACEHOLDER, column_key
from qatune.data.generative import PromptEncoder
from qatune.data.spreadsheet import QARecord, load_from_config, split_validation
from qatune.data.templates import PromptTemplate
from qatune.errors import QatuneError
from qatune.inference.generate import answer_questions
from qatune.model.folder import LoadedModel, ModelInfo, load_model_folder
from qatune.model.gguf_file import embedded_run, load_gguf_run
from qatune.runs import layout
from qatune.runs.atomic import atomic_write_text
from qatune.runs.lock import RunLock

log = logging.getLogger("qatune")

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
                 "GPT2LMHeadModel": "gpt2"}
"""The transformers classes written, and the GGUF architecture each becomes (llama.cpp runs Mistral as Llama)."""

QUANTS = ("f32", "f16", "bf16", "q8_0")


AGREEMENT = {"f32": 0.995, "f16": 0.98, "bf16": 0.95, "q8_0": 0.93}
"""The least share of next tokens a file of each precision must predict as the run does. f32 holds the run's
weights exactly; f16 and bf16 round each weight to 11 and 8 significant bits, q8_0 to 8 bits per block of 32.
A wrong tensor, permutation, hyper-parameter or tokenizer agrees on far less."""

EXACT = 0.999
"""The least share of next tokens the file must predict as the run's own weights do once rounded to the file's
precision: what it holds is then exactly the run at that precision (a near tie may break the other way)."""

CHECK_ROWS = 200

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


class ExportError(QatuneError):
    """A run that cannot be written as a GGUF file, or a file that does not answer as the run does."""


@dataclass
class Check:
    """What the written file reproduced of the run, on ``rows`` held-out rows: its prompts, its greedy answers
    and the next token it predicts at every position of prompt and gold answer, against the run's model and
    against the run's model with its weights rounded as the file stores them."""

    quant: str
    rows: int
    rows_from: str
    prompts_identical: int
    answers_identical: int
    positions: int
    next_tokens_agreeing: int
    next_tokens_as_rounded: int
    first_difference: dict[str, str] | None

    @property
    def answer_share(self) -> float:
        return self.answers_identical / self.rows if self.rows else 1.0

    @property
    def token_share(self) -> float:
        return self.next_tokens_agreeing / self.positions if self.positions else 1.0

    @property
    def rounded_share(self) -> float:
        return self.next_tokens_as_rounded / self.positions if self.positions else 1.0

    def passed(self) -> bool:
        return (self.prompts_identical == self.rows and self.rounded_share >= EXACT
                and self.token_share >= AGREEMENT[self.quant])

    def line(self) -> str:
        line = (f"{self.quant}: {self.answers_identical}/{self.rows} answers identical, next-token agreement "
                f"{100 * self.token_share:.1f}%")
        if self.quant != "f32":
            line += f" ({100 * self.rounded_share:.1f}% with the run's weights rounded to {self.quant})"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {"quant": self.quant, "rows": self.rows, "rows_from": self.rows_from,
                "prompts_identical": self.prompts_identical, "answers_identical": self.answers_identical,
                "answer_share": self.answer_share, "positions": self.positions,
                "next_tokens_agreeing": self.next_tokens_agreeing, "next_token_share": self.token_share,
                "next_tokens_as_rounded": self.next_tokens_as_rounded, "rounded_share": self.rounded_share,
                "required": {"next_token_share": AGREEMENT[self.quant], "rounded_share": EXACT},
                "passed": self.passed(), "line": self.line(), "first_difference": self.first_difference}


def export_gguf(run_dir: str | Path, output: str | Path, quant: str = "f16", which: str = layout.FINAL,
                data_file: str | Path | None = None, reading: list[str] | tuple[str, ...] = (),
                rows: int = CHECK_ROWS) -> tuple[Path, Check]:
    """Write the run's model as ``output`` (a .gguf file) and ``<output stem>.Modelfile`` beside it, once the
    file has been read back and found to answer as the run does; returns the file and the check.

    The check's rows come from ``data_file`` (read as ``reading`` says, like qatune eval's --set), else the
    run's data.eval_file, else its validation rows, else its first training rows."""
    output = Path(output)
    if output.suffix.lower() != ".gguf":
        raise ExportError(f"--gguf {output}: the file name must end in .gguf")
    if quant not in QUANTS:
        raise ExportError(f"--quant {quant}: choose one of {', '.join(QUANTS)}")
    with RunLock(output, "export file"):
        if output.exists():
            raise ExportError(f"{output} already exists; choose another file name or remove it first")
        loaded = load_model_folder(run_dir, which, device="cpu")
        refusal = unsupported(loaded)
        if refusal:
            raise ExportError(f"cannot export {run_dir} as GGUF: {refusal}; qatune export {run_dir} --merge FOLDER "
                              "writes it as a plain transformers folder instead")
        records, rows_from = check_records(loaded, data_file, reading, rows)
        output.parent.mkdir(parents=True, exist_ok=True)
        # Read back from a folder of its own: transformers' GGUF loader also reads tokenizer files beside it.
        work = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
        try:
            written = work / output.name
            write_gguf(loaded, written, quant)
            check = check_file(loaded, written, quant, records, rows_from)
            run = layout.results_dir(Path(run_dir), loaded.folder)
            if (run / layout.STATUS).is_file():  # the run directory, never a model folder (its manifest)
                atomic_write_text(run / f"export-{output.stem}.json",
                                  json.dumps({"file": str(output), **check.to_dict()}, indent=2) + "\n")
            if not check.passed():
                raise ExportError(_failure(check))
            os.replace(written, output)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        atomic_write_text(output.with_suffix(".Modelfile"), modelfile(loaded, output.name))
    return output, check


def unsupported(loaded: LoadedModel) -> str | None:
    """Why the loaded run cannot be written as GGUF (None: it can)."""
    info, model = loaded.info, loaded.model
    if info.task != "generative":
        return "it is an extractive model (llama.cpp runs language models that write their answers)"
    if info.seq2seq:
        return "it is an encoder-decoder model (T5), which llama.cpp's GGUF does not hold"
    kind = type(model).__name__
    if kind not in ARCHITECTURES:
        return f"its architecture {kind} is not one qatune writes as GGUF ({', '.join(sorted(ARCHITECTURES))})"
    if not getattr(loaded.tokenizer, "is_fast", False):
        return "its tokenizer is not a fast (tokenizer.json) one"
    if json.loads(loaded.tokenizer.backend_tokenizer.to_str())["model"]["type"] != "BPE":
        return "its tokenizer is not a byte-level BPE one (SentencePiece tokenizers are not written)"
    if pre_tokenizer(loaded.tokenizer) is None:
        return ("its tokenizer splits text in a way llama.cpp has no pre-tokenizer for (its pre-tokenization is "
                "neither GPT-2's nor one llama.cpp's converter knows)")
    extra = prompt_columns(info)
    if extra:
        return (f"its prompt reads the column(s) {', '.join(repr(c) for c in extra)} besides the question and the "
                "context; a chat template has only the question (the user message) and the context (the system "
                "message)")
    rope = getattr(model.config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ("default", "linear", None):
        return f"its rope scaling ({rope.get('rope_type')}) is not one qatune writes"
    return None


def prompt_columns(info: ModelInfo) -> list[str]:
    """The placeholders of the run's prompt other than the question and the context."""
    names = [m.group(1) for m in PLACEHOLDER.finditer(info.prompt_template) if m.group(1) is not None]
    return [name for name in dict.fromkeys(names) if column_key(name) not in ("question", "context")]


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


def check_records(loaded: LoadedModel, data_file: str | Path | None, reading: list[str] | tuple[str, ...],
                  rows: int) -> tuple[list[QARecord], str]:
    """The rows the check asks, and where they come from."""
    config = loaded.config
    data = with_reading_overrides(config, list(reading)).data if reading else config.data
    context = "{context}" in loaded.info.prompt_template
    if data_file is not None:
        records, _ = load_from_config(data, data_file, with_context=context)
        where = str(data_file)
    elif config.data.eval_file and Path(config.data.eval_file).is_file():
        records, _ = load_from_config(data, config.data.eval_file, with_context=context)
        where = f"{config.data.eval_file} (the run's data.eval_file)"
    elif config.data.train_file and Path(config.data.train_file).is_file():
        records, _ = load_from_config(data, config.data.train_file, with_context=context)
        if config.data.validation_fraction > 0:
            _, records = split_validation(records, config.data.validation_fraction, config.seed)
            where = f"the run's validation rows of {config.data.train_file}"
        else:
            where = f"{config.data.train_file} (the run's training rows: it holds none out)"
    else:
        raise ExportError("the run's data files are not where its config says; pass --data FILE, a sheet of rows "
                          "to check the exported file on")
    if not records:
        raise ExportError(f"no rows to check the exported file on in {where}")
    return records[:rows], where


# ------------------------------------------------------------------------------------------- writing


def write_gguf(loaded: LoadedModel, path: Path, quant: str) -> None:
    """The run's model, tokenizer, prompt and qatune's keys as one GGUF file."""
    import gguf

    model, config = loaded.model, loaded.model.config
    arch = ARCHITECTURES[type(model).__name__]
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
    names = gguf.get_tensor_name_map({"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
                                      "gpt2": gguf.MODEL_ARCH.GPT2}[arch],
                                     config.n_layer if arch == "gpt2" else config.num_hidden_layers)
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

    arch = ARCHITECTURES[type(model).__name__]
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


# ------------------------------------------------------------------------------------------- the prompt


def _segments(template: str) -> list[tuple[str, str]]:
    """A qatune prompt template as ("text", literal) and ("field", question|context) pieces."""
    pieces: list[tuple[str, str]] = []
    last = 0
    for match in PLACEHOLDER.finditer(template):
        if match.start() > last:
            pieces.append(("text", template[last:match.start()]))
        token = match.group(0)
        if token in ("{{", "}}"):
            pieces.append(("text", token[0]))
        else:
            pieces.append(("field", column_key(match.group(1))))
        last = match.end()
    if last < len(template):
        pieces.append(("text", template[last:]))
    return pieces


def chat_template(prompt_template: str, answer_prefix: str = "", end: str = "") -> str:
    """A Jinja chat template that renders exactly the run's prompt: its question is the last user message, its
    context the last system message; an assistant message after that user message is rendered as the run's
    training text goes on (``answer_prefix``, the answer, ``end``: the text of the token that ends an answer)."""
    out = ["{%- set ns = namespace(question='', context='', answer=none) -%}",
           "{%- for message in messages -%}",
           "{%- if message['role'] == 'user' -%}{%- set ns.question = message['content'] -%}"
           "{%- set ns.answer = none -%}",
           "{%- elif message['role'] == 'system' -%}{%- set ns.context = message['content'] -%}",
           "{%- elif message['role'] == 'assistant' -%}{%- set ns.answer = message['content'] -%}{%- endif -%}",
           "{%- endfor -%}"]
    for kind, value in _segments(prompt_template):
        out.append("{{ ns." + value + " }}" if kind == "field" else "{{ " + _jinja_string(value) + " }}")
    out.append("{%- if ns.answer is not none -%}{{ " + _jinja_string(answer_prefix) + " }}{{ ns.answer }}{{ "
               + _jinja_string(end) + " }}{%- endif -%}")
    return "".join(out)


def _jinja_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def modelfile(loaded: LoadedModel, file_name: str) -> str:
    """An Ollama Modelfile that asks the file exactly as qatune asked the run."""
    info, generate = loaded.info, loaded.config.generate
    template = "".join(
        ("{{ .Prompt }}" if value == "question" else "{{ .System }}") if kind == "field"
        else value.replace("{{", '{{ "{{" }}') for kind, value in _segments(info.prompt_template))
    encoder = PromptEncoder(loaded.tokenizer, PromptTemplate(info.prompt_template, info.answer_prefix))
    stops = [loaded.tokenizer.decode([index]) for index in encoder.stop_ids]
    lines = [f"FROM ./{file_name}", f'TEMPLATE """{template}"""']
    lines += [f'PARAMETER stop "{stop}"' for stop in stops if stop and '"' not in stop]
    lines += [f"PARAMETER temperature {generate.temperature:g}", f"PARAMETER num_predict {generate.max_new_tokens}"]
    if generate.temperature > 0:
        lines.append(f"PARAMETER top_p {generate.top_p:g}")
    return "\n".join(lines) + "\n"


def modelfile_prompt(text: str, question: str, context: str = "") -> str:
    """What Ollama renders from a Modelfile's TEMPLATE for one question (its only actions are these two)."""
    template = text.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    return (template.replace('{{ "{{" }}', "\0").replace("{{ .Prompt }}", question)
            .replace("{{ .System }}", context).replace("\0", "{{"))


# ------------------------------------------------------------------------------------------- the check


def check_file(loaded: LoadedModel, path: Path, quant: str, records: list[QARecord], rows_from: str) -> Check:
    """The written file read back by transformers and asked the run's questions: see :class:`Check`. Rounds
    ``loaded.model``'s weights in place to the file's precision."""
    info = loaded.info
    template = PromptTemplate(info.prompt_template, info.answer_prefix)
    ours = PromptEncoder(loaded.tokenizer, template)
    generate = GenerateConfig(max_new_tokens=loaded.config.generate.max_new_tokens, temperature=0.0)
    questions, contexts = [r.question for r in records], [r.context for r in records]
    fields = [r.fields for r in records]
    expected = answer_questions(loaded.model, loaded.tokenizer, info, questions, contexts, generate, fields=fields)
    run_next = _next_tokens(loaded.model, ours, records, info.max_length)
    if quant != "f32":
        round_like_file(loaded.model, quant)
        rounded_next = _next_tokens(loaded.model, ours, records, info.max_length)
    else:
        rounded_next = run_next

    exported = load_gguf_run(path, device="cpu")
    theirs = PromptEncoder(exported.tokenizer, PromptTemplate(exported.info.prompt_template,
                                                              exported.info.answer_prefix))
    end = loaded.tokenizer.decode([ours.end_id])
    identical = 0
    for record in records:
        text = template.render(record.question, record.context, record.fields)
        messages = [*([{"role": "system", "content": record.context}] if record.context else []),
                    {"role": "user", "content": record.question}]
        prompt = exported.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        trained = exported.tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": record.answer}], tokenize=False)
        same_ids = theirs.prompt_ids(record.question, record.context) == ours.prompt_ids(record.question,
                                                                                          record.context)
        identical += int(prompt == text and trained == text + info.answer_prefix + record.answer + end and same_ids)
    got = answer_questions(exported.model, exported.tokenizer, exported.info, questions, contexts, generate,
                           fields=fields)
    file_next = _next_tokens(exported.model, ours, records, info.max_length)
    same = [a == b for a, b in zip(expected, got)]
    first = next(({"question": r.question, "run": a, "file": b} for r, a, b, s in zip(records, expected, got, same)
                  if not s), None)
    positions = sum(len(t) for t in run_next)
    agreeing = sum(int((a == b).sum()) for a, b in zip(run_next, file_next))
    as_rounded = sum(int((a == b).sum()) for a, b in zip(rounded_next, file_next))
    return Check(quant, len(records), rows_from, identical, sum(same), positions, agreeing, as_rounded, first)


@torch.no_grad()
def _next_tokens(model: Any, encoder: PromptEncoder, records: list[QARecord], max_length: int
                 ) -> list[torch.Tensor]:
    """Per row, the token the model predicts after each position of its prompt and gold answer."""
    predicted = []
    for record in records:
        example = encoder.example(record, max_length)
        if example is not None:
            predicted.append(model(input_ids=torch.tensor([example.input_ids[:-1]])).logits[0].argmax(-1))
    return predicted


def _failure(check: Check) -> str:
    why = []
    if check.prompts_identical < check.rows:
        why.append(f"its chat template or tokenizer gave another prompt for {check.rows - check.prompts_identical} "
                   "rows")
    if check.rounded_share < EXACT:
        why.append(f"it predicts {100 * check.rounded_share:.1f}% of next tokens as the run's weights rounded to "
                   f"{check.quant} do (at least {100 * EXACT:.1f}% expected: the file does not hold those weights "
                   "as the run uses them)")
    if check.token_share < AGREEMENT[check.quant]:
        why.append(f"next-token agreement with the run {100 * check.token_share:.1f}% (at least "
                   f"{100 * AGREEMENT[check.quant]:.0f}% expected of {check.quant})")
    first = check.first_difference
    example = (f"; first differing answer: {first['question']!r}: the run says {first['run']!r}, the file "
               f"{first['file']!r}") if first else ""
    return f"the exported file does not answer as the run does: {'; '.join(why)}{example}; nothing was written"
