"""Every family written as GGUF from its record, on a tiny random model of the family (tests/families.py), without
training: the file read back by transformers' own GGUF reader gives the model's logits (exactly the weights rounded
to the file's precision) and its tokenizer the same ids; the end of a turn ends generation in the file; tensor names
and keys are llama.cpp's. SmolLM3, which transformers' reader does not know, is held to what llama.cpp's converter
writes for it: a Llama's tensors under its own architecture. A broken record (a wrong permute, Gemma's norms not
shifted, the end-of-turn token left out, a wrong pre-tokenizer) fails these checks."""

import copy
import dataclasses
import json

import pytest
import torch

from qatune.config import Config, DataConfig, ModelConfig
from qatune.data.templates import resolve_template
from qatune.export import gguf_write
from qatune.model import families
from qatune.model.families import FAMILIES, family_of
from qatune.model.folder import LoadedModel, ModelInfo
from tests.families import GGUF_CASES as CASES
from tests.families import family_model, family_tokenizer
from tests.unit.export.llama_cpp_tokenizer import sentencepiece_ids

gguf = pytest.importorskip("gguf")

TEXTS = ("The council met in Brussels in 1999 and again in 2004.", "naïve café, Ünïcödé: 東京タワー 😶‍🌫️ 🦙🦙",
         "  two  spaces\n\n\ttab and 3.14159 or 33333333", "I've been 'told he's there, 'RE you sure?")


def case_config(case):
    from transformers import AutoConfig

    return AutoConfig.for_model(case.model_type, **case.config)


READ_BACK = [case for case in CASES if family_of(case_config(case)).gguf.read_by_transformers(case_config(case))]
"""The cases whose file transformers' reader reads whole: not SmolLM3's architecture, nor Llama 3's rope factors,
nor Phi-4-mini's partial rope and longrope factors."""


def loaded_case(case, folder):
    """(LoadedModel of the family's tiny random model with its chat prompt, its tokenizer) saved in ``folder``."""
    tokenizer = family_tokenizer(case)  # 500 tokens: merges of digits too, which the pre-tokenizers split apart
    model = family_model(case, tokenizer).eval()
    data = DataConfig(train_file="rows.csv", context_column="context")
    template = resolve_template(data, tokenizer, case.id)
    info = ModelInfo(task="generative", max_length=128, prompt_template=template.template,
                     answer_prefix=template.answer_prefix)
    config = Config(task="generative", model=ModelConfig(name_or_path=f"tiny-{case.id}"), data=data)
    folder.mkdir(parents=True, exist_ok=True)
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, info=info, folder=folder)


def write(loaded, quant="f32", name=None):
    path = loaded.folder / (name or f"{quant}.gguf")
    gguf_write.write_gguf(loaded, path, quant)
    return path


def read_model(path, model):
    """The file's model as transformers' GGUF reader builds it (GPT-2 with the context it was trained with)."""
    from transformers import AutoModelForCausalLM

    extra = {"n_positions": model.config.n_positions} if model.config.model_type == "gpt2" else {}
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **extra).eval()


def read_tokenizer(path):
    """The file's tokenizer as transformers' GGUF reader builds it (AutoTokenizer would ask the file's config, which
    transformers does not read for every architecture: SmolLM3's)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)


@torch.no_grad()
def logits(model, tokenizer):
    ids = torch.tensor([tokenizer(" ".join(TEXTS))["input_ids"][:120]])
    return model(input_ids=ids).logits


def prompt_texts(loaded):
    """The texts a run's tokenizer meets: free text, and prompts with the chat markup and its special tokens."""
    from qatune.data.templates import PromptTemplate

    template = PromptTemplate(loaded.info.prompt_template, loaded.info.answer_prefix)
    return [*TEXTS, *(template.render(text, "A passage of 12 words.") for text in TEXTS)]


def same_ids(loaded, path):
    """Whether the tokenizer read back from the file gives the run's ids on every text."""
    theirs = read_tokenizer(path)
    return all(theirs(text)["input_ids"] == loaded.tokenizer(text)["input_ids"] for text in prompt_texts(loaded))


