"""train.speedups: one switch over the speed paths. off trains through the model's own forward with nothing
patched, and gives the losses auto gives; the log says once which paths are on and why the others are off."""

import json
import logging
import math

import pytest
import torch

from qatune.model.objectives import CausalLMObjective
from qatune.speedups import NAMES, Speedups, auto_verdict
from qatune.train import fit, prepare, train
from tests.conftest import chat_tokenizer, speedups_on, tiny_config, tiny_llama, wordpiece_tokenizer

PASSAGES = ["the river flows north through the old town and past the mill",
            "a mountain rises west of the harbour bay above the fishing boats"]
ROWS = [(f"what is said of thing {i}?", PASSAGES[i % 2], f"thing {i} is {word}")
        for i, word in enumerate(["red", "blue", "green", "apple", "river", "stone", "cloud", "north", "seven",
                                  "paper", "glass", "tiger"])]
SPAN_ROWS = [(f"what colour is thing {i}?", f"thing {i} is {c} and round.", c)
             for i, c in enumerate(["red", "blue", "green", "black", "white", "grey", "pink", "brown"])]


def llama_folder(tmp_path):
    """A one-layer Llama and its chat tokenizer saved as a local model folder, as a user names one."""
    tokenizer = chat_tokenizer([f"{q} {c} {a} system user assistant" for q, c, a in ROWS] * 3)
    model = tiny_llama(tokenizer)
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def bert_folder(tmp_path):
    """A two-layer BERT for QA and a WordPiece tokenizer of a fixed vocabulary (a scratch one's is not the same from
    one training to the next) saved as a local model folder."""
    from transformers import BertConfig, BertForQuestionAnswering

    words = {w for q, c, a in SPAN_ROWS for w in f"{q} {c} {a}".replace("?", " ?").replace(".", " .").split()}
    tokenizer = wordpiece_tokenizer(sorted(words))
    torch.manual_seed(0)
    model = BertForQuestionAnswering(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=2, intermediate_size=64,
                                                max_position_embeddings=64))
    folder = tmp_path / "tiny-bert"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def step_losses(run):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("event") == "train"]


KINDS = {
    "gpt2": (ROWS, ["data.context_column=context"]),
    "gpt2-lora": (ROWS, ["data.context_column=context", "model.lora.r=4", "model.lora.dropout=0.0"]),
    "llama": (ROWS, ["data.context_column=context", "train.group_by_prefix=true"]),
    "llama-lora": (ROWS, ["data.context_column=context", "model.lora.r=4", "model.lora.dropout=0.0",
                          "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"]),
    "extractive": (SPAN_ROWS, ["task=extractive", "data.context_column=context", "data.max_length=64",
                               "data.doc_stride=16", "train.batch_size=2", "model.scratch=null",
                               "train.learning_rate=1e-4"]),
}
LOSS_TOLERANCE = 1e-5
"""Relative difference allowed between the two runs' logged losses at each step, in fp32: the paths compute the
same sums in another order (a row's prefix once, rows gathered), which rounds differently (here by at most 6e-7),
and the difference grows a little with every update."""


@pytest.mark.parametrize("kind", list(KINDS))
def test_off_and_auto_train_the_same_losses_step_by_step_in_fp32(tmp_path, kind, caplog):
    rows, overrides = KINDS[kind]
    if kind.startswith("llama"):
        overrides = [*overrides, f"model.name_or_path={llama_folder(tmp_path)}", "model.scratch=null"]
    if kind == "extractive":
        overrides = [*overrides, f"model.name_or_path={bert_folder(tmp_path)}"]
    runs, on = {}, {}
    for setting in ("off", "auto"):
        config = tiny_config(tmp_path, rows, "train.epochs=3", "train.batch_size=4", "train.learning_rate=3e-3",
                             *overrides, f"train.speedups={setting}", "train.device=cpu")
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="qatune"):
            runs[setting] = train(config, output_dir=tmp_path / setting, progress=False)
        on[setting] = set(speedups_on(caplog))
    assert on["off"] == set()
    expected = {"gpt2": {"last_column", "supervised_head", "gpt2_supervised_rows"},
                "gpt2-lora": {"last_column", "supervised_head", "gpt2_supervised_rows", "lora_one_pass"},
                "llama": {"last_column", "supervised_head", "shared_prefix", "prefix_groups", "last_layer_rows",
                          "unpadded_rows"},
                "llama-lora": {"last_column", "supervised_head", "shared_prefix", "prefix_groups", "last_layer_rows",
                               "unpadded_rows", "lora_one_pass"},
                "extractive": set()}[kind]
    assert expected | {"malloc_reuse", "folded_clipping"} == on["auto"]
    off, auto = step_losses(runs["off"]), step_losses(runs["auto"])
    assert len(off) == len(auto) >= 9
    for step, (a, b) in enumerate(zip(off, auto, strict=True), 1):
        assert math.isclose(a, b, rel_tol=LOSS_TOLERANCE), (step, a, b)
    assert auto[-1] < auto[0]


