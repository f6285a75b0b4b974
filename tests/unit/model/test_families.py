"""The family records against the models transformers builds: every record found from its config, its LoRA
targets the attention projections of every decoder layer (peft's own default where peft has one), its decoder layer
FSDP's unit, its GGUF architecture one gguf-py knows; and a new family is a record, nothing else."""

import pytest

from qatune.errors import ModelError
from qatune.model import families
from qatune.model.adapters import apply_lora
from qatune.model.families import FAMILIES, family_of, gguf_refusal
from qatune.train.sharding import units
from tests.families import CASES, family_model, family_tokenizer


@pytest.fixture(scope="module", params=CASES, ids=[case.id for case in CASES])
def built(request):
    case = request.param
    return case, family_model(case, family_tokenizer(case, vocab_size=300))


def test_every_record_has_a_test_case_and_every_case_a_record():
    tested = {case.model_type for case in CASES}
    assert tested == {kind for family in FAMILIES for kind in family.model_types}


def test_the_family_is_found_from_the_model_config(built):
    case, model = built
    assert case.model_type in family_of(model.config).model_types


def test_lora_targets_are_attention_projections_of_every_decoder_layer(built):
    _, model = built
    record = family_of(model.config)
    layers = model.config.get_text_config().num_hidden_layers
    for target in record.lora_targets:
        found = [name for name, _ in model.named_modules() if name.endswith(f".{target}")]
        assert len(found) == layers and all(".attn." in name or ".self_attn." in name for name in found), found


def test_lora_targets_are_peft_defaults_where_peft_has_them(built):
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    case, model = built
    default = PEFT_DEFAULTS.get(case.model_type)
    if default is not None:
        assert sorted(family_of(model.config).lora_targets) == sorted(default)


def test_the_decoder_layer_is_the_fsdp_unit(built):
    _, model = built
    record = family_of(model.config)
    found = units(model)
    assert [type(unit).__name__ for unit in found] == [record.decoder_layer] * model.config.num_hidden_layers


def test_the_gguf_architecture_is_one_gguf_py_knows(built):
    gguf = pytest.importorskip("gguf")
    _, model = built
    record = family_of(model.config)
    assert record.gguf_architecture in gguf.MODEL_ARCH_NAMES.values()
    assert (gguf_refusal(model.config) is None) == record.gguf_written


def test_a_family_not_written_as_gguf_is_refused_in_one_line_naming_it(monkeypatch):
    import dataclasses

    case = next(c for c in CASES if c.id == "gemma3")
    model = family_model(case, family_tokenizer(case, vocab_size=300))
    assert gguf_refusal(model.config) is None
    unwritten = tuple(dataclasses.replace(f, gguf_written=f.name != "Gemma 3") for f in FAMILIES)
    monkeypatch.setattr(families, "FAMILIES", unwritten)
    assert gguf_refusal(model.config) == (
        "qatune does not write Gemma 3 models (GGUF architecture gemma3) as GGUF; it writes Llama (Llama 3, SmolLM2), "
        "Mistral, Qwen2, Qwen3, Gemma 2, Phi-3, SmolLM3, GPT-2")


@pytest.mark.parametrize(("case_id", "changes", "said"), [
    ("gemma3", {"query_pre_attn_scalar": 64}, "its query_pre_attn_scalar equals its head_dim"),
    ("gemma3", {"layer_types": ["full_attention", "sliding_attention"]}, "five sliding-window layers and a full one"),
    ("gemma2", {"final_logit_softcapping": 10.0}, "its logits are soft-capped at 50 and 30"),
    ("gemma2", {"layer_types": ["full_attention", "full_attention"]}, "alternate a sliding-window layer and a full"),
    ("qwen3", {"head_dim": 16}, "its head_dim is 128"),
    ("smollm3", {"no_rope_layers": [0, 1]}, "every fourth layer has no rope"),
])
def test_a_model_unlike_what_llama_cpp_assumes_of_its_family_is_refused(case_id, changes, said):
    """What llama.cpp's runtime (or transformers' GGUF reader, which checks the file) takes for granted of a family
    without reading it from the file: a model that differs is refused before training, saying what."""
    case = next(c for c in CASES if c.id == case_id)
    config = family_model(case, family_tokenizer(case, vocab_size=300)).config
    for key, value in changes.items():
        setattr(config, key, value)
    refusal = gguf_refusal(config)
    assert refusal.startswith(f"qatune writes a {family_of(config).name} model as GGUF only if ") and said in refusal


def test_lora_without_target_modules_takes_the_record_targets(built):
    pytest.importorskip("peft")
    from qatune.config import LoraSettings

    _, model = built
    record = family_of(model.config)
    adapted = apply_lora(model, LoraSettings(r=4), "generative")
    assert sorted(adapted.peft_config["default"].target_modules) == sorted(record.lora_targets)
    adapted.unload()


def test_a_new_family_is_one_record(monkeypatch, tmp_path):
    """Olmo2 is no family of qatune's and peft has no LoRA default for it: LoRA without target modules fails, naming
    the modules it could adapt; its record is all that LoRA and the GGUF export need (FSDP finds its decoder layers
    from transformers' own _no_split_modules, with or without the record). transformers' GGUF reader does not know
    olmo2, so its file is read back into the model's class, the record's layout undone."""
    pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    from qatune.config import LoraSettings

    config = AutoConfig.for_model("olmo2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    assert family_of(config) is None
    with pytest.raises(ModelError) as refused:
        apply_lora(AutoModelForCausalLM.from_config(config), LoraSettings(r=4), "generative")
    offered = str(refused.value).split("some of ", 1)[1]
    assert "'q_proj'" in offered and "'layers'" not in offered and "'0'" not in offered
    assert "is not a family qatune knows" in gguf_refusal(config)

    olmo2 = families.Family("OLMo 2", ("olmo2",), ("q_proj", "v_proj"), "Olmo2DecoderLayer",
                            families.GgufLayout("olmo2", families.DECODER_KEYS, read_back=False))
    monkeypatch.setattr(families, "FAMILIES", (*FAMILIES, olmo2))
    model = AutoModelForCausalLM.from_config(config)
    assert family_of(config) is olmo2
    assert [type(unit).__name__ for unit in units(model)] == ["Olmo2DecoderLayer"] * 2
    adapted = apply_lora(model, LoraSettings(r=4), "generative")
    assert sorted(adapted.peft_config["default"].target_modules) == ["q_proj", "v_proj"]
    assert gguf_refusal(config) is None
    adapted.unload()
    written_and_read_back(model, tmp_path)


def written_and_read_back(model, folder):
    """The model written as GGUF by its record and read back into its class gives its logits."""
    pytest.importorskip("gguf")
    import torch

    from qatune.export.gguf_write import file_tensors, read_into, write_gguf
    from tests.unit.export.test_gguf_families import loaded_case

    case = next(c for c in CASES if c.id == "smollm2")
    loaded = loaded_case(case, folder / "final")
    model.resize_token_embeddings(len(loaded.tokenizer))
    loaded.model = model.eval()
    write_gguf(loaded, folder / "final" / "olmo2.gguf", "f32")
    import gguf

    names = {t.name for t in gguf.GGUFReader(str(folder / "final" / "olmo2.gguf")).tensors}
    assert names == {name for _, name, _ in file_tensors(model, family_of(model.config).gguf)}
    back = type(model)(model.config).eval()
    read_into(back, folder / "final" / "olmo2.gguf")
    ids = torch.tensor([loaded.tokenizer("The council met in Brussels in 1999.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, model(input_ids=ids).logits)