def ends_turns(loaded, path, case):
    """Whether the file stops generation at the family's end-of-turn token (its EOS or end-of-turn id)."""
    fields = gguf.GGUFReader(str(path)).fields
    stops = {fields[key].contents() for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
             if key in fields}
    return loaded.tokenizer.convert_tokens_to_ids(case.end_of_turn) in stops


@pytest.fixture(scope="module", params=CASES, ids=[case.id for case in CASES])
def family(request, tmp_path_factory):
    case = request.param
    return case, loaded_case(case, tmp_path_factory.mktemp(case.id) / "final")


@pytest.fixture(scope="module", params=READ_BACK, ids=[case.id for case in READ_BACK])
def readable(request, tmp_path_factory):
    """A family transformers' GGUF reader reads, with its file written in f32."""
    case = request.param
    loaded = loaded_case(case, tmp_path_factory.mktemp(case.id) / "final")
    return case, loaded, write(loaded)


def test_every_family_is_written():
    assert all(family.gguf_written for family in FAMILIES)


def test_file_read_back_by_transformers_gives_the_model_logits(readable):
    _, loaded, path = readable
    back = read_model(path, loaded.model)
    assert back.config.model_type in (loaded.model.config.model_type, "llama")  # Mistral is run as a Llama
    torch.testing.assert_close(logits(back, loaded.tokenizer), logits(loaded.model, loaded.tokenizer),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("quant", ["f16", "q8_0"])
def test_rounded_files_hold_the_model_rounded(readable, quant):
    """f16 and q8_0: the file's logits are the model's with its weights rounded as the file stores them, and close
    to the model's own (f16 within its rounding; q8_0 keeps the next token)."""
    _, loaded, _ = readable
    path = write(loaded, quant)
    back = read_model(path, loaded.model)
    rounded = copy.deepcopy(loaded.model)
    gguf_write.round_like_file(rounded, quant)
    ours, theirs = logits(loaded.model, loaded.tokenizer), logits(back, loaded.tokenizer)
    torch.testing.assert_close(theirs, logits(rounded, loaded.tokenizer), atol=1e-4, rtol=1e-4)
    if quant == "f16":
        torch.testing.assert_close(theirs, ours, atol=2e-2, rtol=2e-2)
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.9


def test_tokenizer_read_back_gives_the_same_ids(readable):
    _, loaded, path = readable
    assert same_ids(loaded, path)


def test_the_end_of_turn_token_ends_generation_in_the_file(family, tmp_path):
    case, loaded = family
    assert ends_turns(loaded, write(loaded, name="eot.gguf"), case)


def test_tensor_names_and_keys_are_llama_cpps(family):
    """Every tensor is one gguf-py lists for the architecture, every hyper-parameter key one llama.cpp reads, and
    the tokenizer's special tokens are those of its files (gguf.SpecialVocab)."""
    _, loaded = family
    path = write(loaded, name="names.gguf")
    reader = gguf.GGUFReader(str(path))
    record = family_of(loaded.model.config)
    arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == record.gguf_architecture)
    allowed = {gguf.TENSOR_NAMES[kind] for kind in gguf.MODEL_TENSORS[arch]}
    names = {tensor.name.rsplit(".", 1)[0].replace("blk.0.", "blk.{bid}.").replace("blk.1.", "blk.{bid}.")
             for tensor in reader.tensors}
    assert names <= allowed, names - allowed
    known = {value.replace("{arch}", record.gguf_architecture) for group in (gguf.Keys.LLM, gguf.Keys.Attention,
             gguf.Keys.Rope) for value in vars(group).values() if isinstance(value, str)}
    written = {key for key in reader.fields if key.startswith(f"{record.gguf_architecture}.")}
    assert written <= known, written - known
    fields = reader.fields
    assert fields["general.architecture"].contents() == record.gguf_architecture
    assert fields["tokenizer.ggml.eos_token_id"].contents() == loaded.tokenizer.eos_token_id
    if loaded.tokenizer.bos_token_id is not None:
        assert fields["tokenizer.ggml.bos_token_id"].contents() == loaded.tokenizer.bos_token_id
    assert len(fields["tokenizer.ggml.merges"].data) == len(
        json.loads(loaded.tokenizer.backend_tokenizer.to_str())["model"]["merges"])