def test_off_patches_nothing_and_trains_through_the_models_own_forward(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.activations import NewGELUActivation

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32))
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM"))
    forwards = {name: module.forward for name, module in model.named_modules()}
    speedups = Speedups("off", "bf16", "cpu")
    objective = speedups.attach(model, CausalLMObjective(model))
    assert type(objective) is CausalLMObjective
    assert {name: module.forward for name, module in model.named_modules()} == forwards
    assert any(type(m) is NewGELUActivation for m in model.modules())           # fused_gelu did not swap it
    assert {p.dtype for p in model.parameters()} == {torch.float32}             # no bf16 master weights
    assert model.config._attn_implementation == "sdpa" and speedups.attention is None
    from qatune.data.generative import CausalCollator

    collator = CausalCollator(pad_token_id=0)
    assert speedups.collator(collator) is collator and collator.pad_to_multiple_of == 1
    assert collator.uncounted_columns == 0
    assert speedups.clipper(None, None, 1.0) is None
    assert speedups.describe() == "speedups (off): off: the model's own forward, nothing patched; bf16: autocast " \
                                  "over fp32 weights"


def test_the_log_says_once_which_paths_are_on_and_why_the_others_are_off(tmp_path, caplog):
    config = tiny_config(tmp_path, ROWS, "data.context_column=context", "train.epochs=1", "train.device=cpu")
    with caplog.at_level(logging.INFO, logger="qatune"):
        fit(prepare(config), None, progress=False)
    lines = [m for m in caplog.messages if m.startswith("speedups (")]
    assert lines == [
        "speedups (auto): on: last_column, supervised_head, gpt2_supervised_rows, malloc_reuse, folded_clipping; "
        "off: fused_gelu (the model has no Python tanh-GELU); lora_one_pass (no LoRA adapters); shared_prefix, "
        "prefix_groups, last_layer_rows, unpadded_rows (gpt2_supervised_rows computes GPT-2's rows itself); "
        "attention_by_width, width_rounding (measured faster under bf16 only); bf16_master_weights (fp32 run)"]


def test_a_list_turns_on_only_the_paths_it_names(tmp_path, caplog):
    config = tiny_config(tmp_path, ROWS, "data.context_column=context", "train.epochs=1", "train.device=cpu",
                         "train.speedups=[supervised_head, gpt2_supervised_rows]")
    with caplog.at_level(logging.INFO, logger="qatune"):
        fit(prepare(config), None, progress=False)
    assert speedups_on(caplog) == ["supervised_head", "gpt2_supervised_rows"]
    line = next(m for m in caplog.messages if m.startswith("speedups ("))
    assert line.startswith("speedups ([supervised_head, gpt2_supervised_rows]): on: ")
    assert "last_column, " in line and "(not listed in train.speedups)" in line


@pytest.mark.parametrize(("dropout", "noted"), [(0.0, False), (0.1, True)])
def test_the_log_notes_that_prompt_prefixes_are_not_shared_while_dropout_is_active(tmp_path, caplog, dropout,
                                                                                   noted):
    config = tiny_config(tmp_path, ROWS, "train.epochs=1", "train.device=cpu", f"model.scratch.dropout={dropout}")
    with caplog.at_level(logging.INFO, logger="qatune"):
        fit(prepare(config), None, progress=False)
    line = next(m for m in caplog.messages if m.startswith("speedups ("))
    assert "gpt2_supervised_rows" in speedups_on(caplog)
    assert line.endswith("; prompt prefixes are not shared while dropout is active") is noted


def test_a_path_listed_without_what_it_needs_says_so():
    from tests.unit.speedups.models import tiny_llama as llama

    speedups = Speedups(["shared_prefix", "last_layer_rows"], "fp32", "cpu")
    objective = speedups.attach(model := llama(), CausalLMObjective(model))
    assert type(objective) is CausalLMObjective
    assert speedups.reasons["shared_prefix"] == speedups.reasons["last_layer_rows"] == "needs supervised_head"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_auto_turns_nothing_on_on_a_gpu_until_a_gpu_benchmark_shows_a_gain(precision):
    verdict = ("measured on a GPU for one small workload only, not yet for a whole run's gain (bench/gpu.sh measures "
               "them; speedups: all turns them on)")
    assert all(auto_verdict(name, "cuda", precision) == verdict for name in NAMES)
    speedups = Speedups("auto", precision, "cuda")
    assert not any(speedups.on(name) for name in NAMES)
    assert speedups.describe() == f"speedups (auto): none on: {verdict}"
    assert all(Speedups(list(NAMES), precision, "cuda").on(name) for name in NAMES)  # a list asks for them


