"""LoRA via peft: only the adapters train and are saved, a scratch base is saved beside them, the QA head of
an extractive model trains too."""

import json

import pytest

from qatune.errors import ModelError
from qatune.kinds import answer_questions
from qatune.model.folder import load_model_folder
from qatune.train import prepare, train
from tests.lora_runs import lora_config

pytest.importorskip("peft")


def test_only_adapters_are_trained_and_saved(lora_run):
    run, config = lora_run
    assert (run / "final" / "adapter_model.safetensors").is_file()
    assert not (run / "final" / "model.safetensors").exists()
    info = json.loads((run / "final" / "qatune.json").read_text())
    assert info["lora_base"] == config.model.name_or_path           # the local base folder, not a copy
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-3:]) < 0.98 * sum(losses[:3])       # adapters on a tiny model learn slowly, but learn


def test_lora_on_a_scratch_model_saves_its_random_base(tmp_path):
    run = train(lora_config(tmp_path, "train.epochs=2"), output_dir=tmp_path / "run", progress=False)
    assert (run / "base" / "model.safetensors").is_file()
    assert json.loads((run / "final" / "qatune.json").read_text())["lora_base"] == "base"
    loaded = load_model_folder(run)
    assert not any("lora" in name for name, _ in loaded.model.named_parameters())   # merged for inference


def test_frozen_base_and_trainable_adapters(tmp_path):
    prepared = prepare(lora_config(tmp_path))
    trainable = [n for n, p in prepared.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_extractive_lora_keeps_the_new_qa_head_trainable(tmp_path):
    run = train(lora_config(tmp_path, "train.epochs=2", task="extractive"), output_dir=tmp_path / "run",
                progress=False)
    from safetensors.torch import load_file

    keys = load_file(run / "final" / "adapter_model.safetensors")
    assert any("qa_outputs" in k for k in keys) and any("lora_A" in k for k in keys)
    loaded = load_model_folder(run)
    assert answer_questions(loaded.model, loaded.tokenizer, loaded.info, ["what is item 1?"],
                            ["The thing 1 is on shelf 1."])[0]


def test_unknown_target_modules_name_the_real_ones(tmp_path):
    with pytest.raises(ModelError, match=r"set model\.lora\.target_modules to some of"):
        prepare(lora_config(tmp_path, "model.lora.target_modules=[q_proj]"))


def test_last_layers_adapts_only_the_top_of_the_model(tmp_path):
    prepared = prepare(lora_config(tmp_path, "model.scratch.n_layer=3", "model.lora.last_layers=2"))
    adapted = {n.split(".h.")[1].split(".")[0] for n, p in prepared.model.named_parameters() if p.requires_grad}
    assert adapted == {"1", "2"}
    with pytest.raises(ModelError, match=r"model\.lora\.last_layers is 4, but the model has 3 layers"):
        prepare(lora_config(tmp_path, "model.scratch.n_layer=3", "model.lora.last_layers=4"))