def test_sentencepiece_scores_make_llama_cpp_merge_as_the_tokenizer(tmp_path):
    """Gemma's SentencePiece BPE is written as llama.cpp's "llama" vocabulary: tokens, types and scores, by which
    llama.cpp merges (it ignores merges there). Its merging on the file's scores gives the tokenizer's ids."""
    case = next(c for c in CASES if c.id == "gemma3")
    loaded = loaded_case(case, tmp_path / "final")
    fields = gguf.GGUFReader(str(write(loaded))).fields
    assert fields["tokenizer.ggml.model"].contents() == "llama" and fields["tokenizer.ggml.pre"].contents() == "default"
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is False
    tokens, scores = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.scores"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    assert [tokens[i] for i, kind in enumerate(types) if kind == gguf.TokenType.BYTE] == [
        f"<0x{byte:02X}>" for byte in range(256)]
    ids = {token: index for index, token in enumerate(tokens)}
    for text in (*TEXTS, " ".join(TEXTS) * 2):
        assert sentencepiece_ids(text, ids, scores) == loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    flat = [0.0] * len(scores)  # without the scores llama.cpp merges in another order
    assert any(sentencepiece_ids(text, ids, flat) != loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
               for text in TEXTS)


def test_smollm3_is_written_as_llama_cpps_converter_writes_it(tmp_path):
    """llama.cpp's converter writes SmolLM3 with its Llama class (queries and keys permuted, Llama's keys) under the
    architecture smollm3: the same weights in a Llama give the same tensors and keys, and that Llama's file is read
    back by transformers with the model's logits (test_file_read_back_by_transformers_gives_the_model_logits)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    case = next(c for c in CASES if c.id == "smollm3")
    smollm3 = loaded_case(case, tmp_path / "smollm3" / "final")
    config = smollm3.model.config
    llama = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.to_dict().items() if k not in (
        "model_type", "architectures", "no_rope_layers", "no_rope_layer_interval", "layer_types")})).eval()
    llama.load_state_dict(smollm3.model.state_dict())
    as_llama = dataclasses.replace(smollm3, model=llama, folder=tmp_path / "llama" / "final")
    as_llama.folder.mkdir(parents=True)
    ours, theirs = (gguf.GGUFReader(str(write(run, "q8_0"))) for run in (smollm3, as_llama))
    assert [(t.name, t.tensor_type, t.data.tobytes()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data.tobytes()) for t in theirs.tensors]

    def keys(reader, arch):
        return {key.replace(f"{arch}.", "ARCH."): field.contents() for key, field in reader.fields.items()
                if key.startswith(f"{arch}.")}

    assert keys(ours, "smollm3") == keys(theirs, "llama")


def test_smollm3_file_read_into_the_model_gives_its_logits(tmp_path):
    """transformers cannot read a smollm3 file; export's check reads its tensors back into the run's model class
    with the record's layout undone, and its tokenizer with transformers."""
    from qatune.export.gguf_check import read_back

    case = next(c for c in CASES if c.id == "smollm3")
    loaded = loaded_case(case, tmp_path / "final")
    back = read_back(loaded, write(loaded))
    torch.testing.assert_close(logits(back.model, loaded.tokenizer), logits(loaded.model, loaded.tokenizer))
    assert same_ids(loaded, loaded.folder / "f32.gguf")


def broken(monkeypatch, model_type, **changes):
    """The family of ``model_type`` with its GGUF layout changed."""
    index, family = next((i, f) for i, f in enumerate(FAMILIES) if model_type in f.model_types)
    changed = dataclasses.replace(family, gguf=dataclasses.replace(family.gguf, **changes))
    monkeypatch.setattr(families, "FAMILIES", (*FAMILIES[:index], changed, *FAMILIES[index + 1:]))