def test_on_cpu_auto_turns_on_the_bf16_paths_under_bf16_only():
    fp32, bf16 = Speedups("auto", "fp32", "cpu"), Speedups("auto", "bf16", "cpu")
    assert {n for n in NAMES if bf16.on(n)} - {n for n in NAMES if fp32.on(n)} == {"attention_by_width",
                                                                                    "width_rounding"}
    assert all(bf16.on(name) for name in NAMES)


def test_the_checks_run_after_the_model_is_placed_on_the_runs_device(monkeypatch):
    from qatune.speedups import causal
    from tests.unit.speedups.models import tiny_gpt2

    model, events = tiny_gpt2(), []
    real_to, real_choose = model.to, causal.choose
    monkeypatch.setattr(model, "to", lambda *a, **k: events.append(("placed", str(a[0]))) or real_to(*a, **k))

    def choose(m, wanted, attention=None, slack=1.0):
        events.append(("checked", str(next(m.parameters()).device), torch.is_autocast_enabled("cpu"), slack))
        return real_choose(m, wanted, attention, slack)

    monkeypatch.setattr(causal, "choose", choose)
    Speedups("auto", "bf16", "cpu").attach(model, CausalLMObjective(model))
    # On a CPU the checks compare in fp32, before bf16_master_weights turns the weights to bf16.
    assert events == [("placed", "cpu"), ("checked", "cpu", False, 1.0)]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_the_checks_on_a_gpu_run_under_the_runs_autocast_with_a_tolerance_for_it():
    speedups = Speedups(["supervised_head"], "bf16", "cuda")
    context = speedups._check_precision()
    assert isinstance(context, torch.autocast) and context.fast_dtype == torch.bfloat16
    assert speedups._slack() == 100.0 and Speedups("auto", "fp32", "cuda")._slack() == 1.0
    assert Speedups("auto", "bf16", "cpu")._slack() == 1.0


def test_the_evaluation_loss_follows_the_runs_setting():
    from qatune.data.generative import CausalCollator
    from qatune.speedups import evaluation_loss
    from qatune.speedups.causal import SupervisedRowsObjective
    from qatune.speedups.prefixes import PrefixPlanner
    from tests.unit.speedups.models import tiny_gpt2

    model = tiny_gpt2()
    objective, collator = evaluation_loss(model, CausalCollator(pad_token_id=0), "off")
    assert type(objective) is CausalLMObjective and type(collator) is CausalCollator
    objective, collator = evaluation_loss(model, CausalCollator(pad_token_id=0), "auto")
    assert type(objective) is SupervisedRowsObjective and "gpt2_supervised_rows" in objective.paths
    assert type(collator) is PrefixPlanner and collator.collator.uncounted_columns == 1
@pytest.mark.parametrize(("device_type", "precision", "expected"), [
    ("cpu", "bf16", 2), ("cpu", "fp32", 1), ("cuda", "fp32", 1), ("cuda", "bf16", 1), ("mps", "fp32", 1)])
def test_batch_widths_are_rounded_where_new_shapes_cost_a_kernel_build(device_type, precision, expected):
    from qatune.speedups import Speedups
    from qatune.speedups.shapes import width_multiple

    auto = Speedups("auto", precision, device_type)
    assert (width_multiple(device_type) if auto.on("width_rounding") else 1) == expected
    assert Speedups(["width_rounding"], precision, device_type).on("width_rounding")  # listed: wherever asked




def test_bf16_on_cpu_trains_gpt2_through_its_lean_path_with_eager_attention(tmp_path, monkeypatch, caplog):
    from qatune.speedups import gpt2 as lean_gpt2

    eager = []  # per attention call of the training steps (the checks at start-up run without gradients)
    real = lean_gpt2._attend
    monkeypatch.setattr(lean_gpt2, "_attend",
                        lambda *args: (torch.is_grad_enabled() and eager.append(args[-1])) or real(*args))
    from tests.conftest import MIXED_ROWS, one_epoch_config

    with caplog.at_level(logging.INFO, logger="qatune"):
        result = fit(prepare(one_epoch_config(tmp_path, MIXED_ROWS, "train.precision=bf16", "train.device=cpu")), None,
                     progress=False)
    assert {"gpt2_supervised_rows", "attention_by_width", "bf16_master_weights"} <= set(speedups_on(caplog))
    assert eager and all(eager)  # the rows are short: eager attention in every step
    assert math.isfinite(result["final_train_loss"]) and result["final_train_loss"] < result["first_train_loss"]


