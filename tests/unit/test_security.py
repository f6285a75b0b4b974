"""Safe loading across the source: safetensors only, torch.load(weights_only=True), no remote code unless
asked. (Safe YAML, spreadsheet formulas, remote code and adapters are tested with their modules.)"""

import ast
from pathlib import Path

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