@pytest.mark.parametrize(("case_id", "changes"), [
    ("llama3", {"permuted": ()}),  # queries and keys in transformers' order
    ("llama3", {"permuted": (("q_proj", "num_attention_heads"), ("k_proj", "num_attention_heads"))}),  # GQA's heads
    ("gemma3", {"norm_shift": 0.0}),  # Gemma's norms written as transformers keeps them
    ("gemma3-byte-level", {"norm_shift": 0.0}),
    ("gemma2", {"hyperparameters": ()}),  # no hyper-parameters: the reader's defaults
], ids=["llama-no-permute", "llama-permute-wrong-heads", "gemma3-norms-unshifted", "gemma3-byte-level-unshifted",
        "gemma2-no-keys"])
def test_a_broken_layout_gives_other_logits(case_id, changes, monkeypatch, tmp_path):
    case = next(c for c in CASES if c.id == case_id)
    loaded = loaded_case(case, tmp_path / "final")
    broken(monkeypatch, case.model_type, **changes)
    try:
        back = read_model(write(loaded), loaded.model)
    except (RuntimeError, ValueError, KeyError):
        return  # not even read back
    assert not torch.allclose(logits(back, loaded.tokenizer), logits(loaded.model, loaded.tokenizer), atol=1e-3)


def test_smollm3_with_a_broken_permute_is_no_longer_llama_cpps(monkeypatch, tmp_path):
    broken(monkeypatch, "smollm3", permuted=())
    with pytest.raises(AssertionError):
        test_smollm3_is_written_as_llama_cpps_converter_writes_it(tmp_path / "again")


def test_a_missing_end_of_turn_token_is_found(monkeypatch, tmp_path):
    """Gemma's turns end with <end_of_turn>, not its EOS: a file without the end-of-turn id never stops."""
    case = next(c for c in CASES if c.id == "gemma3")
    loaded = loaded_case(case, tmp_path / "final")
    assert ends_turns(loaded, write(loaded, name="right.gguf"), case)
    monkeypatch.setattr(gguf_write, "end_of_turn", lambda loaded: None)
    assert not ends_turns(loaded, write(loaded, name="wrong.gguf"), case)


@pytest.mark.parametrize(("case_id", "wrong"), [("llama3", "qwen2"), ("smollm3", "qwen2"), ("gpt2", "qwen2")])
def test_a_wrong_pre_tokenizer_gives_other_ids(case_id, wrong, monkeypatch, tmp_path):
    """Llama 3 (and SmolLM3) split digits in threes, GPT-2 in runs, Qwen one by one: a file naming Qwen's
    pre-tokenizer for their tokenizers reads numbers into other tokens than they were trained on."""
    case = next(c for c in CASES if c.id == case_id)
    loaded = loaded_case(case, tmp_path / "final")
    assert same_ids(loaded, write(loaded, name="right.gguf"))
    monkeypatch.setattr(gguf_write, "pre_tokenizer", lambda tokenizer: wrong)
    assert not same_ids(loaded, write(loaded, name="wrong.gguf"))


def test_gemma3_from_a_gguf_as_llama_cpp_publishes_it_is_written_back(tmp_path, monkeypatch):
    """Gemma 3 270M comes as llama.cpp's GGUF (a SentencePiece vocabulary, norms plus one: tests/unit/model/
    tiny_gemma3.py, here with the published head width of 256): read as qatune reads a model file, written again by
    export, and read back by transformers, it gives the same logits and token ids."""
    from transformers import Gemma3ForCausalLM

    from qatune.model.gguf_file import load_gguf_run
    from tests.unit.model import tiny_gemma3

    narrow = tiny_gemma3.tiny_gemma3

    def published_width(seed=0):
        config = narrow(seed).config
        config.head_dim = 256
        torch.manual_seed(seed)
        return Gemma3ForCausalLM(config)

    monkeypatch.setattr(tiny_gemma3, "tiny_gemma3", published_width)
    source = tmp_path / "gemma-3-270m.gguf"
    tiny_gemma3.write_tiny_gemma3_gguf(source)
    loaded = load_gguf_run(source, device="cpu", convert=False)
    assert gguf_write.vocabulary_kind(loaded.tokenizer) == "llama"
    loaded.folder = tmp_path / "run" / "final"
    loaded.folder.mkdir(parents=True)
    for quant in ("f16", "q8_0"):
        path = write(loaded, quant)
        back = read_model(path, loaded.model)
        rounded = copy.deepcopy(loaded.model)
        gguf_write.round_like_file(rounded, quant)
        torch.testing.assert_close(logits(back, loaded.tokenizer), logits(rounded, loaded.tokenizer),
                                   atol=1e-4, rtol=1e-4)
        assert same_ids(loaded, path)
        fields = gguf.GGUFReader(str(path)).fields
        assert fields["tokenizer.ggml.model"].contents() == "llama"
        assert fields["tokenizer.ggml.eos_token_id"].contents() == loaded.tokenizer.convert_tokens_to_ids("<eos>")


