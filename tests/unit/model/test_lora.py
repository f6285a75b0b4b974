"""LoRA via peft: adapters only in the run, eval/generate on adapter runs, export of a merged model."""

import json

import pytest
from click.testing import CliRunner

from qatune.cli import cli
from qatune.errors import ModelError
from qatune.inference.generate import answer_questions
from qatune.model.folder import load_model_folder
from qatune.train import prepare, train
from tests.conftest import tiny_config

pytest.importorskip("peft")

ROWS = [(f"what is item {i}?", f"thing {i}") for i in range(12)]


def config_for(tmp_path, *overrides, task="generative"):
    rows = ROWS if task == "generative" else [(q, f"The {a} is on shelf {i}.", f"shelf {i}")
                                              for i, (q, a) in enumerate(ROWS)]
    return tiny_config(tmp_path, rows, f"task={task}", "model.scratch.n_layer=2", "model.scratch.n_embd=64",
                       "model.lora.r=16", "model.lora.alpha=32", "model.lora.dropout=0.0", "train.learning_rate=1e-2",
                       "train.epochs=20", "train.batch_size=4",
                       *(["data.context_column=context"] if task == "extractive" else []), *overrides)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """LoRA on a local 'pretrained' folder: a small model first trained in full for a few epochs."""
    tmp = tmp_path_factory.mktemp("lora")
    base_run = train(config_for(tmp, "model.lora=null", "train.epochs=3", "train.learning_rate=3e-3"),
                     output_dir=tmp / "pretrained", progress=False)
    config = config_for(tmp, "model.scratch=null", f"model.name_or_path={base_run / 'final'}",
                        "model.lora.target_modules=[c_attn, c_fc, c_proj]", "train.epochs=20",
                        "train.learning_rate=3e-3")
    return train(config, output_dir=tmp / "run", progress=False), config


def test_only_adapters_are_trained_and_saved(lora_run):
    run, config = lora_run
    assert (run / "final" / "adapter_model.safetensors").is_file()
    assert not (run / "final" / "model.safetensors").exists()
    info = json.loads((run / "final" / "qatune.json").read_text())
    assert info["lora_base"] == config.model.name_or_path           # the local base folder, not a copy
    losses = [json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-3:]) < 0.98 * sum(losses[:3])       # adapters on a tiny model learn slowly, but learn


def test_lora_on_a_scratch_model_saves_its_random_base(tmp_path):
    run = train(config_for(tmp_path, "train.epochs=2"), output_dir=tmp_path / "run", progress=False)
    assert (run / "base" / "model.safetensors").is_file()
    assert json.loads((run / "final" / "qatune.json").read_text())["lora_base"] == "base"
    loaded = load_model_folder(run)
    assert not any("lora" in name for name, _ in loaded.model.named_parameters())   # merged for inference


def test_frozen_base_and_trainable_adapters(tmp_path):
    prepared = prepare(config_for(tmp_path))
    trainable = [n for n, p in prepared.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_eval_generate_and_merged_export_agree(lora_run, tmp_path):
    run, _ = lora_run
    questions = [q for q, _ in ROWS]
    adapter = load_model_folder(run)
    from_adapter = answer_questions(adapter.model, adapter.tokenizer, adapter.info, questions)
    result = CliRunner().invoke(cli, ["export", str(run), "--merge", str(tmp_path / "merged")])
    assert result.exit_code == 0, result.output + result.stderr
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name, _ in plain.named_parameters())
    merged = load_model_folder(tmp_path / "merged")
    assert answer_questions(merged.model, merged.tokenizer, merged.info, questions) == from_adapter
    metrics = json.loads(CliRunner().invoke(cli, ["eval", str(run), "--data", str(run.parent / "qa.csv"),
                                                  "--json"]).stdout)
    first_train_loss = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert metrics["num_examples"] == 12 and 0 < metrics["loss"] < first_train_loss
    from qatune.data.spreadsheet import load_from_config
    from qatune.inference.evaluate import evaluate_records

    records, _ = load_from_config(merged.config.data, run.parent / "qa.csv")
    merged_metrics, _ = evaluate_records(merged.model, merged.tokenizer, merged.info, records)
    assert metrics["loss"] == pytest.approx(merged_metrics["loss"], rel=1e-4)   # adapter run == merged export


def test_extractive_lora_keeps_the_new_qa_head_trainable(tmp_path):
    run = train(config_for(tmp_path, "train.epochs=2", task="extractive"), output_dir=tmp_path / "run",
                progress=False)
    from safetensors.torch import load_file

    keys = load_file(run / "final" / "adapter_model.safetensors")
    assert any("qa_outputs" in k for k in keys) and any("lora_A" in k for k in keys)
    loaded = load_model_folder(run)
    assert answer_questions(loaded.model, loaded.tokenizer, loaded.info, ["what is item 1?"],
                            ["The thing 1 is on shelf 1."])[0]


def test_unknown_target_modules_name_the_real_ones(tmp_path):
    with pytest.raises(ModelError, match=r"set model\.lora\.target_modules to some of"):
        prepare(config_for(tmp_path, "model.lora.target_modules=[q_proj]"))


def test_lora_on_a_llama_keeps_the_lm_head_on_supervised_positions_only():
    """peft's own ``model`` attribute must not be taken for Llama's backbone (base_model_prefix "model")."""
    import torch

    from qatune.config import LoraSettings
    from qatune.model.lora import apply_lora
    from qatune.speedups.causal import SupervisedRowsObjective
    from qatune.speedups.gpt2 import has_dropout
    from tests.conftest import chat_tokenizer, tiny_llama

    tokenizer = chat_tokenizer()
    model = apply_lora(tiny_llama(tokenizer), LoraSettings(r=4, target_modules=["q_proj", "v_proj"]), "generative")
    objective = SupervisedRowsObjective.checked(model)
    assert {"supervised_head", "last_layer_rows", "unpadded_rows"} <= objective.paths
    assert has_dropout(model)  # LoRA's dropout: while training, prompt prefixes are computed per row
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    labels = torch.tensor([[-100, -100, -100, 8, 9, 10]])
    model.eval()
    out = objective(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    reference = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss
    assert torch.allclose(out["loss_sum"] / out["count"], reference, atol=1e-5)
