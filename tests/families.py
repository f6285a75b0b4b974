"""A tiny random model folder per model family, as a user's local folder of that family looks: the family's
transformers config (2 layers, hidden size 32) and a tokenizer of its kind, a byte-level BPE trained offline on
tests/fixtures/xquad_slice.csv with the family's special tokens, its end-of-turn token and its own chat template
(the templates below keep what qatune reads of the real ones: the turn markup, a default system message, a thinking
block, a system message folded into the user's, a BOS the template writes itself)."""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import CHATML_TEMPLATE, FIXTURES

LLAMA3_TEMPLATE = (  # Llama 3.2's: a system message with its dates always, the content trimmed
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{{ '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
    "Today Date: 26 Jul 2024\n\n' + system + '<|eot_id|>' }}"
    "{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN2_TEMPLATE = (  # Qwen2.5's: ChatML with a default system message
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are "
    "a helpful assistant.<|im_end|>\n' }}{% endif %}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN3_TEMPLATE = (  # Qwen3's: the last answer written after an empty thinking block
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GEMMA2_TEMPLATE = (  # Gemma 2's: no system role, the assistant is the model, the BOS written by the template
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
GEMMA3_TEMPLATE = (  # Gemma 3's: a system message is the start of the first user turn
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set first = '' %}{% endif %}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3_TEMPLATE = (  # Phi-4-mini's: <|end|> ends a turn, the EOS (<|endoftext|>) the conversation
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)
MISTRAL_TEMPLATE = (  # Mistral's: [INST] ... [/INST], the answer ended by the EOS, a system message in the user's
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + (messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' else '')"
    " + message['content'] + '[/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
SMOLLM3_TEMPLATE = (  # SmolLM3's without reasoning: a metadata system block, an empty thinking block to answer after
    "{{ '<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\nReasoning Mode: /no_think\n\n"
    "## Custom Instructions\n\n' }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% set messages = messages[1:] %}{% else %}{{ 'You are a helpful AI assistant named SmolLM.' }}{% endif %}"
    "{{ '\n\n<|im_end|>\n' }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' }}{% endif %}{{ message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n' }}{% endif %}"
)

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")

GEMMA_HEAD = 256
"""Gemma's heads are as wide as its configs' query_pre_attn_scalar (256): llama.cpp scales queries by the head width,
and transformers' GGUF reader takes the config's default scalar."""
QWEN3_HEAD = 128
"""Qwen3's head width (its config's default, which transformers' GGUF reader takes)."""
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
"""Llama 3.2's rope scaling, its original context cut to 256 so that the tiny model's 4 pairs of dimensions meet all
three of its cases (kept, scaled, in between)."""
PHI4_MINI_ROPE = {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 256,
                  "max_position_embeddings": 1024, "rope_scaling": {
                      "type": "longrope", "short_factor": [1.0, 1.25, 2.0], "long_factor": [1.0, 4.0, 32.0]}}
"""Phi-4-mini's rope as its config.json writes it: on three quarters of each head (6 of 8 dimensions here, 3 pairs),
scaled by longrope's factors per pair (the short ones up to the original context, the long ones beyond) and by an
attention factor from the context's growth (1024 / 256 here; 131072 / 4096 published). The original context is one
llama.cpp can run within (it rounds its context up to a multiple of 256, and takes the long factors past it)."""
DECODER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 512}
WIDE_HEADS = {**DECODER, "num_attention_heads": 2, "num_key_value_heads": 1}
"""Families with wide heads (Gemma's, Qwen3's): two heads and one for keys and values keep the model small."""


@dataclass(frozen=True)
class FamilyCase:
    """A family as the tests build it: its transformers config and its tokenizer's kind."""

    id: str
    model_type: str
    config: dict
    """The config's keys besides the vocabulary and the special tokens' ids."""
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str | None
    end_of_turn: str
    """The token that ends an answer."""
    template: str | None
    split: str | None = None
    """The pre-tokenizer's split expression (None: GPT-2's byte-level split)."""
    tied: bool = True
    sentencepiece: bool = False
    """A SentencePiece BPE as Gemma's published tokenizer is (spaces as ▁, bytes by fallback), not a byte-level one."""


CASES = (
    FamilyCase("llama3", "llama", {**DECODER, "rope_parameters": LLAMA3_ROPE}, ("<|begin_of_text|>",
               "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), "<|begin_of_text|>",
               "<|eot_id|>", None, "<|eot_id|>", LLAMA3_TEMPLATE, split=LLAMA3_SPLIT),
    FamilyCase("smollm2", "llama", DECODER, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_start|>",
               "<|im_end|>", "<|im_end|>", "<|im_end|>", CHATML_TEMPLATE),
    FamilyCase("qwen2", "qwen2", DECODER, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>",
               "<|endoftext|>", "<|im_end|>", QWEN2_TEMPLATE, split=QWEN2_SPLIT),
    FamilyCase("qwen3", "qwen3", {**WIDE_HEADS, "head_dim": QWEN3_HEAD}, ("<|endoftext|>", "<|im_start|>",
               "<|im_end|>"), None, "<|im_end|>", "<|endoftext|>", "<|im_end|>", QWEN3_TEMPLATE, split=QWEN2_SPLIT),
    FamilyCase("gemma2", "gemma2", {**WIDE_HEADS, "head_dim": GEMMA_HEAD}, ("<pad>", "<eos>", "<bos>", "<unk>",
               "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>", "<pad>", "<end_of_turn>", GEMMA2_TEMPLATE),
    # Gemma 3 as published (270M, 1B): its own SentencePiece tokenizer.
    FamilyCase("gemma3", "gemma3_text", {**WIDE_HEADS, "head_dim": GEMMA_HEAD}, ("<pad>", "<eos>", "<bos>", "<unk>",
               "<mask>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>", "<pad>", "<end_of_turn>",
               GEMMA3_TEMPLATE, sentencepiece=True),
    FamilyCase("phi3", "phi3", DECODER, ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
               "<|endoftext|>", "<|endoftext|>", "<|endoftext|>", "<|end|>", PHI3_TEMPLATE),
    FamilyCase("phi4-mini", "phi3", {**DECODER, **PHI4_MINI_ROPE}, ("<|endoftext|>", "<|system|>", "<|user|>",
               "<|assistant|>", "<|end|>"), "<|endoftext|>", "<|endoftext|>", "<|endoftext|>", "<|end|>",
               PHI3_TEMPLATE),
    FamilyCase("mistral", "mistral", DECODER, ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), "<s>", "</s>", None,
               "</s>", MISTRAL_TEMPLATE, tied=False),
    FamilyCase("smollm3", "smollm3", DECODER, ("<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"),
               None, "<|im_end|>", "<|im_end|>", "<|im_end|>", SMOLLM3_TEMPLATE, split=LLAMA3_SPLIT),
    FamilyCase("gpt2", "gpt2", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 512}, ("<|endoftext|>",),
               "<|endoftext|>", "<|endoftext|>", None, "<|endoftext|>", None),
)

GEMMA3_BYTE_LEVEL = FamilyCase("gemma3-byte-level", "gemma3_text", {**WIDE_HEADS, "head_dim": GEMMA_HEAD}, (
    "<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>", "<pad>", "<end_of_turn>",
    GEMMA3_TEMPLATE)
"""A Gemma 3 fine-tuned with a byte-level BPE (llama.cpp's converter writes it as such): the GGUF tests only."""
GGUF_CASES = (*CASES, GEMMA3_BYTE_LEVEL)


def answer_sentence_rows(path: Path, n: int, max_answer_words: int | None = None) -> list[dict[str, str]]:
    """The first ``n`` rows of a reading-comprehension sheet (question, context, answer columns) whose answer lies in
    one sentence of its passage (and is at most ``max_answer_words`` words long), the passage cut to that sentence, one
    row per question: (question, context, answer) rows whose answers are spans of their passages."""
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            sentence = next((s for s in re.split(r"(?<=[.!?]) ", row["context"]) if row["answer"] in s), None)
            short = max_answer_words is None or len(row["answer"].split()) <= max_answer_words
            if sentence and short and row["question"] not in {r["question"] for r in rows}:
                rows.append({"question": row["question"], "context": sentence, "answer": row["answer"]})
    return rows[:n]


def sheet_rows(n: int) -> list[dict[str, str]]:
    """The first ``n`` rows of the XQuAD fixture with a short answer (three words at most), the passage cut to the
    sentence that holds it."""
    return answer_sentence_rows(FIXTURES / "xquad_slice.csv", n, max_answer_words=3)


def write_sheet(path: Path, rows: list[dict]) -> Path:
    """``rows`` as a CSV sheet, their keys the columns."""
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_config(path: Path, model: str | Path, train_file: Path, output_dir: Path, *, seed: int = 0,
                 epochs: int = 60, learning_rate: float = 1.0e-2, data: dict | None = None,
                 generate: dict | None = None) -> Path:
    """A generative config that trains ``model`` on ``train_file`` (question, context, answer) as the family matrix
    trains its tiny models: batches of 8 rows, fp32, no weight decay, 2 warmup steps, the loss logged every step;
    ``data`` and ``generate``: keys of those sections (besides the files and columns, ``max_new_tokens: 8``)."""
    import yaml

    path.write_text(yaml.safe_dump({
        "task": "generative", "seed": seed, "output_dir": str(output_dir), "model": {"name_or_path": str(model)},
        "data": {"train_file": str(train_file), "context_column": "context", **(data or {})},
        "train": {"epochs": epochs, "batch_size": 8, "learning_rate": learning_rate, "weight_decay": 0.0,
                  "warmup_steps": 2, "logging_steps": 1, "precision": "fp32"},
        "generate": {"max_new_tokens": 8, **(generate or {})}}, sort_keys=False), encoding="utf-8")
    return path


def family_setup(case: FamilyCase, folder: Path, rows: int = 8) -> tuple[Path, Path, Path]:
    """The family's model folder, the first ``rows`` rows of the fixture sheet and a config training the one on the
    other into ``folder``/run (:func:`write_config`), all in ``folder``: (model folder, config file, rows file)."""
    model = family_folder(case, folder / f"tiny-{case.id}")
    data = write_sheet(folder / "rows.csv", sheet_rows(rows))
    return model, write_config(folder / "config.yaml", model, data, folder / "run"), data


def sheet_texts() -> list[str]:
    with open(FIXTURES / "xquad_slice.csv", encoding="utf-8", newline="") as f:
        return [" ".join(row.values()) for row in csv.DictReader(f)] + ["system user assistant model"] * 5


def family_tokenizer(case: FamilyCase, vocab_size: int = 500):
    """A byte-level BPE of the family's kind trained on the fixture sheet (or Gemma's SentencePiece BPE)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if case.sentencepiece:
        return sentencepiece_tokenizer(case, vocab_size)
    tok = Tokenizer(models.BPE())
    if case.split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(case.split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(case.specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sheet_texts(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=case.bos, eos_token=case.eos,
                                        pad_token=case.pad, unk_token=case.specials[0])
    if case.template is not None:
        tokenizer.chat_template = case.template
    return tokenizer


def sentencepiece_tokenizer(case: FamilyCase, vocab_size: int = 500):
    """Gemma's tokenizer (transformers' GemmaTokenizer: spaces as ▁, byte fallback, BOS added) with pieces trained on
    the fixture sheet, laid out as Gemma's: the special tokens, the 256 byte tokens <0x00>..<0xFF>, the pieces."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")  # pieces start with ▁
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(case.specials), show_progress=False)
    tok.train_from_iterator(sheet_texts(), trainer)
    trained = json.loads(tok.to_str())["model"]
    pieces = [*case.specials, *(f"<0x{byte:02X}>" for byte in range(256)),
              *(piece for piece in trained["vocab"] if piece not in case.specials)]
    tokenizer = GemmaTokenizer(vocab={piece: index for index, piece in enumerate(pieces)},
                               merges=[tuple(merge) for merge in trained["merges"]], add_bos_token=True)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = case.template
    return tokenizer


def family_model(case: FamilyCase, tokenizer, seed: int = 0):
    """A random model built from the family's transformers config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    ids = {name: tokenizer.convert_tokens_to_ids(token) if token else None
           for name, token in (("bos_token_id", case.bos), ("eos_token_id", case.eos), ("pad_token_id", case.pad))}
    config = AutoConfig.for_model(case.model_type, vocab_size=len(tokenizer), tie_word_embeddings=case.tied,
                                  **ids, **case.config)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def family_folder(case: FamilyCase, folder: Path) -> Path:
    """The family's tiny model and tokenizer saved as a local model folder (what model.name_or_path names)."""
    tokenizer = family_tokenizer(case)
    family_model(case, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