def test_llama3_rope_is_written_as_llama_cpps_factors_of_transformers_frequencies(tmp_path):
    """Llama 3.2's rope scaling goes into the file as llama.cpp's converter writes it, a tensor rope_freqs of factors
    dividing each frequency: the base frequencies over transformers' own scaled ones. transformers' reader ignores
    that tensor, so export's check reads the file into the run's model class, which gives the model's logits."""
    from qatune.export.gguf_check import read_back

    case = next(c for c in CASES if c.id == "llama3")
    loaded = loaded_case(case, tmp_path / "final")
    path = write(loaded, "q8_0")
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    config = loaded.model.config
    base = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    scaled = loaded.model.model.rotary_emb.inv_freq.double()
    factors = torch.from_numpy(tensors["rope_freqs.weight"].data.copy()).double()
    torch.testing.assert_close(factors, base / scaled, rtol=1e-5, atol=0)
    assert factors[0] == 1 and factors[-1] == 32 and 1 < factors[1] < 32  # kept, in between, scaled
    back = read_back(loaded, path)
    rounded = copy.deepcopy(loaded.model)
    gguf_write.round_like_file(rounded, "q8_0")
    torch.testing.assert_close(logits(back.model, loaded.tokenizer), logits(rounded, loaded.tokenizer),
                               atol=1e-4, rtol=1e-4)


def test_llama3_rope_left_out_of_the_file_is_found(monkeypatch, tmp_path):
    """Without rope_freqs, the file is a Llama without Llama 3's scaling: read back, its logits are not the model's."""
    from qatune.export.gguf_check import read_back

    case = next(c for c in CASES if c.id == "llama3")
    loaded = loaded_case(case, tmp_path / "final")
    broken(monkeypatch, "llama", extra_tensors=())
    back = read_back(loaded, write(loaded))
    # the scaled frequencies are the slow ones, which a short text turns little: the f32 file's logits are exact
    assert not torch.allclose(logits(back.model, loaded.tokenizer), logits(loaded.model, loaded.tokenizer), atol=1e-5,
                              rtol=1e-5)



