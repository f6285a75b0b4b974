"""Safe loading: safetensors only, torch.load(weights_only=True), no remote code unless asked, safe YAML."""

import ast
from pathlib import Path

import pytest

from qatune.config import ModelConfig, load_config
from qatune.data.spreadsheet import load_records
from qatune.errors import ConfigError

SRC = Path(__file__).resolve().parents[2] / "src" / "qatune"


def calls(name):
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(name):
                yield path.name, node


def test_every_torch_load_is_weights_only():
    found = list(calls("torch.load"))
    assert found, "expected checkpoint loading to use torch.load"
    for where, node in found:
        keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
        assert keywords.get("weights_only") == "True", f"{where}: {ast.unparse(node)}"


def test_every_from_pretrained_model_load_asks_for_safetensors_and_passes_trust_remote_code():
    for where, node in calls(".from_pretrained"):
        keywords = {k.arg for k in node.keywords}
        target = ast.unparse(node.func)
        if target == "PeftModel.from_pretrained":
            continue  # adapters: model_folder.py checks that adapter_model.safetensors exists (tested below)
        if "Tokenizer" in target or "tokenizer" in target or "AutoConfig" in target:
            assert "trust_remote_code" in keywords, f"{where}: {ast.unparse(node)}"
        else:
            assert {"use_safetensors", "trust_remote_code"} <= keywords, f"{where}: {ast.unparse(node)}"


def test_yaml_is_read_safely(tmp_path):
    path = tmp_path / "evil.yaml"
    marker = tmp_path / "pwned"
    path.write_text(f'!!python/object/apply:os.system ["touch {marker}"]\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    assert not marker.exists()


def test_remote_code_is_off_unless_asked(monkeypatch):
    assert ModelConfig().trust_remote_code is False
    seen = {}

    def fake(name, **kwargs):
        seen.update(kwargs)
        raise OSError("stop here")

    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake)
    from qatune.errors import ModelError
    from qatune.model.loading import load_tokenizer

    with pytest.raises(ModelError):
        load_tokenizer(ModelConfig(name_or_path="someone/model"), "generative")
    assert seen["trust_remote_code"] is False


def test_spreadsheet_formulas_and_dde_payloads_stay_text(tmp_path):
    path = tmp_path / "f.csv"
    path.write_text("question,answer\n\"=cmd|' /C calc'!A0\",=1+1\n", encoding="utf-8")
    records, _ = load_records(path)
    assert (records[0].question, records[0].answer) == ("=cmd|' /C calc'!A0", "=1+1")


def test_lora_adapters_are_loaded_from_safetensors_only(tmp_path):
    pytest.importorskip("peft")
    from qatune.errors import RunDirError
    from qatune.model.folder import ModelInfo, _load_lora

    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(RunDirError, match=r"no adapter_model\.safetensors"):
        _load_lora(tmp_path, ModelInfo(task="generative", max_length=8, lora_base="base"), None, False)