def llama_cpp_rope(path, positions):
    """The cosines and sines llama.cpp's phi3 graph turns queries and keys by at ``positions`` positions, from what
    the file holds and llama.cpp's defaults for what it lacks (src/llama-model.cpp, ggml's rope): NeoX order on
    ``rope.dimension_count`` dimensions (else the whole head), each pair's frequency divided by the long factors
    where the context passes ``rope.scaling.original_context_length`` (else the context length), by the short ones
    otherwise (none where the file has none), times ``rope.scaling.attn_factor`` (else 1). None: llama.cpp would
    not load the file (factors of another length than the pairs)."""
    reader = gguf.GGUFReader(str(path))
    fields, tensors = reader.fields, {t.name: t for t in reader.tensors}

    def key(name, default):
        return fields[f"phi3.{name}"].contents() if f"phi3.{name}" in fields else default

    rotated = int(key("rope.dimension_count", key("embedding_length", 0) // key("attention.head_count", 1)))
    original = int(key("rope.scaling.original_context_length", key("context_length", 0)))
    factors = tensors.get(f"rope_factors_{'long' if positions > original else 'short'}.weight")
    factors = torch.ones(rotated // 2) if factors is None else torch.from_numpy(factors.data.copy())
    if len(factors) != rotated // 2:
        return None
    pairs = key("rope.freq_base", 10000.0) ** (-torch.arange(0, rotated, 2, dtype=torch.float64) / rotated)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * pairs / factors.double()
    attention = key("rope.scaling.attn_factor", 1.0)
    return torch.cat([angles.cos()] * 2, -1) * attention, torch.cat([angles.sin()] * 2, -1) * attention


def rope_as_the_model(loaded, path):
    """Whether llama.cpp's rope from the file (:func:`llama_cpp_rope`) is the model's own (transformers' Phi-3 rotary
    embedding), on a sequence within the original context (the short factors) and on one past it (the long ones)."""
    config = loaded.model.config
    original = config.rope_parameters["original_max_position_embeddings"]
    for positions in (original // 2, original * 2):
        rotary = type(loaded.model.model.rotary_emb)(config)  # a new one: it keeps the last length's frequencies
        cos, sin = rotary(torch.zeros(1), torch.arange(positions)[None])
        ours = llama_cpp_rope(path, positions)
        if ours is None or ours[0].shape != cos[0].shape or not all(
                torch.allclose(a.float(), b[0], atol=1e-5, rtol=1e-4) for a, b in zip(ours, (cos, sin))):
            return False
    return True


def test_phi4_mini_rope_is_written_as_llama_cpp_reads_it(tmp_path):
    """Phi-4-mini turns three quarters of each head and scales rope by longrope: the file holds its rope dimensions,
    original context, attention factor and long and short factors (the tensors rope_factors_long/short) as llama.cpp's
    converter writes them, from which llama.cpp's rope is the model's at either length. transformers' GGUF reader
    reads none of them (it takes rope on every dimension), so export's check reads the file into the run's model
    class, which gives the model's logits."""
    from qatune.export.gguf_check import read_back

    case = next(c for c in CASES if c.id == "phi4-mini")
    loaded = loaded_case(case, tmp_path / "final")
    path = write(loaded, "q8_0")
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["phi3.rope.dimension_count"].contents() == 6  # of heads of 8
    assert reader.fields["phi3.rope.scaling.original_context_length"].contents() == 256
    assert {t.name: t.data.tolist() for t in reader.tensors if t.name.startswith("rope_")} == {
        "rope_factors_long.weight": [1.0, 4.0, 32.0], "rope_factors_short.weight": [1.0, 1.25, 2.0]}
    assert loaded.model.model.rotary_emb.attention_scaling > 1.1  # 1024 / 256: sqrt(1 + ln 4 / ln 256)
    assert rope_as_the_model(loaded, path)
    assert not family_of(loaded.model.config).gguf.read_by_transformers(loaded.model.config)
    back = read_back(loaded, path)
    rounded = copy.deepcopy(loaded.model)
    gguf_write.round_like_file(rounded, "q8_0")
    torch.testing.assert_close(logits(back.model, loaded.tokenizer), logits(rounded, loaded.tokenizer),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("left_out", ["rope.dimension_count", "rope.scaling.original_context_length",
                                      "rope.scaling.attn_factor", "rope_factors_long.weight",
                                      "rope_factors_short.weight"])
def test_phi4_mini_rope_left_out_of_the_record_is_found(left_out, monkeypatch, tmp_path):
    """A Phi-3 record without one of what Phi-4-mini's rope needs writes a file whose rope in llama.cpp is not the
    model's: every dimension turned (and factors of the wrong length), the long factors never taken, no attention
    factor, no factors at one length."""
    case = next(c for c in CASES if c.id == "phi4-mini")
    loaded = loaded_case(case, tmp_path / "final")
    layout = family_of(loaded.model.config).gguf
    assert rope_as_the_model(loaded, write(loaded, name="right.gguf"))
    broken(monkeypatch, "phi3", hyperparameters=tuple(kv for kv in layout.hyperparameters if kv[0] != left_out),
           extra_tensors=tuple(kv for kv in layout.extra_tensors if kv[0] != left_out))
    assert not rope_as_the_model(loaded, write(loaded, name="wrong.gguf"))
